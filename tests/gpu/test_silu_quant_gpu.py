"""Fused SiLU-and-mul + quantization on the GPU at full size (SPEC section 3).

Grid: tokens {1, 16, 256, 4096} x H {1024, 5120, 14336} x input {fp16, bf16}, plus fp32 cases.
- per group: every grid point, the mode (group 128 or a small group 16/64, fp8 or int8, row-major or
  transposed scales) rotating so that each of the 8 combinations runs at 3 grid points with 3 different
  token counts, 3 different H and both input types;
- per token (fp8/int8, with and without a scale_ub that bites on some rows) and per tensor static
  (fp8/int8): each (tokens, H) point once, with complementary input types, so the two together cover
  every grid point.
Why sampled rather than the full cross product: almost every (shape, mode, dtype) call is a distinct
Triton specialization (tile, divisibility hints, dtypes), and a compile costs about 0.3 to 1 s; the full
cross product would be several hundred compiles. This file holds about 80 (a minute or less on an H100
host, most of it compiling). QUANTFUSE_GPU_FULL_GRID=1 runs every mode at every grid point instead.

Stated bounds (against `quantfuse.reference`, run on the GPU). The kernels are designed to match it bit
for bit on the GPU (libdevice expf is torch's CUDA expf; true divisions; the fp8 cast is the hardware's),
and the bounds only leave room for an ulp moving a value across a rounding tie:
- scales: within 1e-5 relative;
- codes: equal, except one code step at rounding ties, at a mismatch rate below 1e-4 (SPEC section 0;
  the CPU tests allow 1e-3 because the interpreter evaluates exp with numpy). At the smallest shapes
  (T=1, H=1024) this means no mismatch at all.
Chained with the block-scaled GEMM (fp8, group 128, transposed scales) against the unquantized float32 MLP
down-projection: mean|out - want| / mean|want| < 0.05 (fp8-e4m3 on both operands gives about 0.035),
and against the reference GEMM on the same quantized operands < 1e-3 (the GEMM's own bound).
"""

import math
import os

import pytest
import torch

import quantfuse as qf
from quantfuse import reference as ref
from quantfuse.kernels import silu_quant as ksq
from tests._util import assert_codes_equal, codes

pytestmark = pytest.mark.gpu

INT8, FP8 = torch.int8, torch.float8_e4m3fn
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOKENS = [1, 16, 256, 4096]
HIDDEN = [1024, 5120, 14336]
TIE_RATE = 1e-4  # SPEC section 0: mismatch rate < 1e-4, never more than one code
SCALE_RTOL = 1e-5
FULL_GRID = os.environ.get("QUANTFUSE_GPU_FULL_GRID", "0") == "1"
_SHORT = {F16: "fp16", BF16: "bf16", F32: "fp32", FP8: "fp8", INT8: "int8"}


def rand_x(t, h, dtype, scale=3.0, row_spread=False):
    """[t, 2H] = [gate | up] made on the GPU; row_spread multiplies the rows by factors spread over
    [1/4, 4] so per-row scales differ (a scale_ub then bites on some rows and not on others)."""
    x = torch.randn(t, 2 * h, device="cuda") * scale
    if row_spread:
        x *= torch.logspace(-1, 1, t, base=4.0, device="cuda")[torch.randperm(t, device="cuda")].unsqueeze(1)
    return x.to(dtype)


def assert_close_outputs(got, want, tie_rate=TIE_RATE):
    assert_codes_equal(got[0], want[0], tie_rate=tie_rate)
    assert got[1].shape == want[1].shape, (got[1].shape, want[1].shape)
    torch.testing.assert_close(got[1], want[1], rtol=SCALE_RTOL, atol=0)


# ---------------------------------------------------------------------------------------------------
# The grid: per group, per token, per tensor static
# ---------------------------------------------------------------------------------------------------
GROUP_MODES = [  # (group_size, dtype, transposed_scales)
    (128, FP8, False), (128, FP8, True), (128, INT8, False), (128, INT8, True),
    (16, FP8, False), (64, FP8, True), (64, INT8, False), (16, INT8, True),
]


def _group_grid():
    cases = []
    for ti, t in enumerate(TOKENS):
        for hi, h in enumerate(HIDDEN):
            for di, d in enumerate((F16, BF16)):
                # (ti + 3 hi + 4 di) mod 8: each mode at 3 points, with 3 token counts, 3 H, both inputs
                modes = GROUP_MODES if FULL_GRID else [GROUP_MODES[(ti + 3 * hi + 4 * di) % 8]]
                cases += [(t, h, d, *mode) for mode in modes]
    cases.append((16, 5120, F32, 128, FP8, True))
    cases.append((4096, 1024, F32, 16, INT8, False))
    return [
        pytest.param(*c, id=f"t{c[0]}-h{c[1]}-{_SHORT[c[2]]}-g{c[3]}-{_SHORT[c[4]]}{'-T' if c[5] else ''}")
        for c in cases
    ]


@pytest.mark.parametrize("tokens,hidden,in_dtype,group,dtype,transposed", _group_grid())
def test_per_group(tokens, hidden, in_dtype, group, dtype, transposed):
    x = rand_x(tokens, hidden, in_dtype)
    got = qf.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
    want = ref.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
    assert got[0].shape == (tokens, hidden) and got[0].dtype == dtype
    assert got[1].shape == (tokens, hidden // group) and got[1].dtype == torch.float32
    assert (got[1].t() if transposed else got[1]).is_contiguous()
    assert_close_outputs(got, want)


TOKEN_MODES = [(FP8, False), (INT8, True), (INT8, False), (FP8, True)]  # (dtype, with scale_ub)


def _token_grid():
    # each (tokens, H) once; input type by token index (the static grid takes the other one);
    # mode (ti + hi) mod 4: each mode at 3 points with 3 token counts and 3 H
    cases = [
        (t, h, (F16, BF16)[ti % 2], *TOKEN_MODES[(ti + hi) % 4])
        for ti, t in enumerate(TOKENS)
        for hi, h in enumerate(HIDDEN)
    ]
    if FULL_GRID:
        cases = [(t, h, d, *mode) for t in TOKENS for h in HIDDEN for d in (F16, BF16) for mode in TOKEN_MODES]
    cases.append((256, 14336, F32, INT8, True))
    return [
        pytest.param(*c, id=f"t{c[0]}-h{c[1]}-{_SHORT[c[2]]}-{_SHORT[c[3]]}{'-ub' if c[4] else ''}") for c in cases
    ]


@pytest.mark.parametrize("tokens,hidden,in_dtype,dtype,with_ub", _token_grid())
def test_per_token(tokens, hidden, in_dtype, dtype, with_ub):
    x = rand_x(tokens, hidden, in_dtype, row_spread=True)
    ub = None
    if with_ub:
        # a little under the median row scale: bites on about half the rows (on the only row at T=1)
        ub = (ref.silu_and_mul_quant(x, dtype)[1].flatten().median() * 0.9).reshape(1)
    got = qf.silu_and_mul_quant(x, dtype, scale_ub=ub)
    want = ref.silu_and_mul_quant(x, dtype, scale_ub=ub)
    assert got[0].shape == (tokens, hidden) and got[0].dtype == dtype and got[1].shape == (tokens, 1)
    assert_close_outputs(got, want)
    if with_ub:
        assert (want[1] == ub).any() and (got[1] <= ub).all()
        if tokens > 1:
            assert (want[1] < ub).any()


def _static_grid():
    cases = [
        (t, h, (BF16, F16)[ti % 2], (FP8, INT8)[(ti + hi) % 2])
        for ti, t in enumerate(TOKENS)
        for hi, h in enumerate(HIDDEN)
    ]
    if FULL_GRID:
        cases = [(t, h, d, dtype) for t in TOKENS for h in HIDDEN for d in (F16, BF16) for dtype in (FP8, INT8)]
    cases.append((4096, 1024, F32, FP8))
    return [pytest.param(*c, id=f"t{c[0]}-h{c[1]}-{_SHORT[c[2]]}-{_SHORT[c[3]]}") for c in cases]


@pytest.mark.parametrize("tokens,hidden,in_dtype,dtype", _static_grid())
def test_per_tensor_static(tokens, hidden, in_dtype, dtype):
    x = rand_x(tokens, hidden, in_dtype)
    # 0.8 of the dynamic per-tensor scale: the largest values saturate
    scale = (ref.silu_and_mul(x).abs().amax() / ref.QMAX[dtype] * 0.8).reshape(1).float()
    q, s = qf.silu_and_mul_quant(x, dtype, scale=scale)
    assert s is scale and q.shape == (tokens, hidden) and q.dtype == dtype
    assert_codes_equal(q, ref.silu_and_mul_quant(x, dtype, scale=scale)[0], tie_rate=TIE_RATE)


@pytest.mark.parametrize("tokens,hidden", [(1, 14336), (4096, 14336)])
def test_per_token_other_path(tokens, hidden):
    """Each per-token strategy where the launch table would not pick it (the grid runs the picked one):
    on H100, 'single' for one token of H=14336 and 'split' for 4096 tokens."""
    path = "split" if ksq.per_token_path(torch.device("cuda"), tokens, hidden) == "single" else "single"
    x = rand_x(tokens, hidden, BF16, row_spread=True)
    for dtype in (FP8, INT8):
        got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
        assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype))


# ---------------------------------------------------------------------------------------------------
# Strided input, non-finite isolation, all-zero regions: one shape, T=256, H=5120, bf16, whose kernels
# these tests (and the CUDA-graph / torch.compile ones) share
# ---------------------------------------------------------------------------------------------------
T0, H0 = 256, 5120
SHARED_GROUP_MODES = [(128, FP8, False), (128, FP8, True), (16, INT8, False)]
SHARED_TOKEN_MODES = [("single", FP8), ("split", INT8)]  # both per-token kernels (path forced)
SHARED_STATIC_DTYPE = INT8


def test_padded_rows_and_leading_dims():
    base = rand_x(T0, H0 + 64, BF16)  # rows of 2H + 128 elements, the first 2H used
    x = base[:, : 2 * H0].reshape(2, T0 // 2, 2 * H0)
    assert not x.is_contiguous() and x.stride(-1) == 1
    for kw in (dict(group_size=128, transposed_scales=True), dict(group_size=16), {}):
        dtype = INT8 if kw.get("group_size") == 16 else FP8
        got = qf.silu_and_mul_quant(x, dtype, **kw)
        want = ref.silu_and_mul_quant(x.contiguous(), dtype, **kw)
        assert got[0].shape == (2, T0 // 2, H0) and got[0].is_contiguous()
        assert_close_outputs(got, want)


@pytest.mark.parametrize(
    "poison,where", [(float("nan"), "gate"), (float("nan"), "up"), (float("inf"), "gate"), (float("-inf"), "up")]
)
def test_non_finite_stays_in_its_region(poison, where):
    """A NaN/inf in one token changes only that token's scaled region: its group (per group), its row
    (per token, both paths), its element (static). Everything else equals the reference on clean input."""
    x = rand_x(T0, H0, BF16)
    row, col = 77, 300  # output column 300: group 2 of 128, group 18 of 16
    xcol = col if where == "gate" else H0 + col
    x[row, xcol] = poison
    clean = x.clone()
    clean[row, xcol] = 1.0
    others = torch.arange(T0, device="cuda") != row

    for group, dtype, transposed in SHARED_GROUP_MODES:
        got = qf.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
        want = ref.silu_and_mul_quant(clean, dtype, group_size=group, transposed_scales=transposed)
        assert_codes_equal(got[0][others], want[0][others], tie_rate=TIE_RATE)
        torch.testing.assert_close(got[1][others], want[1][others], rtol=SCALE_RTOL, atol=0)
        g = col // group
        keep_cols = torch.ones(H0, dtype=torch.bool, device="cuda")
        keep_cols[g * group : (g + 1) * group] = False
        assert_codes_equal(got[0][row, keep_cols], want[0][row, keep_cols], tie_rate=TIE_RATE)
        keep_groups = torch.arange(H0 // group, device="cuda") != g
        torch.testing.assert_close(got[1][row, keep_groups], want[1][row, keep_groups], rtol=SCALE_RTOL, atol=0)

    for path, dtype in SHARED_TOKEN_MODES:
        got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
        want = ref.silu_and_mul_quant(clean, dtype)
        assert_codes_equal(got[0][others], want[0][others], tie_rate=TIE_RATE)
        torch.testing.assert_close(got[1][others], want[1][others], rtol=SCALE_RTOL, atol=0)

    scale = torch.tensor([0.05], device="cuda")
    mask = torch.ones(T0, H0, dtype=torch.bool, device="cuda")
    mask[row, col] = False
    got = qf.silu_and_mul_quant(x, SHARED_STATIC_DTYPE, scale=scale)[0]
    want = ref.silu_and_mul_quant(clean, SHARED_STATIC_DTYPE, scale=scale)[0]
    assert_codes_equal(got[mask], want[mask], tie_rate=TIE_RATE)


def test_all_zero_regions():
    x = rand_x(T0, H0, BF16)
    x[3, H0:] = 0.0  # up = 0: a whole row of y is zero (+-0)
    x[5, 128:256] = 0.0  # gate = 0 over group 1 of 128 (groups 8..15 of 16)
    x[7] = 0.0  # a whole zero token
    zero_rows = [3, 7]
    for group, dtype, transposed in SHARED_GROUP_MODES:
        floor = ref.dynamic_scale(torch.zeros((), device="cuda"), dtype)  # 1e-10 / qmax, true division
        got = qf.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed)
        assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype, group_size=group, transposed_scales=transposed))
        s = got[1]
        assert torch.isfinite(s).all() and (s > 0).all()
        assert (s[zero_rows] == floor).all() and (s[5, 128 // group : 256 // group] == floor).all()
        assert got[0][zero_rows].float().eq(0).all() and got[0][5, 128:256].float().eq(0).all()
    for path, dtype in SHARED_TOKEN_MODES:
        floor = ref.dynamic_scale(torch.zeros((), device="cuda"), dtype)
        got = ksq.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
        assert_close_outputs(got, ref.silu_and_mul_quant(x, dtype))
        assert torch.isfinite(got[1]).all() and (got[1] > 0).all()
        assert (got[1][zero_rows] == floor).all()
        assert got[0][zero_rows].float().eq(0).all()
    q, _ = qf.silu_and_mul_quant(x, SHARED_STATIC_DTYPE, scale=torch.tensor([0.05], device="cuda"))
    assert q[zero_rows].float().eq(0).all() and q[5, 128:256].float().eq(0).all()


# ---------------------------------------------------------------------------------------------------
# CUDA graphs and torch.compile
# ---------------------------------------------------------------------------------------------------
def _modes(x, ub, static_scale):
    a = qf.silu_and_mul_quant(x, FP8, group_size=128, transposed_scales=True)
    b = qf.silu_and_mul_quant(x, INT8, group_size=16)
    c = qf.silu_and_mul_quant(x, FP8, scale_ub=ub)
    d = qf.silu_and_mul_quant(x, INT8, scale=static_scale)
    return a[0], a[1], b[0], b[1], c[0], c[1], d[0]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(codes(g) if g.dtype in (INT8, FP8) else g, codes(w) if w.dtype in (INT8, FP8) else w)


@pytest.mark.parametrize("tokens", [1, T0])  # T=1 takes the split per-token path (two kernels)
def test_cuda_graph_capture(tokens):
    ub = torch.tensor([0.02], device="cuda")
    static_scale = torch.tensor([0.03], device="cuda")
    x = rand_x(tokens, H0, BF16)
    _modes(x, ub, static_scale)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = _modes(x, ub, static_scale)
    x.copy_(rand_x(tokens, H0, BF16, scale=5.0))
    ub.fill_(0.05)
    g.replay()
    torch.cuda.synchronize()
    _assert_same(captured, _modes(x, ub, static_scale))
    # the replay read the new input and the new bound
    assert_close_outputs((captured[0], captured[1]), ref.silu_and_mul_quant(x, FP8, 128, transposed_scales=True))
    assert_close_outputs((captured[4], captured[5]), ref.silu_and_mul_quant(x, FP8, scale_ub=ub))


def test_torch_compile_fullgraph():
    ub = torch.tensor([0.02], device="cuda")
    static_scale = torch.tensor([0.03], device="cuda")
    x = rand_x(T0, H0, BF16)
    eager = _modes(x, ub, static_scale)
    compiled = torch.compile(_modes, fullgraph=True)(x, ub, static_scale)
    _assert_same(compiled, eager)
    assert compiled[1].t().is_contiguous()  # the transposed layout survives the fake implementation

    def dequantized(t):
        # the op's outputs consumed by traced code: shapes and strides come from the fake implementation
        q, s = qf.silu_and_mul_quant(t, FP8, group_size=128, transposed_scales=True)
        y = q.float().view(t.shape[0], -1, 128) * s.unsqueeze(-1)
        return y.view(t.shape[0], -1).to(torch.bfloat16)

    assert torch.equal(torch.compile(dequantized, fullgraph=True)(x), dequantized(x))


# ---------------------------------------------------------------------------------------------------
# Chained into the block-scaled GEMM: the MLP down-projection
# ---------------------------------------------------------------------------------------------------
def _blockwise_weight(w):
    """w [N, H] float32 -> (b [H, N]: fp8 transpose view of [N, H], scale_b [H/128, N/128]), 128x128 blocks."""
    n, h = w.shape
    amax = w.reshape(n // 128, 128, h // 128, 128).abs().amax(dim=(1, 3))  # [N/128, H/128]
    scale_b = ref.dynamic_scale(amax, FP8).t().contiguous()  # [H/128, N/128]
    full = scale_b.t().repeat_interleave(128, 0).repeat_interleave(128, 1)  # [N, H]
    return ref.quantize_values(w / full, FP8).t(), scale_b


@pytest.mark.parametrize("tokens,hidden,n", [(16, 5120, 1280), (256, 14336, 4096)])
def test_chained_into_blockwise_gemm(tokens, hidden, n):
    x = rand_x(tokens, hidden, BF16, scale=2.0)
    w_down = torch.randn(n, hidden, device="cuda") / math.sqrt(hidden)
    want = (ref.silu_and_mul(x).double() @ w_down.double().t()).float()  # the unquantized MLP, float32

    q, scales = qf.silu_and_mul_quant(x, FP8, group_size=128, transposed_scales=True)
    assert scales.t().is_contiguous()
    b, scale_b = _blockwise_weight(w_down)
    out = qf.scaled_mm_blockwise(q, b, scales, scale_b, torch.float32)
    assert out.shape == (tokens, n)

    same_operands = ref.scaled_mm_blockwise(q, b, scales, scale_b, torch.float32)
    gemm_err = float((out - same_operands).abs().mean() / same_operands.abs().mean())
    quant_err = float((out - want).abs().mean() / want.abs().mean())
    print(f"GEMM vs reference GEMM: {gemm_err:.3g}; vs unquantized fp32 MLP: {quant_err:.3g}")
    assert gemm_err < 1e-3
    assert quant_err < 0.05
