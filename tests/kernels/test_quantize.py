"""Activation quantization kernels (Triton; the interpreter on CPU) against the reference."""

import pytest
import torch

import quantfuse as qf
from quantfuse import reference as ref
from tests._util import assert_codes_equal

INT8, FP8 = torch.int8, torch.float8_e4m3fn
IN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 16), (7, 17), (33, 1025)]


def rand(m, k, dtype, scale=3.0, device="cpu"):
    return (torch.randn(m, k, device=device) * scale).to(dtype)


def assert_outputs_equal(got, want):
    assert_codes_equal(got[0], want[0])
    assert got[1].shape == want[1].shape
    assert torch.equal(got[1], want[1])
    if want[2] is None:
        assert got[2] is None
    else:
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype,symmetric", [(INT8, True), (FP8, True), (INT8, False)])
def test_per_token(triton_backend, shape, in_dtype, dtype, symmetric):
    x = rand(*shape, in_dtype)
    assert_outputs_equal(qf.quantize_per_token(x, dtype, symmetric=symmetric), ref.quantize_per_token(x, dtype, symmetric=symmetric))


@pytest.mark.parametrize("dtype,symmetric", [(INT8, True), (FP8, True), (INT8, False)])
def test_per_token_long_rows_two_pass(triton_backend, dtype, symmetric):
    x = rand(3, 8193 + 4096, torch.bfloat16)  # longer than one register-resident row: the looping path
    assert_outputs_equal(qf.quantize_per_token(x, dtype, symmetric=symmetric), ref.quantize_per_token(x, dtype, symmetric=symmetric))


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_token_scale_ub(triton_backend, dtype):
    x = rand(7, 64, torch.float32, scale=50.0)
    ub = torch.tensor([0.05])
    got = qf.quantize_per_token(x, dtype, scale_ub=ub)
    assert_outputs_equal(got, ref.quantize_per_token(x, dtype, scale_ub=ub))
    assert (got[1] <= 0.05).all()


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("k,group", [(16, 16), (1024, 128), (1024, 512), (96, 32)])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_group(triton_backend, m, k, group, in_dtype, dtype, transposed):
    x = rand(m, k, in_dtype)
    got = qf.quantize_per_group(x, dtype, group, transposed_scales=transposed)
    assert_outputs_equal(got, ref.quantize_per_group(x, dtype, group, transposed_scales=transposed))
    if transposed:
        assert got[1].t().is_contiguous()
    else:
        assert got[1].is_contiguous()


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_group_scale_ub(triton_backend, dtype):
    x = rand(5, 256, torch.float32, scale=100.0)
    ub = torch.tensor([0.2])
    assert_outputs_equal(qf.quantize_per_group(x, dtype, 64, scale_ub=ub), ref.quantize_per_group(x, dtype, 64, scale_ub=ub))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_per_tensor_dynamic_and_static(triton_backend, shape, in_dtype, dtype):
    x = rand(*shape, in_dtype)
    assert_outputs_equal(qf.quantize_per_tensor(x, dtype), ref.quantize_per_tensor(x, dtype))
    scale = torch.tensor([0.037])
    got = qf.quantize_per_tensor(x, dtype, scale=scale)
    assert got[1] is scale
    assert_codes_equal(got[0], ref.quantize_per_tensor(x, dtype, scale=scale)[0])


def test_per_tensor_dynamic_many_partials(triton_backend):
    # More partial-amax programs than one reduction block holds (BLOCK_P = 1024).
    x = rand(1100, 17, torch.float16)
    x[1099, 3] = 40.0  # the global max sits in the last partial
    assert_outputs_equal(qf.quantize_per_tensor(x, INT8), ref.quantize_per_tensor(x, INT8))


@pytest.mark.parametrize("shape", SHAPES)
def test_per_tensor_static_asymmetric(triton_backend, shape):
    x = rand(*shape, torch.float32)
    scale, azp = torch.tensor([0.02]), torch.tensor([-17], dtype=torch.int32)
    got = qf.quantize_per_tensor(x, INT8, scale=scale, azp=azp)
    assert got[1] is scale and got[2] is azp
    assert_codes_equal(got[0], ref.quantize_per_tensor(x, INT8, scale=scale, azp=azp)[0])


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_rounding_ties(triton_backend, dtype):
    ties = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -127.5, 17.0, 19.0, 232.0, 0.0078125 * 1.5])
    x = ties.repeat(3, 1)
    got = qf.quantize_per_tensor(x, dtype, scale=torch.ones(1))[0]
    assert_codes_equal(got, ref.quantize_per_tensor(x, dtype, scale=torch.ones(1))[0])
    if dtype == INT8:
        assert got[0, :7].tolist() == [0, 0, 2, -2, 2, 126, -128]


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_saturation_near_int32_range(triton_backend, dtype):
    x = torch.tensor([[2.0**31 - 128, -(2.0**31), 1e30, -1e30, 449.0, -449.0, 128.0, -129.0]])
    got = qf.quantize_per_tensor(x, dtype, scale=torch.ones(1))[0]
    want = ref.quantize_per_tensor(x, dtype, scale=torch.ones(1))[0]
    assert_codes_equal(got, want)
    q = torch.tensor([[2.0**31 - 128, -(2.0**31)]])
    got_azp = qf.quantize_per_tensor(q, INT8, scale=torch.ones(1), azp=torch.tensor([100], dtype=torch.int32))[0]
    assert got_azp.tolist() == [[127, -128]]


@pytest.mark.parametrize("dtype,symmetric", [(INT8, True), (FP8, True), (INT8, False)])
def test_all_zero_and_constant_rows(triton_backend, dtype, symmetric):
    x = rand(4, 48, torch.float32)
    x[1] = 0.0
    x[2] = 5.0
    got = qf.quantize_per_token(x, dtype, symmetric=symmetric)
    assert_outputs_equal(got, ref.quantize_per_token(x, dtype, symmetric=symmetric))
    assert torch.isfinite(got[1]).all() and (got[1] > 0).all()
    if symmetric:
        assert got[0][1].float().eq(0).all()


def _cleaned(fn, x, bad_row, bad_col):
    """Outputs of fn on x with the poisoned element replaced by a finite value."""
    clean = x.clone()
    clean[bad_row, bad_col] = 1.0
    return fn(clean)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_non_finite_values_stay_in_their_region(triton_backend, poison, dtype):
    x = rand(6, 64, torch.bfloat16)
    x[2, 5] = poison
    others = [0, 1, 3, 4, 5]
    got = qf.quantize_per_token(x, dtype)
    want = _cleaned(lambda t: ref.quantize_per_token(t, dtype), x, 2, 5)
    assert_codes_equal(got[0][others], want[0][others])
    assert torch.equal(got[1][others], want[1][others])
    # per group: only the poisoned group (row 2, group 0 of 16) may change
    got_g = qf.quantize_per_group(x, dtype, 16)
    want_g = _cleaned(lambda t: ref.quantize_per_group(t, dtype, 16), x, 2, 5)
    assert_codes_equal(got_g[0][others], want_g[0][others])
    assert_codes_equal(got_g[0][2, 16:], want_g[0][2, 16:])
    assert torch.equal(got_g[1][2, 1:], want_g[1][2, 1:])
    # asymmetric per token
    if dtype == INT8:
        got_a = qf.quantize_per_token(x, dtype, symmetric=False)
        want_a = _cleaned(lambda t: ref.quantize_per_token(t, dtype, symmetric=False), x, 2, 5)
        assert_codes_equal(got_a[0][others], want_a[0][others])
        assert torch.equal(got_a[2][others], want_a[2][others])


@pytest.mark.parametrize("op", ["token", "token_asym", "group", "tensor"])
def test_padded_rows_match_contiguous(triton_backend, op):
    base = rand(9, 160, torch.float16)
    x = base[:, :128]  # row stride 160, last dim contiguous
    assert not x.is_contiguous()
    fns = {
        "token": lambda t: qf.quantize_per_token(t, INT8),
        "token_asym": lambda t: qf.quantize_per_token(t, INT8, symmetric=False),
        "group": lambda t: qf.quantize_per_group(t, FP8, 32),
        "tensor": lambda t: qf.quantize_per_tensor(t, FP8),
    }
    got, want = fns[op](x), fns[op](x.contiguous())
    assert_outputs_equal(got, want)
    assert got[0].is_contiguous()


def test_leading_dims_flattened(triton_backend):
    x = rand(6, 32, torch.float32).reshape(2, 3, 32)
    q, s, _ = qf.quantize_per_token(x, INT8)
    assert q.shape == (2, 3, 32) and s.shape == (6, 1)
    assert_codes_equal(q, ref.quantize_per_token(x, INT8)[0])


@pytest.mark.parametrize("out_dtype", IN_DTYPES)
@pytest.mark.parametrize("mode", ["tensor", "token", "token_asym", "group", "group_t", "tensor_azp"])
def test_dequantize(triton_backend, out_dtype, mode):
    x = rand(7, 64, torch.float32)
    gs = None
    if mode == "tensor":
        q, s, z = qf.quantize_per_tensor(x, FP8)
    elif mode == "tensor_azp":
        q, s, z = qf.quantize_per_tensor(x, INT8, torch.tensor([0.03]), torch.tensor([3], dtype=torch.int32))
    elif mode == "token":
        q, s, z = qf.quantize_per_token(x, INT8)
    elif mode == "token_asym":
        q, s, z = qf.quantize_per_token(x, INT8, symmetric=False)
    else:
        gs = 16
        q, s, z = qf.quantize_per_group(x, FP8, gs, transposed_scales=mode == "group_t")
    got = qf.dequantize(q, s, z, group_size=gs, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, ref.dequantize(q, s, z, group_size=gs, out_dtype=out_dtype))


def test_cpu_default_runs_reference():
    x = rand(3, 32, torch.float32)
    assert_outputs_equal(qf.quantize_per_token(x, INT8), ref.quantize_per_token(x, INT8))


def test_torch_compile_fullgraph_traces_the_ops():
    def f(x):
        q, s, _ = qf.quantize_per_group(x, FP8, 16, transposed_scales=True)
        q2, s2, z2 = qf.quantize_per_token(x, INT8, symmetric=False)
        return qf.dequantize(q, s, group_size=16), qf.dequantize(q2, s2, z2)

    x = rand(5, 32, torch.float32)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x), f(x)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda x: qf.quantize_per_token(x.to(torch.int8), INT8), TypeError, "x: expected dtype"),
        (lambda x: qf.quantize_per_token(x, torch.float16), TypeError, "dtype: expected one of"),
        (lambda x: qf.quantize_per_token(x, FP8, symmetric=False), ValueError, "symmetric"),
        (lambda x: qf.quantize_per_token(x, INT8, scale_ub=torch.ones(2)), ValueError, "scale_ub: expected numel"),
        (lambda x: qf.quantize_per_token(x, INT8, scale_ub=torch.ones(1, dtype=torch.float16)), TypeError, "scale_ub"),
        (lambda x: qf.quantize_per_token(x.t(), INT8), ValueError, "contiguous last dimension"),
        (lambda x: qf.quantize_per_token(x[:, :0], INT8), ValueError, "non-empty"),
        (lambda x: qf.quantize_per_token([1.0], INT8), TypeError, "torch.Tensor"),
        (lambda x: qf.quantize_per_group(x, INT8, group_size=48), ValueError, "power of two"),
        (lambda x: qf.quantize_per_group(x, INT8, group_size=256), ValueError, "must divide"),
        (lambda x: qf.quantize_per_group(x, INT8, group_size=8), ValueError, "group_size"),
        (lambda x: qf.quantize_per_tensor(x, INT8, scale=torch.ones(2)), ValueError, "scale: expected numel"),
        (lambda x: qf.quantize_per_tensor(x, INT8, scale=torch.ones(1, dtype=torch.float64)), TypeError, "scale"),
        (lambda x: qf.quantize_per_tensor(x, FP8, torch.ones(1), torch.zeros(1, dtype=torch.int32)), ValueError, "azp"),
        (lambda x: qf.quantize_per_tensor(x, INT8, None, torch.zeros(1, dtype=torch.int32)), ValueError, "azp"),
        (lambda x: qf.quantize_per_tensor(x, INT8, torch.ones(1), torch.zeros(1)), TypeError, "azp"),
        (lambda x: qf.quantize_per_tensor(x, INT8, scale=torch.ones(1, device="meta")), ValueError, "device"),
        (lambda x: qf.dequantize(x, torch.ones(1)), TypeError, "q: expected dtype"),
        (lambda x: qf.dequantize(x.to(torch.int8), torch.ones(3)), ValueError, "scale: expected numel"),
        (lambda x: qf.dequantize(x.to(torch.int8), torch.ones(4, 3), group_size=32), ValueError, "scale: expected shape"),
        (lambda x: qf.dequantize(x.to(FP8), torch.ones(1), torch.zeros(1, dtype=torch.int32)), ValueError, "azp"),
        (lambda x: qf.dequantize(x.to(torch.int8), torch.ones(1), out_dtype=torch.int32), TypeError, "out_dtype"),
        (lambda x: qf.dequantize(x[:3, :0].to(torch.int8), torch.ones(3)), ValueError, "q: expected a non-empty"),
        (lambda x: qf.dequantize(x[:3, :0].to(torch.int8), torch.ones(1)), ValueError, "q: expected a non-empty"),
    ],
)
def test_bad_arguments_raise(triton_backend, call, exc, match):
    x = rand(4, 128, torch.float32)
    with pytest.raises(exc, match=match):
        call(x)
