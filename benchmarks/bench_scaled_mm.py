"""Scaled matmul benchmark (issue 3): INT8 / FP8 GEMMs with fused epilogues vs torch, on one GPU, one run.

Rows (every time is a CUDA-graph replay median with inputs rotated past L2, see common.time_ms):
- int8: ours (per-token x per-channel + bias, bf16 out) vs torch._int_mm + the epilogue in torch
  (int32 * s_a, then addcmul(bias, ., s_b) into bf16: two kernels) and vs bf16 F.linear with bias (ours
  from pre-quantized int8 activations: the GEMM alone).
- fp8: ours (same epilogue) vs torch._scaled_mm (rowwise scales, bf16 bias), the faster of use_fast_accum=True
  (the fp8 accumulation ours uses; cuBLAS refuses it on some decode shapes) and the default, per shape
  (scaled_mm_accum).
  Ours and these two torch peers alternate in BENCH_ROUNDS rounds (default 3): medians, and each round's ratio's
  range (*_min / *_max). One timing of the same kernel moves by up to ~10% on this machine between calls (the
  GPU's clocks under a sustained INT8 load), so a single back-to-back pair can misstate the ratio; every timing
  starts after BENCH_SETTLE_S (default 0.3 s) idle, so it does not inherit the clocks of the kernel before it.
- azp: ours with the per-token zero-point epilogue vs ours symmetric at the same shape, timed in alternation
  (AZP_ROUNDS each, medians): a single back-to-back pair read 5-7% apart on shapes where earlier runs read 1-4%.
- blockwise: our 1x128 / 128x128 block-scaled fp8 vs our rowwise fp8 and vs torch._scaled_mm blockwise
  (when this torch accepts it).
TOPS count 2*M*N*K; peak = 1979 dense INT8/FP8 TOPS (H100 SXM); bf16 is also measured. For decode rows the
weight-streaming bandwidth (bytes of b / time) is given as a fraction of the measured copy bandwidth.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/bench_scaled_mm.py
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
from quantfuse.kernels import scaled_mm as kmm  # noqa: E402

PEAK_TOPS = 1979.0
INT8, FP8, BF16 = torch.int8, torch.float8_e4m3fn, torch.bfloat16
LLAMA_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
LLAMA_M = [1, 16, 1024, 4096]
LLAMA_KN = common.shapes_from_env(LLAMA_KN)  # BENCH_KN: other shapes, written to scaled_mm<BENCH_SUFFIX>.json
SUFFIX = os.environ.get("BENCH_SUFFIX", "")
QUICK = os.environ.get("BENCH_QUICK", "0") == "1"
AZP_ROUNDS = 3
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def _q(shape, dtype):
    if dtype == INT8:
        return torch.randint(-128, 128, shape, dtype=INT8, device="cuda")
    return (torch.randn(shape, device="cuda") * 60).to(FP8)


def make_sets(m, k, n, dtype, extra_bytes=0):
    per_call = m * k + k * n + 2 * m * n + extra_bytes
    sets = []
    for _ in range(common.rotation_count(per_call)):
        a = _q((m, k), dtype)
        w = _q((n, k), dtype)
        sa = torch.rand(m, 1, device="cuda") * 1e-3 + 1e-4
        sb = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        bias = torch.randn(n, device="cuda").to(BF16)
        sets.append((a, w.t(), sa, sb, bias))
    return sets


def t(fn, sets):
    common.settle()
    return common.time_ms(fn, sets, graph=True, warmup=10 if QUICK else 20, rep=40 if QUICK else 80)


def tops(m, k, n, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


# ---- the contenders --------------------------------------------------------------------------------
def ours(a, b, sa, sb, bias):
    return qf.scaled_mm(a, b, sa, sb, BF16, bias)


def ours_azp(a, b, sa, sb, bias, adj, azp):
    return qf.scaled_mm(a, b, sa, sb, BF16, bias, adj, azp)


def torch_int_mm_unfused(a, b, sa, sb, bias):
    # the leanest eager epilogue: int32 * s_a promotes to float32 in one kernel, addcmul adds the bias and s_b in a
    # second one writing bf16 (one rounding); the earlier form (.float(), three in-place ops, a cast: five kernels)
    # made the peer ~40% slower at 8192^3 (a review found it, stop 60)
    out = torch.empty(a.shape[0], b.shape[1], dtype=BF16, device=a.device)
    return torch.addcmul(bias, torch._int_mm(a, b) * sa, sb.view(1, -1), out=out)


def torch_int_mm_alone(a, b, sa, sb, bias):
    return torch._int_mm(a, b)


def torch_scaled_mm_rowwise(a, b, sa, sb, bias, fast_accum=False):
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb.view(1, -1), bias=bias, out_dtype=BF16,
                            use_fast_accum=fast_accum)


def torch_scaled_mm_rowwise_fast(a, b, sa, sb, bias):
    # use_fast_accum: the fp8 accumulation our kernels use too (Triton's sm90 default for fp8 dots accumulates the
    # whole K in the tensor core's precision)
    return torch_scaled_mm_rowwise(a, b, sa, sb, bias, fast_accum=True)


def strongest_scaled_mm(sets):
    """(label, fn) of the faster torch._scaled_mm rowwise variant on these inputs: fast accumulation where cuBLAS
    takes it (it refuses some decode shapes), else the default; one timing each."""
    variants = [("default", torch_scaled_mm_rowwise)]
    try:
        torch_scaled_mm_rowwise_fast(*sets[0])
        torch.cuda.synchronize()
        variants.append(("fast_accum", torch_scaled_mm_rowwise_fast))
    except Exception:  # noqa: BLE001 - cuBLAS refused fast accumulation here
        torch.cuda.synchronize()
    return min(variants, key=lambda v: t(v[1], sets)) if len(variants) > 1 else variants[0]


def bf16_linear(x, w, bias):
    return F.linear(x, w, bias)


def ours_blockwise(a, b, sa, sb, bias):
    return qf.scaled_mm_blockwise(a, b, sa, sb, BF16, bias)


def torch_blockwise(a, b, sa, sb_cm, bias):
    # torch wants scale_a [M, K/128] outer-dim-major and scale_b as the column-major [K/128, N/128]
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb_cm, out_dtype=BF16)


def block_sets(fp8_sets, k, n):
    out = []
    kb, nb = -(-k // 128), -(-n // 128)
    for a, b, _, _, bias in fp8_sets:
        m = a.shape[0]
        sa = (torch.rand(kb, m, device="cuda") * 0.1 + 0.01).t()  # the transposed layout of section 3
        sb = (torch.rand(nb, kb, device="cuda") * 1e-3 + 1e-4).t()  # [kb, nb], column-major
        out.append((a, b, sa, sb, bias))
    return out


def alternated(row, ours_key, ours_fn, peer_key, peer_fn, ratio_key, sets):
    """Ours and the peer (None: ours alone) timed in ROUNDS alternated rounds: the medians into row[ours_key] /
    row[peer_key], their ratio into row[ratio_key] and the range of the per-round ratios into ratio_key_min / _max.
    Returns (ours ms, peer ms or None)."""
    ours_runs, peer_runs = [], []
    for _ in range(ROUNDS if peer_fn is not None else 1):
        ours_runs.append(t(ours_fn, sets))
        if peer_fn is not None:
            peer_runs.append(t(peer_fn, sets))
    row[ours_key] = ours_ms = statistics.median(ours_runs)
    if peer_fn is None:
        return ours_ms, None
    row[peer_key] = peer_ms = statistics.median(peer_runs)
    row[ratio_key] = peer_ms / ours_ms
    ratios = [p / o for o, p in zip(ours_runs, peer_runs)]
    row[ratio_key + "_min"], row[ratio_key + "_max"] = min(ratios), max(ratios)
    return ours_ms, peer_ms


def main():
    torch.manual_seed(0)
    info = common.env_info()
    bw = common.copy_bandwidth_gbs()
    bf16_peak = common.bf16_matmul_tflops()
    print(f"device {info.get('device')}  copy {bw:.0f} GB/s  bf16 matmul {bf16_peak:.0f} TFLOPS")
    rows = []
    torch_blockwise_ran = []
    torch_blockwise_refused = {}  # error message -> shapes (MxKxN)
    start = time.time()

    shapes = [(8192, 8192, 8192)] + [(m, k, n) for (k, n) in LLAMA_KN for m in LLAMA_M]
    if QUICK:
        shapes = [(8192, 8192, 8192), (1, 4096, 6144), (16, 4096, 28672), (1024, 4096, 4096), (4096, 14336, 4096)]
    for m, k, n in shapes:
        row = {"M": m, "K": k, "N": n}
        # int8: ours vs torch._int_mm + torch epilogue vs bf16 F.linear
        sets = make_sets(m, k, n, INT8)
        peer = torch_int_mm_unfused if m > 16 and k % 8 == 0 and n % 8 == 0 else None
        ours_ms, _ = alternated(row, "int8_ms", ours, "int_mm_epi_ms", peer, "x_vs_int_mm_epi", sets)
        row["int8_TOPS"] = tops(m, k, n, ours_ms)
        row["int8_frac_peak"] = row["int8_TOPS"] / PEAK_TOPS
        row["int8_weight_GBs_frac_copy"] = (k * n / (ours_ms * 1e-3) / 1e9) / bw
        if (m, k, n) == (8192, 8192, 8192):
            row["int_mm_alone_ms"] = t(torch_int_mm_alone, sets)
            row["int_mm_alone_TOPS"] = tops(m, k, n, row["int_mm_alone_ms"])
        # zero-point epilogue overhead (per-token azp + bias) vs symmetric + bias
        azp_sets = [(a, b, sa, sb, bias, qf.azp_adjustment(b),
                     torch.randint(-100, 100, (m, 1), dtype=torch.int32, device="cuda"))
                    for a, b, sa, sb, bias in sets]
        sym_runs, azp_runs = [ours_ms], []
        for r in range(AZP_ROUNDS):
            azp_runs.append(t(ours_azp, azp_sets))
            if r + 1 < AZP_ROUNDS:
                sym_runs.append(t(ours, sets))
        row["azp_ms"] = statistics.median(azp_runs)
        row["azp_sym_ms"] = statistics.median(sym_runs)
        row["azp_overhead"] = row["azp_ms"] / row["azp_sym_ms"] - 1.0
        del sets, azp_sets
        lin_sets = []
        for _ in range(common.rotation_count(2 * (m * k + k * n + m * n))):
            lin_sets.append((torch.randn(m, k, device="cuda", dtype=BF16), torch.randn(n, k, device="cuda", dtype=BF16),
                             torch.randn(n, device="cuda", dtype=BF16)))
        row["bf16_linear_ms"] = t(bf16_linear, lin_sets)
        row["x_vs_bf16_linear"] = row["bf16_linear_ms"] / ours_ms
        del lin_sets
        # fp8: ours vs torch._scaled_mm rowwise + bias
        sets = make_sets(m, k, n, FP8)
        try:
            row["scaled_mm_accum"], peer = strongest_scaled_mm(sets)
            fp8_ms, _ = alternated(row, "fp8_ms", ours, "scaled_mm_ms", peer, "x_vs_scaled_mm", sets)
        except Exception as e:  # noqa: BLE001 - torch refused: ours alone
            torch.cuda.synchronize()
            row["fp8_ms"] = fp8_ms = t(ours, sets)
            row["scaled_mm_ms"] = f"error: {type(e).__name__}"
        row["fp8_TOPS"] = tops(m, k, n, fp8_ms)
        row["fp8_frac_peak"] = row["fp8_TOPS"] / PEAK_TOPS
        # blockwise fp8 vs our rowwise fp8 and torch blockwise
        bsets = block_sets(sets, k, n)
        row["blockwise_ms"] = t(ours_blockwise, bsets)
        row["blockwise_vs_rowwise"] = fp8_ms / row["blockwise_ms"]
        # every shape is tried: cuBLAS takes some shapes and refuses others (one refusal says nothing of the rest)
        try:
            row["torch_blockwise_ms"] = t(torch_blockwise, bsets)
            row["x_vs_torch_blockwise"] = row["torch_blockwise_ms"] / row["blockwise_ms"]
            torch_blockwise_ran.append(f"{m}x{k}x{n}")
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            torch_blockwise_refused.setdefault(msg, []).append(f"{m}x{k}x{n}")
            torch.cuda.synchronize()
        del sets, bsets
        torch.cuda.empty_cache()
        rows.append(row)
        def fmt(key):
            v = row.get(key)
            return f"{v:.2f}" if isinstance(v, float) else "n/a"

        print(f"[{time.time() - start:6.1f}s] {m}x{k}x{n}: int8 {row['int8_TOPS']:.0f} TOPS "
              f"({fmt('x_vs_int_mm_epi')}x int_mm+epi, "
              f"{fmt('x_vs_bf16_linear')}x bf16), fp8 {row['fp8_TOPS']:.0f} TOPS ({fmt('x_vs_scaled_mm')}x scaled_mm), "
              f"azp +{100 * row['azp_overhead']:.1f}%, blockwise {fmt('blockwise_vs_rowwise')}x rowwise, "
              f"{fmt('x_vs_torch_blockwise')}x torch blockwise", flush=True)

    columns = ["M", "K", "N", "int8_ms", "int8_TOPS", "int8_frac_peak", "int_mm_epi_ms", "x_vs_int_mm_epi",
               "x_vs_int_mm_epi_min", "x_vs_int_mm_epi_max",
               "bf16_linear_ms", "x_vs_bf16_linear", "azp_ms", "azp_sym_ms", "azp_overhead", "fp8_ms", "fp8_TOPS",
               "fp8_frac_peak",
               "scaled_mm_ms", "scaled_mm_accum", "x_vs_scaled_mm", "x_vs_scaled_mm_min", "x_vs_scaled_mm_max",
               "blockwise_ms",
               "blockwise_vs_rowwise", "torch_blockwise_ms",
               "x_vs_torch_blockwise", "int8_weight_GBs_frac_copy", "int_mm_alone_ms", "int_mm_alone_TOPS"]
    tuned = {str(k): str(v) for k, v in kmm._tuned.items()}
    notes = (f"copy bandwidth {bw:.0f} GB/s, bf16 matmul {bf16_peak:.0f} TFLOPS measured; peak INT8/FP8 dense "
             f"{PEAK_TOPS} TOPS. int8 vs int_mm+epi and fp8 vs scaled_mm: medians of {ROUNDS} alternated rounds, "
             f"*_min / *_max the range of the per-round ratios; every timing after {common.SETTLE_S} s idle. "
             f"azp_overhead: median of {AZP_ROUNDS} zero-point timings over the median of the symmetric ones, timed in "
             "alternation (azp_sym_ms). "
             f"torch._scaled_mm blockwise (1x128 x 128x128, no bias: ours adds it) ran on "
             f"{len(torch_blockwise_ran)} of {len(rows)} shapes; "
             + ("; ".join(f"refused on {', '.join(v)}: {k}" for k, v in torch_blockwise_refused.items())
                or "refused on none")
             + f". autotune={'on' if kmm._autotune_enabled() else 'off'}")
    title = "Scaled matmul with fused epilogues (INT8/FP8) and blockwise FP8" + common.shapes_title(LLAMA_KN)
    path = common.write_result("scaled_mm" + SUFFIX, title, rows,
                               columns=columns, notes=notes, extra={"tuned_configs": tuned})
    print()
    common.print_table(rows, ["M", "K", "N", "int8_TOPS", "x_vs_int_mm_epi", "x_vs_bf16_linear", "azp_overhead",
                              "fp8_TOPS", "x_vs_scaled_mm", "blockwise_vs_rowwise", "x_vs_torch_blockwise"])
    print(notes)
    if tuned:
        for k, v in tuned.items():
            print("tuned", k, v)
    print("wrote", path)


if __name__ == "__main__":
    main()
