"""Probe W4A16 g128 at batch-sized M (32..128) on the GPU: the shipped dispatch against forced tl wide tiles / K
splits and Gluon wgmma configs, with bf16 F.linear, in one run (a dev tool behind weight_only_wgmma.SMALL_M_16BIT;
results/tune_weight_only_mid_m_*.json).

Per (K, N, M): CUDA-graph timings (common.graph_us, weights rotated past L2, one timing each) of bf16 F.linear on the
dequantized weight, quantfuse.weight_only_mm ("shipped") and each candidate; a candidate's output is first compared
with the shipped one (mean |delta| / mean |ref|; over 3e-3 it is reported, not timed).
Candidates: with P_WGMMA ("block_m,num_warps,stages,programs_per_sm;..."), those WgmmaW4Configs through
weight_only_wgmma.wgmma_w4_mm with its own split / tail plan; otherwise every tl wide tile (block_n 64..256, 4 / 8
warps, 3 / 4 stages, block_m = M) and Gluon wgmma config (block_m = M, 4 / 8 warps, 3 / 4 stages) with 1..6 K splits.
Env: P_KN ("K:N,...", default 4096:6144), P_MS (default 64,128), P_SCALE (scale dtype, default float32), P_OUT.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_weight_only_mid_m.py
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
from quantfuse.kernels import weight_only as kw  # noqa: E402
from quantfuse.kernels import weight_only_wgmma as ww  # noqa: E402

BF16 = torch.bfloat16


def _candidates(m: int, n: int):
    out = []
    if os.environ.get("P_WGMMA"):
        for item in os.environ["P_WGMMA"].split(";"):
            bm, nw, st, pps = (int(v) for v in item.split(","))
            cfg = ww.WgmmaW4Config(bm, nw, st, pps)
            out.append((f"wgmma {bm}x{16 * nw} s{st} p{pps}", lambda x, q, cfg=cfg: ww.wgmma_w4_mm(
                x, q.qweight, q.scales, q.zeros, None, q.group_size, n, config=cfg)))
        return out
    for bn, nw in ((128, 4), (128, 8), (256, 8), (64, 4)):
        for st in (3, 4):
            for sp in (1, 2, 3, 4, 6):
                tile = dict(block_m=m, block_n=bn, num_warps=nw, num_stages=st, programs_per_sm=1, chunks=1,
                            kernel="mma", convert="packed", scale="auto", wide=True)
                out.append((f"tl {bn}w{nw} s{st} split{sp}", lambda x, q, tile=tile, sp=sp: kw.fused_mm(
                    x, q.qweight, q.scales, q.zeros, None, 4, q.group_size, n, tile=tile, splits=sp)))
    for nw in (4, 8):
        for st in (3, 4):
            for sp in (1, 2, 3, 4, 6):
                cfg = ww.WgmmaW4Config(m, nw, st)
                out.append((f"wgmma {m}x{16 * nw} s{st} split{sp}", lambda x, q, cfg=cfg, sp=sp: ww.wgmma_w4_mm(
                    x, q.qweight, q.scales, q.zeros, None, q.group_size, n, config=cfg, splits=sp)))
    return out


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split(":")) for s in os.environ.get("P_KN", "4096:6144").split(",")]
    ms = [int(v) for v in os.environ.get("P_MS", "64,128").split(",")]
    scale_dtype = getattr(torch, os.environ.get("P_SCALE", "float32"))
    rows = []
    start = time.time()
    for k, n in shapes:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=4, group_size=128, scale_dtype=scale_dtype)
        q_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(qw_bytes(qw)) - 1)]
        w_hat = qw.dequantize(BF16)
        w_sets = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=BF16)
            ref = qf.weight_only_mm(x, qw).float()
            bf16 = common.graph_us(F.linear, [(x, w) for w in w_sets])
            ship = common.graph_us(lambda x_, q: qf.weight_only_mm(x_, q), [(x, q) for q in q_sets])
            base = dict(K=k, N=n, M=m, bf16_us=bf16, ship_us=ship)
            rows.append(dict(base, cand="shipped", us=ship, vs_bf16=bf16 / ship))
            common.print_row(rows[-1])
            for name, fn in _candidates(m, n):
                row = dict(base, cand=name)
                try:
                    row["err"] = common.mean_rel_diff(fn(x, qw), ref)
                    if row["err"] > 3e-3:
                        row["error"] = "mismatch"
                    else:
                        row["us"] = common.graph_us(fn, [(x, q) for q in q_sets])
                        row["vs_bf16"], row["vs_ship"] = bf16 / row["us"], ship / row["us"]
                except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                common.print_row(row)
            torch.cuda.empty_cache()
    common.write_result(os.environ.get("P_OUT", "tune_weight_only_mid_m"),
                        "W4A16 at batch-sized M: forced tiles, splits and Gluon configs vs the dispatch", rows,
                        notes=f"scale dtype {scale_dtype}; total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
