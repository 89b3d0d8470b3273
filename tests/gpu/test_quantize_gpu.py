"""Activation quantization on the GPU at full size, plus the interpreter twins against the hardware."""

import pytest
import torch
import triton
import triton.language as tl

import quantfuse as qf
from quantfuse import reference as ref
from quantfuse.kernels._common import _bf16_bits, fp8e4m3_twin, to_fp8e4m3
from tests._util import assert_codes_equal

pytestmark = pytest.mark.gpu

INT8, FP8 = torch.int8, torch.float8_e4m3fn
IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_outputs_equal(got, want):
    assert_codes_equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    if want[2] is not None:
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("tokens", [1, 7, 4096])
@pytest.mark.parametrize("hidden", [17, 1024, 1025, 5137, 8193])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_per_token_and_per_tensor_full_size(tokens, hidden, in_dtype):
    x = (torch.randn(tokens, hidden, device="cuda") * 4).to(in_dtype)
    for dtype, sym in [(INT8, True), (FP8, True), (INT8, False)]:
        assert_outputs_equal(qf.quantize_per_token(x, dtype, symmetric=sym), ref.quantize_per_token(x, dtype, symmetric=sym))
    for dtype in (INT8, FP8):
        assert_outputs_equal(qf.quantize_per_tensor(x, dtype), ref.quantize_per_tensor(x, dtype))
        s = torch.tensor([0.02], device="cuda")
        assert_codes_equal(qf.quantize_per_tensor(x, dtype, s)[0], ref.quantize_per_tensor(x, dtype, s)[0])
    # static asymmetric int8 (the int8_static model scheme with a zero point)
    s, z = torch.tensor([0.05], device="cuda"), torch.tensor([-7], dtype=torch.int32, device="cuda")
    got = qf.quantize_per_tensor(x, INT8, s, z)
    assert_codes_equal(got[0], ref.quantize_per_tensor(x, INT8, s, z)[0])
    assert torch.equal(got[1], s) and torch.equal(got[2], z)


@pytest.mark.parametrize("tokens", [1, 7, 4096])
@pytest.mark.parametrize("hidden,group", [(1024, 128), (5120, 128), (8192, 16), (8192, 512), (1536, 64)])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_per_group_full_size(tokens, hidden, group, in_dtype):
    x = (torch.randn(tokens, hidden, device="cuda") * 4).to(in_dtype)
    for dtype in (INT8, FP8):
        for transposed in (False, True):
            got = qf.quantize_per_group(x, dtype, group, transposed_scales=transposed)
            assert_outputs_equal(got, ref.quantize_per_group(x, dtype, group, transposed_scales=transposed))


def test_padded_rows_and_non_finite_on_gpu():
    base = (torch.randn(64, 1100, device="cuda") * 3).to(torch.bfloat16)
    x = base[:, :1024]
    for fn in (
        lambda t: qf.quantize_per_token(t, FP8),
        lambda t: qf.quantize_per_group(t, INT8, 128),
        lambda t: qf.quantize_per_token(t, INT8, symmetric=False),
    ):
        assert_outputs_equal(fn(x), fn(x.contiguous()))
    y = x.contiguous()
    y[5, 7] = float("nan")
    clean = y.clone()
    clean[5, 7] = 1.0
    got, want = qf.quantize_per_token(y, INT8), qf.quantize_per_token(clean, INT8)
    keep = torch.arange(64, device="cuda") != 5
    assert_codes_equal(got[0][keep], want[0][keep])
    assert torch.equal(got[1][keep], want[1][keep])


def test_dequantize_gpu():
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    q, s, _ = qf.quantize_per_group(x, FP8, 128, transposed_scales=True)
    assert torch.equal(qf.dequantize(q, s, group_size=128, out_dtype=torch.bfloat16), ref.dequantize(q, s, group_size=128, out_dtype=torch.bfloat16))
    q, s, z = qf.quantize_per_token(x, INT8, symmetric=False)
    assert torch.equal(qf.dequantize(q, s, z, out_dtype=torch.float16), ref.dequantize(q, s, z, out_dtype=torch.float16))


def test_cuda_graph_capture_and_torch_compile():
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)

    def f(t):
        a = qf.quantize_per_tensor(t, FP8)
        b = qf.quantize_per_token(t, INT8, symmetric=False)
        c = qf.quantize_per_group(t, FP8, 128, transposed_scales=True)
        return a[0], a[1], b[0], b[1], b[2], c[0], c[1]

    eager = f(x)
    f(x)  # compile kernels before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = f(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, f(x)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    compiled = torch.compile(f, fullgraph=True)
    for a, b in zip(compiled(x), f(x)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    del eager


@triton.jit
def _twins_kernel(x_ptr, hw_ptr, twin_ptr, bhw_ptr, btwin_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(hw_ptr + offs, to_fp8e4m3(x, False), mask=m)
    tl.store(twin_ptr + offs, fp8e4m3_twin(x), mask=m)
    tl.store(bhw_ptr + offs, x.to(tl.bfloat16), mask=m)
    tl.store(btwin_ptr + offs, _bf16_bits(x), mask=m)


def test_interpreter_twins_match_the_hardware_conversions():
    """The bit-level fp8/bf16 conversions the CPU tests rely on equal the GPU's own conversions."""
    g = torch.Generator(device="cuda").manual_seed(0)
    parts = [
        torch.randn(1 << 20, device="cuda", generator=g) * 100,
        torch.randn(1 << 20, device="cuda", generator=g) * 1e-3,  # fp8 subnormals
        (torch.randint(-900, 900, (1 << 16,), device="cuda", generator=g).float() / 2),  # ties
        torch.randint(0, 2**31 - 1, (1 << 20,), device="cuda", generator=g, dtype=torch.int32).view(torch.float32),
        torch.tensor([0.0, -0.0, 448.0, 464.0, -464.0, 1e30, float("inf"), -float("inf")], device="cuda"),
    ]
    x = torch.cat(parts)
    x = x[torch.isfinite(x) | torch.isinf(x)]  # NaN excluded: both sides may pick different NaN codes
    n = x.numel()
    hw, twin = torch.empty(n, dtype=FP8, device="cuda"), torch.empty(n, dtype=FP8, device="cuda")
    bhw, btwin = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    _twins_kernel[(triton.cdiv(n, 1024),)](x, hw, twin, bhw, btwin, n, BLOCK=1024)
    assert torch.equal(hw.view(torch.uint8), twin.view(torch.uint8))
    assert torch.equal(bhw.view(torch.int16), btwin.view(torch.int16))
    # and both equal torch's own conversion (the reference's)
    assert torch.equal(hw.view(torch.uint8), x.clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(bhw.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
