"""Probe (stop 48): can W8A16 decode (M = 1..16, per-channel scales) stream its weight like our FP8 decode kernel?

The shipped W8A16 decode paths (the tl mma tile `weight_only.fused_mm` at M = 2..16, the Gluon GEMV at M = 1) stay at
1.27-1.84x bf16 (issue 5 asks 1.8x at M = 1..16), while `scaled_mm`'s fp8 decode tiles stream the same number of
weight bytes 1.1-1.3x faster. This probe's kernel is the fp8 decode recipe for the int8 codes: the packed int32
words read as bytes [N, K_pad] (a `tl.dot` operand straight from memory, pipelined by `num_stages`; inside each
64-code chunk byte 4 j + i holds k = 16 i + j, so x is read in that permuted order: gathered element by element, or
(`xperm`) read in k order and permuted in registers), each byte widened to the exact u - z by the 2^23 magic
(OR + FADD), one bf16 dot per BLOCK_K bytes, the per-channel scale applied to the sums, split-K partials reduced
by `weight_only.splitk_reduce` or the tile's last program (`fused`). Orientation `xa`: x [16, BK] @ w [BK, BN]
(mma.sync); `swap`: w^T [BN, BK] @ x^T (a register-operand wgmma for BN >= 64).

Times in one call on the device, CUDA graphs, weights rotated past L2 (common.graph_us), the minimum of ROUNDS
alternated rounds, five Llama-3 shapes at M = 1 / 4 / 16: bf16 F.linear, the shipped dispatch
(quantfuse.weight_only_mm, W8A16 per channel, float32 scales), our fp8 decode (quantfuse.scaled_mm, fp8 x and
weight of the same shape: the bytes-equal reference) and the probe's candidates (the best of a 19-candidate sweep in
an earlier call of this stop). Each candidate's output is checked against the shipped op first.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_w8_bytes.py (--dry: the interpreter, small shapes, the
kernel against the float32 product with the unrounded weights; --set sweep1 / sweep2 / ab: the later sweeps, `SETS`).
Result: results/tune_weight_only_w8_bytes.json."""
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import clone_qw  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import weight_only as wo  # noqa: E402
from quantfuse.kernels._common import INTERPRET, cast_to, cdiv  # noqa: E402
from quantfuse.kernels.w8_decode import _dot  # noqa: E402  (the same dot, interpreter twin included)


@triton.jit
def _codes(w, zm):
    """The exact u - z of int8 bytes as float32: the byte OR-ed into the mantissa of 2^23, minus 2^23 + z."""
    return ((w.to(tl.int32) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - zm


@triton.jit
def _w8_bytes_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, K, K_PAD, k_per_split, splits, stride_xm, stride_wn, stride_om,
                     HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                     EVEN: tl.constexpr, INTERPRET: tl.constexpr, XPERM: tl.constexpr = False):
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rn = (offs_n % N).to(tl.int64)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rm = (offs_m % M).to(tl.int64)
    p_begin = pid_s * k_per_split
    p_end = tl.minimum(p_begin + k_per_split, K_PAD)
    pk = tl.arange(0, BLOCK_K)
    if XPERM:  # x read in k order, permuted in registers
        kperm = pk
    else:
        kperm = (pk // 64) * 64 + 16 * (pk % 4) + (pk % 64) // 4
    if HAS_ZERO:
        z = tl.load(z_ptr + rn).to(tl.float32)
    else:
        z = tl.full([BLOCK_N], 128.0, tl.float32)
    zm = z + 8388608.0
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (p_begin + pk)[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (p_begin + kperm)[:, None]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + (p_begin + pk)[:, None]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (p_begin + kperm)[None, :]
    for p in range(p_begin, p_end, BLOCK_K):
        if SWAP:
            if EVEN:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(p + pk < p_end)[None, :], other=0)
                x = tl.load(x_ptrs, mask=((p + kperm < K) & (p + pk < p_end))[:, None], other=0.0)
            wv = _codes(w, zm[:, None]).to(x_ptr.dtype.element_ty)
            if XPERM:
                x = tl.reshape(tl.permute(tl.reshape(x, [BLOCK_K // 64, 4, 16, BLOCK_M]), (0, 2, 1, 3)),
                               [BLOCK_K, BLOCK_M])
            acc = _dot(wv, x, acc, INTERPRET)
        else:
            if EVEN:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(p + pk < p_end)[:, None], other=0)
                x = tl.load(x_ptrs, mask=((p + kperm < K) & (p + pk < p_end))[None, :], other=0.0)
            wv = _codes(w, zm[None, :]).to(x_ptr.dtype.element_ty)
            if XPERM:
                x = tl.reshape(tl.permute(tl.reshape(x, [BLOCK_M, BLOCK_K // 64, 4, 16]), (0, 1, 3, 2)),
                               [BLOCK_M, BLOCK_K])
            acc = _dot(x, wv, acc, INTERPRET)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    s = tl.load(s_ptr + rn).to(tl.float32)
    if SWAP:
        acc = acc * s[:, None]
        tile = acc
    else:
        acc = acc * s[None, :]
        tile = tl.trans(acc)  # [BLOCK_N, BLOCK_M]
    rows64 = offs_m.to(tl.int64)[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + rows64 * N + offs_n[:, None], tile, mask=out_mask)
        if FUSED_REDUCE:
            wo._last_split_reduces(part_ptr, bias_ptr, out_ptr, count_ptr, splits, M, N, offs_n, n_mask, offs_m,
                                   m_mask, stride_om, HAS_BIAS, INTERPRET)
    else:
        if HAS_BIAS:
            tile += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows64 * stride_om + offs_n[:, None], cast_to(tile, out_ptr.dtype.element_ty, INTERPRET),
                 mask=out_mask)


def w8_bytes_mm(x2d, qweight, scales, zeros, bias, n, block_m=16, block_n=64, block_k=256, num_warps=4,
                num_stages=4, programs_per_sm=4, swap=False, fused=False, splits=None, xperm=False):
    m, k = x2d.shape
    assert scales.shape[0] == 1
    w8 = qweight.view(torch.int8)  # [N, K_pad]
    k_pad = w8.shape[1]
    grid_n, grid_m = cdiv(n, block_n), cdiv(m, block_m)
    steps = cdiv(k_pad, block_k)
    if splits is None:
        target = programs_per_sm * wo._num_sms(x2d.device)
        splits = max(1, min(steps, target // max(1, grid_n * grid_m)))
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)
    k_per_split = steps_per_split * block_k
    even = k == k_pad and k_pad % block_k == 0
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    split = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x2d.device) if split else out
    counts = wo._tile_counters(x2d.device, grid_n * grid_m) if (split and fused) else None
    fused = counts is not None
    _w8_bytes_kernel[(grid_n, splits, grid_m)](
        x2d, w8, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out, part,
        counts if fused else scales, m, n, k, k_pad, k_per_split, splits, x2d.stride(0), w8.stride(0), out.stride(0),
        HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split, FUSED_REDUCE=fused, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, EVEN=even, INTERPRET=INTERPRET, XPERM=xperm,
        num_warps=num_warps, num_stages=num_stages)
    if split and not fused:
        wo.splitk_reduce(part, bias, out)
    return out


SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
ROUNDS = int(os.environ.get("ROUNDS", "2"))


def _cand(block_n, block_k, num_stages, programs_per_sm, num_warps=4, swap=False, xperm=True, fused=False):
    return dict(swap=swap, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                programs_per_sm=programs_per_sm, xperm=xperm, fused=fused)


CANDIDATES = [_cand(64, 256, 4, 2), _cand(64, 256, 4, 4), _cand(64, 256, 4, 4, fused=True), _cand(32, 256, 4, 4),
              _cand(64, 128, 4, 4, swap=True, xperm=False), _cand(64, 256, 4, 4, xperm=False)]
LARGE_K = [(28672, 8192), (14336, 4096), (11008, 4096), (13824, 5120), (8192, 10240), (14336, 8192)]
# --set NAME: (candidates, shapes, Ms); "probe" is the default run. sweep1 / sweep2 / ab: the later calls of stop 48
# (results/tune_weight_only_w8_bytes_sweeps.json), which picked w8_decode's config (128 columns, 256 bytes a step, 4
# stages, one program per SM)
SETS = {
    "probe": (CANDIDATES, SHAPES, (1, 4, 16)),
    "sweep1": ([_cand(64, 256, s, p) for s in (3, 4, 5) for p in (1, 2, 3)] + [_cand(128, 256, 4, p) for p in (1, 2)]
               + [_cand(64, 512, 3, 2), _cand(32, 256, 4, 2), _cand(64, 256, 4, 2, num_warps=8)], LARGE_K, (16, 4)),
    "sweep2": ([_cand(128, 256, s, 1) for s in (4, 3, 5, 6)] + [_cand(128, 128, 6, 1), _cand(256, 128, 4, 1),
                                                             _cand(256, 256, 3, 1), _cand(128, 512, 3, 1),
                                                             _cand(128, 256, 4, 1, num_warps=8)],
               LARGE_K + [(4096, 6144), (4096, 28672), (4096, 14336)], (16, 8, 2)),
    "ab": ([_cand(128, 256, 4, 1), _cand(128, 256, 3, 1), _cand(128, 256, 4, 1, fused=True)],
           SHAPES + [(11008, 4096)], (1, 2, 4, 8, 16)),
}


def label(c):
    return (f"{'swap' if c['swap'] else 'xa'} n{c['block_n']} k{c['block_k']} s{c['num_stages']} "
            f"p{c['programs_per_sm']}{' fused' if c.get('fused') else ''}{' xperm' if c.get('xperm') else ''}"
            f"{' w' + str(c['num_warps']) if c['num_warps'] != 4 else ''}")


def unrounded_product(x, qw, bias):
    w = (qw.biased_codes().float() - qw.zero_points().float().t()) * qw.scales.float().t()
    return x.float() @ w.t() + (bias.float() if bias is not None else 0.0)


def dry():
    torch.manual_seed(0)
    for m, k, n, sym, c in [(3, 200, 40, True, CANDIDATES[0]), (1, 256, 64, False, CANDIDATES[4]),
                            (16, 576, 33, False, CANDIDATES[2]), (5, 128, 64, True, CANDIDATES[5])]:
        qw = qf.quantize_weight(torch.randn(n, k), bits=8, group_size=-1, symmetric=sym)
        x = torch.randn(m, k, dtype=torch.bfloat16)
        bias = torch.randn(n, dtype=torch.bfloat16)
        out = w8_bytes_mm(x, qw.qweight, qw.scales, qw.zeros, bias, n, splits=2, **c)
        want = unrounded_product(x, qw, bias)
        err = float((out.float() - want).abs().max() / want.abs().max())
        print(f"M{m} K{k} N{n} {label(c)}: max error / max |ref| {err:.2g}")
        assert err < 1e-2


def main():
    if "--dry" in sys.argv:
        return dry()
    name = sys.argv[sys.argv.index("--set") + 1] if "--set" in sys.argv else "probe"
    candidates, shapes, ms = SETS[name]
    rows = []
    t = common.graph_us
    for k, n in shapes:
        qw = qf.quantize_weight(torch.randn(n, k, device="cuda"), bits=8, group_size=-1, symmetric=True)
        reps = common.rotation_count(qw.qweight.numel() * 4 + qw.scales.numel() * 4)
        qws = [qw] + [clone_qw(qw) for _ in range(reps - 1)]
        w_hat = qw.dequantize(torch.bfloat16)
        lin = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        w8 = (torch.randn(n, k, device="cuda") * 0.1).to(torch.float8_e4m3fn)
        f8 = [w8] + [w8.clone() for _ in range(common.rotation_count(w8.numel()) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xs, sa = x.to(torch.float8_e4m3fn), torch.rand(m, 1, device="cuda") * 1e-3
            sb = torch.rand(n, device="cuda") * 1e-3
            shipped = qf.weight_only_mm(x, qw).float()
            fns = {"bf16": (lambda w: F.linear(x, w), [(w,) for w in lin]),
                   "shipped": (lambda q: qf.weight_only_mm(x, q), [(q,) for q in qws]),
                   "fp8": (lambda b: qf.scaled_mm(xs, b, sa, sb, torch.bfloat16), [(b.t(),) for b in f8])}
            for c in candidates:
                out = w8_bytes_mm(x, qw.qweight, qw.scales, None, None, n, **c).float()
                err = float((out - shipped).abs().max() / shipped.abs().max())
                assert err < 2e-2, (label(c), err)
                fns[label(c)] = ((lambda c: lambda q: w8_bytes_mm(x, q.qweight, q.scales, None, None, n, **c))(c),
                                 [(q,) for q in qws])
            best = {name: math.inf for name in fns}
            for _ in range(ROUNDS):
                for name, (fn, sets) in fns.items():
                    best[name] = min(best[name], t(fn, sets))
            row = dict(M=m, K=k, N=n, bf16_us=best["bf16"], shipped_us=best["shipped"], fp8_us=best["fp8"])
            name = min((nm for nm in fns if nm not in ("bf16", "shipped", "fp8")), key=lambda nm: best[nm])
            row.update(best_probe=name, best_probe_us=best[name], probe_vs_shipped=best["shipped"] / best[name],
                       shipped_vs_bf16=best["bf16"] / best["shipped"], fp8_vs_shipped=best["shipped"] / best["fp8"])
            row.update({f"{nm} us": best[nm] for nm in fns if nm not in ("bf16", "shipped", "fp8")})
            print(row, flush=True)
            rows.append(row)
        del qws, lin, f8
        torch.cuda.empty_cache()
    cols = ["M", "K", "N", "bf16_us", "shipped_us", "fp8_us", "best_probe", "best_probe_us", "probe_vs_shipped",
            "shipped_vs_bf16", "fp8_vs_shipped"] + [f"{label(c)} us" for c in candidates]
    common.finish("tune_weight_only_w8_bytes" + ("" if name == "probe" else f"_{name}"),
                  "W8A16 decode: a byte-view tl kernel vs the shipped paths and fp8 decode", rows, cols,
                  f"W8A16 per channel symmetric, float32 scales, bf16 x; CUDA graphs, weights rotated past L2, "
                  f"minimum of {ROUNDS} alternated rounds; probe_vs_shipped > 1: the probe faster. See the module "
                  f"doc of benchmarks/probe_w8_bytes.py.")


if __name__ == "__main__":
    main()
