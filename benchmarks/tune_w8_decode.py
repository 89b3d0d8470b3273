"""Same-run A/B for the byte-view W8A16 decode kernel (kernels/w8_decode.py): the shipped dispatch
(quantfuse.weight_only_mm, which runs it at M = 2..16 for int8 per-channel weights on sm90) against the path it
replaced there (`weight_only.fused_mm` with the int8 table tile for M and the scale width) and bf16 F.linear.

W8A16 per channel, symmetric, bf16 x; five Llama-3 shapes plus 11008x4096; M = 2 / 4 / 8 / 16 with float32 scales
and M = 16 with bfloat16 scales; CUDA graphs, weights rotated past L2 (common.graph_us); the minimum of ROUNDS
(default 3) alternated rounds. Rows: ours_us, replaced_us, bf16_us, ours_vs_replaced (> 1: ours faster),
ours_vs_bf16, weight_GBs (packed weight + scales bytes / ours time).
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_w8_decode.py   ->  results/tune_weight_only_w8_decode.json
     ... --splits: w8_decode with forced K splits 1..8 against the dispatch's own count (programs_per_sm x SMs over
     the column blocks, floored), M = 4 / 16, float32 scales, min of 2 rounds
     ->  results/tune_weight_only_w8_decode_splits.json
     ... --wide: M = 17 / 24 / 32 / 48 / 64 / 96 / 128 (past the decode band; TUNE_M overrides): the shipped
     dispatch, bf16 F.linear and w8_decode configs (WIDE_CANDIDATES), float32 scales, min of ROUNDS rounds
     ->  results/tune_weight_only_w8_decode_wide.json (TUNE_OUT_NAME overrides)
     ... --prefill: M = 33..4096 (TUNE_M overrides): the dispatch, bf16 F.linear and the Gluon int8 wgmma kernel
     (weight_only_wgmma.wgmma_w8_mm) with each of PREFILL_CANDIDATES and with its own pick, float32 scales
     ->  results/tune_weight_only_w8_wgmma.json (TUNE_OUT_NAME overrides)"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import clone_qw  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import w8_decode as kwd  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402
from quantfuse.kernels import weight_only_wgmma as ww  # noqa: E402

SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192), (11008, 4096)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def replaced(x, qw):
    """The int8 decode tile weight_only_mm ran at M = 2..16 before w8_decode (fused_mm, the table's tile)."""
    return kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, None, 8, qw.group_size, qw.shape[0])


def splits_sweep():
    rows = []
    dev = torch.device("cuda")
    for k, n in SHAPES + [(4096, 14336), (8192, 8192)]:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=8, group_size=-1, symmetric=True)
        qws = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(qw.qweight.numel() * 4) - 1)]
        cfg = kwd.pick_config(kw.arch_key(dev.type, dev.index))
        steps = kwd.split_plan(n, qw.qweight.shape[1] * 4, cfg, kw._num_sms(dev))[0]
        for m in (4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            fns = {"ours": lambda q: qf.weight_only_mm(x, q)}
            for s in (1, 2, 3, 4, 5, 6, 8):
                if s <= steps:
                    fns[f"s{s}"] = (lambda s: lambda q: kwd.w8_decode_mm(x, q.qweight, q.scales, None, None, n,
                                                                         splits=s))(s)
            best = {name: math.inf for name in fns}
            for _ in range(2):
                for name, fn in fns.items():
                    best[name] = min(best[name], common.graph_us(fn, [(q,) for q in qws]))
            row = dict(M=m, K=k, N=n, grid_n=-(-n // cfg.block_n), **best)
            common.print_row(row)
            rows.append(row)
        del qws
        torch.cuda.empty_cache()
    common.finish("tune_weight_only_w8_decode_splits", "w8_decode: forced K splits vs the dispatch's count", rows,
                  ["M", "K", "N", "grid_n", "ours"] + [f"s{s}" for s in (1, 2, 3, 4, 5, 6, 8)],
                  "W8A16 per channel symmetric, float32 scales, bf16 x; CUDA graphs, weights rotated past L2, minimum "
                  "of 2 alternated rounds; times in us; ours = weight_only_mm (w8_decode with its split rule), sN = N "
                  "splits forced.")


# W8DecodeConfig(block_n, block_k, num_warps, num_stages, programs_per_sm, block_m) per M of the --wide sweep
_C = kwd.W8DecodeConfig
_NARROW = [_C(128, 128, 4, 4, 2, 32), _C(128, 128, 4, 3, 2, 32), _C(128, 128, 4, 6, 2, 32), _C(128, 128, 4, 4, 3, 32),
           _C(64, 128, 4, 4, 4, 32), _C(128, 128, 8, 4, 2, 32), _C(128, 128, 4, 4, 2, 16), _C()]
_MID = [_C(128, 128, 4, 4, 2, 32), _C(128, 128, 4, 3, 2, 32), _C(128, 128, 4, 4, 2, 16), _C(),
        _C(128, 256, 4, 4, 1, 32)]
_WIDE = [_C(128, 128, 4, 4, 2, 32), _C(128, 128, 4, 4, 2, 16), _C()]
WIDE_CANDIDATES = {17: _NARROW, 24: _NARROW, 32: _NARROW, 48: _MID, 64: _MID, 96: _WIDE, 128: _WIDE}


def _label(c) -> str:
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages} p{c.programs_per_sm}"


def _sweep_vs_dispatch(ms, candidates, out_name, title, what):
    """Per (shape, M): the dispatch, bf16 F.linear and each of candidates(m, x, n) -> [(name, fn(qw))], each first
    checked against w8_decode's 16-row config (the same scale-after math; past M = 16 the dispatch's tl tiles round
    each weight first), min of ROUNDS alternated rounds; a candidate that does not build or differs is reported."""
    rows = []
    dev = torch.device("cuda")
    for k, n in SHAPES[:5]:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=8, group_size=-1, symmetric=True)
        nbytes = qw.qweight.numel() * 4 + qw.scales.numel() * 4
        qws = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
        w_hat = qw.dequantize(torch.bfloat16)
        lin = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = kwd.w8_decode_mm(x, qw.qweight, qw.scales, None, None, n, config=_C())
            fns = {"dispatch": (lambda q: qf.weight_only_mm(x, q), [(q,) for q in qws]),
                   "bf16": (lambda w: F.linear(x, w), [(w,) for w in lin])}
            errors = {}
            for name, fn in candidates(m, x, n):
                try:
                    err = common.mean_rel_diff(fn(qw), want)
                except Exception as e:  # noqa: BLE001 - a config that does not build is reported, not fatal
                    errors[name] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                if err > 1e-3:
                    errors[name] = f"mismatch {err:.2e}"
                    continue
                fns[name] = (fn, [(q,) for q in qws])
            best = {name: math.inf for name in fns}
            for _ in range(ROUNDS):
                for name, (fn, sets) in fns.items():
                    best[name] = min(best[name], common.graph_us(fn, sets))
            for name, us in best.items():
                if name in ("dispatch", "bf16"):
                    continue
                row = dict(M=m, K=k, N=n, config=name, us=us, dispatch_us=best["dispatch"], bf16_us=best["bf16"],
                           vs_dispatch=best["dispatch"] / us, vs_bf16=best["bf16"] / us,
                           dispatch_vs_bf16=best["bf16"] / best["dispatch"], TFLOPS=2 * m * n * k / us / 1e6)
                common.print_row(row)
                rows.append(row)
            for name, err in errors.items():
                rows.append(dict(M=m, K=k, N=n, config=name, error=err))
                print(m, k, n, name, err, flush=True)
        del qws, lin
        torch.cuda.empty_cache()
    common.finish(os.environ.get("TUNE_OUT_NAME", out_name), title, rows,
                  ["M", "K", "N", "config", "us", "dispatch_us", "bf16_us", "vs_dispatch", "vs_bf16",
                   "dispatch_vs_bf16", "TFLOPS", "error"],
                  f"W8A16 per channel symmetric, float32 scales, bf16 x; CUDA graphs, weights rotated past L2, minimum "
                  f"of {ROUNDS} alternated rounds; times in us. dispatch = quantfuse.weight_only_mm as shipped at the "
                  f"time of the run; {what}")


def _ms(default: str):
    return [int(v) for v in os.environ.get("TUNE_M", default).split(",")]


def wide_sweep():
    def candidates(m, x, n):
        return [(_label(cfg), (lambda cfg: lambda q: kwd.w8_decode_mm(x, q.qweight, q.scales, None, None, n,
                                                                      config=cfg))(cfg))
                for cfg in WIDE_CANDIDATES.get(m, [])]
    _sweep_vs_dispatch(_ms("17,24,32,48,64,96,128"), candidates, "tune_weight_only_w8_decode_wide",
                       "W8A16 past the decode band: w8_decode with wider x blocks vs the dispatch and bf16",
                       "configs: w8_decode with that config (block_m rows of x per program).")


_G = ww.WgmmaW4Config
PREFILL_CANDIDATES = [_G(256, 8, 4), _G(256, 8, 3), _G(128, 8, 6), _G(128, 8, 4), _G(64, 8, 6)]


def prefill_sweep():
    def candidates(m, x, n):
        return [("wgmma pick" if cfg is None else f"wgmma {cfg.block_m}x{cfg.block_n} s{cfg.stages}",
                 (lambda cfg: lambda q: ww.wgmma_w8_mm(x, q.qweight, q.scales, None, None, n, config=cfg))(cfg))
                for cfg in [None] + PREFILL_CANDIDATES]
    _sweep_vs_dispatch(_ms("33,48,64,96,128,256,512,1024,2048,4096"), candidates, "tune_weight_only_w8_wgmma",
                       "W8A16 prefill: the Gluon int8 wgmma kernel vs the dispatch and bf16",
                       "wgmma = weight_only_wgmma.wgmma_w8_mm with that config (pick: its own).")


def main():
    if "--prefill" in sys.argv:
        return prefill_sweep()
    if "--splits" in sys.argv:
        return splits_sweep()
    if "--wide" in sys.argv:
        return wide_sweep()
    rows = []
    dev = torch.device("cuda")
    arch = kw.arch_key(dev.type, dev.index)
    for scale_dtype, ms in ((torch.float32, (2, 4, 8, 16)), (torch.bfloat16, (16,))):
        for k, n in SHAPES:
            qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=8, group_size=-1, symmetric=True,
                                    scale_dtype=scale_dtype)
            nbytes = qw.qweight.numel() * 4 + qw.scales.numel() * qw.scales.element_size()
            qws = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
            w_hat = qw.dequantize(torch.bfloat16)
            lin = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
            for m in ms:
                assert kwd.prefer(m, arch), "run on an sm90 device: the dispatch must take w8_decode here"
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                fns = {"ours": (lambda q: qf.weight_only_mm(x, q), [(q,) for q in qws]),
                       "replaced": (lambda q: replaced(x, q), [(q,) for q in qws]),
                       "bf16": (lambda w: F.linear(x, w), [(w,) for w in lin])}
                best = {name: math.inf for name in fns}
                for _ in range(ROUNDS):
                    for name, (fn, sets) in fns.items():
                        best[name] = min(best[name], common.graph_us(fn, sets))
                row = dict(scales=str(scale_dtype).replace("torch.", ""), M=m, K=k, N=n, ours_us=best["ours"],
                           replaced_us=best["replaced"], bf16_us=best["bf16"],
                           ours_vs_replaced=best["replaced"] / best["ours"], ours_vs_bf16=best["bf16"] / best["ours"],
                           weight_GBs=nbytes / best["ours"] / 1e3)
                common.print_row(row)
                rows.append(row)
            del qws, lin
            torch.cuda.empty_cache()
    cfg = kwd.pick_config(arch)
    common.finish("tune_weight_only_w8_decode", "W8A16 decode: w8_decode vs the int8 tile it replaced, and bf16",
                  rows, ["scales", "M", "K", "N", "ours_us", "replaced_us", "bf16_us", "ours_vs_replaced",
                         "ours_vs_bf16", "weight_GBs"],
                  f"W8A16 per channel symmetric, bf16 x; CUDA graphs, weights rotated past L2, minimum of {ROUNDS} "
                  f"alternated rounds. ours = quantfuse.weight_only_mm (w8_decode {cfg}); replaced = "
                  f"weight_only.fused_mm with the int8 table tile (the dispatch before).")


if __name__ == "__main__":
    main()
