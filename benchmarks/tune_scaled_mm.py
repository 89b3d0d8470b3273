"""Sweep candidate tiles for the scaled-mm kernels on a few shapes and print the best (a dev tool that
feeds the CONFIGS / BLOCKWISE_CONFIGS tables in quantfuse/kernels/scaled_mm.py; not part of the suite)."""

from __future__ import annotations

import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

from quantfuse.kernels import scaled_mm as kmm  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = [(4096, 4096, 4096), (1024, 4096, 4096), (4096, 14336, 4096), (1024, 8192, 10240)]


def main():
    rows = []
    for m, k, n in SHAPES:
        a = (torch.randn(m, k, device="cuda") * 4).to(FP8)
        w = (torch.randn(n, k, device="cuda") * 4).to(FP8)
        b = w.t()
        kb, nb = -(-k // 128), -(-n // 128)
        sa = torch.rand(kb, m, device="cuda").t()
        sb = torch.rand(kb, nb, device="cuda")
        sar = torch.rand(m, 1, device="cuda")
        sbr = torch.rand(n, device="cuda")
        flops = 2 * m * n * k
        rowwise_cfgs = [kmm.MMConfig(*c) for c in [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 64, 8, 4)]]
        best_row = None
        for cfg in rowwise_cfgs:
            try:
                ms = triton.testing.do_bench(lambda: kmm.scaled_mm(a, b, sar, sbr, torch.bfloat16, None, None, None, config=cfg), rep=50)
            except Exception as err:  # noqa: BLE001
                print("rowwise", cfg, "failed", type(err).__name__)
                continue
            best_row = ms if best_row is None else min(best_row, ms)
            rows.append(dict(kind="rowwise", M=m, K=k, N=n, cfg=str(cfg), tflops=flops / ms / 1e9))
        for bm, bn, warps, stages, gm in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), (8,)):
            cfg = kmm.MMConfig(bm, bn, 128, warps, stages, gm)
            try:
                ms = triton.testing.do_bench(lambda: kmm.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16, None, config=cfg), rep=50)
            except Exception as err:  # noqa: BLE001
                print("blockwise", cfg, "failed", type(err).__name__)
                continue
            rows.append(dict(kind="blockwise", M=m, K=k, N=n, cfg=str(cfg), tflops=flops / ms / 1e9,
                             vs_best_rowwise=best_row / ms if best_row else float("nan")))
        for r in sorted([r for r in rows if r["M"] == m and r["K"] == k and r["N"] == n], key=lambda r: -r["tflops"])[:6]:
            print(r)
    write_result("tune_scaled_mm", "Tile sweep for scaled_mm / scaled_mm_blockwise (dev)", rows)


if __name__ == "__main__":
    main()
