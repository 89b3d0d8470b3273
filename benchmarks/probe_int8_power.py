"""Diagnostic (issue 3): one INT8 GEMM under a sustained load, ours vs torch._int_mm + the torch epilogue, sampling
the GPU's SM clock, power, temperature and active clock-event reasons (nvidia-smi) next to each timing.

Phases: ours for PHASE_A seconds, the peer for PHASE_B, ours again for PHASE_C; each sample is a do_bench median
of the kernel's CUDA graph (inputs rotated past L2), then the counters read during a burst of replays.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_int8_power.py  (PROBE_SHAPE=MxKxN, default 1024x28672x8192)
Writes probe_int8_power.json (common.write_result).
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
from bench_scaled_mm import INT8, make_sets, ours, tops, torch_int_mm_unfused  # noqa: E402

PHASES = (("A", "ours", 25.0), ("B", "int_mm+epi", 15.0), ("C", "ours", 10.0))
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def counters():
    out = subprocess.check_output(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"], text=True)
    mhz, watts, temp, reasons = out.strip().splitlines()[0].split(", ")
    return {"sm_mhz": float(mhz), "power_w": float(watts), "temp_c": float(temp), "throttle": reasons}


def main():
    import triton

    m, k, n = (int(v) for v in os.environ.get("PROBE_SHAPE", "1024x28672x8192").split("x"))
    sets = make_sets(m, k, n, INT8)
    graphs = {}
    for name, fn in (("ours", ours), ("int_mm+epi", torch_int_mm_unfused)):
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
            ms = triton.testing.do_bench(graphs[name].replay, warmup=5, rep=200, return_mode="median") / len(sets)
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
    notes = (f"{m}x{k}x{n} int8 per-token x per-channel + bf16 bias, bf16 out. Steady state (second half of a phase): "
             f"ours {a['ms']:.4f} ms at {a['sm_mhz']:.0f} MHz / {a['power_w']:.0f} W, int_mm+epi {b['ms']:.4f} ms at "
             f"{b['sm_mhz']:.0f} MHz / {b['power_w']:.0f} W, ratio {b['ms'] / a['ms']:.2f}x. throttle: nvidia-smi's "
             "active clock-event reasons (0x4: software power cap).")
    common.finish("probe_int8_power", "INT8 long-K GEMM under sustained load: time, SM clock and power vs "
                  "torch._int_mm (dev)", rows, ["t", "phase", "kernel", "ms", "TOPS", "sm_mhz", "power_w", "temp_c",
                                                "throttle"], notes)


if __name__ == "__main__":
    main()
