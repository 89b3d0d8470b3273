"""Diagnostic (issue 3): one INT8 or FP8 GEMM under a sustained load, ours vs the torch peer (int8: torch._int_mm +
the torch epilogue; fp8: torch._scaled_mm, fast accumulation), sampling the GPU's SM clock, power, temperature and
active clock-event reasons (nvidia-smi) next to each timing.

Phases: ours for 25 s, the peer for 15 s, ours again for 10 s (times PROBE_SCALE); with PROBE_DTYPE=fp8 a fourth,
ours in int8 on the same shape (does the fp8 kernel get fewer clocks than the same kernel in int8?). Each sample is
a do_bench median of the kernel's CUDA graph (inputs rotated past L2), then the counters read during a burst of
replays.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_int8_power.py  (PROBE_SHAPE=MxKxN, default 1024x28672x8192;
PROBE_DTYPE=int8|fp8). Writes probe_int8_power.json, or probe_fp8_power.json (common.write_result).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_scaled_mm import FP8, INT8, make_sets, ours, tops, torch_int_mm_unfused  # noqa: E402
from bench_scaled_mm import torch_scaled_mm_rowwise_fast  # noqa: E402

DTYPE = os.environ.get("PROBE_DTYPE", "int8")
PEER = "int_mm+epi" if DTYPE == "int8" else "scaled_mm"
SCALE = float(os.environ.get("PROBE_SCALE", "1"))
PHASES = (("A", "ours", 25.0 * SCALE), ("B", PEER, 15.0 * SCALE), ("C", "ours", 10.0 * SCALE))
if DTYPE == "fp8":
    PHASES += (("D", "ours int8", 10.0 * SCALE), )
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def counters():
    out = subprocess.check_output(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"], text=True)
    mhz, watts, temp, reasons = out.strip().splitlines()[0].split(", ")
    return {"sm_mhz": float(mhz), "power_w": float(watts), "temp_c": float(temp), "throttle": reasons}


def main():
    import triton

    m, k, n = (int(v) for v in os.environ.get("PROBE_SHAPE", "1024x28672x8192").split("x"))
    sets = make_sets(m, k, n, INT8 if DTYPE == "int8" else FP8)
    contenders = [("ours", ours, sets), (PEER, torch_int_mm_unfused if DTYPE == "int8" else
                                          torch_scaled_mm_rowwise_fast, sets)]
    if DTYPE == "fp8":
        contenders.append(("ours int8", ours, make_sets(m, k, n, INT8)))
    graphs, calls = {}, {}
    for name, fn, sets in contenders:
        calls[name] = len(sets)
        for args in sets:
            fn(*args)
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for args in sets:
                fn(*args)
    rows, start = [], time.time()
    for phase, name, seconds in PHASES:
        end = time.time() + seconds
        while time.time() < end:
            ms = triton.testing.do_bench(graphs[name].replay, warmup=5, rep=200, return_mode="median") / calls[name]
            for _ in range(20):
                graphs[name].replay()
            sample = counters()
            torch.cuda.synchronize()
            rows.append({"t": round(time.time() - start, 1), "phase": phase, "kernel": name, "ms": ms,
                         "TOPS": tops(m, k, n, ms), **sample})
            common.print_row(rows[-1])

    def steady(phase):  # the second half of a phase's samples
        rs = [r for r in rows if r["phase"] == phase]
        rs = rs[len(rs) // 2:]
        return {key: statistics.median(r[key] for r in rs) for key in ("ms", "sm_mhz", "power_w")}

    a, b = steady("A"), steady("B")
    notes = (f"{m}x{k}x{n} {DTYPE} per-token x per-channel + bf16 bias, bf16 out. Steady state (second half of a "
             f"phase): ours {a['ms']:.4f} ms at {a['sm_mhz']:.0f} MHz / {a['power_w']:.0f} W, {PEER} {b['ms']:.4f} ms "
             f"at {b['sm_mhz']:.0f} MHz / {b['power_w']:.0f} W, ratio {b['ms'] / a['ms']:.2f}x.")
    if DTYPE == "fp8":
        d = steady("D")
        notes += (f" Ours in int8 on the same shape: {d['ms']:.4f} ms at {d['sm_mhz']:.0f} MHz / {d['power_w']:.0f} "
                  "W.")
    notes += " throttle: nvidia-smi's active clock-event reasons (0x4: software power cap)."
    common.finish(f"probe_{DTYPE}_power", f"{DTYPE.upper()} GEMM under sustained load: time, SM clock and power vs "
                  f"the torch peer (dev)", rows, ["t", "phase", "kernel", "ms", "TOPS", "sm_mhz", "power_w", "temp_c",
                                                   "throttle"], notes)


if __name__ == "__main__":
    main()
