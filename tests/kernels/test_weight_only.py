"""Weight-only INT4/INT8 GEMM (SPEC section 4): reference hand cases, the packed layout, the exhaustive
magic-number converter check, the fused kernels under the interpreter vs an fp32 reference, the
checkpoint loaders on tensors packed here in each format, and bad arguments."""

import pytest
import torch

from quantfuse import ops
from quantfuse import reference as ref
from quantfuse.kernels import _common
from quantfuse.kernels import weight_only as kw
from quantfuse.weights import QuantizedWeight, pack_codes, unpack_codes
from tests._util import KernelSpy

pytestmark = pytest.mark.filterwarnings("ignore")


def _bits_pattern(t):
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    diff = _bits_pattern(a) != _bits_pattern(b)
    assert not bool(diff.any()), f"{int(diff.sum())} of {diff.numel()} differ; first {torch.nonzero(diff)[:4].tolist()}"


def assert_gemm_close(y, x, w_hat, bias=None):
    """|y - x @ w_hat.T - bias| <= u * |ref| + 2^-20 * (|x| @ |w_hat|.T): one output rounding (unit
    roundoff u of the dtype) plus float32 accumulation-order noise."""
    xf, wf = x.float().reshape(-1, x.shape[-1]), w_hat.float()
    expected = xf @ wf.t()
    if bias is not None:
        expected = expected + bias.float()
    u = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-11
    bound = u * expected.abs() + 2.0**-20 * (xf.abs() @ wf.abs().t()) + 1e-30
    err = (y.float().reshape(expected.shape) - expected).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {float(err.max())} exceeds the bound (ratio {worst})"


# ---------------------------------------------------------------------------------------------------
# reference: hand-computed cases
# ---------------------------------------------------------------------------------------------------
def test_reference_symmetric_int4_hand_case():
    w = torch.tensor([[0.7, -1.4, 0.35, 0.0, 0.1, -0.05, 1.0, 0.2]])
    q, s, z = ref.quantize_weight(w, bits=4, group_size=-1, symmetric=True)
    assert z is None
    assert torch.allclose(s, torch.tensor([[1.4 / 7]]))
    # w / s = [3.5, -7, 1.75, 0, 0.5, -0.25, 5, 1] -> rne: 4 (tie to even), -7, 2, 0, 0 (tie), 0, 5, 1
    assert q.tolist() == [[4, -7, 2, 0, 0, 0, 5, 1]]


def test_reference_asymmetric_int4_hand_case():
    w = torch.tensor([[1.0, 2.5, 4.0, 1.5, 3.0, 2.2, 1.25, 3.5]])
    q, s, z = ref.quantize_weight(w, bits=4, group_size=-1, symmetric=False)
    # lo = min(1, 0) = 0, hi = 4: s = 4/15, z = 0, q = rne(w * 15/4)
    assert torch.allclose(s, torch.tensor([[4.0 / 15]]))
    assert z.tolist() == [[0]]
    assert q.tolist() == [[4, 9, 15, 6, 11, 8, 5, 13]]
    w2 = torch.tensor([[-1.0, 0.75, 2.0, -0.35, 0.0, 1.0, 1.35, -0.25]])
    q2, s2, z2 = ref.quantize_weight(w2, bits=4, group_size=-1, symmetric=False)
    assert torch.allclose(s2, torch.tensor([[0.2]]))  # (2 - (-1)) / 15
    assert z2.tolist() == [[5]]  # rne(1 / 0.2)
    assert q2.tolist() == [[0, 9, 15, 3, 5, 10, 12, 4]]  # rne(w / 0.2) + 5 (3.75 -> 4, -1.75 -> -2)
    w_hat = ref.dequantize_weight(q2, s2, z2, -1, torch.float32)
    assert torch.allclose(w_hat, (q2 - 5).float() * s2[0, 0])


def test_reference_partial_last_group_and_group_index():
    w = torch.randn(3, 200)
    q, s, z = ref.quantize_weight(w, bits=8, group_size=128, symmetric=True)
    assert s.shape == (2, 3)
    assert torch.allclose(s[1], w[:, 128:].abs().amax(dim=1) / 127)
    w_hat = ref.dequantize_weight(q + 128, s, torch.full((2, 3), 128, dtype=torch.int32), 128, torch.float32)
    assert torch.allclose(w_hat[:, 130], q[:, 130].float() * s[1])
    assert float((w_hat - w).abs().max()) <= float(s.max()) / 2 + 1e-6


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_weight_ranges_and_error(bits, symmetric):
    w = torch.randn(33, 264)
    qw = ops.quantize_weight(w, bits=bits, group_size=64, symmetric=symmetric)
    u = qw.biased_codes()
    assert int(u.min()) >= 0 and int(u.max()) <= 2**bits - 1
    assert qw.scales.shape == (5, 33) and qw.scales.dtype == torch.float32
    w_hat = qw.dequantize(torch.float32)
    step = qw.scales.t().repeat_interleave(64, dim=1)[:, :264]
    assert bool(((w_hat - w).abs() <= step * 0.5 + 1e-6).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_quantize_weight_16bit_scales(bits, symmetric, scale_dtype):
    """A 16-bit scale is the float32 one rounded up (the smallest scale_dtype value >= it), the codes are
    the round-to-nearest codes of that stored scale, and |w - w_hat| <= s / 2 holds with it."""
    w = torch.randn(33, 264) * torch.exp2(torch.randint(-6, 7, (33, 1)).float())
    s32 = ref.quantize_weight(w, bits, 64, symmetric)[1]
    qw = ops.quantize_weight(w, bits=bits, group_size=64, symmetric=symmetric, scale_dtype=scale_dtype)
    s16 = qw.scales
    assert s16.dtype == scale_dtype and s16.shape == s32.shape
    assert bool((s16.float() >= s32).all())
    below = torch.nextafter(s16, torch.zeros_like(s16)).float()
    assert bool((below < s32).all())  # the smallest such value
    assert bool((s16.float() > s32).any())  # the rounding happened (not float32 values in disguise)
    q_ref, _, z_ref = ref.quantize_weight(w, bits, 64, symmetric, scale_dtype)
    u = qw.biased_codes()
    assert torch.equal(u, q_ref + (1 << (bits - 1)) if symmetric else q_ref)
    # the codes belong to the stored scale: the same grid computed by hand from it
    sg = s16.float().t().repeat_interleave(64, dim=1)[:, :264]
    z = qw.zero_points().t().repeat_interleave(64, dim=1)[:, :264]
    top = 2**bits - 1
    if symmetric:
        q_hand = torch.round(w / sg).clamp(-(top + 1) // 2, top // 2) + (1 << (bits - 1))
    else:
        q_hand = (torch.round(w / sg) + z).clamp(0, top)
    assert torch.equal(u, q_hand.to(torch.int32))
    w_hat = qw.dequantize(torch.float32)
    assert bool(((w_hat - w).abs() <= sg * 0.5 * (1 + 2.0**-20)).all())
    for dtype in (torch.float16, torch.bfloat16):
        with ops.backend("reference"):
            expected = qw.dequantize(dtype)
        assert_bitwise_equal(expected, ref.dequantize_weight(u, s16, qw.zero_points(), 64, dtype))
        with ops.backend("triton"):
            assert_bitwise_equal(qw.dequantize(dtype), expected)


def test_quantize_weight_scale_dtype_errors():
    w = torch.randn(16, 64)
    with pytest.raises(TypeError, match="scale_dtype"):
        ops.quantize_weight(w, scale_dtype="bfloat16")
    with pytest.raises(ValueError, match="scale_dtype"):
        ops.quantize_weight(w, scale_dtype=torch.float64)
    with pytest.raises(ValueError, match="scale_dtype"):
        ops.quantize_weight(w, scale_dtype=torch.int8)
    # float16 cannot hold a scale above 65504 (|w| up to 65504 * qmax would still fit)
    big = torch.full((2, 64), 1e6)
    with pytest.raises(ValueError, match="scale_dtype"):
        ops.quantize_weight(big, bits=4, scale_dtype=torch.float16)
    assert ops.quantize_weight(big, bits=4, scale_dtype=torch.bfloat16).scales.dtype == torch.bfloat16
    # a tiny weight: the scale rounds up to a float16 subnormal, never to zero
    tiny = ops.quantize_weight(torch.full((2, 64), 1e-7), bits=4, scale_dtype=torch.float16)
    assert bool((tiny.scales > 0).all())
    assert bool((tiny.dequantize(torch.float32) - 1e-7).abs().max() <= tiny.scales.float().max() / 2)


# ---------------------------------------------------------------------------------------------------
# packed layout
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_layout_interleave_by_hand(bits):
    per = 32 // bits
    chunk = 16 * per
    k = chunk + 24  # one full chunk plus a padded one
    u = torch.randint(0, 2**bits, (3, k), dtype=torch.int32)
    words = pack_codes(u, bits)
    assert words.shape == (3, 2 * 16) and words.dtype == torch.int32
    for n in range(3):
        for kk in (0, 1, 15, 16, 17, chunk - 1, chunk, chunk + 23):
            c, r = divmod(kk, chunk)
            field, j = divmod(r, 16)
            word = int(words[n, c * 16 + j]) & 0xFFFFFFFF
            assert (word >> (field * bits)) & (2**bits - 1) == int(u[n, kk])
    assert torch.equal(unpack_codes(words, bits, k), u)
    # padding holds code 0
    assert int(unpack_codes(words, bits, 2 * chunk)[:, k:].abs().sum()) == 0


# ---------------------------------------------------------------------------------------------------
# exhaustive converter exactness: every code at every field position, every zero point
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_converter_exhaustive_codes_and_zero_points(bits, dtype, triton_backend):
    per = 32 // bits
    top = 2**bits
    # k = chunk*16*per + 16*i + j, code = (chunk*16 + j) % top: every code lands on every field i.
    chunks = max(1, top // 16)
    k = chunks * 16 * per
    kk = torch.arange(k)
    chunk_idx, rem = kk // (16 * per), kk % (16 * per)
    code = (chunk_idx * 16 + rem % 16) % top
    n = top + 1  # zero points 0 .. 2^bits (GPTQ v1 checkpoints reach 2^bits)
    u = code.to(torch.int32).expand(n, k).contiguous()
    zeros = torch.arange(n, dtype=torch.int32).view(1, n)
    qw = QuantizedWeight.from_codes(u, torch.ones(1, n), zeros, bits, -1)
    got = qw.dequantize(dtype)
    expected = (u - zeros.t()).to(dtype)
    assert torch.equal((u - zeros.t()).to(dtype).float(), (u - zeros.t()).float())  # exactly representable
    assert_bitwise_equal(got, expected)
    # the symmetric (implicit zero point 2^(bits-1)) path
    sym = QuantizedWeight.from_codes(u[:1], torch.ones(1, 1), None, bits, -1)
    assert_bitwise_equal(sym.dequantize(dtype), (u[:1] - top // 2).to(dtype))


def _exhaustive_codes(bits, n):
    """Biased codes u [n, K]: k = chunk*16*per + 16*i + j holds code (chunk*16 + j) % 2^bits, so every code
    sits at every field position i (both halves of every packed pair) in every row."""
    per, top = 32 // bits, 2**bits
    k = max(1, top // 16) * 16 * per
    kk = torch.arange(k)
    code = ((kk // (16 * per)) * 16 + kk % 16) % top
    fields = (kk % (16 * per)) // 16
    assert torch.unique(code * per + fields).numel() == top * per
    return code.to(torch.int32).expand(n, k).contiguous()


def _scales_16bit(n, dtype):
    """One scale per column n, values of `dtype`: 1, powers of two, random significands over many binades
    and (float16) subnormals, so products round in every way (to even, up, down, into subnormals)."""
    s = torch.ldexp(1 + torch.rand(n), torch.randint(-12, 6, (n,))).to(dtype)
    s[0] = 1.0
    s[1] = 0.5
    if dtype == torch.float16:
        s[2] = 3 * 2.0**-24  # subnormal scale
        s[3] = 2.0**-14 + 2.0**-24  # smallest normal binade: products land in subnormals
    return s.view(1, n)


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (4, torch.float16), (8, torch.float16)])
def test_packed_converter_exhaustive_codes_zero_points_scales(bits, dtype, monkeypatch):
    """The packed conversion (16-bit pairs, scales in x's dtype) through the fused GEMM on identity rows:
    every code at every field (both halves of every pair), every zero point 0 .. 2^bits, and 16-bit scales
    of every kind, against the reference's round(dtype, float32(u - z) * s), bit for bit."""
    top = 2**bits
    n = top + 1
    u = _exhaustive_codes(bits, n)
    k = u.shape[1]
    zeros = torch.arange(n, dtype=torch.int32).view(1, n)
    scales = _scales_16bit(n, dtype)
    expected = ref.dequantize_weight(u, scales, zeros, -1, dtype)
    tile = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, programs_per_sm=1, chunks=2, convert="packed")
    spy = KernelSpy(kw._wo_mm_kernel)
    monkeypatch.setattr(kw, "_wo_mm_kernel", spy)
    for qw, want in ((QuantizedWeight.from_codes(u, scales, zeros, bits, -1), expected),
                     (QuantizedWeight.from_codes(u[:3], scales[:, :3], None, bits, -1),  # implicit 2^(bits-1)
                      ref.dequantize_weight(u[:3], scales[:, :3], torch.full((1, 3), top // 2), -1, dtype))):
        assert qw.scales.dtype == dtype
        eye = torch.eye(k, dtype=dtype)
        got = kw.fused_mm(eye, qw.qweight, qw.scales, qw.zeros, None, bits, -1, qw.shape[0], tile=tile, splits=1)
        assert_bitwise_equal(got.t().contiguous(), want)
    assert [c["CONVERT"] for c in spy.calls] == [kw._CONVERTS["packed"]] * 2


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_kernel_matches_reference(bits, group_size, symmetric, triton_backend):
    w = torch.randn(37, 328) * 3
    qw = ops.quantize_weight(w, bits=bits, group_size=group_size, symmetric=symmetric)
    for dtype in (torch.float16, torch.bfloat16):
        with ops.backend("reference"):
            expected = qw.dequantize(dtype)
        u, z = qw.biased_codes(), qw.zero_points()
        assert_bitwise_equal(expected, ref.dequantize_weight(u, qw.scales, z, group_size, dtype))
        assert_bitwise_equal(qw.dequantize(dtype), expected)


# ---------------------------------------------------------------------------------------------------
# fused GEMM under the interpreter
# ---------------------------------------------------------------------------------------------------
GEMM_CASES = [
    # (M, K, N, bits, group_size, symmetric, dtype, bias)
    (1, 200, 37, 4, 128, True, torch.bfloat16, False),
    (3, 328, 100, 4, 32, False, torch.float16, True),
    (17, 264, 19, 4, 64, True, torch.float16, False),
    (33, 136, 70, 4, -1, False, torch.bfloat16, True),
    (2, 200, 37, 8, -1, True, torch.bfloat16, True),
    (7, 192, 57, 8, 64, False, torch.float16, False),
    (20, 328, 33, 8, 256, True, torch.bfloat16, False),
    (5, 1000, 9, 4, 256, False, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_weight_only_mm_kernel_vs_fp32_reference(case, triton_backend):
    m, k, n, bits, group_size, symmetric, dtype, has_bias = case
    w = torch.randn(n, k)
    qw = ops.quantize_weight(w, bits=bits, group_size=group_size, symmetric=symmetric)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    y = ops.weight_only_mm(x, qw, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    w_hat = qw.dequantize(dtype)
    assert_gemm_close(y, x, w_hat, bias)
    with ops.backend("reference"):
        y_ref = ops.weight_only_mm(x, qw, bias)
    assert_gemm_close(y_ref, x, w_hat, bias)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_k_and_tiles_agree(splits):
    k, n = 5 * 128 + 40, 45
    qw = ops.quantize_weight(torch.randn(n, k), bits=4, group_size=64, symmetric=False)
    x = torch.randn(6, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    tile = dict(block_m=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=1)
    y = kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, bias, 4, 64, n, tile=tile, splits=splits)
    assert_gemm_close(y, x, qw.dequantize(torch.bfloat16), bias)


@pytest.mark.parametrize("m", [1, 40])  # 40: three row blocks, so tiles differ in m as well as n
def test_fused_split_k_reduction_equals_reduce_kernel(monkeypatch, m):
    # The tile's last program sums the partials in split order, as the separate reduce kernel does: the
    # same bits. The counters it used are back at zero afterwards (the next launch reuses them).
    k, n = 7 * 128, 45
    qw = ops.quantize_weight(torch.randn(n, k), bits=4, group_size=128)
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    tile = dict(block_m=16, block_n=16, num_warps=4, num_stages=2, programs_per_sm=1)
    fused = kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, bias, 4, 128, n, tile=tile, splits=3)
    counters = kw._tile_counters(x.device, 1)
    assert counters is not None and int(counters.abs().sum()) == 0
    assert kw._tile_counters(x.device, _common.COUNTER_SLOTS + 1) is None  # too many tiles: the reduce kernel
    again = kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, bias, 4, 128, n, tile=tile, splits=3)
    monkeypatch.setattr(kw, "_tile_counters", lambda device, tiles: None)
    separate = kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, bias, 4, 128, n, tile=tile, splits=3)
    assert torch.equal(fused, separate) and torch.equal(again, separate)
    assert_gemm_close(fused, x, qw.dequantize(torch.bfloat16), bias)


def test_padded_rows_3d_input_and_nan_isolation(triton_backend):
    k, n = 136, 29
    qw = ops.quantize_weight(torch.randn(n, k), bits=4, group_size=32)
    base = torch.randn(2, 3, k + 8).half()
    x = base[..., :k]  # padded rows: row stride k + 8
    assert not x.is_contiguous()
    y = ops.weight_only_mm(x, qw)
    assert y.shape == (2, 3, n) and y.is_contiguous()
    assert_gemm_close(y, x.reshape(-1, k), qw.dequantize(torch.float16))
    x_bad = x.clone()
    x_bad[0, 1, 5] = float("nan")
    x_bad[1, 2, 7] = float("inf")
    y_bad = ops.weight_only_mm(x_bad, qw)
    clean = torch.ones(2, 3, dtype=torch.bool)
    clean[0, 1] = clean[1, 2] = False
    assert torch.equal(y_bad[clean], y[clean])
    assert not bool(torch.isfinite(y_bad[0, 1]).all())


def test_custom_op_fake_shapes():
    qw = ops.quantize_weight(torch.randn(24, 64), bits=8, group_size=32)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(4, 5, 64, dtype=torch.bfloat16)
        qweight = torch.empty(qw.qweight.shape, dtype=qw.qweight.dtype)
        scales = torch.empty(qw.scales.shape, dtype=qw.scales.dtype)
        y = torch.ops.quantfuse.weight_only_mm(x, qweight, scales, None, None, None, 8, 32, 24)
        assert y.shape == (4, 5, 24) and y.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# checkpoint loaders (tensors packed here, in each format, independently of quantfuse.weights)
# ---------------------------------------------------------------------------------------------------
def _pack_loop(codes, bits, dim, order=None):
    """Reference packer: field i of word c along `dim` = element c * per + order[i]."""
    per = 32 // bits
    codes = codes.movedim(dim, 0).to(torch.int64)
    out = torch.zeros((codes.shape[0] // per, *codes.shape[1:]), dtype=torch.int64)
    for c in range(out.shape[0]):
        for i in range(per):
            src = c * per + (order[i] if order is not None else i)
            out[c] |= (codes[src] & (2**bits - 1)) << (i * bits)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.movedim(0, dim).contiguous()


def _expected(q, z, s, group_idx):
    """w[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n] in float32, then to each dtype."""
    diff = q - z.t()[:, group_idx]
    return diff.float() * s.float().t()[:, group_idx]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_from_gptq_bit_exact(bits, fmt, act_order):
    k, n, gs = 256, 48, 64
    groups = k // gs
    top = 2**bits
    q = torch.randint(0, top, (n, k), dtype=torch.int32)
    if fmt == "gptq":
        z = torch.randint(1, top + 1, (groups, n), dtype=torch.int32)  # v1: the stored value is z - 1
        stored_z = z - 1
    else:
        z = torch.randint(0, top, (groups, n), dtype=torch.int32)
        stored_z = z
    s = (torch.rand(groups, n) * 0.1 + 0.01).half()
    if act_order:
        g_idx = (torch.randperm(k) // gs).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // gs).to(torch.int32)
    qweight = _pack_loop(q.t(), bits, 0)  # [K / per, N] packed along K
    qzeros = _pack_loop(stored_z, bits, 1)  # [G, N / per] packed along N
    qw = QuantizedWeight.from_gptq(qweight, qzeros, s, g_idx=g_idx, bits=bits, checkpoint_format=fmt)
    assert qw.shape == (n, k) and qw.group_size == gs and (qw.perm is not None) == act_order
    expected = _expected(q, z, s, g_idx.long())
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert_bitwise_equal(qw.dequantize(dtype), expected.to(dtype))
    x = torch.randn(3, k).half()
    with ops.backend("triton"):
        y = ops.weight_only_mm(x, qw)
    assert_gemm_close(y, x, expected.half())


def test_from_awq_bit_exact():
    k, n, gs = 256, 40, 128
    groups = k // gs
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    z = torch.randint(0, 16, (groups, n), dtype=torch.int32)
    s = (torch.rand(groups, n) * 0.1 + 0.01).half()
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = _pack_loop(q.t(), 4, 1, order)  # [K, N / 8] packed along N
    qzeros = _pack_loop(z, 4, 1, order)
    # field order by hand: field 1 of word 0 of row 0 is output column 2
    assert (int(qweight[0, 0]) >> 4) & 0xF == int(q[2, 0])
    qw = QuantizedWeight.from_awq(qweight, qzeros, s)
    expected = _expected(q, z, s, torch.arange(k) // gs)
    for dtype in (torch.float16, torch.bfloat16):
        assert_bitwise_equal(qw.dequantize(dtype), expected.to(dtype))
        with ops.backend("triton"):
            assert_bitwise_equal(qw.dequantize(dtype), expected.to(dtype))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_from_compressed_tensors_bit_exact(bits, symmetric):
    k, n, gs = 192, 20, 64  # n not a multiple of 8: zero points padded along N
    groups = k // gs
    offset = 2 ** (bits - 1)
    q = torch.randint(-offset, offset, (n, k), dtype=torch.int32)  # signed codes
    s = (torch.rand(n, groups) * 0.1 + 0.01).bfloat16()
    weight_packed = _pack_loop(q + offset, bits, 1)  # [N, K / per]
    zp = torch.randint(-offset, offset, (n, groups), dtype=torch.int32) if not symmetric else None
    packed_zp = None
    if zp is not None:
        per = 32 // bits
        rows = -(-n // per) * per
        zp_pad = torch.zeros(rows, groups, dtype=torch.int32)
        zp_pad[:n] = zp + offset
        packed_zp = _pack_loop(zp_pad, bits, 0)  # [ceil(N / per), G] packed along N
    qw = QuantizedWeight.from_compressed_tensors(weight_packed, s, torch.tensor([n, k]), packed_zp)
    z = zp.t() if zp is not None else torch.zeros(groups, n, dtype=torch.int32)
    expected = _expected(q, z, s.t(), torch.arange(k) // gs)
    assert qw.bits == bits and qw.group_size == gs
    for dtype in (torch.float16, torch.bfloat16):
        assert_bitwise_equal(qw.dequantize(dtype), expected.to(dtype))


def test_loader_scale_dtype():
    """Loaders widen scales to float32 by default (exact); scale_dtype=None keeps the checkpoint's dtype
    (float16 GPTQ scales: the packed path for float16 activations), a 16-bit dtype only if exact."""
    k, n = 256, 16
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    z = torch.randint(0, 16, (2, n), dtype=torch.int32)
    s = (torch.rand(2, n) * 0.1 + 0.01).half()
    qweight, qzeros = _pack_loop(q.t(), 4, 0), _pack_loop(z, 4, 1)
    default = QuantizedWeight.from_gptq(qweight, qzeros, s, checkpoint_format="gptq_v2")
    kept = QuantizedWeight.from_gptq(qweight, qzeros, s, checkpoint_format="gptq_v2", scale_dtype=None)
    assert default.scales.dtype == torch.float32 and kept.scales.dtype == torch.float16
    assert torch.equal(kept.scales.float(), default.scales)
    for dtype in (torch.float16, torch.bfloat16):
        assert_bitwise_equal(kept.dequantize(dtype), default.dequantize(dtype))
    x = torch.randn(3, k).half()
    with ops.backend("triton"):
        assert torch.equal(ops.weight_only_mm(x, kept), ops.weight_only_mm(x, default))
    # bfloat16 cannot hold these float16 scales (11-bit significands): refused, not rounded
    with pytest.raises(ValueError, match="scale_dtype"):
        QuantizedWeight.from_gptq(qweight, qzeros, s, checkpoint_format="gptq_v2", scale_dtype=torch.bfloat16)
    # float16 scales that happen to be bfloat16 values convert exactly
    s_bf = s.bfloat16().half()
    qw_bf = QuantizedWeight.from_gptq(qweight, qzeros, s_bf, checkpoint_format="gptq_v2", scale_dtype=torch.bfloat16)
    assert qw_bf.scales.dtype == torch.bfloat16 and torch.equal(qw_bf.scales.float(), s_bf.float().view(2, n))
    with pytest.raises(TypeError, match="scale_dtype"):
        QuantizedWeight.from_awq(_pack_loop(q.t(), 4, 1, [0, 2, 4, 6, 1, 3, 5, 7])[:, :2],
                                 _pack_loop(z, 4, 1, [0, 2, 4, 6, 1, 3, 5, 7])[:, :2], s, scale_dtype="half")


def test_loader_per_channel_and_bad_g_idx():
    k, n = 64, 16
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    qweight = _pack_loop(q.t(), 4, 0)
    qzeros = _pack_loop(torch.full((1, n), 7, dtype=torch.int32), 4, 1)
    s = torch.rand(1, n).half()
    qw = QuantizedWeight.from_gptq(qweight, qzeros, s)
    assert qw.group_size == -1
    assert_bitwise_equal(qw.dequantize(torch.float32), (q - 8).float() * s.float().t())
    bad = torch.zeros(k, dtype=torch.int32)
    bad[:5] = 1  # unequal groups
    qz2 = _pack_loop(torch.full((2, n), 7, dtype=torch.int32), 4, 1)
    with pytest.raises(ValueError, match="g_idx"):
        QuantizedWeight.from_gptq(qweight, qz2, torch.rand(2, n).half(), g_idx=bad)
    with pytest.raises(ValueError, match="checkpoint_format"):
        QuantizedWeight.from_gptq(qweight, qzeros, s, checkpoint_format="v3")
    with pytest.raises(ValueError, match="qzeros"):
        QuantizedWeight.from_gptq(qweight, qz2, s)
    with pytest.raises(ValueError, match="bits"):
        QuantizedWeight.from_awq(qweight, qzeros, s, bits=8)
    for value in (-1, 2, 1 << 40):  # out of [0, G): named before the message counts the groups
        wild = torch.zeros(k, dtype=torch.int64)
        wild[k // 2:] = 1
        wild[0] = value
        with pytest.raises(ValueError, match=r"g_idx: expected group indices in \[0, 2\)"):
            QuantizedWeight.from_gptq(qweight, qz2, torch.rand(2, n).half(), g_idx=wild)


def test_loader_shape_errors_name_the_argument():
    n = 16
    with pytest.raises(ValueError, match="qweight: expected K = 4 x rows a multiple of 8"):
        QuantizedWeight.from_gptq(torch.zeros(3, n, dtype=torch.int32), torch.zeros(1, n // 4, dtype=torch.int32),
                                  torch.rand(1, n), bits=8)
    with pytest.raises(ValueError, match="qweight: expected K = rows a multiple of 8"):
        QuantizedWeight.from_awq(torch.zeros(12, 2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                                 torch.rand(1, n))
    for shape in ((16, 12), (16, 256, 1), (0, 64)):
        with pytest.raises(ValueError, match="weight_shape: expected \\(N, K\\)"):
            QuantizedWeight.from_compressed_tensors(torch.zeros(16, 32, dtype=torch.int32), torch.rand(16, 1), shape)
    qw = ops.quantize_weight(torch.randn(n, 64), bits=4)
    for dtype in (torch.int8, "bfloat16", torch.float64):
        with pytest.raises(TypeError, match="dtype: expected one of"):
            qw.dequantize(dtype)


# ---------------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------------
def test_bad_arguments():
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="bits"):
        ops.quantize_weight(w, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize_weight(w, group_size=100)
    with pytest.raises(ValueError, match="w"):
        ops.quantize_weight(torch.randn(16, 60))
    with pytest.raises(ValueError, match="w"):
        ops.quantize_weight(torch.randn(64))
    with pytest.raises(TypeError, match="w"):
        ops.quantize_weight(torch.randint(0, 3, (16, 64)))
    with pytest.raises(TypeError, match="symmetric"):
        ops.quantize_weight(w, symmetric=1)
    qw = ops.quantize_weight(w, group_size=32)
    with pytest.raises(TypeError, match="x"):
        ops.weight_only_mm(torch.randn(2, 64), qw)
    with pytest.raises(ValueError, match="K=64"):
        ops.weight_only_mm(torch.randn(2, 32).half(), qw)
    with pytest.raises(ValueError, match="contiguous"):
        ops.weight_only_mm(torch.randn(64, 2).half().t(), qw)
    with pytest.raises(TypeError, match="qw"):
        ops.weight_only_mm(torch.randn(2, 64).half(), w)
    with pytest.raises(ValueError, match="bias"):
        ops.weight_only_mm(torch.randn(2, 64).half(), qw, torch.randn(15).half())
    with pytest.raises(TypeError, match="bias"):
        ops.weight_only_mm(torch.randn(2, 64).half(), qw, torch.randn(16))
    # a QuantizedWeight whose fields disagree cannot be built, so no kernel ever sees one (a group size the
    # kernels cannot place would compute silently wrong sums)
    with pytest.raises(TypeError, match="QuantizedWeight: expected scales"):
        QuantizedWeight(qw.qweight, qw.scales.double(), qw.zeros, qw.bits, qw.group_size, qw.shape)
    u = qw.biased_codes()
    for build, match in [
        (lambda: QuantizedWeight.from_codes(u, qw.scales, qw.zeros, qw.bits, 48), "group_size"),
        (lambda: QuantizedWeight(qw.qweight, qw.scales, qw.zeros, 3, qw.group_size, qw.shape), "bits"),
        (lambda: QuantizedWeight(qw.qweight[:, :4].contiguous(), qw.scales, qw.zeros, qw.bits, qw.group_size,
                                 qw.shape), "qweight"),
        (lambda: QuantizedWeight(qw.qweight, qw.scales[:, :8].contiguous(), qw.zeros, qw.bits, qw.group_size,
                                 qw.shape), "scales of shape"),
        (lambda: QuantizedWeight(qw.qweight, qw.scales, qw.scales.to(torch.int64), qw.bits, qw.group_size,
                                 qw.shape), "zeros"),
        (lambda: QuantizedWeight(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.shape,
                                 torch.arange(63)), "perm"),
    ]:
        with pytest.raises(ValueError, match=match):
            build()


def test_splitk_reduce_runs_in_stream_order_unless_asked(monkeypatch):
    # pdl=True (gemv_mma, where configs.split_k_reduce_pdl says so: tested with scaled_mm's reduce) launches it
    # early; by default, and under the interpreter, it runs in stream order
    from quantfuse.kernels import weight_only as kw

    spy = KernelSpy(kw._splitk_reduce_kernel)
    monkeypatch.setattr(kw, "_splitk_reduce_kernel", spy)
    part, bias = torch.randn(3, 2, 40), torch.randn(40)
    out = torch.empty(2, 40)
    kw.splitk_reduce(part, bias, out)
    assert spy.calls[-1]["PDL"] is False and "launch_pdl" not in spy.calls[-1]
    torch.testing.assert_close(out, part.sum(0) + bias)


def test_decode_pdl_rule_and_interpreted_launch(monkeypatch):
    # the rule (configs.decode_pdl): M <= DECODE_PDL_MAX_M, a weight width the architecture's DECODE_PDL lists (int4 on
    # sm90), grid dependency control available; under the interpreter the decode kernels launch in stream order
    import quantfuse as qf
    from quantfuse.kernels import configs

    spy = KernelSpy(kw._wo_gemv_kernel)
    monkeypatch.setattr(kw, "_wo_gemv_kernel", spy)
    qw = qf.quantize_weight(torch.randn(40, 256), bits=4, group_size=128)
    x = torch.randn(1, 256).to(torch.bfloat16)
    y = kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, None, 4, 128, 40,
                    tile=dict(max_m=1, block_m=1, block_n=32, num_warps=4, num_stages=1, programs_per_sm=2,
                              kernel="gemv", convert="inplace", scale="auto"))
    torch.testing.assert_close(y.float(), x.float() @ qw.dequantize(torch.float32).t(), rtol=2e-2, atol=2e-2)
    assert spy.calls[-1]["PDL"] is False and "launch_pdl" not in spy.calls[-1]
    cpu = torch.device("cpu")
    assert configs.decode_pdl(cpu, 1, 4) is False
    monkeypatch.setattr(configs, "arch_key", lambda *args: "sm90")
    monkeypatch.setattr(configs, "pdl_supported", lambda: True)
    assert configs.decode_pdl(cpu, 1, 4) and configs.decode_pdl(cpu, configs.DECODE_PDL_MAX_M, 4)
    assert not configs.decode_pdl(cpu, configs.DECODE_PDL_MAX_M + 1, 4)
    assert not configs.decode_pdl(cpu, 1, 8)
    monkeypatch.setattr(configs, "arch_key", lambda *args: "default")
    assert not configs.decode_pdl(cpu, 1, 4)


def test_quantized_weight_views_are_read_as_values():
    """A QuantizedWeight made of views (one shard's output channels of a larger weight, column-major scales, a
    strided qweight) computes what its values say: the constructor keeps packed copies the kernels can read."""
    torch.manual_seed(9)
    n, k, n0, n1 = 32, 128, 8, 24
    full = ops.quantize_weight(torch.randn(n, k), bits=4, group_size=32, symmetric=False)
    col_major = lambda t: t.t().contiguous().t()  # noqa: E731
    wide = torch.zeros(n, 2 * full.qweight.shape[1], dtype=torch.int32)
    wide[:, ::2] = full.qweight
    cases = {
        "shard": (QuantizedWeight(full.qweight[n0:n1], full.scales[:, n0:n1], full.zeros[:, n0:n1], 4, 32,
                                  (n1 - n0, k)), slice(n0, n1)),
        "column-major": (QuantizedWeight(full.qweight, col_major(full.scales), col_major(full.zeros), 4, 32, (n, k)),
                         slice(0, n)),
        "strided words": (QuantizedWeight(wide[:, ::2], full.scales, full.zeros, 4, 32, (n, k)), slice(0, n)),
    }
    x = torch.randn(3, k, dtype=torch.float16)
    with ops.backend("reference"):
        want_full = ops.weight_only_mm(x, full)
        deq_full = full.dequantize(torch.float16)
    for name, (qw, cols) in cases.items():
        assert all(t.is_contiguous() for t in (qw.qweight, qw.scales, qw.zeros)), name
        with ops.backend("triton"):
            got = ops.weight_only_mm(x, qw)
            assert_bitwise_equal(qw.dequantize(torch.float16), deq_full[cols])
        assert_gemm_close(got, x, deq_full[cols])
        assert_gemm_close(want_full[:, cols], x, deq_full[cols])


def test_quantized_weight_field_errors():
    qw = ops.quantize_weight(torch.randn(16, 64), bits=4, group_size=32)
    with pytest.raises(ValueError, match="expected scales on cpu .*got meta"):
        QuantizedWeight(qw.qweight, qw.scales.to("meta"), None, 4, 32, (16, 64))
    with pytest.raises(TypeError, match="expected scales to be a torch.Tensor"):
        QuantizedWeight(qw.qweight, qw.scales.tolist(), None, 4, 32, (16, 64))
    for perm in (torch.zeros(64, dtype=torch.int64), torch.arange(64) + 1):
        with pytest.raises(ValueError, match="perm: expected a permutation of 0..63"):
            QuantizedWeight(qw.qweight, qw.scales, None, 4, 32, (16, 64), perm=perm)
    QuantizedWeight(qw.qweight, qw.scales, None, 4, 32, (16, 64), perm=torch.randperm(64))
