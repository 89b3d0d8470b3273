"""Sweep the Gluon tensor-core int4 decode kernel's configs (kernels/gemv_mma.py) against the shipped path
(`weight_only.weight_only_mm` with this kernel switched off), bf16 F.linear and tinygemm at M = 1..16, in one run
on the GPU (issues 5 and 6: weight-only decode).

Per (K, N, M): CUDA-graph medians with the weights rotated past L2 (common.time_ms): bf16 F.linear on the
dequantized weight, torch.ops.aten._weight_int4pack_mm (tinygemm), the dispatch without this kernel ("shipped
dispatch": the tl kernels), and each MmaDecodeConfig (split-K reduction fused or by the reduce kernel, as the
config says). Each config's output is first compared with x @ W.T in float32 for the unrounded W = (u - z) s
(mean |delta| / mean |ref|; the shipped path's error is reported too); a config over 3e-3 (a bf16 output rounding
is ~1e-3) is reported and not timed.
W4A16 g128 symmetric, float32 scales, bf16 x. Env: TUNE_CONFIGS ("block_n,warps,programs_per_sm[,fused_reduce
0/1[,early_refill 0/1[,x_group[,evict_first 0/1]]]];...", default: the candidates of M's bucket, each with the pick's
evict-first hint for the weight's size), TUNE_KN ("K:N,..."), TUNE_M ("1,16"),
TUNE_OUT_NAME (default tune_gemv_mma), ROUNDS (default 1: each variant timed ROUNDS times in alternated rounds, the
median kept).
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_gemv_mma.py
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import clone_qw, qw_bytes, tinygemm, tinygemm_pack  # noqa: E402
from tune_gemv_tma import _kn  # noqa: E402  (the same shapes and TUNE_KN spelling)

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import gemv_mma as gm  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

BF16 = torch.bfloat16


def _configs(m: int, weights: int):
    """TUNE_CONFIGS as given, or M's candidates each with the evict-first hint the pick takes for a weight of
    `weights` codes (pick_config's EVICT_FIRST_BELOW rule), so a candidate and the pick differ only in their
    config fields."""
    spec = os.environ.get("TUNE_CONFIGS")
    if not spec:
        hint = gm.pick_config(m, torch.device("cuda"), weights).evict_first
        return [dataclasses.replace(c, evict_first=hint) for c in gm.candidates(m, torch.device("cuda"))]
    return [gm.MmaDecodeConfig(*[int(v) for v in item.split(",")]) for item in spec.split(";") if item]


def _short(c) -> str:
    return (f"{c.block_n} w{c.num_warps} p{c.programs_per_sm}" + ("" if c.fused_reduce else " reduce-kernel")
            + (" early" if c.early_refill else "") + (f" xs{c.x_group}" if c.x_group else "")
            + (" ef" if c.evict_first else ""))


def _without_kernel(fn):
    """fn() with weight_only_mm's dispatch not taking this kernel (the "shipped dispatch" rows: the tl kernels)."""
    prefer = kw.prefer_gemv_mma
    kw.prefer_gemv_mma = lambda *a: False
    try:
        return fn()
    finally:
        kw.prefer_gemv_mma = prefer


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bw = common.copy_bandwidth_gbs()
    print(f"copy {bw:.0f} GB/s", flush=True)
    kns = _kn()
    ms = [int(v) for v in os.environ.get("TUNE_M", "1,2,4,8,16").split(",") if v]
    rounds = int(os.environ.get("ROUNDS", "1"))
    rows = []
    start = time.time()
    for k, n in kns:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=4, group_size=128)
        nbytes = qw_bytes(qw)
        qw_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
        w_hat = qw.dequantize(BF16)
        w32 = qw.dequantize(torch.float32)
        w_sets = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        try:
            tg = [tinygemm_pack(q) for q in qw_sets]
        except Exception as e:  # noqa: BLE001 - tinygemm is a peer: its absence is reported, not fatal
            print("tinygemm unavailable:", e)
            tg = None
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=BF16)
            sets = [(x, q) for q in qw_sets]
            base = dict(K=k, N=n, M=m)
            bf16_us = common.graph_us(F.linear, [(x, w) for w in w_sets])
            tiny_us = common.graph_us(tinygemm, [(x,) + p for p in tg]) if tg else float("nan")

            ref = x.float() @ w32.t()  # the unrounded-weight product, what the kernel computes

            def shipped(x_, q):
                return qf.weight_only_mm(x_, q)

            want = _without_kernel(lambda: shipped(x, qw))
            timed = [("shipped dispatch", lambda: _without_kernel(lambda: common.graph_us(shipped, sets)),
                      common.mean_rel_diff(want, ref))]
            variants = _configs(m, n * k)
            for cfg in variants:
                def ours(x_, q, cfg=cfg):
                    return kw.gemv_mma_mm(x_, q.qweight, q.scales, q.zeros, None, q.group_size, n, config=cfg)

                label = _short(cfg)
                try:
                    err = common.mean_rel_diff(ours(x, qw), ref)
                except Exception as e:  # noqa: BLE001 - a config the kernel refuses is reported, not fatal
                    rows.append(dict(base, config=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(rows[-1], flush=True)
                    continue
                if err > 3e-3:  # a bf16 output rounding is ~1e-3 of mean |ref|
                    rows.append(dict(base, config=label, rel_err=err, error="mismatch"))
                    print(rows[-1], flush=True)
                    continue
                timed.append((label, lambda ours=ours: common.graph_us(ours, sets), err))
            times = {label: [] for label, _, _ in timed}
            for _ in range(rounds):  # alternated: every variant once per round
                for label, run, _ in timed:
                    times[label].append(run())
            ship_us = statistics.median(times["shipped dispatch"])
            for label, _, err in timed:
                us = statistics.median(times[label])
                rows.append(dict(base, config=label, us=us, us_min=min(times[label]), us_max=max(times[label]),
                                 bf16_us=bf16_us, tinygemm_us=tiny_us, vs_bf16=bf16_us / us,
                                 vs_tinygemm=tiny_us / us, vs_shipped=ship_us / us,
                                 frac_copy_bw=nbytes / (us * 1e-6) / 1e9 / bw, rel_err=err))
            for r in rows[-len(timed):]:
                common.print_row(r)
        del qw_sets, w_sets, tg, w32
        torch.cuda.empty_cache()
    columns = ["K", "N", "M", "config", "us", "us_min", "us_max", "bf16_us", "tinygemm_us", "vs_bf16", "vs_tinygemm",
               "vs_shipped", "frac_copy_bw", "rel_err", "error"]
    notes = (f"W4A16 g128 symmetric, float32 scales, bf16 x; CUDA graphs, weights rotated past L2; copy bandwidth "
             f"{bw:.0f} GB/s in this run; frac_copy_bw = packed weight + scales bytes / time / copy bandwidth. "
             f"vs_shipped: the shipped dispatch's time / this config's; us: the median of {rounds} alternated round(s) "
             f"(us_min / us_max their range). total {time.time() - start:.0f} s")
    common.finish(os.environ.get("TUNE_OUT_NAME", "tune_gemv_mma"),
                  "Gluon tensor-core int4 decode configs vs the shipped path, bf16 and tinygemm", rows, columns, notes)


if __name__ == "__main__":
    main()
