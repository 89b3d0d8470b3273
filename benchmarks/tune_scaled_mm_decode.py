"""Sweep the decode (M <= 16) configurations of the rowwise scaled-mm kernels on the GPU: at these M the
GEMM streams the weight, so the tile that keeps the most bytes in flight per SM (block_n, block_k,
stages, split-K) wins. A dev tool feeding CONFIGS[arch][M <= 16] in quantfuse/kernels/scaled_mm.py.

Per (dtype, M, K, N): torch's peer (fp8: torch._scaled_mm with rowwise scales and bias; int8:
torch._int_mm + the epilogue in torch), the shipped config, and candidates block_n {32, 64, 128} (32:
mma.sync) x block_k {256, 512} x stages {4, 6} x split-K {automatic, 4}, all under CUDA
graphs with inputs rotated past L2 (common.time_ms). Reports the weight-streaming bandwidth (bytes of b /
time) against the copy bandwidth measured in the same run. Stops at TUNE_BUDGET_S (default 240 s) and
writes tune_scaled_mm_decode.json (TUNE_OUT_NAME overrides the name). `--dry-run` lists the candidates.
Narrowing: TUNE_SHAPES=1:4096:28672,... (M:K:N), TUNE_DTYPES=fp8, TUNE_TMA=0,1 (each tile with pointer loads
and / or tensor descriptors), TUNE_TILES=64:256:4:0:1,... (block_n:block_k:stages:split:tma).
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_scaled_mm_decode.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BUDGET_S = float(os.environ.get("TUNE_BUDGET_S", "240"))
SHAPES = [(m, k, n) for m in (1, 16) for k, n in ((4096, 6144), (4096, 28672), (14336, 4096))]
if os.environ.get("TUNE_SHAPES"):  # e.g. "1:4096:28672,16:8192:10240"
    SHAPES = [tuple(int(v) for v in t.split(":")) for t in os.environ["TUNE_SHAPES"].split(",")]
DTYPES = tuple(os.environ.get("TUNE_DTYPES", "fp8,int8").split(","))
# TUNE_TMA=0,1: each tile with pointer loads and / or tensor descriptors
TMA = [t == "1" for t in os.environ.get("TUNE_TMA", "0").split(",")]
TILES = [(bn, bk, st, split, tma)
         for bn, bk, st, split, tma in itertools.product((32, 64, 128), (256, 512), (4, 6), (0, 4), TMA)
         if bn * bk * st <= 128 * 256 * 4]
if os.environ.get("TUNE_TILES"):  # e.g. "64:256:4:0:1,32:256:4:0:0" (block_n:block_k:stages:split:tma)
    TILES = [tuple(int(v) for v in t.split(":")) for t in os.environ["TUNE_TILES"].split(",")]


def rowwise_input_sets(dtype: str, m: int, k: int, n: int, count: int):
    """`count` sets of (a [m, k], b = w.t() [k, n], per-token scales [m, 1], per-channel scales [n], bf16
    bias) with random codes ("fp8": e4m3 of N(0, 60^2); "int8": uniform codes), for scaled_mm and its peer."""
    qdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.int8
    sets = []
    for _ in range(count):
        if dtype == "fp8":
            a = (torch.randn(m, k, device="cuda") * 60).to(qdtype)
            w = (torch.randn(n, k, device="cuda") * 60).to(qdtype)
        else:
            a = torch.randint(-128, 128, (m, k), dtype=qdtype, device="cuda")
            w = torch.randint(-128, 128, (n, k), dtype=qdtype, device="cuda")
        sa = torch.rand(m, 1, device="cuda") * 1e-3 + 1e-4
        sb = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        sets.append((a, w.t(), sa, sb, bias))
    return sets


def rowwise_peer(dtype: str):
    """torch's path for the same product: fp8 torch._scaled_mm (rowwise scales, bias); int8 torch._int_mm
    plus the epilogue in torch."""
    if dtype == "fp8":
        def peer(a, b, sa, sb, bias):
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb.view(1, -1), bias=bias, out_dtype=torch.bfloat16)
    else:
        def peer(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float().mul_(sa).mul_(sb).add_(bias)).to(torch.bfloat16)
    return peer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    total = len(SHAPES) * len(DTYPES) * len(TILES)
    print(f"{total} candidates ({len(TILES)} tiles x {len(SHAPES)} shapes x {len(DTYPES)} dtypes), "
          f"budget {BUDGET_S:.0f} s")
    if args.dry_run:
        for tile in TILES:
            print(tile)
        return

    from common import copy_bandwidth_gbs, rotation_count, time_ms, write_result

    from quantfuse.kernels import scaled_mm as kmm

    copy_gbs = copy_bandwidth_gbs()
    t0 = time.perf_counter()
    rows = []
    for dtype in DTYPES:
        for m, k, n in SHAPES:
            sets = rowwise_input_sets(dtype, m, k, n, rotation_count(k * n))
            try:
                peer_ms = time_ms(rowwise_peer(dtype), sets, graph=True, warmup=10, rep=40)
            except Exception as err:  # noqa: BLE001 -- e.g. _int_mm refusing M=1
                print(f"peer {dtype} {m}x{k}x{n} failed: {type(err).__name__}", flush=True)
                peer_ms = float("nan")

            def ours(cfg):
                return lambda a, b, sa, sb, bias: kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None,
                                                                config=cfg)

            shipped_ms = time_ms(ours(None), sets, graph=True, warmup=10, rep=40)
            base = dict(dtype=dtype, M=m, K=k, N=n, peer_us=round(peer_ms * 1e3, 2))
            rows.append(dict(base, cfg="shipped", us=round(shipped_ms * 1e3, 2),
                             weight_frac_copy=round(k * n / (shipped_ms * 1e-3) / 1e9 / copy_gbs, 3),
                             vs_peer=round(peer_ms / shipped_ms, 3)))
            print(rows[-1], flush=True)
            for bn, bk, st, split, tma in TILES:
                if time.perf_counter() - t0 > BUDGET_S:
                    break
                cfg = kmm.MMConfig(16, bn, bk, 4, st, split_k=split, tma=bool(tma))
                try:
                    ms = time_ms(ours(cfg), sets, graph=True, warmup=5, rep=25)
                except Exception as err:  # noqa: BLE001
                    print(f"{dtype} {m}x{k}x{n} {cfg} failed: {type(err).__name__}", flush=True)
                    continue
                name = f"bn{bn} bk{bk} s{st} split{split or 'auto'} tma{int(tma)}"
                rows.append(dict(base, cfg=name, us=round(ms * 1e3, 2),
                                 weight_frac_copy=round(k * n / (ms * 1e-3) / 1e9 / copy_gbs, 3),
                                 vs_peer=round(peer_ms / ms, 3)))
            mine = [r for r in rows if (r["dtype"], r["M"], r["K"], r["N"]) == (dtype, m, k, n)]
            best = min(mine, key=lambda r: r["us"])
            print(f"best {dtype} {m}x{k}x{n}: {best['cfg']} {best['us']} us, {best['vs_peer']}x peer, "
                  f"{best['weight_frac_copy']} of copy [{time.perf_counter() - t0:.0f} s]", flush=True)
    write_result(os.environ.get("TUNE_OUT_NAME", "tune_scaled_mm_decode"),
                 "Decode (M <= 16) tile sweep for scaled_mm (dev)", rows,
                 extra={"copy_bandwidth_gbs": round(copy_gbs, 1)})


if __name__ == "__main__":
    main()
