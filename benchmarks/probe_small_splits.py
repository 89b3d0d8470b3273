"""Probe the K-split count of the weight-only decode / small-batch kernels on small weights (a dev tool; results/
probe_small_splits.json): the shipped dispatch against the same kernel with the splits forced.

Per (bits, K, N, M): CUDA-graph timings (common.graph_us, weights rotated past L2, one timing each) of bf16 F.linear,
quantfuse.weight_only_mm ("shipped", its path and split count named) and the kernel the dispatch runs there with
splits forced to each of P_SPLITS: gemv_mma (int4, M <= 16), the tl tiles (`weight_only.fused_mm`, int4 M > 16) or
w8_decode (int8 per channel). A forced variant's output is compared with the shipped one first (mean |delta| /
mean |ref| over 3e-3: reported, not timed).
W4A16 g128 symmetric and W8A16 per channel, float32 scales, bf16 x. Env: P_KN (BENCH_KN spelling, default the four
smallest Llama-3.2 shapes and 8192x2048), P_MS (default 16,32,64), P_SPLITS (default 1,2,4,8,16), P_BITS (default
4,8), P_OUT.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_small_splits.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import path_of, rotated_weights  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import gemv_mma as gm  # noqa: E402
from quantfuse.kernels import w8_decode as kwd  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

BF16 = torch.bfloat16


def forced(bits: int, m: int, n: int, splits: int):
    """(label, fn(x, q)) of the kernel weight_only_mm runs at this M, with `splits` K splits."""
    if bits == 4 and m <= gm.MAX_M:
        return "gemv_mma", lambda x, q: kw.gemv_mma_mm(x, q.qweight, q.scales, q.zeros, None, q.group_size, n,
                                                        splits=splits)
    if bits == 4:
        return "tl tile", lambda x, q: kw.fused_mm(x, q.qweight, q.scales, q.zeros, None, 4, q.group_size, n,
                                                   splits=splits)
    return "w8_decode", lambda x, q: kwd.w8_decode_mm(x, q.qweight, q.scales, q.zeros, None, n, splits=splits)


def main():
    torch.manual_seed(0)
    os.environ.setdefault("BENCH_KN", os.environ.get("P_KN", ""))
    kns = common.shapes_from_env([(2048, 2048), (2048, 3072), (3072, 3072), (3072, 5120), (8192, 2048)])
    ms = [int(v) for v in os.environ.get("P_MS", "16,32,64").split(",") if v]
    split_list = [int(v) for v in os.environ.get("P_SPLITS", "1,2,4,8,16").split(",") if v]
    rows = []
    start = time.time()
    for bits in [int(v) for v in os.environ.get("P_BITS", "4,8").split(",") if v]:
        for k, n in kns:
            qw_sets, w_sets = rotated_weights(bits, k, n)
            qw = qw_sets[0]
            for m in ms:
                if bits == 8 and m > 32:  # the tl tiles there, not w8_decode
                    continue
                xs = [torch.randn(m, k, device="cuda", dtype=BF16) for _ in range(max(len(qw_sets), len(w_sets)))]
                sets = list(zip(xs, qw_sets))
                want = qf.weight_only_mm(xs[0], qw)
                bf16_us = common.graph_us(F.linear, list(zip(xs, w_sets)))
                ship_us = common.graph_us(qf.weight_only_mm, sets)
                base = dict(bits=bits, K=k, N=n, M=m, bf16_us=bf16_us)
                rows.append(dict(base, variant="shipped", path=path_of(m, k, n, bits), us=ship_us,
                                 vs_shipped=1.0, vs_bf16=bf16_us / ship_us))
                common.print_row(rows[-1])
                for s in split_list:
                    label, fn = forced(bits, m, n, s)
                    err = common.mean_rel_diff(fn(xs[0], qw).float(), want.float())
                    if err > 3e-3:
                        rows.append(dict(base, variant=f"{label} splits={s}", rel_diff=err, error="mismatch"))
                        continue
                    us = common.graph_us(fn, sets)
                    rows.append(dict(base, variant=f"{label} splits={s}", us=us, vs_shipped=ship_us / us,
                                     vs_bf16=bf16_us / us, rel_diff=err))
                    common.print_row(rows[-1])
                del xs, sets
            del qw_sets, w_sets, qw
            torch.cuda.empty_cache()
    columns = ["bits", "K", "N", "M", "variant", "path", "us", "bf16_us", "vs_shipped", "vs_bf16", "rel_diff",
               "error"]
    notes = (f"CUDA graphs, weights rotated past L2, one timing each; vs_shipped = shipped time / this one. "
             f"total {time.time() - start:.0f} s")
    common.finish(os.environ.get("P_OUT", "probe_small_splits"),
                  "Weight-only decode kernels on small weights: the shipped K splits vs forced ones", rows, columns,
                  notes)


if __name__ == "__main__":
    main()
