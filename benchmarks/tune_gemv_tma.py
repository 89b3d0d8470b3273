"""Sweep the Gluon TMA-fed GEMV's configs (kernels/gemv_tma.py) against the `tl` GEMV and bf16 F.linear at M = 1,
in one run on the GPU (issues 5 and 6: weight-only decode).

Per (scheme, K, N): CUDA-graph medians with the weights rotated past L2 (common.time_ms): bf16 F.linear on the
dequantized weight, the shipped `tl` GEMV (weight_only.fused_mm with the M = 1 tile) and each GemvConfig. Each
config's output is first compared with the `tl` GEMV's (same math, scale after the sums; mean |delta| / mean
|ref|); a config over 1e-3 is reported and not timed.
Shapes: the Llama-3-8B/70B linears of bench_weight_only plus the 8B layer's q/o (4096x4096), k/v (4096x1024) and
gate/up (4096x14336). Schemes: W4A16 g128 symmetric, W8A16 per channel (float32 scales).
Env: TUNE_CONFIGS ("block_n,chunks,warps,stages,programs_per_sm;..."; default GEMV_CONFIGS' sm90 candidates),
TUNE_KN ("K:N,..."), TUNE_BITS ("4,8"), TUNE_OUT_NAME (default tune_gemv_tma).
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_gemv_tma.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import clone_qw, qw_bytes  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import gemv_tma as gt  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

BF16 = torch.bfloat16
DEFAULT_KN = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192), (4096, 4096), (4096, 1024),
              (4096, 14336)]


def _configs(bits):
    spec = os.environ.get("TUNE_CONFIGS")
    if not spec:
        return gt.GEMV_CONFIGS["sm90"][bits]
    return [gt.GemvConfig(*[int(v) for v in item.split(",")]) for item in spec.split(";") if item]


def _short(c: gt.GemvConfig) -> str:
    return f"{c.block_n}x{c.chunks}c w{c.num_warps} s{c.stages} p{c.programs_per_sm}"


def _kn():
    spec = os.environ.get("TUNE_KN")
    if not spec:
        return DEFAULT_KN
    return [tuple(int(v) for v in item.split(":")) for item in spec.split(",") if item]


t = common.graph_us
rel = common.mean_rel_diff


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bw = common.copy_bandwidth_gbs()
    print(f"copy {bw:.0f} GB/s", flush=True)
    bits_list = [int(b) for b in os.environ.get("TUNE_BITS", "4,8").split(",")]
    tl_tile = {b: kw.pick_tile(1, dev, b) for b in bits_list}
    rows = []
    start = time.time()
    for bits in bits_list:
        group = 128 if bits == 4 else -1
        for k, n in _kn():
            qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=bits, group_size=group)
            nbytes = qw_bytes(qw)
            qw_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
            x = torch.randn(1, k, device=dev, dtype=BF16)
            w_hat = qw.dequantize(BF16)
            lin_sets = [(x, w_hat)] + [(x, w_hat.clone()) for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
            sets = [(x, q) for q in qw_sets]
            del w_hat

            def tl_gemv(x_, q):
                return kw.fused_mm(x_, q.qweight, q.scales, q.zeros, None, bits, q.group_size, n, tile=tl_tile[bits])

            want = tl_gemv(x, qw)
            base = dict(scheme=f"W{bits}A16 " + ("g128" if bits == 4 else "per-channel"), K=k, N=n)
            bf16_us = t(F.linear, lin_sets)
            tl_us = t(tl_gemv, sets)
            del lin_sets
            rows.append(dict(base, config="tl gemv (shipped)", us=tl_us, vs_bf16=bf16_us / tl_us, vs_tl=1.0,
                             frac_copy_bw=nbytes / (tl_us * 1e-6) / 1e9 / bw, bf16_us=bf16_us, rel_err=0.0))
            for cfg in _configs(bits):
                def ours(x_, q, cfg=cfg):
                    return kw.gemv_tma_mm(x_, q.qweight, q.scales, q.zeros, None, bits, q.group_size, n, config=cfg)

                try:
                    err = rel(ours(x, qw), want)
                except Exception as e:  # noqa: BLE001 - a config the kernel refuses is reported, not fatal
                    rows.append(dict(base, config=_short(cfg), error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                if err > 1e-3:
                    rows.append(dict(base, config=_short(cfg), rel_err=err, error="mismatch"))
                    continue
                us = t(ours, sets)
                rows.append(dict(base, config=_short(cfg), us=us, vs_bf16=bf16_us / us, vs_tl=tl_us / us,
                                 frac_copy_bw=nbytes / (us * 1e-6) / 1e9 / bw, bf16_us=bf16_us, rel_err=err))
            for r in rows[-1 - len(_configs(bits)):]:
                common.print_row(r)
            del qw_sets, sets
            torch.cuda.empty_cache()
    columns = ["scheme", "K", "N", "config", "us", "bf16_us", "vs_bf16", "vs_tl", "frac_copy_bw", "rel_err", "error"]
    notes = (f"M = 1, bf16 x, float32 scales; CUDA graphs, weights rotated past L2; copy bandwidth {bw:.0f} GB/s "
             f"(read + write) in this run; frac_copy_bw = packed weight + scales bytes / time / copy bandwidth. "
             f"vs_tl: the shipped tl GEMV's time / this config's. total {time.time() - start:.0f} s")
    common.finish(os.environ.get("TUNE_OUT_NAME", "tune_gemv_tma"),
                  "Gluon TMA GEMV configs vs the tl GEMV and bf16 (M = 1)", rows, columns, notes)


if __name__ == "__main__":
    main()
