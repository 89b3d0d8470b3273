"""Fused SiLU-and-mul + quantization (SPEC section 3): reference hand cases, the Triton kernels under the
interpreter against the reference, non-finite isolation, strided inputs, GEMM hand-off, bad arguments."""

import math

import pytest
import torch

import quantfuse as qf
from quantfuse import reference as ref
from quantfuse.kernels import silu_quant as ksq
from tests._util import assert_codes_equal, codes

INT8, FP8 = torch.int8, torch.float8_e4m3fn
IN_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
GROUP_SIZES = [16, 32, 64, 128, 256]
# the kernel's exp (numpy's under the interpreter) may differ from torch's by an ulp, which can move a
# value across a rounding tie: allow one-step code differences at a rate below this
TIE_RATE = 1e-3


def rand_x(t, h, dtype, scale=3.0):
    return (torch.randn(t, 2 * h) * scale).to(dtype)


def assert_close_outputs(got, want, tie_rate=TIE_RATE):
    assert_codes_equal(got[0], want[0], tie_rate=tie_rate)
    assert got[1].shape == want[1].shape
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------------
# Reference against hand-computed values
# ---------------------------------------------------------------------------------------------------
def test_reference_silu_and_mul_hand_values():
    gate = [0.0, 1.0, -1.0, 2.0, -20.0]
    up = [1.0, 2.0, 3.0, -1.0, 4.0]
    x = torch.tensor([gate + up])
    want = [g / (1.0 + math.exp(-g)) * u for g, u in zip(gate, up)]
    torch.testing.assert_close(ref.silu_and_mul(x), torch.tensor([want]), rtol=2e-7, atol=0)


def test_reference_per_token_int8_hand_codes():
    # y = [0, 1.46212, -0.80682, -1.76159]; scale = 1.76159 / 127; codes = rne(y / scale)
    x = torch.tensor([[0.0, 1.0, -1.0, 2.0, 1.0, 2.0, 3.0, -1.0]])
    q, s = ref.silu_and_mul_quant(x, INT8)
    y3 = -2.0 / (1.0 + math.exp(-2.0))
    assert s.shape == (1, 1)
    assert abs(s.item() - abs(y3) / 127) < 1e-9
    assert q.tolist() == [[0, 105, -58, -127]]


def test_reference_per_group_and_static_hand_codes():
    # two groups of 16: group 0 all zero (up = 0), group 1 has y = silu(1) * 1 everywhere
    gate = torch.cat([torch.full((16,), 5.0), torch.ones(16)])
    up = torch.cat([torch.zeros(16), torch.ones(16)])
    x = torch.cat([gate, up]).reshape(1, 64)
    q, s = ref.silu_and_mul_quant(x, FP8, group_size=16)
    assert torch.equal(s[0, 0], torch.tensor(1e-10 / 448))
    assert codes(q)[0, :16].eq(0).all()
    assert q[0, 16:].float().eq(448.0).all()
    q_static, s_static = ref.silu_and_mul_quant(x, INT8, scale=torch.tensor([0.01]))
    y1 = 1.0 / (1.0 + math.exp(-1.0))  # 0.7311 / 0.01 = 73.1 -> 73
    assert q_static[0, 16:].eq(round(y1 / 0.01)).all() and q_static[0, :16].eq(0).all()


# ---------------------------------------------------------------------------------------------------
# Kernels (interpreter) against the reference
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("group,h", [(g, h) for g in GROUP_SIZES for h in (64, 1024) if g <= h])
def test_per_group(triton_backend, group, h, transposed, dtype, in_dtype, t):
    x = rand_x(t, h, in_dtype)
    got = qf.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
    want = ref.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
    assert_close_outputs(got, want)
    assert got[0].shape == (t, h) and got[1].shape == (t, h // group)
    assert (got[1].t() if transposed else got[1]).is_contiguous()


@pytest.mark.parametrize("h", [64, 1024])
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_token(triton_backend, dtype, in_dtype, t, h):
    x = rand_x(t, h, in_dtype)
    got = qf.silu_and_mul_quant(x, dtype)
    assert got[1].shape == (t, 1)
    assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype))


@pytest.mark.parametrize("h", [64, 1024])
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_tensor_static(triton_backend, dtype, in_dtype, t, h):
    x = rand_x(t, h, in_dtype)
    scale = torch.tensor([0.043])
    q, s = qf.silu_and_mul_quant(x, dtype, scale=scale)
    assert s is scale
    assert_codes_equal(q, ref.silu_and_mul_quant(x, dtype, scale=scale)[0], tie_rate=TIE_RATE)


@pytest.mark.parametrize("mode", ["g128", "g128_t", "token", "static"])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_h5120(triton_backend, mode, dtype):
    x = rand_x(7, 5120, torch.bfloat16)
    kw = {"g128": dict(group_size=128), "g128_t": dict(group_size=128, transposed_scales=True),
          "token": {}, "static": dict(scale=torch.tensor([0.02]))}[mode]
    assert_close_outputs(qf.silu_and_mul_quant(x, dtype, **kw), ref.silu_and_mul_quant(x, dtype, **kw))


@pytest.mark.parametrize("path", ["single", "split", "loop"])
@pytest.mark.parametrize("h", [64, 1000, 3000])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_token_both_paths(triton_backend, path, h, dtype):
    # both per-token strategies, with a masked tail (H not a power of two) and several chunks per row
    x = rand_x(5, h, torch.bfloat16)
    got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
    assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype))


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_token_loop_two_rows_per_program(triton_backend, monkeypatch, dtype):
    # the 'loop' path with two rows per program over an odd token count (the last program's second row is
    # masked) and a masked column tail in each chunk walk
    monkeypatch.setitem(ksq.SILU_QUANT_CONFIGS["default"], "loop_rows", 2)
    monkeypatch.setitem(ksq.SILU_QUANT_CONFIGS["default"], "loop_block", 256)
    x = rand_x(5, 1000, torch.bfloat16)
    got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path="loop")
    assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype))


@pytest.mark.parametrize("path", ["single", "split", "loop"])
def test_per_token_scale_ub(triton_backend, path):
    x = rand_x(6, 96, torch.float32, scale=10.0)
    ub = torch.tensor([0.05])
    got = ksq.silu_and_mul_quant(x, FP8, None, None, ub, False, token_path=path)
    want = ref.silu_and_mul_quant(x, FP8, scale_ub=ub)
    assert_close_outputs(got, want)
    assert (got[1] <= 0.05).all() and (want[1] == 0.05).any()


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_group_scale_ub(triton_backend, dtype, transposed):
    x = rand_x(5, 256, torch.bfloat16, scale=8.0)
    x[3] = (torch.randn(512) * 0.3).bfloat16()  # a quiet row whose scales stay under the bound
    ub = torch.tensor([0.1])
    kw = dict(group_size=32, scale_ub=ub, transposed_scales=transposed)
    got = qf.silu_and_mul_quant(x, dtype, **kw)
    want = ref.silu_and_mul_quant(x, dtype, **kw)
    assert_close_outputs(got, want)
    assert (want[1] == 0.1).any() and (want[1] < 0.1).any()  # the bound both bites and does not


def test_many_chunks_partials(triton_backend):
    # a per-token row split over more chunks than one partial block row needs to reduce in one go
    x = rand_x(2, 40000, torch.float16)
    x[1, 39999] = 30.0  # the row max of row 1 sits in its last chunk of gate
    x[1, 79999] = 30.0
    for path in ("split", "loop"):
        got = ksq.silu_and_mul_quant(x, INT8, None, None, None, False, token_path=path)
        assert_close_outputs(got, ref.silu_and_mul_quant(x, INT8))


# ---------------------------------------------------------------------------------------------------
# Zeros, huge values, non-finite isolation, strides
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("mode", ["group", "token", "token_split", "token_loop"])
def test_all_zero_regions(triton_backend, dtype, mode):
    x = rand_x(4, 128, torch.bfloat16)
    x[1, 128:] = 0.0  # up = 0: a whole zero row of y
    x[2, 32:64] = 0.0  # gate = 0 over group 1 of 32
    if mode == "group":
        got = qf.silu_and_mul_quant(x, dtype, group_size=32)
        want = ref.silu_and_mul_quant(x, dtype, group_size=32)
        assert got[1][2, 1] == torch.tensor(1e-10) / ref.QMAX[dtype]
    else:
        path = {"token_split": "split", "token_loop": "loop"}.get(mode, "single")
        got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
        want = ref.silu_and_mul_quant(x, dtype)
    assert_close_outputs(got, want)
    assert torch.isfinite(got[1]).all() and (got[1] > 0).all()
    assert got[0][1].float().eq(0).all()  # +0 or -0 (fp8 keeps the sign of silu(gate) * 0)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_huge_values(triton_backend, dtype):
    x = rand_x(3, 64, torch.float16)
    x[0, :64] = 60000.0  # silu(gate) = gate
    x[0, 64:] = -65504.0
    x[1, :64] = -60000.0  # exp(60000) overflows: silu -> -0
    x[2, 3] = 2000.0
    x[2, 67] = 3e4
    for kw in (dict(group_size=16), {}, dict(scale=torch.tensor([1e3]))):
        got = qf.silu_and_mul_quant(x, dtype, **kw)
        want = ref.silu_and_mul_quant(x, dtype, **kw)
        assert_codes_equal(got[0], want[0], tie_rate=TIE_RATE)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
        assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["gate", "up"])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_non_finite_stays_in_its_region(triton_backend, poison, where, dtype):
    t, h = 6, 128
    x = rand_x(t, h, torch.bfloat16)
    col = 37 if where == "gate" else h + 37  # output column 37: group 1 of 32
    x[2, col] = poison
    clean = x.clone()
    clean[2, col] = 1.0
    others = [0, 1, 3, 4, 5]
    # per group: only row 2, group 1 may change
    got = qf.silu_and_mul_quant(x, dtype, group_size=32)
    want = ref.silu_and_mul_quant(clean, dtype, group_size=32)
    assert_codes_equal(got[0][others], want[0][others], tie_rate=TIE_RATE)
    keep = torch.ones(h, dtype=torch.bool)
    keep[32:64] = False
    assert_codes_equal(got[0][2, keep], want[0][2, keep], tie_rate=TIE_RATE)
    torch.testing.assert_close(got[1][others], want[1][others], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1][2, [0, 2, 3]], want[1][2, [0, 2, 3]], rtol=1e-5, atol=0)
    # per token, both paths: only row 2 may change
    for path in ("single", "split", "loop"):
        got_t = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
        want_t = ref.silu_and_mul_quant(clean, dtype)
        assert_codes_equal(got_t[0][others], want_t[0][others], tie_rate=TIE_RATE)
        torch.testing.assert_close(got_t[1][others], want_t[1][others], rtol=1e-5, atol=0)
    # static: only the poisoned element may change
    scale = torch.tensor([0.05])
    got_s = qf.silu_and_mul_quant(x, dtype, scale=scale)[0]
    want_s = ref.silu_and_mul_quant(clean, dtype, scale=scale)[0]
    mask = torch.ones(t, h, dtype=torch.bool)
    mask[2, 37] = False
    assert_codes_equal(got_s[mask], want_s[mask], tie_rate=TIE_RATE)


@pytest.mark.parametrize("mode", ["group", "group_t", "token", "static"])
def test_padded_rows_and_leading_dims(triton_backend, mode):
    base = rand_x(2 * 5, 96 + 40, torch.float16)  # rows of 272 elements, we use the first 192
    x = base[:, :192].reshape(2, 5, 192)
    assert not x.is_contiguous() and x.stride(-1) == 1
    kw = {"group": dict(group_size=32), "group_t": dict(group_size=32, transposed_scales=True),
          "token": {}, "static": dict(scale=torch.tensor([0.03]))}[mode]
    got = qf.silu_and_mul_quant(x, FP8, **kw)
    want = ref.silu_and_mul_quant(x.contiguous(), FP8, **kw)
    assert got[0].shape == (2, 5, 96) and got[0].is_contiguous()
    assert_close_outputs(got, want)
    if mode != "static":
        assert got[1].shape[0] == 10


def test_empty_token_dim(triton_backend):
    x = torch.randn(0, 64)
    q, s = qf.silu_and_mul_quant(x, FP8, group_size=16)
    assert q.shape == (0, 32) and s.shape == (0, 2)


# ---------------------------------------------------------------------------------------------------
# The output feeds the down-projection GEMMs
# ---------------------------------------------------------------------------------------------------
def _mlp_down_case(t=33, h=256, n=96):
    x = rand_x(t, h, torch.bfloat16, scale=2.0)
    w_down = torch.randn(n, h) / math.sqrt(h)  # [N, H] row-major weight, as stored by a linear layer
    want = ref.silu_and_mul(x) @ w_down.t()
    return x, w_down, want


def _relative_error(got, want):
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.skipif(not hasattr(qf.ops, "scaled_mm_blockwise"), reason="scaled_mm_blockwise not available")
@pytest.mark.parametrize("transposed", [False, True])
def test_feeds_blockwise_gemm(triton_backend, transposed):
    x, w_down, want = _mlp_down_case()
    q, scales = qf.silu_and_mul_quant(x, FP8, group_size=128, transposed_scales=transposed)
    # weight quantized per 128 x 128 block, scale_b [ceil(H/128), ceil(N/128)]
    w_t = w_down.t().contiguous()  # [H, N]
    hb, nb = -(-w_t.shape[0] // 128), -(-w_t.shape[1] // 128)
    blocks = torch.nn.functional.pad(w_t, (0, nb * 128 - w_t.shape[1], 0, hb * 128 - w_t.shape[0]))
    amax = blocks.reshape(hb, 128, nb, 128).abs().amax(dim=(1, 3))
    scale_b = ref.dynamic_scale(amax, FP8)
    scale_full = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w_t.shape[0], : w_t.shape[1]]
    b_q = ref.quantize_values(w_t / scale_full, FP8)
    out = qf.ops.scaled_mm_blockwise(q, b_q.t().contiguous().t(), scales, scale_b, torch.float32)
    assert out.shape == want.shape
    assert _relative_error(out, want) < 0.06


@pytest.mark.skipif(not hasattr(qf.ops, "scaled_mm"), reason="scaled_mm not available")
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_feeds_scaled_mm_per_token(triton_backend, dtype):
    x, w_down, want = _mlp_down_case()
    q, scale_a = qf.silu_and_mul_quant(x, dtype)
    w_scale = ref.dynamic_scale(w_down.abs().amax(dim=1), dtype)  # per output channel
    b_q = ref.quantize_values(w_down / w_scale[:, None], dtype).t()  # [H, N] view of [N, H]
    out = qf.ops.scaled_mm(q, b_q, scale_a, w_scale, torch.float32)
    assert _relative_error(out, want) < (0.02 if dtype == INT8 else 0.06)


@pytest.mark.parametrize("mode", ["g128", "token", "static"])
def test_dequantized_output_matches_mlp(triton_backend, mode):
    x, w_down, want = _mlp_down_case()
    if mode == "g128":
        q, s = qf.silu_and_mul_quant(x, FP8, group_size=128)
        y_hat = qf.dequantize(q, s, group_size=128)
    elif mode == "token":
        q, s = qf.silu_and_mul_quant(x, INT8)
        y_hat = qf.dequantize(q, s)
    else:
        q, s = qf.silu_and_mul_quant(x, INT8, scale=torch.tensor([ref.silu_and_mul(x).abs().max().item() / 127]))
        y_hat = qf.dequantize(q, s)
    assert _relative_error(y_hat @ w_down.t(), want) < (0.06 if mode == "g128" else 0.03)


# ---------------------------------------------------------------------------------------------------
# Bad arguments: clear errors before any launch
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda x: qf.silu_and_mul_quant(x[:, :63], FP8), ValueError, ["x", "even", "63"]),
        (lambda x: qf.silu_and_mul_quant(x[:, :0], FP8), ValueError, ["x", "even"]),
        (lambda x: qf.silu_and_mul_quant(x.to(torch.int32), FP8), TypeError, ["x", "int32"]),
        (lambda x: qf.silu_and_mul_quant(x.t(), FP8), ValueError, ["x", "contiguous"]),
        (lambda x: qf.silu_and_mul_quant(x, torch.float16), TypeError, ["dtype", "float16"]),
        (lambda x: qf.silu_and_mul_quant(x, torch.float8_e5m2), TypeError, ["dtype", "float8_e5m2"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, group_size=24), ValueError, ["group_size", "24"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, group_size=512), ValueError, ["group_size", "512"]),
        (lambda x: qf.silu_and_mul_quant(x[:, :48], FP8, group_size=16), ValueError, ["group_size", "H = 24"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, group_size=16, scale=torch.ones(1)), ValueError, ["group_size", "scale"]),
        (lambda x: qf.silu_and_mul_quant(x, INT8, scale=torch.ones(1), scale_ub=torch.ones(1)), ValueError, ["scale_ub", "static"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, scale=torch.ones(2)), ValueError, ["scale", "numel"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, scale=torch.ones(1, dtype=torch.float64)), TypeError, ["scale", "float64"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, scale_ub=torch.ones(3)), ValueError, ["scale_ub", "numel"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, transposed_scales=True), ValueError, ["transposed_scales", "group_size"]),
        (lambda x: qf.silu_and_mul_quant(x, FP8, group_size=16, transposed_scales=1), TypeError, ["transposed_scales", "int"]),
    ],
)
def test_bad_arguments(call, exc, words):
    x = torch.randn(4, 64)
    with pytest.raises(exc) as info:
        call(x)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
