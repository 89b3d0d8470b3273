"""Sweep the large-M (prefill) tiles of the rowwise scaled-mm kernels on the GPU, per (M, K, N): at M = 1024
the shipped 128x256 tile leaves the last wave part-empty on some Llama shapes (1024x4096x6144: 8 x 24 = 192
tiles on 132 SMs, 1.45 waves), so the best tile depends on N. A dev tool feeding the M > 256 buckets of
CONFIGS["sm90"] in quantfuse/kernels/scaled_mm.py (buckets may be keyed by N).

Per (dtype, M, K, N): the peer (fp8: torch._scaled_mm with rowwise scales and bias; int8: torch._int_mm + the
epilogue in torch), bf16 F.linear, the shipped config and the candidates in TILES, per-token x per-channel
scales + bias, bf16 out, CUDA graphs, inputs rotated past L2 (common.time_ms). Stops at TUNE_BUDGET_S
(default 200 s) and writes tune_scaled_mm_prefill.json (TUNE_OUT_NAME overrides the name). `--dry-run`
lists the candidates. TUNE_MS, TUNE_KN, TUNE_DTYPES and TUNE_TILES narrow a follow-up sweep.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_scaled_mm_prefill.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BUDGET_S = float(os.environ.get("TUNE_BUDGET_S", "200"))
KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
if os.environ.get("TUNE_KN"):  # e.g. "4096:6144,8192:10240"
    KN = [tuple(int(v) for v in kn.split(":")) for kn in os.environ["TUNE_KN"].split(",")]
MS = tuple(int(v) for v in os.environ.get("TUNE_MS", "1024,4096").split(","))
DTYPES = tuple(os.environ.get("TUNE_DTYPES", "fp8,int8").split(","))
# (block_m, block_n, block_k, warps, stages, group_m[, tma[, persistent programs per SM]])
TILES = [(128, 256, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8), (128, 128, 128, 4, 3, 8), (256, 128, 128, 8, 3, 8),
         (128, 256, 64, 8, 4, 8), (64, 256, 128, 4, 3, 8), (128, 128, 256, 8, 3, 8), (128, 256, 128, 8, 3, 16)]
if os.environ.get("TUNE_TILES"):  # e.g. "128,128,128,8,5,8;128,128,64,4,5,8"
    TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ["TUNE_TILES"].split(";")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    shapes = [(m, k, n) for m in MS for k, n in KN]
    print(f"{len(shapes) * len(DTYPES) * len(TILES)} candidates ({len(TILES)} tiles x {len(shapes)} shapes x "
          f"{len(DTYPES)} dtypes), budget {BUDGET_S:.0f} s")
    if args.dry_run:
        for tile in TILES:
            print(tile)
        return

    from common import rotation_count, time_ms, write_result
    from tune_scaled_mm_decode import rowwise_input_sets, rowwise_peer

    from quantfuse.kernels import scaled_mm as kmm

    t0 = time.perf_counter()
    rows = []
    for m, k, n in shapes:
        for dtype in DTYPES:
            if time.perf_counter() - t0 > BUDGET_S:
                break
            sets = rowwise_input_sets(dtype, m, k, n, rotation_count(k * n + m * k))
            peer_ms = time_ms(rowwise_peer(dtype), sets, graph=True, warmup=10, rep=40)
            bf16_ms = float("nan")
            if dtype == "fp8":  # once per shape
                lin_sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, device="cuda", dtype=torch.bfloat16))
                            for _ in range(rotation_count(2 * (k * n + m * k)))]
                bf16_ms = time_ms(torch.nn.functional.linear, lin_sets, graph=True, warmup=10, rep=40)
                del lin_sets

            def ours(cfg):
                return lambda a, b, sa, sb, bias: kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None,
                                                                config=cfg)

            base = dict(dtype=dtype, M=m, K=k, N=n, peer_us=round(peer_ms * 1e3, 2),
                        bf16_us=round(bf16_ms * 1e3, 2))
            flops = 2.0 * m * k * n

            def add(cfg_name, ms):
                rows.append(dict(base, cfg=cfg_name, us=round(ms * 1e3, 2), tops=round(flops / ms / 1e9, 1),
                                 vs_peer=round(peer_ms / ms, 3)))

            add("shipped", time_ms(ours(None), sets, graph=True, warmup=10, rep=40))
            for tile in TILES:
                if time.perf_counter() - t0 > BUDGET_S:
                    break
                # optional 7th / 8th fields: tensor-descriptor operands, persistent programs per SM
                bm, bn, bk, w, st, gm = tile[:6]
                tma = bool(tile[6]) if len(tile) > 6 else False
                persistent = tile[7] if len(tile) > 7 else 0
                cfg = kmm.MMConfig(bm, bn, bk, w, st, gm, tma=tma, persistent=persistent)
                try:
                    ms = time_ms(ours(cfg), sets, graph=True, warmup=5, rep=25)
                except Exception as err:  # noqa: BLE001 -- out of resources etc.
                    print(f"{dtype} {m}x{k}x{n} {cfg} failed: {type(err).__name__}", flush=True)
                    continue
                add(f"{bm}x{bn}x{bk} w{w} s{st} g{gm}" + (f" tma{int(tma)} p{persistent}" if len(tile) > 6 else ""),
                    ms)
            mine = [r for r in rows if (r["dtype"], r["M"], r["K"], r["N"]) == (dtype, m, k, n)]
            best = min(mine, key=lambda r: r["us"])
            shipped = mine[0]
            print(f"{dtype} {m}x{k}x{n}: peer {peer_ms * 1e3:.1f} us, shipped {shipped['us']} us "
                  f"({shipped['vs_peer']}x); best {best['cfg']} {best['us']} us {best['vs_peer']}x peer "
                  f"{best['tops']} TOPS [{time.perf_counter() - t0:.0f} s]", flush=True)
            sets.clear()
            torch.cuda.empty_cache()
    write_result(os.environ.get("TUNE_OUT_NAME", "tune_scaled_mm_prefill"), "Prefill (M >= 1024) tile sweep for scaled_mm (dev)", rows)


if __name__ == "__main__":
    main()
