"""Probe where dequantize-once + cuBLAS beats the fused weight-only kernels (a dev tool behind
weight_only.DEQUANT_CUBLAS_MIN_M; results/probe_dequant_cublas*.json).

Per (bits, K, N, M): CUDA-graph timings (common.time_ms, weights rotated past L2) of quantfuse.weight_only_mm as it
dispatches ("ours", its path named), of the dequantize + F.linear path forced ("dq_cublas": weight_only.dequantize,
then cuBLAS; what the dispatch runs where it prefers it) and of bf16 F.linear on the dequantized weight. ours and
dq_cublas alternate in P_ROUNDS rounds (median each); bf16 is timed once. dq_over_ours = ours / dq_cublas time.
W4A16 g128 symmetric and W8A16 per channel, float32 scales (the quantize_weight default), bf16 x.
Env: P_KN (BENCH_KN spelling: "small", or "K:N,..."; default the small models' shapes plus 4096x4096 and 4096x6144),
P_MS (default 64,128,256,512,1024,2048), P_BITS (default 4,8), P_ROUNDS (default 2), P_OUT.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_dequant_cublas.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import path_of, rotated_weights  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

BF16 = torch.bfloat16


def dq_cublas(x, q):
    w_hat = kw.dequantize(q.qweight, q.scales, q.zeros, q.bits, q.group_size, x.shape[1], x.dtype)
    return F.linear(x, w_hat)


def main():
    torch.manual_seed(0)
    os.environ.setdefault("BENCH_KN", os.environ.get("P_KN", ""))
    kns = common.shapes_from_env(common.SMALL_MODEL_KN + [(4096, 4096), (4096, 6144)])
    ms = [int(v) for v in os.environ.get("P_MS", "64,128,256,512,1024,2048").split(",") if v]
    bits_list = [int(v) for v in os.environ.get("P_BITS", "4,8").split(",") if v]
    rounds = int(os.environ.get("P_ROUNDS", "2"))
    rows = []
    start = time.time()
    for bits in bits_list:
        for k, n in kns:
            qw_sets, w_sets = rotated_weights(bits, k, n)
            qw = qw_sets[0]
            for m in ms:
                xs = [torch.randn(m, k, device="cuda", dtype=BF16) for _ in range(max(len(qw_sets), len(w_sets)))]
                err = common.mean_rel_diff(dq_cublas(xs[0], qw), qf.weight_only_mm(xs[0], qw).float())
                ours_r, dq_r = [], []
                for _ in range(rounds):
                    ours_r.append(common.time_ms(qf.weight_only_mm, list(zip(xs, qw_sets)), graph=True, warmup=10,
                                                 rep=40) * 1e3)
                    dq_r.append(common.time_ms(dq_cublas, list(zip(xs, qw_sets)), graph=True, warmup=10, rep=40) * 1e3)
                bf16_us = common.time_ms(F.linear, list(zip(xs, w_sets)), graph=True, warmup=10, rep=40) * 1e3
                ours_us, dq_us = statistics.median(ours_r), statistics.median(dq_r)
                rows.append(dict(bits=bits, K=k, N=n, M=m, weights_M=round(n * k / 2**20, 2),
                                 path=path_of(m, k, n, bits),
                                 ours_us=ours_us, dq_cublas_us=dq_us, bf16_us=bf16_us, dq_over_ours=ours_us / dq_us,
                                 ours_vs_bf16=bf16_us / ours_us, dq_vs_bf16=bf16_us / dq_us, rel_diff=err))
                common.print_row(rows[-1])
                del xs
            del qw_sets, w_sets, qw
            torch.cuda.empty_cache()
    columns = ["bits", "K", "N", "M", "weights_M", "path", "ours_us", "dq_cublas_us", "bf16_us", "dq_over_ours",
               "ours_vs_bf16", "dq_vs_bf16", "rel_diff"]
    notes = (f"CUDA graphs, weights rotated past L2; ours / dq_cublas: median of {rounds} alternated rounds, bf16 one "
             f"timing; weights_M = N x K / 2^20 codes; rel_diff = mean |dq - ours| / mean |ours|. "
             f"total {time.time() - start:.0f} s")
    common.finish(os.environ.get("P_OUT", "probe_dequant_cublas"),
                  "Weight-only: the dispatch vs dequantize + cuBLAS forced, by M and weight size", rows, columns, notes)


if __name__ == "__main__":
    main()
