"""Weight-only GEMM: every launch variant of kernels/weight_only.py forced through
`fused_mm(..., tile=..., splits=...)` (the candidates benchmarks/tune_weight_only.py sweeps): the tensor-core
kernel at chunks 1/2/4 per K-loop iteration and block_n 16..128 / block_m 16..64, the GEMV kernel at
block_m 1/2/4, and both weight conversions ("shift", "inplace").

Checks, under the interpreter (CPU tensors; the GPU twins at the end run with `pytest -m gpu` on the device):
- the in-place converter `_field_minus_zero` gives the exact u - z, like `_codes_minus_zero`, for every
  code at every field position and every zero point 0 .. 2^bits (exhaustive);
- identity rows: x = rows of eye(K), so every output is one exact product plus exact zeros and must equal
  w_hat[n, k] bit for bit (w_hat = QuantizedWeight.dequantize(x.dtype), one rounding of fp32 (u - z) * s):
  catches any wrong field, group, zero point or chunk, and any masked (padded / past-the-split) weight
  that would leak in;
- random x (NaN-free, randn) against ref = x.float() @ w_hat.float().T (+ bias), the fp32 reference of the
  same w_hat. Bound, per output element (stated for every case):

      |out - round(dtype, ref)| <= ulp + 1e-5 * (|x| @ |w_hat|.T + |bias|)

  ulp = the larger output-dtype ulp of out and round(dtype, ref) (the kernel's fp32 sum and ref each
  round once to dtype), 1e-5 * sum |x||w|: fp32 accumulation-order differences (the kernel sums in
  another order, split-K partials included).
Coverage: bits 4 and 8; group 32, 128 (K = 200: a partial last group) and -1; symmetric and asymmetric;
fp16 and bf16; M in 1, 2, 3, 5; K = 192, 200 (a partial last chunk), 1024; N = 100, 257; splits 1, 2, 3,
including splits whose chunk count is not a multiple of `chunks` (K = 1024 int4: 8 chunks in splits of 3, 3,
2; int8: 16 chunks in 6, 6, 4; K = 192 int8: 3 chunks in 2, 1). Each (variant, case) pair is listed by hand
(not the full cross product) to keep the file under a minute on two cores.
"""

import os

import pytest
import torch

from quantfuse import ops
from quantfuse.kernels import weight_only as kw
from tests._util import KernelSpy

pytestmark = pytest.mark.filterwarnings("ignore")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need TRITON_INTERPRET=1")
F16, BF16 = torch.float16, torch.bfloat16
RTOL_SUM = 1e-5


def tile(kernel="mma", block_m=16, block_n=64, chunks=1, convert="shift", num_warps=4, num_stages=2, scale=None,
         wide=False):
    t = dict(kernel=kernel, block_m=block_m, block_n=block_n, chunks=chunks, convert=convert,
             num_warps=num_warps, num_stages=num_stages, programs_per_sm=1)
    if scale is not None:
        t["scale"] = scale
    if wide:
        t["wide"] = True
    return t


def tile_id(t):
    return f"{t['kernel']}-m{t['block_m']}-n{t['block_n']}-c{t['chunks']}-{t['convert']}" + \
        (f"-{t['scale']}" if "scale" in t else "") + ("-wide" if t.get("wide") else "")


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def make_qw(n, k, bits, group, symmetric, device="cpu", scale_dtype=torch.float32):
    """Weights with a random power-of-two magnitude per 64-column block, so that a wrong group (scale)
    or zero point shows up far above the bound."""
    w = torch.randn(n, k, device=device)
    mag = torch.exp2(torch.randint(-4, 5, (1, -(-k // 64)), device=device).float())
    w = w * mag.repeat_interleave(64, dim=1)[:, :k]
    return ops.quantize_weight(w, bits=bits, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)


def ulp(v, dtype):
    """Spacing of `dtype` at |v| (float32 tensor of dtype values); the subnormal spacing at 0."""
    p, floor = (8, 2.0**-133) if dtype == BF16 else (11, 2.0**-24)
    _, e = torch.frexp(v.abs())
    u = torch.exp2((e - p).float())
    return torch.where(v == 0, torch.full_like(u, floor), torch.clamp(u, min=floor))


def assert_close_to_ref(out, x, w_hat, bias=None, label=""):
    xf, wf = x.float(), w_hat.float()
    ref = xf @ wf.t()
    s = xf.abs() @ wf.abs().t()
    if bias is not None:
        ref = ref + bias.float()
        s = s + bias.float().abs()
    ref_r = ref.to(out.dtype).float()
    got = out.float()
    assert bool(torch.isfinite(got).all()), f"{label}: non-finite output"
    bound = torch.maximum(ulp(got, out.dtype), ulp(ref_r, out.dtype)) + RTOL_SUM * s
    err = (got - ref_r).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{label}: error {float(err.max())} exceeds the bound (worst err / bound {worst:.3g})"


def run(x, qw, t, splits, bias=None):
    n = qw.shape[0]
    return kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.bits, qw.group_size, n, tile=t, splits=splits)


def launch_spied(monkeypatch, x, qw, t, splits, bias=None):
    """fused_mm with tile t (one launch of t's kernel), and that launch's keyword arguments."""
    name = "_wo_gemv_kernel" if t["kernel"] == "gemv" else "_wo_mm_kernel"
    spy = KernelSpy(getattr(kw, name))
    monkeypatch.setattr(kw, name, spy)
    out = run(x, qw, t, splits, bias)
    monkeypatch.undo()
    assert len(spy.calls) == 1
    return out, spy.calls[0]


# ---------------------------------------------------------------------------------------------------
# the in-place converter, exhaustively
# ---------------------------------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _both_converters(w_ptr, z_ptr, out0_ptr, out1_ptr, field_mask, W: tl.constexpr, Z: tl.constexpr,
                     BITS: tl.constexpr):
    """out{0,1}[i, r, c] = field i of word c minus zero point z[r], by the shift and the in-place converter."""
    FIELDS: tl.constexpr = 32 // BITS
    rows = tl.arange(0, Z)[:, None]
    cols = tl.arange(0, W)[None, :]
    words = tl.load(w_ptr + cols + rows * 0)
    zm = tl.load(z_ptr + rows + cols * 0) + 8388608.0
    hi = words >> 12
    for i in tl.static_range(FIELDS):
        d0 = kw._codes_minus_zero(words, i * BITS, (1 << BITS) - 1, zm)
        d1 = kw._field_minus_zero(words, hi, field_mask, i, BITS, zm - 8388608.0)
        tl.store(out0_ptr + i * Z * W + rows * W + cols, d0)
        tl.store(out1_ptr + i * Z * W + rows * W + cols, d1)


@needs_interpreter
@pytest.mark.parametrize("bits", [4, 8])
def test_inplace_converter_exhaustive(bits):
    top, per = 2**bits, 32 // bits
    w_count = top  # word c holds code (c + 7 * i) % top in field i: every code at every field
    c = torch.arange(w_count, dtype=torch.int64)
    words = torch.zeros(w_count, dtype=torch.int64)
    for i in range(per):
        words |= ((c + 7 * i) % top) << (i * bits)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    z_rows = 1 << (top).bit_length()  # zero points 0 .. 2^bits (GPTQ v1), padded to a power of two
    z = torch.arange(z_rows, dtype=torch.float32).clamp(max=top)
    out0 = torch.empty(per, z_rows, w_count)
    out1 = torch.empty_like(out0)
    _both_converters[(1,)](words, z, out0, out1, top - 1, W=w_count, Z=z_rows, BITS=bits)
    codes = torch.stack([(c + 7 * i) % top for i in range(per)]).float()  # [per, W]
    expected = codes[:, None, :] - z[None, :, None]
    assert torch.equal(out0, expected)
    assert torch.equal(out1, expected)
    assert torch.equal(out1.view(torch.int32), out0.view(torch.int32))  # bit for bit (no -0 vs +0)


# ---------------------------------------------------------------------------------------------------
# every variant: identity rows (exact) and random x (bound above)
# ---------------------------------------------------------------------------------------------------
MMA = [
    tile(block_n=16, chunks=1),
    tile(block_n=16, chunks=2),
    tile(block_n=16, chunks=4, convert="inplace", num_warps=1),
    tile(block_n=32, chunks=1, convert="inplace", num_warps=2),
    tile(block_n=32, chunks=2),
    tile(block_n=32, chunks=4, convert="inplace"),
    tile(block_n=64, chunks=1),
    tile(block_n=64, chunks=2, convert="inplace"),
    tile(block_n=64, chunks=4),
    tile(block_m=32, block_n=128, chunks=2, convert="inplace", num_warps=8),
    tile(block_m=64, block_n=16, chunks=2, convert="inplace"),
    tile(block_m=32, block_n=64, chunks=4),
    # one product per chunk (WIDE): every field side by side in k order
    tile(block_n=64, chunks=1, wide=True),
    tile(block_m=32, block_n=32, chunks=1, convert="inplace", wide=True),
    tile(block_n=128, chunks=1, convert="packed", num_warps=8, wide=True),
]
GEMV = [
    tile("gemv", block_m=1, block_n=16, chunks=1),
    tile("gemv", block_m=1, block_n=32, chunks=4, convert="inplace", num_warps=2),
    tile("gemv", block_m=2, block_n=16, chunks=2, convert="inplace"),
    tile("gemv", block_m=2, block_n=64, chunks=1),
    tile("gemv", block_m=4, block_n=64, chunks=2),
    tile("gemv", block_m=4, block_n=32, chunks=4, convert="inplace"),
    tile("gemv", block_m=4, block_n=16, chunks=1, convert="inplace"),
]
VARIANTS = MMA + GEMV

# (variant, M, K, N, bits, group, symmetric, dtype, splits, bias), by hand: see the module docstring
GEMM_CASES = [
    (MMA[0], 3, 200, 100, 4, 128, False, F16, 2, True),
    (MMA[1], 1, 192, 100, 8, 32, True, BF16, 2, False),  # int8 3 chunks -> 2 + 1: chunks=2 tail
    (MMA[2], 5, 200, 257, 4, 32, False, BF16, 1, False),  # 2 chunks, chunks=4: half the iteration masked
    (MMA[3], 2, 192, 257, 8, -1, False, F16, 3, True),
    (MMA[4], 5, 1024, 100, 4, 128, True, BF16, 3, False),  # 8 chunks -> 3, 3, 2
    (MMA[5], 3, 1024, 257, 8, 128, False, F16, 3, True),  # int8 16 chunks -> 6, 6, 4 (chunks=4 tail)
    (MMA[6], 1, 1024, 257, 4, 32, False, F16, 2, False),
    (MMA[7], 2, 200, 257, 4, -1, True, BF16, 1, True),
    (MMA[8], 5, 1024, 100, 8, 32, False, BF16, 3, False),  # 6, 6, 4
    (MMA[9], 5, 1024, 257, 4, 128, False, F16, 3, True),  # 3, 3, 2
    (MMA[10], 3, 192, 100, 4, 32, True, F16, 1, False),
    (MMA[11], 2, 192, 257, 8, 128, True, F16, 2, False),  # 3 chunks -> 2 + 1 with chunks=4
    (MMA[12], 3, 200, 257, 4, 32, False, BF16, 2, True),  # wide: two groups per pair of fields
    (MMA[13], 5, 1024, 100, 8, 128, True, F16, 3, False),  # wide int8: 4 fields per product, 6, 6, 4
    (MMA[14], 2, 1024, 257, 4, -1, False, F16, 1, True),  # wide, "packed" on float32 scales: runs "inplace"
    (GEMV[0], 1, 200, 100, 4, 128, False, BF16, 2, True),
    (GEMV[1], 2, 1024, 100, 8, 32, False, F16, 3, False),  # 6, 6, 4 with chunks=4
    (GEMV[2], 3, 192, 100, 4, 32, True, BF16, 1, True),
    (GEMV[3], 5, 200, 257, 8, -1, True, F16, 3, False),
    (GEMV[4], 5, 1024, 100, 4, 128, False, BF16, 3, True),  # 3, 3, 2 with chunks=2
    (GEMV[5], 3, 200, 257, 8, 128, True, F16, 2, False),  # 4 chunks -> 2, 2 with chunks=4
    (GEMV[6], 2, 192, 100, 4, -1, False, BF16, 3, False),
]


def _case_id(c):
    t, m, k, n, bits, group, sym, dtype, splits, bias = c
    return (f"{tile_id(t)}-M{m}K{k}N{n}-int{bits}-g{group}-{'sym' if sym else 'asym'}-"
            f"{str(dtype).replace('torch.', '')}-s{splits}{'-bias' if bias else ''}")


@needs_interpreter
@pytest.mark.parametrize("case", GEMM_CASES, ids=_case_id)
def test_variant_gemm_vs_fp32_reference(case, monkeypatch):
    t, m, k, n, bits, group, sym, dtype, splits, has_bias = case
    qw = make_qw(n, k, bits, group, sym)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    out, call = launch_spied(monkeypatch, x, qw, t, splits, bias)
    assert call["CHUNKS"] == t["chunks"]
    convert = "inplace" if t["convert"] == "packed" else t["convert"]  # float32 scales: no packed conversion
    assert call["CONVERT"] == kw._CONVERTS[convert] and call["BLOCK_N"] == t["block_n"]
    assert call.get("WIDE", False) == bool(t.get("wide"))
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_ref(out, x, qw.dequantize(dtype), bias, _case_id(case))


@needs_interpreter
@pytest.mark.parametrize("t", VARIANTS, ids=tile_id)
def test_variant_identity_rows_exact(t):
    """out[m, n] = w_hat[n, k_m] bit for bit, for both bits (int4 split-K, int8 not split), asymmetric group
    32 (groups end inside chunks), K = 200 (a partial last chunk) and N = 40 (a partial n block)."""
    k, n = 200, 40
    for bits, dtype, splits in ((4, F16, 3), (8, BF16, 1)):
        qw = make_qw(n, k, bits, 32, symmetric=False)
        chunk = 16 * (32 // bits)
        ks = [17, chunk - 1, chunk + 16 * (32 // bits - 1) // 2 + 5, 199]  # inside fields, chunk edges, K - 1
        x = torch.zeros(len(ks), k, dtype=dtype)
        x[torch.arange(len(ks)), torch.tensor(ks)] = 1
        w_hat = qw.dequantize(dtype)
        out = run(x, qw, t, splits)
        want = w_hat[:, ks].t().contiguous()
        diff = out.view(torch.int16) != want.view(torch.int16)
        assert not bool(diff.any()), f"int{bits} splits={splits}: {int(diff.sum())} outputs differ, first " \
                                     f"{torch.nonzero(diff)[:4].tolist()}"


@needs_interpreter
def test_nan_in_x_stays_in_its_row():
    qw = make_qw(40, 640, 4, 128, symmetric=True)  # 5 chunks: splits of 2, 2, 1
    x = torch.randn(3, 640).to(BF16)
    for t in (tile(block_n=32, chunks=4, convert="inplace"), tile("gemv", block_m=2, block_n=32, chunks=2),
              tile("gemv", block_m=2, block_n=32, chunks=2, convert="inplace", scale="auto"),
              tile(block_n=32, chunks=1, convert="packed", scale="after")):
        clean = run(x, qw, t, 3)
        bad = x.clone()
        bad[1, 300] = float("nan")
        got = run(bad, qw, t, 3)
        assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])
        assert bool(torch.isnan(got[1]).all())


# ---------------------------------------------------------------------------------------------------
# the packed conversion (convert="packed": two weights per 16-bit pair instruction, scales in x's dtype)
# ---------------------------------------------------------------------------------------------------
def run_spied(monkeypatch, x, qw, t, splits, bias=None):
    """fused_mm with tile t, and the CONVERT it launched with."""
    out, call = launch_spied(monkeypatch, x, qw, t, splits, bias)
    return out, call["CONVERT"]


# (variant, M, K, N, bits, group, symmetric, dtype, splits, bias): int4 in both dtypes, int8 in float16; every
# group size relation to the 128-code int4 / 64-code int8 chunk (g32: a pair's fields in groups p // 2 and
# p // 2 + 2; g64: two groups per chunk; g128, g256 (a group over two chunks), per channel); partial last
# chunk (K = 200) and group; chunks 1 / 2 / 4 with masked tail chunks; split-K
PACKED_CASES = [
    (tile(block_n=32, chunks=1, convert="packed"), 3, 200, 100, 4, 32, False, BF16, 2, True),
    (tile(block_n=64, chunks=2, convert="packed"), 5, 1024, 257, 4, 64, True, F16, 3, False),  # 3, 3, 2 chunks
    (tile(block_n=16, chunks=4, convert="packed", num_warps=1), 2, 200, 257, 4, 128, False, BF16, 1, False),
    (tile(block_m=32, block_n=64, chunks=1, convert="packed"), 1, 192, 100, 4, -1, True, F16, 2, True),
    (tile(block_n=64, chunks=4, convert="packed"), 2, 1024, 100, 4, 256, False, BF16, 3, False),
    (tile(block_n=32, chunks=2, convert="packed"), 3, 192, 257, 8, 32, False, F16, 2, True),  # 3 chunks: 2 + 1
    (tile(block_n=64, chunks=1, convert="packed"), 5, 200, 100, 8, -1, True, F16, 3, False),
    (tile(block_n=16, chunks=4, convert="packed", num_warps=2), 2, 1024, 257, 8, 128, False, F16, 3, False),
    (tile(block_n=32, chunks=1, convert="packed"), 2, 200, 100, 4, 64, False, F16, 1, False),
    # one product per chunk: g32 (pairs of fields in different groups), g64 (two groups a chunk), int8 fp16
    (tile(block_n=64, chunks=1, convert="packed", wide=True), 3, 1024, 257, 4, 32, False, BF16, 3, True),
    (tile(block_m=32, block_n=32, chunks=1, convert="packed", wide=True), 5, 200, 100, 4, 64, True, F16, 2, False),
    (tile(block_n=64, chunks=1, convert="packed", wide=True), 2, 192, 257, 8, 32, False, F16, 1, False),
]


@needs_interpreter
@pytest.mark.parametrize("case", PACKED_CASES, ids=_case_id)
def test_packed_gemm_bitwise_equals_inplace(case, monkeypatch):
    """Same products in the same order, same w_hat: the packed tile's output equals the in-place tile's bit
    for bit (x random, so a misplaced field, group, zero point or scale changes the sums), and it is within
    the fp32-reference bound above."""
    t, m, k, n, bits, group, sym, dtype, splits, has_bias = case
    qw = make_qw(n, k, bits, group, sym, scale_dtype=dtype)
    assert qw.scales.dtype == dtype
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    out, convert = run_spied(monkeypatch, x, qw, t, splits, bias)
    assert convert == kw._CONVERTS["packed"]
    ref_out, ref_convert = run_spied(monkeypatch, x, qw, dict(t, convert="inplace"), splits, bias)
    assert ref_convert == kw._CONVERTS["inplace"]
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), _case_id(case)
    assert_close_to_ref(out, x, qw.dequantize(dtype), bias, _case_id(case))


@needs_interpreter
@pytest.mark.parametrize("bits,group,dtype,splits", [(4, 32, BF16, 3), (4, 64, F16, 1), (8, 32, F16, 2)])
def test_packed_identity_rows_exact(bits, group, dtype, splits):
    """out[m, n] = w_hat[n, k_m] bit for bit through packed tiles (chunks 1 and 2), asymmetric, K = 200."""
    k, n = 200, 40
    qw = make_qw(n, k, bits, group, symmetric=False, scale_dtype=dtype)
    chunk = 16 * (32 // bits)
    ks = [0, 17, 16 * (32 // bits // 2) + 3, chunk - 1, chunk + 5, 199]  # low and high fields of a pair
    x = torch.zeros(len(ks), k, dtype=dtype)
    x[torch.arange(len(ks)), torch.tensor(ks)] = 1
    want = qw.dequantize(dtype)[:, ks].t().contiguous()
    for t in (tile(block_n=16, chunks=1, convert="packed"), tile(block_n=32, chunks=2, convert="packed")):
        got = run(x, qw, t, splits)
        diff = got.view(torch.int16) != want.view(torch.int16)
        assert not bool(diff.any()), f"{tile_id(t)}: {int(diff.sum())} differ, first {torch.nonzero(diff)[:4].tolist()}"


@pytest.mark.parametrize("x_dtype,scale_dtype,bits,kernel,expected", [
    (BF16, BF16, 4, "mma", "packed"),
    (F16, F16, 4, "mma", "packed"),
    (F16, F16, 8, "mma", "packed"),
    (BF16, BF16, 8, "mma", "inplace"),  # 128 + u is not exact in bfloat16 for u >= 128
    (BF16, torch.float32, 4, "mma", "inplace"),  # a float32 scale: the 16-bit product would round it
    (F16, BF16, 4, "mma", "inplace"),  # scales of another dtype
    (BF16, F16, 4, "mma", "inplace"),
    (BF16, BF16, 4, "gemv", "inplace"),  # the GEMV kernel has no packed path
])
def test_packed_dispatch_and_fallback(x_dtype, scale_dtype, bits, kernel, expected, monkeypatch):
    """convert="packed" launches CONVERT 2 exactly where `packed_applies` (and on the mma kernel), else the
    in-place conversion, with the same results as asking for "inplace" directly."""
    assert kw.packed_applies(x_dtype, scale_dtype, bits) == (expected == "packed" or kernel == "gemv")
    qw = make_qw(24, 128, bits, 64, symmetric=False, scale_dtype=scale_dtype)
    x = torch.randn(2, 128).to(x_dtype)
    t = tile(kernel, block_m=2 if kernel == "gemv" else 16, block_n=16, convert="packed")
    out, convert = run_spied(monkeypatch, x, qw, t, 1)
    assert convert == kw._CONVERTS[expected]
    ref_out, _ = run_spied(monkeypatch, x, qw, dict(t, convert="inplace"), 1)
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))


# ---------------------------------------------------------------------------------------------------
# the scale after the sums (tile scale "after" / "auto"): the kernels multiply exact integers u - z by x
# and scale each group's float32 sum, i.e. they compute x @ W.T with the unrounded W = (u - z) * s
# ---------------------------------------------------------------------------------------------------
def assert_close_to_exact(out, x, qw, bias=None, label=""):
    """|out - round(dtype, x @ W.T + b)| <= ulp + 1e-5 * (|x| @ |W|.T + |b|), W = (u - z) * s unrounded
    (float32 product of an integer below 2^9 and a scale: within 2^-24 of exact). The rounded-w_hat bound
    of `assert_close_to_ref` does not hold here (each weight differs by up to one rounding), and this one
    fails for kernels that round w_hat: both pin down which product a kernel computes."""
    assert_close_to_ref(out, x, qw.dequantize(torch.float32), bias, label)


# (variant, M, K, N, bits, group, symmetric, dtype, splits, bias, scale dtype, expected SCALE): the GEMV with
# "auto" (1 per group, 2 per channel) at block_m 1..4 and chunks 1 / 2 / 4 (chunks of one iteration in
# different groups), the tensor-core kernel with "after" (shift / inplace / packed conversions, packed with
# float32 scales too) and "auto" (= before there); every group size vs the chunk (g32, g64: groups end inside
# a chunk; g128; g256: a group over two chunks; per channel), partial last chunk / group (K = 200), split-K
# (fused reduction) and bias
SCALE_CASES = [
    (tile("gemv", block_m=1, block_n=32, chunks=1, convert="inplace", scale="auto"), 1, 200, 100, 4, 128, True, BF16, 3,
     True, torch.float32, 1),
    (tile("gemv", block_m=2, block_n=16, chunks=2, convert="shift", scale="auto"), 2, 1024, 257, 4, 32, False, F16, 3,
     False, torch.float32, 1),
    (tile("gemv", block_m=3, block_n=64, chunks=4, convert="inplace", scale="auto"), 3, 1024, 100, 8, -1, True, BF16, 2,
     True, torch.float32, 2),
    (tile("gemv", block_m=4, block_n=32, chunks=2, convert="inplace", scale="after"), 4, 200, 257, 8, 64, False, F16, 1,
     False, torch.float16, 1),
    (tile("gemv", block_m=1, block_n=64, chunks=2, convert="inplace", scale="auto"), 1, 1024, 100, 4, 256, False, BF16,
     2, False, torch.bfloat16, 1),
    (tile("gemv", block_m=2, block_n=32, chunks=1, convert="inplace", scale="auto"), 2, 192, 100, 8, 128, False, BF16, 2,
     True, torch.float32, 1),
    (tile(block_n=32, chunks=1, convert="packed", scale="after"), 3, 200, 100, 4, 32, False, BF16, 2, True,
     torch.float32, 1),
    (tile(block_n=16, chunks=1, convert="inplace", scale="after"), 2, 1024, 257, 4, 64, True, F16, 3, False,
     torch.float32, 1),
    (tile(block_n=64, chunks=1, convert="shift", scale="after"), 5, 192, 100, 8, 128, False, BF16, 2, False,
     torch.float32, 1),
    (tile(block_n=32, chunks=1, convert="packed", scale="after"), 1, 200, 257, 8, -1, True, F16, 3, True,
     torch.float32, 2),
    (tile(block_n=16, chunks=1, convert="packed", scale="after", num_warps=1), 2, 1024, 100, 4, 256, False, F16, 3,
     False, torch.float16, 1),
    (tile(block_m=32, block_n=64, chunks=1, convert="packed", scale="after"), 3, 200, 100, 4, -1, False, BF16, 1, True,
     torch.bfloat16, 2),
    # tiny: K = 8 (one chunk, 120 padded codes), N = 1; K = 40 with group 32 (a partial second group)
    (tile("gemv", block_m=1, block_n=16, chunks=1, convert="inplace", scale="auto"), 1, 8, 1, 4, -1, False, F16, 1,
     True, torch.float32, 2),
    (tile("gemv", block_m=1, block_n=16, chunks=2, convert="inplace", scale="auto"), 1, 40, 3, 8, 32, False, BF16, 1,
     False, torch.float32, 1),
]


def _scale_case_id(c):
    return _case_id(c[:10]) + f"-{str(c[10]).replace('torch.', '')}"


@needs_interpreter
@pytest.mark.parametrize("case", SCALE_CASES, ids=_scale_case_id)
def test_scale_after_gemm_vs_unrounded_weights(case, monkeypatch):
    t, m, k, n, bits, group, sym, dtype, splits, has_bias, scale_dtype, want_scale = case
    qw = make_qw(n, k, bits, group, sym, scale_dtype=scale_dtype)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    out, call = launch_spied(monkeypatch, x, qw, t, splits, bias)
    assert call["SCALE"] == want_scale
    if t["convert"] == "packed" and (bits == 4 or dtype == F16):
        assert call["CONVERT"] == kw._CONVERTS["packed"]  # any scale dtype once the scale comes after
    if splits > 1:
        assert call["SPLIT"] and call["FUSED_REDUCE"]
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_exact(out, x, qw, bias, _scale_case_id(case))


@needs_interpreter
@pytest.mark.parametrize("t", [tile("gemv", block_m=1, block_n=32, chunks=2, convert="inplace", scale="auto"),
                               tile("gemv", block_m=4, block_n=16, chunks=1, convert="shift", scale="after"),
                               tile(block_n=32, chunks=1, convert="packed", scale="after"),
                               tile(block_n=16, chunks=1, convert="inplace", scale="after")], ids=tile_id)
def test_scale_after_identity_rows_exact(t):
    """One row of eye(K): the sum is the one exact integer u - z, scaled once in float32 and rounded once:
    w_hat bit for bit, as with the scale first (asymmetric group 32, K = 200, both bits, split-K)."""
    k, n = 200, 40
    for bits, dtype, splits in ((4, F16, 3), (8, BF16, 1), (4, BF16, 2)):
        qw = make_qw(n, k, bits, 32, symmetric=False)
        chunk = 16 * (32 // bits)
        ks = [0, 17, chunk - 1, chunk + 16 * (32 // bits - 1) // 2 + 5, 199]
        rows = 1 if t["kernel"] == "gemv" and t["block_m"] == 1 else len(ks)
        w_hat = qw.dequantize(dtype)
        for r0 in range(0, len(ks), rows):
            sel = ks[r0:r0 + rows]
            x = torch.zeros(len(sel), k, dtype=dtype)
            x[torch.arange(len(sel)), torch.tensor(sel)] = 1
            got = run(x, qw, t, splits)
            want = w_hat[:, sel].t().contiguous()
            diff = got.view(torch.int16) != want.view(torch.int16)
            assert not bool(diff.any()), f"int{bits} rows {sel}: {int(diff.sum())} differ"


@pytest.mark.parametrize("scale,kernel,block_n,chunks,groups,want", [
    ("before", "gemv", 64, 1, 4, 0), ("before", "mma", 32, 1, 1, 0), (None, "gemv", 64, 1, 1, 0),
    ("auto", "gemv", 64, 2, 4, 1), ("auto", "gemv", 64, 1, 1, 2),
    ("auto", "mma", 64, 1, 4, 0), ("auto", "mma", 128, 1, 1, 0),  # wgmma tiles: before
    ("auto", "mma", 32, 1, 4, 1), ("auto", "mma", 16, 1, 1, 2),  # mma.sync tiles: after
    ("auto", "mma", 32, 2, 4, 0),  # more than one chunk per dot: before
    ("after", "mma", 128, 1, 4, 1), ("after", "mma", 64, 1, 1, 2), ("after", "gemv", 32, 4, 4, 1),
])
def test_scale_code(scale, kernel, block_n, chunks, groups, want):
    t = tile(kernel, block_m=1 if kernel == "gemv" else 16, block_n=block_n, chunks=chunks, scale=scale)
    assert kw._scale_code(t, groups, kernel == "mma") == want


@needs_interpreter
def test_gemv_fused_reduce_equals_reduce_kernel(monkeypatch):
    """The GEMV's last-program split-K reduction sums the same partials in the same order as the reduce
    kernel: the same bits, for a block_m that is not a power of two and a partial row block."""
    qw = make_qw(100, 1024, 4, 128, symmetric=False)
    x = torch.randn(5, 1024).to(BF16)
    bias = torch.randn(100).to(BF16)
    t = tile("gemv", block_m=3, block_n=32, chunks=2, convert="inplace", scale="auto")
    spy = KernelSpy(kw._wo_gemv_kernel)
    monkeypatch.setattr(kw, "_wo_gemv_kernel", spy)
    fused = run(x, qw, t, 3, bias)
    table = dict(kw._DISPATCH["default"], fused_reduce_max_m=0)
    monkeypatch.setitem(kw._DISPATCH, "default", table)
    separate = run(x, qw, t, 3, bias)
    assert [c["FUSED_REDUCE"] for c in spy.calls] == [True, False]
    assert torch.equal(fused.view(torch.int16), separate.view(torch.int16))


# ---------------------------------------------------------------------------------------------------
# tile validation and the shipped table
# ---------------------------------------------------------------------------------------------------
def test_bad_tiles_raise():
    qw = make_qw(16, 128, 4, 128, symmetric=True)
    x = torch.randn(2, 128).to(F16)
    for bad, match in [(dict(tile(), kernel="simt"), "kernel"), (dict(tile(), convert="lut"), "convert"),
                       (dict(tile(), chunks=3), "chunks"), (dict(tile(), block_n=8), "block_n"),
                       (dict(tile(), block_m=8), "block_m"), (tile("gemv", block_m=8), "block_m"),
                       (tile(scale="sideways"), "scale"), (tile(chunks=2, scale="after"), "scale"),
                       (tile(chunks=2, wide=True), "wide"), (tile("gemv", block_m=2, wide=True), "wide"),
                       (tile(scale="after", wide=True), "wide")]:
        with pytest.raises(ValueError, match=match):
            run(x, qw, bad, 1)
    run(x, qw, tile(chunks=2, scale="auto"), 1)  # "auto" is "before" on the tensor-core kernel: any chunks
    run(x, qw, tile("gemv", block_m=2, chunks=4, scale="after"), 1)  # the GEMV keeps chunks apart


def test_pick_from_bits_rows():
    """A row naming `bits` serves only weights of that width; the others fall through to the next row."""
    tiles = [dict(max_m=1, bits=8, block_n=128), dict(max_m=1, block_n=64), dict(max_m=16, block_n=32)]
    assert kw.pick_from(tiles, 1, 8)["block_n"] == 128
    assert kw.pick_from(tiles, 1, 4)["block_n"] == 64
    assert kw.pick_from(tiles, 2, 8)["block_n"] == 32
    assert kw.pick_from(tiles, 99, 4)["block_n"] == 32  # past the last max_m: the last row
    sm90 = kw._DISPATCH["sm90"]["tiles"]
    assert kw.pick_from(sm90, 1, 4)["kernel"] == kw.pick_from(sm90, 1, 8)["kernel"] == "gemv"
    with pytest.raises(ValueError, match="bits"):
        kw.check_tile(dict(tile(), bits=3))


def test_pick_from_scale_width_rows():
    """A row naming `scale_bytes` serves only scales of that width (W8A16 decode: float32 scales take the two-chunk
    tile that scales each weight, 16-bit ones the wide tile that scales the sums)."""
    tiles = [dict(max_m=16, bits=8, scale_bytes=4, block_n=64), dict(max_m=16, bits=8, block_n=128),
             dict(max_m=16, block_n=32)]
    assert kw.pick_from(tiles, 16, 8, 4)["block_n"] == 64
    assert kw.pick_from(tiles, 16, 8, 2)["block_n"] == 128
    assert kw.pick_from(tiles, 16, 4, 4)["block_n"] == 32
    sm90 = kw._DISPATCH["sm90"]["tiles"]
    f32, s16 = kw.pick_from(sm90, 16, 8, 4), kw.pick_from(sm90, 16, 8, 2)
    assert (f32["block_n"], f32["chunks"]) == (64, 2) and s16.get("wide") and s16["scale"] == "auto"
    assert kw.pick_from(sm90, 8, 8, 4) is f32 and kw.pick_from(sm90, 16, 4, 4) is kw.pick_from(sm90, 16, 4, 2)
    with pytest.raises(ValueError, match="scale_bytes"):
        kw.check_tile(dict(tile(), scale_bytes=1))


def test_shipped_tiles_are_valid():
    """Every shipped tile is one the kernels can run, in ascending max_m; a gemv tile covers at most 4 rows
    per program (more rows would re-stream the weight once per row block)."""
    for arch in kw._DISPATCH.values():
        max_ms = [t["max_m"] for t in arch["tiles"]]
        assert max_ms == sorted(max_ms)
        for t in arch["tiles"]:
            kw.check_tile(t)
            if t.get("kernel", "mma") == "gemv":
                assert t["max_m"] <= 4


def test_dequant_cublas_small_weights_rule():
    """Small weights take dequantize + cuBLAS from the M their `cublas_small_weights` entry names (sm90 table):
    up to 6.5M codes from M = 128, up to 9.5M from M = 512, nothing larger; other tables have no entry."""
    sm90 = kw._DISPATCH["sm90"]
    rule = kw.prefer_dequant_cublas_small
    assert rule(128, 3072, 2048, sm90) and rule(2048, 2048, 2048, sm90)  # Llama-3.2-1B q|k|v and o
    assert not rule(127, 3072, 2048, sm90) and not rule(64, 2048, 2048, sm90)  # decode sizes stay on the kernels
    assert rule(512, 3072, 3072, sm90) and not rule(511, 3072, 3072, sm90)  # Llama-3.2-3B o: from M = 512
    assert not rule(4096, 5120, 3072, sm90) and not rule(1024, 4096, 4096, sm90)  # 15M codes and up: the kernels
    assert not rule(1 << 20, 1, 1, kw._DISPATCH["default"])
    for min_m, max_codes in sm90["cublas_small_weights"]:
        assert rule(min_m, 1, max_codes, sm90) and not rule(min_m, 1, max_codes + 1, sm90)  # inclusive bounds


def test_automatic_splits_keep_two_chunks_on_sm90():
    """The sm90 table's automatic K split leaves each split two chunks at least (`_common.cap_splits`); the
    interpreter's table none (one-chunk splits keep the CPU tests' reductions)."""
    from quantfuse.kernels._common import cap_splits

    assert kw._DISPATCH["sm90"]["min_chunks_per_split"] == 2
    assert "min_chunks_per_split" not in kw._DISPATCH["default"]
    assert cap_splits(16, 16, 2) == 8 and cap_splits(16, 16, 1) == 16  # 2048x2048 at M = 32: 16 chunks
    assert cap_splits(16, 64, 2) == 16 and cap_splits(0, 64, 2) == 1 and cap_splits(4, 1, 2) == 1


# ---------------------------------------------------------------------------------------------------
# GPU (`pytest -m gpu tests/kernels/test_weight_only_variants.py` on the device): every variant compiled
# for real, Llama-sized K, identity rows exact and random x within the bound above
# ---------------------------------------------------------------------------------------------------
GPU_VARIANTS = VARIANTS + [
    tile(block_n=128, chunks=4, convert="inplace", num_warps=8, num_stages=3),
    tile(block_n=16, chunks=4, convert="inplace", num_warps=1, num_stages=4),
    tile(block_n=32, chunks=4, convert="inplace", num_warps=2, num_stages=4),
    tile("gemv", block_m=1, block_n=64, chunks=4, convert="inplace", num_warps=8, num_stages=3),
    tile("gemv", block_m=1, block_n=64, chunks=1, convert="inplace", num_stages=2, scale="auto"),
    tile("gemv", block_m=3, block_n=32, chunks=2, convert="inplace", scale="auto"),
    tile(block_n=128, chunks=1, convert="packed", scale="after"),
    tile(block_n=32, chunks=1, convert="inplace", scale="after", num_warps=2),
    # the large-M candidates of one product per chunk
    tile(block_m=128, block_n=128, chunks=1, convert="packed", num_warps=8, num_stages=3, wide=True),
    tile(block_m=256, block_n=128, chunks=1, convert="packed", num_warps=8, num_stages=3, wide=True),
    tile(block_m=128, block_n=256, chunks=1, convert="packed", num_warps=8, num_stages=3, wide=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [t for t in GPU_VARIANTS if t.get("wide")], ids=tile_id)
def test_wide_packed_gpu_bitwise_equals_inplace(t):
    """One product per chunk with 16-bit scales (the packed conversion really runs): bit for bit the in-place
    conversion's output, int4 g128 and g32 in bfloat16, int8 g64 in float16, and within the reference bound."""
    torch.manual_seed(1)
    for bits, group, sym, dtype, (k, n), m in [(4, 128, True, BF16, (4096, 1000), 77), (4, 32, False, BF16, (1000, 257), 3),
                                               (8, 64, False, F16, (2048, 300), 130)]:
        qw = make_qw(n, k, bits, group, sym, device="cuda", scale_dtype=dtype)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype)
        got = run(x, qw, dict(t, convert="packed"), None, bias)
        ref = run(x, qw, dict(t, convert="inplace"), None, bias)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"{tile_id(t)} int{bits} g{group}"
        assert_close_to_ref(got.cpu(), x.cpu(), qw.dequantize(dtype).cpu(), bias.cpu(), f"{tile_id(t)} int{bits}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", GPU_VARIANTS, ids=tile_id)
def test_variant_gpu(t):
    torch.manual_seed(0)
    for bits, group, sym, dtype, (k, n), m, splits in [
        (4, 128, True, BF16, (4096, 1000), 5, None),
        (4, 32, False, F16, (1000, 257), 3, 3),
        (8, -1, True, BF16, (2000, 300), 2, 7),
    ]:
        qw = make_qw(n, k, bits, group, sym, device="cuda")
        w_hat = qw.dequantize(dtype)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype)
        out = run(x, qw, t, splits, bias)
        check = assert_close_to_exact if t.get("scale", "before") != "before" else assert_close_to_ref
        check(out.cpu(), x.cpu(), qw.to("cpu") if check is assert_close_to_exact else w_hat.cpu(), bias.cpu(),
              f"{tile_id(t)} int{bits} K={k}")
        ks = sorted({0, 1, 15, 16, 127, 128, 129, k // 2 + 5, k - 1})
        eye = torch.zeros(len(ks), k, device="cuda", dtype=dtype)
        eye[torch.arange(len(ks)), torch.tensor(ks)] = 1
        rows = t["block_m"] if t["kernel"] == "gemv" else len(ks)
        got = torch.cat([run(eye[r:r + rows], qw, t, splits) for r in range(0, len(ks), rows)])
        want = w_hat[:, ks].t().contiguous()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{tile_id(t)} int{bits}: identity rows"
