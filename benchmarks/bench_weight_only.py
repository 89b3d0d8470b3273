"""Weight-only quantized GEMM benchmark (SPEC section 4): W4A16 / W8A16 vs bf16 and tinygemm, one GPU, one run.

Rows (every time is a CUDA-graph replay median with the weights rotated past L2, see common.time_ms, taken after
BENCH_SETTLE_S (default 0.3 s) idle so it does not inherit the clocks of the kernel before it; ours and bf16
alternate in BENCH_ROUNDS rounds, default 3, and report the median round):
- W4A16, group 128, symmetric, bf16 activations, on Llama-3-8B/70B linear shapes (K, N) at
  M in {1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}: ours (quantfuse.weight_only_mm, i.e. whatever path the
  dispatch picks: fused split-K for decode, fused tiled, the Gluon wgmma kernel, or dequantize + cuBLAS), bf16 F.linear
  on the dequantized weight, and torch.ops.aten._weight_int4pack_mm (tinygemm, inner_k_tiles=8, group 128,
  zero 0 so it computes the same (q - 8) * s weight). Where the dispatch does not use the fused kernel,
  fused_us times the fused tiled kernel forced (the data behind cublas_min_m in kernels/weight_only.py);
  where it runs the Gluon wgmma kernel, dequant_cublas_us times dequantize + cuBLAS forced as well (the
  alternatives that kernel replaced, same run).
- W8A16 per-channel at M in {1, 16, 32, 256, 1024, 2048} on the same shapes vs bf16 F.linear.
weight_GBs = (packed weight + scales (+ zero points)) bytes / ours time; frac_copy_bw divides it by the
device-to-device copy bandwidth measured in this run (read + write bytes per second).
speedup_vs_X = X time / ours time (> 1: ours faster).
BENCH_DECODE_PDL (default 0): the decode kernels' programmatic dependent launch (configs.DECODE_PDL) stays off
here: a graph replays the same call back to back, so with it each call's launch and prologue hide under the previous
call's tail, a 0.6-6% gain (results/tune_weight_only_decode_pdl.json) that the same A/B did not find inside a model
layer, where another kernel precedes. 1 keeps the shipped table.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/bench_weight_only.py   (BENCH_QUICK=1: fewer shapes)
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

import quantfuse as qf  # noqa: E402
from quantfuse.kernels._common import cap_splits  # noqa: E402
from quantfuse.kernels import gemv_mma as gm  # noqa: E402
from quantfuse.kernels import gemv_tma as gt  # noqa: E402
from quantfuse.kernels import w8_decode as kwd  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402
from quantfuse.kernels import weight_only_wgmma as ww  # noqa: E402
from quantfuse.kernels import weight_only_ws as wws  # noqa: E402
from quantfuse.weights import QuantizedWeight  # noqa: E402

# float32 scales: what quantize_ gives by default; BENCH_SCALE_DTYPE=bfloat16 measures the packed conversion
# (results then go to weight_only_bfloat16.json)
SCALE_DTYPE = getattr(torch, os.environ.get("BENCH_SCALE_DTYPE", "float32"))

BF16 = torch.bfloat16
LLAMA_KN = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
W4_M = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
W8_M = [1, 16, 32, 256, 1024, 2048]
GROUP = 128
INNER_K_TILES = 8
QUICK = os.environ.get("BENCH_QUICK", "0") == "1"
# ours and bf16 F.linear alternate this many rounds per row (median of each): back-to-back timings of one kernel
# drift by up to 10% at M = 4096 on the H100 (power), which a fixed order of single timings turns into a bias
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
if QUICK:
    LLAMA_KN = [(4096, 6144), (28672, 8192)]
    W4_M = [1, 16, 128, 1024]
LLAMA_KN = common.shapes_from_env(LLAMA_KN)  # BENCH_KN: other shapes, written to weight_only<BENCH_SUFFIX>.json
SUFFIX = os.environ.get("BENCH_SUFFIX", "")


def t(fn, sets):
    common.settle()
    return common.time_ms(fn, sets, graph=True, warmup=10, rep=40 if QUICK else 50)


# ---- the contenders --------------------------------------------------------------------------------
def ours(x, qw):
    return qf.weight_only_mm(x, qw)


def fused_forced(x, qw):
    return kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, None, qw.bits, qw.group_size, qw.shape[0])


def dequant_cublas(x, qw):
    """The path the dispatch takes from cublas_min_m on, forced (what the Gluon wgmma rows replaced there)."""
    w_hat = kw.dequantize(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, x.shape[1], x.dtype)
    return F.linear(x, w_hat)


def bf16_linear(x, w):
    return F.linear(x, w)


def tinygemm(x, w_packed, scales_and_zeros):
    return torch.ops.aten._weight_int4pack_mm(x, w_packed, GROUP, scales_and_zeros)


# ---- set-up ----------------------------------------------------------------------------------------
def qw_bytes(qw: QuantizedWeight) -> int:
    n = qw.qweight.numel() * qw.qweight.element_size() + qw.scales.numel() * qw.scales.element_size()
    if qw.zeros is not None:
        n += qw.zeros.numel() * qw.zeros.element_size()
    return n


def clone_qw(qw: QuantizedWeight) -> QuantizedWeight:
    c = lambda v: None if v is None else v.clone()  # noqa: E731
    return QuantizedWeight(qw.qweight.clone(), qw.scales.clone(), c(qw.zeros), qw.bits, qw.group_size, qw.shape,
                           c(qw.perm))


def rotated_weights(bits: int, k: int, n: int):
    """A random [N, K] weight quantized the probes' way (W4A16 g128 symmetric or W8A16 per channel, float32
    scales): (its copies and the dequantized bf16 weight's copies, each list long enough to rotate past L2)."""
    qw = qf.quantize_weight(torch.randn(n, k, device="cuda"), bits=bits, group_size=128 if bits == 4 else -1)
    qw_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(qw_bytes(qw)) - 1)]
    w_hat = qw.dequantize(BF16)
    return qw_sets, [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]


def tinygemm_pack(qw: QuantizedWeight):
    """(packed weight, scales_and_zeros [K/128, N, 2] bf16) for _weight_int4pack_mm, or raise.

    tinygemm dequantizes w = (u - 8) * scale + zero with unsigned codes u; ours are u = q + 8 (symmetric),
    so zero = 0 gives the same weight. torch >= 2.5 packs a uint8 [N, K/2] (even k in the high nibble);
    older versions took an int32 [N, K]."""
    u = qw.biased_codes()
    errors = []
    w_packed = None
    for form in ("uint8", "int32"):
        try:
            if form == "uint8":
                arg = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()
            else:
                arg = u.to(torch.int32).contiguous()
            w_packed = torch.ops.aten._convert_weight_to_int4pack(arg, INNER_K_TILES)
            break
        except Exception as e:  # noqa: BLE001
            errors.append(f"{form}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if w_packed is None:
        raise RuntimeError("; ".join(errors))
    sz = torch.stack([qw.scales, torch.zeros_like(qw.scales)], dim=-1).to(BF16).contiguous()
    return w_packed, sz


def _wgmma_label(cfg, splits, tail) -> str:
    return (f"gluon wgmma {cfg.block_m}x{cfg.block_n} splitK={splits}"
            + ("" if tail is None else f" tail {tail.main_tiles_n}+{tail.splits}way"))


def path_of(m: int, k: int, n: int, bits: int) -> str:
    """The dispatch weight_only_mm takes (mirrors kernels/weight_only.py)."""
    dev = torch.device("cuda")
    table = kw._table(dev)
    sm90_gluon = gt.GLUON_AVAILABLE and torch.cuda.get_device_capability() == (9, 0)
    if kw.prefer_dequant_cublas_small(m, n, k, table):
        return "dequant+cublas (small weight)"
    if bits == 4 and sm90_gluon and wws.prefer(m, n, k, "sm90", kw._num_sms(dev)):
        tail = wws.tail_plan(m, n, k, "sm90", kw._num_sms(dev))  # what ws_w4_mm runs
        return "gluon ws 256x128" + ("" if tail is None else f" tail {tail[1].main_tiles_n}+{tail[1].splits}way")
    if bits == 4 and sm90_gluon and ww.prefer(m, n, k, "sm90", SCALE_DTYPE == BF16):  # group 128: applies
        return _wgmma_label(*ww.plan(m, n, k, "sm90", kw._num_sms(dev)))  # what wgmma_w4_mm runs
    small = ww.small_m_config(m, n, k, "sm90", kw._num_sms(dev), SCALE_DTYPE == BF16) if bits == 4 and sm90_gluon \
        else None
    if small is not None:  # 16-bit scales at M = 32 / 64 / 128: what wgmma_w4_mm runs with that config
        return _wgmma_label(small, ww.splits_for(m, n, k, small, kw._num_sms(dev)),
                            ww.tail_split_for(m, n, k, small, kw._num_sms(dev)))
    if bits == 8 and sm90_gluon and ww.prefer_w8(m, "sm90"):  # per channel here: applies
        cfg = ww.WGMMA_W8_CONFIGS["sm90"]
        return f"gluon wgmma w8 {cfg.block_m}x{cfg.block_n} splitK={ww.w8_splits(m, n, k, cfg, kw._num_sms(dev))}"
    if m >= table["cublas_min_m"]:
        return "dequant+cublas"
    tile = kw.pick_tile(m, dev, bits, SCALE_DTYPE.itemsize)
    if bits == 4 and sm90_gluon and m <= gm.MAX_M and kw.prefer_gemv_mma(m, n, k):  # group 128 here: applies
        cfg = gm.pick_config(m, dev, n * k)
        return (f"gluon mma decode {cfg.block_n}w{cfg.num_warps}" + ("" if cfg.fused_reduce else " +reduce")
                + (" x-ring" if cfg.x_group else ""))
    if bits == 8 and kwd.prefer(m, kw.arch_key(dev.type, dev.index)):  # per channel here: applies
        cfg = kwd.pick_config(kw.arch_key(dev.type, dev.index), m)
        _, splits, _ = kwd.split_plan(n, -(-k // 64) * 64, cfg, kw._num_sms(dev), m=m)  # K_pad: whole 64-code chunks
        return f"w8 decode {cfg.block_m}x{cfg.block_n} splitK={splits}"
    if m == 1 and gt.GLUON_AVAILABLE and torch.cuda.get_device_capability() == (9, 0) and kw.prefer_gemv_tma(
            bits, n, k, tile, kw._num_sms(dev)):
        cfg = gt.pick_config(bits, dev)
        return f"gluon tma gemv {cfg.block_n}x{cfg.chunks}c"
    grid = -(-n // tile["block_n"]) * -(-m // tile["block_m"])
    chunks = -(-k // kw.chunk_codes(bits))
    splits = cap_splits(tile["programs_per_sm"] * kw._num_sms(dev) // max(1, grid), chunks,
                        table.get("min_chunks_per_split", 1))
    per = -(-chunks // splits)
    splits = -(-chunks // per)
    # the WIDE kernel (one product per chunk): kernels/weight_only.py's rule at launch
    num_groups = -(-k // GROUP) if bits == 4 else 1
    wide = kw.runs_wide(tile, kw._scale_code(tile, num_groups, True))
    return f"fused {'wide ' if wide else ''}{tile['block_m']}x{tile['block_n']} splitK={splits}"


rel_err = common.mean_rel_diff


def bench_shape(k, n, ms, bits, bw, rows, tinygemm_status, start):
    group = GROUP if bits == 4 else -1
    w = torch.randn(n, k, device="cuda")
    qw = qf.quantize_weight(w, bits=bits, group_size=group, symmetric=True, scale_dtype=SCALE_DTYPE)
    del w
    w_hat = qw.dequantize(BF16)
    wbytes = qw_bytes(qw)
    qw_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(wbytes) - 1)]
    lin_sets = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
    tg_sets, tg_check = None, None
    if bits == 4 and tinygemm_status["ok"] is not False:
        try:
            wp, sz = tinygemm_pack(qw)
            x_chk = torch.randn(16, k, device="cuda").to(BF16)
            tg_check = rel_err(tinygemm(x_chk, wp, sz), ours(x_chk, qw))
            tg_bytes = wp.numel() * wp.element_size() + sz.numel() * sz.element_size()
            tg_sets = [(wp, sz)] + [(wp.clone(), sz.clone()) for _ in range(common.rotation_count(tg_bytes) - 1)]
            tinygemm_status["ok"] = True
            tinygemm_status.setdefault("check", {})[f"{k}x{n}"] = tg_check
        except Exception as e:  # noqa: BLE001
            tinygemm_status["ok"] = False
            tinygemm_status["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print("tinygemm unavailable:", tinygemm_status["error"], flush=True)
    cublas_min_m = kw._table(torch.device("cuda"))["cublas_min_m"]
    for m in ms:
        row = {"scheme": "W4A16 g128 sym" if bits == 4 else "W8A16 per-channel", "K": k, "N": n, "M": m,
               "path": path_of(m, k, n, bits)}
        xs = [torch.randn(m, k, device="cuda").to(BF16) for _ in range(max(len(qw_sets), len(lin_sets)))]
        ours_rounds, bf16_rounds = [], []
        for _ in range(ROUNDS):
            ours_rounds.append(t(ours, [(xs[i], q) for i, q in enumerate(qw_sets)]))
            bf16_rounds.append(t(bf16_linear, [(xs[i], wl) for i, wl in enumerate(lin_sets)]))
        ours_ms = statistics.median(ours_rounds)
        row["ours_us"] = ours_ms * 1e3
        row["bf16_us"] = statistics.median(bf16_rounds) * 1e3
        gluon_wgmma = row["path"].startswith("gluon wgmma")
        if m >= cublas_min_m or gluon_wgmma:
            try:
                row["fused_us"] = t(fused_forced, [(xs[i], q) for i, q in enumerate(qw_sets)]) * 1e3
            except Exception as e:  # noqa: BLE001
                row["fused_us"] = f"error: {type(e).__name__}"
        if gluon_wgmma:
            row["dequant_cublas_us"] = t(dequant_cublas, [(xs[i], q) for i, q in enumerate(qw_sets)]) * 1e3
        row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
        if bits == 4:
            if tg_sets is not None:
                try:
                    tg_args = [(xs[i % len(xs)], wp, sz) for i, (wp, sz) in enumerate(tg_sets)]
                    row["tinygemm_us"] = t(tinygemm, tg_args) * 1e3
                    row["speedup_vs_tinygemm"] = row["tinygemm_us"] / row["ours_us"]
                except Exception as e:  # noqa: BLE001
                    row["tinygemm_us"] = "n/a"
                    row["speedup_vs_tinygemm"] = "n/a"
                    tinygemm_status.setdefault("run_errors", []).append(f"M={m} {k}x{n}: {type(e).__name__}: "
                                                                      f"{str(e).splitlines()[0][:200]}")
            else:
                row["tinygemm_us"] = row["speedup_vs_tinygemm"] = "n/a"
        row["weight_GBs"] = wbytes / (ours_ms * 1e-3) / 1e9
        row["frac_copy_bw"] = row["weight_GBs"] / bw
        rows.append(row)
        del xs
        torch.cuda.empty_cache()

        def fmt(key, spec=".2f"):
            v = row.get(key)
            return format(v, spec) if isinstance(v, float) else str(v if v is not None else "-")

        print(f"[{time.time() - start:6.1f}s] {row['scheme']} M={m} K={k} N={n} ({row['path']}): "
              f"ours {fmt('ours_us', '.1f')} us, "
              f"bf16 {fmt('bf16_us', '.1f')} us ({fmt('speedup_vs_bf16')}x), tinygemm {fmt('tinygemm_us', '.1f')} us "
              f"({fmt('speedup_vs_tinygemm')}x), fused-forced {fmt('fused_us', '.1f')} us, "
              f"{fmt('weight_GBs', '.0f')} GB/s = {fmt('frac_copy_bw')} of copy", flush=True)
    del qw_sets, lin_sets, tg_sets, w_hat, qw
    torch.cuda.empty_cache()


def main():
    torch.manual_seed(0)
    if os.environ.get("BENCH_DECODE_PDL", "0") != "1":
        from quantfuse.kernels import configs

        configs.DECODE_PDL = {}  # (module doc)
    info = common.env_info()
    bw = common.copy_bandwidth_gbs()
    print(f"device {info.get('device')}  torch {info['torch']}  triton {info['triton']}  copy {bw:.0f} GB/s",
          flush=True)
    rows = []
    tinygemm_status = {"ok": None}
    start = time.time()
    for k, n in LLAMA_KN:
        bench_shape(k, n, W4_M, 4, bw, rows, tinygemm_status, start)
    for k, n in LLAMA_KN:
        bench_shape(k, n, W8_M, 8, bw, rows, tinygemm_status, start)

    columns = ["scheme", "K", "N", "M", "path", "ours_us", "bf16_us", "tinygemm_us", "speedup_vs_bf16",
               "speedup_vs_tinygemm", "weight_GBs", "frac_copy_bw", "fused_us", "dequant_cublas_us"]
    if tinygemm_status["ok"]:
        checks = tinygemm_status.get("check", {}).items()
        tg = "ok; mean rel diff vs ours at M=16: " + ", ".join(f"{s} {v:.2g}" for s, v in checks)
        if tinygemm_status.get("run_errors"):
            tg += "; run errors: " + " | ".join(tinygemm_status["run_errors"][:3])
    else:
        tg = f"n/a ({tinygemm_status.get('error', 'not attempted')})"
    table = kw._table(torch.device("cuda"))
    notes = (f"copy bandwidth {bw:.0f} GB/s measured in this run; CUDA graphs, weights rotated past L2; ours_us and "
             f"bf16_us: medians of {ROUNDS} alternated rounds (the other columns one timing each), every timing after "
             f"{common.SETTLE_S} s idle. "
             f"Our scales are {str(SCALE_DTYPE).replace('torch.', '')} [K/128, N] (counted in weight_GBs; "
             f"BENCH_SCALE_DTYPE). cublas_min_m={table['cublas_min_m']}. "
             f"tinygemm (_weight_int4pack_mm, inner_k_tiles={INNER_K_TILES}): {tg}. total {time.time() - start:.0f} s")
    name = ("weight_only" if SCALE_DTYPE == torch.float32 else f"weight_only_{str(SCALE_DTYPE)[6:]}") + SUFFIX
    title = "Weight-only INT4/INT8 GEMM (W4A16 g128, W8A16) vs bf16 and tinygemm" + common.shapes_title(LLAMA_KN)
    if SCALE_DTYPE != torch.float32:
        title += f", {str(SCALE_DTYPE)[6:]} scales (packed conversion where it applies)"
    common.finish(name, title, rows, columns, notes, extra={"tiles": [dict(t_) for t_ in table["tiles"]]})


if __name__ == "__main__":
    main()
