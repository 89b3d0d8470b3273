"""Scaled matmul with fused epilogues (SPEC section 2): the Triton kernels under the interpreter against
the reference and against an independent int64 computation; odd shapes, split-K, strided operands,
block-scaled fp8, non-finite isolation, bad arguments and the fake (torch.compile) implementations."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import quantfuse as qf
from quantfuse import reference as ref
from quantfuse.kernels import scaled_mm as kmm
from tests._util import KernelSpy

INT8, FP8 = torch.int8, torch.float8_e4m3fn
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPILOGUES = ["plain", "azp_tensor", "azp_token"]


def _cfg(split_k=0, block_m=16, block_n=32, block_k=32, group_m=2):
    """Small tiles (as under the interpreter), optionally with a forced split of K (0 = automatic)."""
    return kmm.MMConfig(block_m, block_n, block_k, 4, 1, group_m=group_m, split_k=split_k)


# ---------------------------------------------------------------------------------------------------
# Inputs and the independent references
# ---------------------------------------------------------------------------------------------------
def rand_q(shape, dtype):
    """Fresh random int8 / fp8 codes (never all zero)."""
    if dtype == INT8:
        return torch.randint(-128, 128, shape, dtype=torch.int8)
    return (torch.randn(shape) * 4).to(FP8)


def make_b(k, n, dtype, layout="t"):
    """b [K, N] in a given memory layout: `t` = transpose of a row-major [N, K] weight, `row` = row-major
    [K, N], `row_padded` = row-major with a row stride > N, `strided` = every other column."""
    if layout == "t":
        b = rand_q((n, k), dtype).t()
    elif layout == "row":
        b = rand_q((k, n), dtype)
    elif layout == "row_padded":
        b = rand_q((k, n + 5), dtype)[:, 2:n + 2]
    elif layout == "strided":
        b = rand_q((k, 2 * n), dtype)[:, ::2]
    else:
        raise AssertionError(layout)
    assert b.shape == (k, n)
    return b


def rand_scale(numel, shape=None):
    s = torch.rand(numel) * 0.02 + 0.002
    return s.reshape(shape) if shape is not None else s


def make_epilogue(kind, a, b):
    """(azp_adj, azp) for an epilogue kind, plus the int64 correction [M, N] computed independently."""
    m, n = a.reshape(-1, a.shape[-1]).shape[0], b.shape[1]
    colsum = b.to(torch.int64).sum(dim=0)  # independent of quantfuse
    if kind == "plain":
        return None, None, torch.zeros(m, n, dtype=torch.int64)
    if kind == "azp_tensor":
        z = torch.randint(-128, 128, (1,), dtype=torch.int32)
        azp_adj = qf.azp_adjustment(b, z)
        assert torch.equal(azp_adj.to(torch.int64), z.to(torch.int64) * colsum)
        return azp_adj, None, (z.to(torch.int64) * colsum).reshape(1, n).expand(m, n)
    if kind == "azp_token":
        azp = torch.randint(-128, 128, (m,), dtype=torch.int32)
        azp_adj = qf.azp_adjustment(b)
        assert torch.equal(azp_adj.to(torch.int64), colsum)
        return azp_adj, azp, azp.to(torch.int64).reshape(m, 1) * colsum.reshape(1, n)
    raise AssertionError(kind)


def int64_result(a, b, corr):
    """a_q @ b_q - corr in int64 (torch int64 matmul), independent of the reference module."""
    rows = a.reshape(-1, a.shape[-1]).to(torch.int64)
    return rows @ b.to(torch.int64) - corr


def assert_mm_close(got, want, out_dtype, is_fp8):
    """The kernel against the reference on the same quantized inputs: one final rounding each, so one
    ulp of out_dtype; fp8 accumulates in float32 in another order, hence a small absolute slack."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype == out_dtype
    assert torch.isfinite(got).all()
    rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[out_dtype]
    scale = float(want.float().abs().max()) + 1e-30
    atol = (1e-5 if is_fp8 else 1e-6) * scale
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def run_mm(a, b, scale_a, scale_b, out_dtype=torch.float32, bias=None, azp_adj=None, azp=None):
    return qf.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=bias, azp_adj=azp_adj, azp=azp)


# ---------------------------------------------------------------------------------------------------
# Every epilogue x dtype x scale granularity x bias x out dtype
# ---------------------------------------------------------------------------------------------------
MATRIX_CASES = [(INT8, e) for e in EPILOGUES] + [(FP8, "plain")]


@pytest.mark.parametrize("dtype,epilogue", MATRIX_CASES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_epilogue_matrix(triton_backend, dtype, epilogue, per_token, per_channel, with_bias, out_dtype):
    m, n, k = 19, 40, 70  # tails in M, N and K for 16x32x32 tiles
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, "t")
    scale_a = rand_scale(m, (m, 1)) if per_token else rand_scale(1, ())
    scale_b = rand_scale(n, (1, n)) if per_channel else rand_scale(1, (1,))
    bias = (torch.randn(n) * 3).to(out_dtype) if with_bias else None
    azp_adj, azp, _ = make_epilogue(epilogue, a, b)
    got = run_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)
    want = ref.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)
    assert_mm_close(got, want, out_dtype, dtype == FP8)
    if dtype == INT8 and epilogue != "plain":
        # the correction really is applied (a kernel ignoring it would differ)
        plain = ref.scaled_mm(a, b, scale_a, scale_b, torch.float32, bias)
        assert not torch.allclose(got.float(), plain, rtol=1e-2, atol=0)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_dtype_independent_of_out_dtype(triton_backend, bias_dtype):
    m, n, k = 5, 33, 40
    a, b = rand_q((m, k), FP8), make_b(k, n, FP8, "row")
    sa, sb = rand_scale(m, (m, 1)), rand_scale(n)
    bias = torch.randn(n).to(bias_dtype)
    for out_dtype in OUT_DTYPES:
        got = run_mm(a, b, sa, sb, out_dtype, bias)
        assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, out_dtype, bias), out_dtype, True)


# ---------------------------------------------------------------------------------------------------
# Exact int32 arithmetic: unit scales, fp32 out, int8 == int64 reference (zero points included)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(1, 3, 1), (7, 17, 17), (33, 17, 100), (2, 17, 3884)])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("layout", ["t", "row"])
def test_int8_exact_against_int64(triton_backend, m, n, k, epilogue, layout):
    a = rand_q((m, k), INT8)
    b = make_b(k, n, INT8, layout)
    azp_adj, azp, corr = make_epilogue(epilogue, a, b)
    got = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, azp_adj, azp)
    want = int64_result(a, b, corr)
    assert want.abs().max() < 2**24  # every value is an exact float32 integer
    assert torch.equal(got, want.to(torch.float32))
    # unit per-token / per-channel scales too
    got = run_mm(a, b, torch.ones(m, 1), torch.ones(n), torch.float32, None, azp_adj, azp)
    assert torch.equal(got, want.to(torch.float32))


@pytest.mark.parametrize("sign", [1, -1])
def test_int8_exact_extreme_codes(triton_backend, sign):
    # |acc| = 128 * 128 * K = 2^14 * 3884 ~ 6.4e7: beyond float32's 2^24, so exactness needs the int32 acc
    m, n, k = 2, 17, 3884
    a = torch.full((m, k), -128, dtype=INT8)
    b = torch.full((k, n), -128 if sign > 0 else 127, dtype=INT8)
    a[1, ::3] = 127  # row 1 not constant
    b[5, :] = 1
    want = int64_result(a, b, torch.zeros(m, n, dtype=torch.int64))
    got = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32)
    assert torch.equal(got, want.to(torch.float32))
    # through the zero-point path: corr = azp[i] * colsum(b) brings the values back under 2^24
    azp = torch.tensor([-128, 3], dtype=torch.int32)
    adj = qf.azp_adjustment(b)
    want = int64_result(a, b, azp.to(torch.int64).reshape(m, 1) * b.to(torch.int64).sum(0).reshape(1, n))
    got = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, adj, azp)
    assert torch.equal(got, want.to(torch.float32))


# ---------------------------------------------------------------------------------------------------
# Odd shapes (no alignment demands)
# ---------------------------------------------------------------------------------------------------
ODD_SHAPES = [(1, 3, 1), (7, 17, 1), (17, 3, 17), (33, 17, 17), (1, 971, 17), (2, 971, 1), (1, 3, 3884), (2, 17, 3884)]


@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_odd_shapes(triton_backend, m, n, k, dtype):
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, "t")
    sa, sb = rand_scale(m, (m, 1)), rand_scale(n)
    bias = torch.randn(n)
    azp_adj, azp, corr = make_epilogue("azp_token" if dtype == INT8 else "plain", a, b)
    got = run_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp)
    assert got.shape == (m, n)
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp), torch.float32, dtype == FP8)
    if dtype == INT8:
        exact = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, azp_adj, azp)
        assert torch.equal(exact, int64_result(a, b, corr).to(torch.float32))


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("split_k", [1, 4])
def test_large_n_and_k_through_launcher(dtype, split_k):
    # M=1, N=971, K=3884 with larger tiles (as the GPU tables use) keeps the interpreter fast
    m, n, k = 1, 971, 3884
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, "t")
    cfg = _cfg(split_k=split_k, block_n=128, block_k=256, group_m=8)
    if dtype == INT8:
        adj = qf.azp_adjustment(b)
        azp = torch.tensor([-37], dtype=torch.int32)
        got = kmm.scaled_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, adj, azp, config=cfg)
        want = int64_result(a, b, -37 * b.to(torch.int64).sum(0).reshape(1, n))
        assert torch.equal(got, want.to(torch.float32))
    sa, sb, bias = rand_scale(1), rand_scale(n), torch.randn(n)
    got = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, config=cfg)
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, torch.bfloat16, bias), torch.bfloat16, dtype == FP8)


# ---------------------------------------------------------------------------------------------------
# Split-K: the workspace + reduction path
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def reduce_calls(monkeypatch):
    """Count launches of the split-K reduction (proves the split path ran)."""
    calls = []
    real = kmm._launch_reduce

    def spy(ws, out, *args):
        calls.append(ws.shape[0])
        return real(ws, out, *args)

    monkeypatch.setattr(kmm, "_launch_reduce", spy)
    return calls


@pytest.mark.parametrize("split_k,k,expect_split", [(2, 300, 2), (3, 300, 3), (7, 300, 5), (16, 97, 4), (5, 64, 2)])
@pytest.mark.parametrize("dtype,epilogue", [(INT8, "plain"), (INT8, "azp_tensor"), (INT8, "azp_token"), (FP8, "plain")])
def test_split_k_forced(reduce_calls, split_k, k, expect_split, dtype, epilogue):
    m, n = 5, 45
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, "t")
    azp_adj, azp, corr = make_epilogue(epilogue, a, b)
    sa, sb, bias = rand_scale(m, (m, 1)), rand_scale(1), torch.randn(n)
    cfg = _cfg(split_k=split_k)
    got = kmm.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp, config=cfg)
    assert reduce_calls == [expect_split]
    want = ref.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp)
    assert_mm_close(got, want, torch.float32, dtype == FP8)
    # and it agrees with the unsplit launch
    unsplit = kmm.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp, config=_cfg(split_k=1))
    assert_mm_close(got, unsplit, torch.float32, dtype == FP8)
    if dtype == INT8:
        # int32 partial sums: the split result is exact, and equal to the unsplit one bit for bit
        assert torch.equal(got, unsplit)
        exact = kmm.scaled_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, azp_adj, azp, config=cfg)
        assert torch.equal(exact, int64_result(a, b, corr).to(torch.float32))


@pytest.mark.parametrize("tma,persistent,split_k", [(True, 0, 1), (False, 2, 1), (True, 2, 1), (True, 2, 3)],
                         ids=["tma", "persistent", "tma_persistent", "tma_split"])
@pytest.mark.parametrize("m,n,k", [(1, 45, 64), (37, 70, 112), (70, 100, 48)])
@pytest.mark.parametrize("dtype,epilogue", [(INT8, "plain"), (INT8, "azp_token"), (FP8, "plain")])
def test_tma_and_persistent_variants(tma, persistent, split_k, m, n, k, dtype, epilogue, monkeypatch):
    """Tensor-descriptor operands (zero fill past M, N and K instead of wrapped rows and K masks) and the
    persistent grid (2 programs per SM: 8 under the interpreter, fewer than the tiles of the larger cases;
    ignored when K is split): exact int8 against int64, fp8 against the reference."""
    spy = KernelSpy(kmm._scaled_mm_kernel)
    monkeypatch.setattr(kmm, "_scaled_mm_kernel", spy)
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, "t")
    azp_adj, azp, corr = make_epilogue(epilogue, a, b)
    sa, sb, bias = rand_scale(m, (m, 1)), rand_scale(n, (1, n)), torch.randn(n)
    cfg = kmm.MMConfig(16, 32, 32, 4, 1, group_m=2, split_k=split_k, tma=tma, persistent=persistent)
    got = kmm.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp, config=cfg)
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp), torch.float32, dtype == FP8)
    call = spy.calls[0]
    assert call["TMA"] == tma and call["PERSISTENT"] == (persistent > 0 and call["grid"][1] == 1)
    if dtype == INT8:
        exact = kmm.scaled_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, azp_adj, azp, config=cfg)
        assert torch.equal(exact, int64_result(a, b, corr).to(torch.float32))



def test_split_k_reduce_launches_early_where_the_table_says(monkeypatch):
    # sm90: the rowwise split-K kernel signals its dependents at its start and the reduce kernel is launched with
    # programmatic dependent launch; elsewhere (and under the interpreter) neither
    launches = []
    real = kmm.launch_kernel
    monkeypatch.setattr(kmm, "launch_kernel", lambda fn, grid, *a, **kw: (launches.append((fn, kw)),
                                                                           real(fn, grid, *a, **kw)))
    a, b = rand_q((3, 256), INT8), make_b(256, 40, INT8, "t")
    cfg = kmm.MMConfig(16, 32, 32, 4, 1, group_m=2, split_k=3)
    kmm.scaled_mm(a, b, torch.ones(1), torch.ones(1), torch.float32, None, None, None, config=cfg)
    (mm, mm_kw), (red, red_kw) = launches
    assert mm is kmm._scaled_mm_kernel and red is kmm._split_k_reduce_kernel
    assert mm_kw["PDL"] is False and red_kw["PDL"] is False and "launch_pdl" not in red_kw
    # the rule (configs.split_k_reduce_pdl, shared with weight_only's reduce): sm90 with grid dependency control
    from quantfuse.kernels import configs

    cpu = torch.device("cpu")
    assert configs.split_k_reduce_pdl(cpu) is False
    monkeypatch.setattr(configs, "arch_key", lambda *args: "sm90")
    monkeypatch.setattr(configs, "pdl_supported", lambda: True)
    assert configs.split_k_reduce_pdl(cpu) is True
    monkeypatch.setattr(configs, "arch_key", lambda *args: "default")
    assert configs.split_k_reduce_pdl(cpu) is False


def test_tma_needs_k_major_aligned_operands(monkeypatch):
    # row-major b [K, N] (N-contiguous), a row stride or a base address off 16 bytes: pointer loads, and the
    # table's TMA candidates are skipped for them
    a = rand_q((5, 64), INT8)
    b = make_b(64, 32, INT8, "t")
    assert kmm.tma_applies(a, b)
    assert not kmm.tma_applies(a, make_b(64, 32, INT8, "row"))
    b60 = rand_q((32, 64), INT8)[:, :60].t()  # K = 60, rows of b^T 64 apart: describable
    assert kmm.tma_applies(rand_q((5, 64), INT8)[:, :60], b60)
    assert not kmm.tma_applies(rand_q((5, 72), INT8)[:, :60], b60)
    assert not kmm.tma_applies(rand_q((5 * 64 + 1,), INT8)[1:].view(5, 64), b)
    monkeypatch.setattr(kmm, "arch_key", lambda *args: "sm90")
    monkeypatch.setattr(kmm, "_autotune_enabled", lambda: False)
    dev = torch.device("cuda")
    assert kmm._pick_config(kmm.CONFIGS, 1, 4096, 4096, dev, None, None).tma
    fallback = kmm._pick_config(kmm.CONFIGS, 1, 4096, 4096, dev, None, None, tma_ok=False)
    assert not fallback.tma and fallback.block_n == 64  # the pointer-load row measured before


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_split_k_half_outputs(reduce_calls, out_dtype):
    m, n, k = 3, 50, 200
    a, b = rand_q((m, k), INT8), make_b(k, n, INT8, "row")
    sa, sb, bias = rand_scale(1), rand_scale(n), torch.randn(n).to(out_dtype)
    got = kmm.scaled_mm(a, b, sa, sb, out_dtype, bias, None, None, config=_cfg(split_k=3))
    assert reduce_calls == [3]
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, out_dtype, bias), out_dtype, False)


def test_split_k_chosen_automatically_for_decode(triton_backend, reduce_calls):
    m, n, k = 2, 17, 3884
    split = kmm.choose_split_k(m, n, k, kmm._INTERPRET_CONFIG, torch.device("cpu"))
    assert split > 1
    a, b = rand_q((m, k), FP8), make_b(k, n, FP8, "t")
    sa, sb = rand_scale(m), rand_scale(n)
    got = run_mm(a, b, sa, sb, torch.float32)
    assert len(reduce_calls) == 1 and reduce_calls[0] > 1
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, torch.float32), torch.float32, True)


# ---------------------------------------------------------------------------------------------------
# Strided operands: padded rows of a, leading dims, any strides of b
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("k", [1, 70])
def test_padded_rows_of_a(triton_backend, dtype, k):
    m, n = 9, 20
    base = rand_q((m, k + 13), dtype)
    a = base[:, 3:3 + k]
    assert a.stride(0) == k + 13 and not a.is_contiguous()
    b = make_b(k, n, dtype, "t")
    sa, sb, bias = rand_scale(m), rand_scale(n), torch.randn(n)
    azp_adj, azp, _ = make_epilogue("azp_token" if dtype == INT8 else "plain", a, b)
    got = run_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp)
    contiguous = run_mm(a.contiguous(), b, sa, sb, torch.float32, bias, azp_adj, azp)
    assert torch.equal(got, contiguous)
    assert_mm_close(got, ref.scaled_mm(a.contiguous(), b, sa, sb, torch.float32, bias, azp_adj, azp), torch.float32, dtype == FP8)


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("how", ["contiguous", "padded", "permuted"])
def test_leading_dims_of_a(triton_backend, dtype, how):
    k, n = 40, 24
    if how == "contiguous":
        a = rand_q((2, 5, k), dtype)
    elif how == "padded":
        a = rand_q((10, k + 8), dtype)[:, :k].reshape(2, 5, k)
        assert not a.is_contiguous()
    else:  # leading dims that do not collapse into one row stride
        a = rand_q((5, 2, k), dtype).transpose(0, 1)
    assert a.shape == (2, 5, k)
    b = make_b(k, n, dtype, "t")
    sa = rand_scale(10, (2, 5, 1))
    sb, bias = rand_scale(n), torch.randn(n)
    got = run_mm(a, b, sa, sb, torch.bfloat16, bias)
    assert got.shape == (2, 5, n)
    flat = run_mm(a.contiguous().reshape(10, k), b, sa.reshape(10), sb, torch.bfloat16, bias)
    assert torch.equal(got.reshape(10, n), flat)
    assert_mm_close(got, ref.scaled_mm(a.contiguous(), b, sa, sb, torch.bfloat16, bias), torch.bfloat16, dtype == FP8)


def test_one_dim_a(triton_backend):
    k, n = 33, 10
    a, b = rand_q((k,), INT8), make_b(k, n, INT8, "row")
    got = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32)
    assert got.shape == (n,)
    assert torch.equal(got, (a.to(torch.int64) @ b.to(torch.int64)).float())


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("layout", ["t", "row", "row_padded", "strided"])
def test_b_strides(triton_backend, dtype, layout):
    m, n, k = 6, 37, 45
    a = rand_q((m, k), dtype)
    b = make_b(k, n, dtype, layout)
    sa, sb, bias = rand_scale(m), rand_scale(n), torch.randn(n)
    got = run_mm(a, b, sa, sb, torch.float32, bias)
    contiguous = run_mm(a, b.contiguous(), sa, sb, torch.float32, bias)
    assert torch.equal(got, contiguous)
    assert_mm_close(got, ref.scaled_mm(a, b, sa, sb, torch.float32, bias), torch.float32, dtype == FP8)
    if dtype == INT8:
        exact = run_mm(a, b, torch.ones(1), torch.ones(1), torch.float32)
        assert torch.equal(exact, int64_result(a, b, 0).float())


# ---------------------------------------------------------------------------------------------------
# Block-scaled fp8
# ---------------------------------------------------------------------------------------------------
def blockwise_inputs(m, k, n, scale_layout, b_layout="t"):
    kb, nb = -(-k // 128), -(-n // 128)
    a = rand_q((m, k), FP8)
    b = make_b(k, n, FP8, b_layout)
    if scale_layout == "row":
        scale_a = torch.rand(m, kb) * 0.02 + 0.002
    else:  # the transposed view of a contiguous [ceil(K/128), M] (quantize_per_group(..., transposed_scales=True))
        scale_a = (torch.rand(kb, m) * 0.02 + 0.002).t()
        assert scale_a.stride() == (1, m)
    scale_b = torch.rand(kb, nb) * 0.02 + 0.002
    return a, b, scale_a, scale_b


def rel_mean_err(got, want):
    return float((got.float() - want.float()).abs().mean() / want.float().abs().mean())


@pytest.mark.parametrize("m,k,n", [(5, 300, 200), (1, 300, 200), (17, 129, 130), (3, 1, 5), (2, 256, 128)])
@pytest.mark.parametrize("scale_layout", ["row", "transposed"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blockwise(triton_backend, m, k, n, scale_layout, with_bias):
    a, b, sa, sb = blockwise_inputs(m, k, n, scale_layout)
    bias = torch.randn(n) * 0.1 if with_bias else None
    for out_dtype in (torch.float32, torch.bfloat16) if with_bias else (torch.float32,):
        got = qf.scaled_mm_blockwise(a, b, sa, sb, out_dtype, bias)
        want = ref.scaled_mm_blockwise(a, b, sa, sb, out_dtype, bias)
        assert got.shape == (m, n) and got.dtype == out_dtype
        err = rel_mean_err(got, want)
        assert err < (1e-6 if out_dtype == torch.float32 else 1e-3), err
        assert_mm_close(got, want, out_dtype, True)
        if out_dtype == torch.float32:
            got32, err32 = got, float((got - want).abs().max())
    # every block scale is used where it belongs: moving any one of them moves the reference by far more
    # than the kernel's distance from it
    for which, idx in [("a", (slice(None), -1)), ("b", (-1, slice(None))), ("b", (slice(None), -1))]:
        sa2, sb2 = sa.clone(), sb.clone()
        (sa2 if which == "a" else sb2)[idx] *= 1.5
        moved = ref.scaled_mm_blockwise(a, b, sa2, sb2, torch.float32, bias)
        assert float((moved - got32).abs().max()) > 100 * err32 + 1e-6, which


@pytest.mark.parametrize("split_k,block_k", [(2, 32), (3, 32), (4, 64), (2, 128)])
@pytest.mark.parametrize("scale_layout", ["row", "transposed"])
def test_blockwise_split_k_and_tiles(reduce_calls, split_k, block_k, scale_layout):
    m, k, n = 6, 300, 200
    a, b, sa, sb = blockwise_inputs(m, k, n, scale_layout, b_layout="row")
    bias = torch.randn(n) * 0.1
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, config=_cfg(split_k=split_k, block_k=block_k))
    assert len(reduce_calls) == 1 and reduce_calls[0] > 1
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert rel_mean_err(got, want) < 1e-6
    assert_mm_close(got, want, torch.float32, True)


def test_blockwise_leading_dims_and_padded_rows(triton_backend):
    k, n = 300, 200
    a = rand_q((6, k + 20), FP8)[:, :k].reshape(2, 3, k)
    b = make_b(k, n, FP8, "t")
    sa = torch.rand(6, 3) * 0.02 + 0.002
    sb = torch.rand(3, 2) * 0.02 + 0.002
    got = qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32)
    assert got.shape == (2, 3, n)
    want = ref.scaled_mm_blockwise(a.contiguous(), b, sa, sb, torch.float32)
    assert rel_mean_err(got, want) < 1e-6
    assert torch.equal(got.reshape(6, n), qf.scaled_mm_blockwise(a.contiguous().reshape(6, k), b, sa, sb, torch.float32))


# ---------------------------------------------------------------------------------------------------
# Non-finite values stay in their row / column
# ---------------------------------------------------------------------------------------------------
FP8_NAN = 0x7F


def _poison_row(a, row, col):
    a = a.clone()
    a.view(torch.uint8)[row, col] = FP8_NAN
    assert torch.isnan(a[row, col].float())
    clean = a.clone()
    clean.view(torch.uint8)[row, col] = 0x38  # 1.0
    return a, clean


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("row", [0, 6])
def test_nan_in_a_row_only_affects_that_row(split_k, row):
    m, n, k = 7, 40, 200
    a, clean = _poison_row(rand_q((m, k), FP8), row, 37)
    b = make_b(k, n, FP8, "t")
    sa, sb, bias = rand_scale(m), rand_scale(n), torch.randn(n)
    got = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, config=_cfg(split_k=split_k))
    want = ref.scaled_mm(clean, b, sa, sb, torch.bfloat16, bias)
    others = [i for i in range(m) if i != row]
    assert torch.isnan(got[row]).all()
    assert_mm_close(got[others], want[others], torch.bfloat16, True)


def test_nan_in_b_column_only_affects_that_column(triton_backend):
    m, n, k = 20, 40, 50
    a = rand_q((m, k), FP8)
    w = rand_q((n, k), FP8)
    w.view(torch.uint8)[11, 7] = FP8_NAN
    b = w.t()
    sa, sb = rand_scale(m), rand_scale(1)
    got = run_mm(a, b, sa, sb, torch.float32)
    assert torch.isnan(got[:, 11]).all()
    keep = [j for j in range(n) if j != 11]
    want = ref.scaled_mm(a, b, sa, sb, torch.float32)
    assert_mm_close(got[:, keep], want[:, keep], torch.float32, True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_inf_scale_of_one_token_only_affects_that_row(triton_backend, dtype):
    m, n, k = 9, 30, 40
    a, b = rand_q((m, k), dtype), make_b(k, n, dtype, "t")
    sa, sb = rand_scale(m), rand_scale(n)
    sa_bad = sa.clone()
    sa_bad[4] = float("inf")
    got = run_mm(a, b, sa_bad, sb, torch.float32)
    assert not torch.isfinite(got[4]).any()
    others = [i for i in range(m) if i != 4]
    assert_mm_close(got[others], ref.scaled_mm(a, b, sa, sb, torch.float32)[others], torch.float32, dtype == FP8)


@pytest.mark.parametrize("split_k", [1, 2])
def test_blockwise_nan_row_isolated(split_k):
    m, k, n = 5, 300, 200
    a, b, sa, sb = blockwise_inputs(m, k, n, "transposed")
    a, clean = _poison_row(a, 2, 250)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, config=_cfg(split_k=split_k))
    want = ref.scaled_mm_blockwise(clean, b, sa, sb, torch.float32)
    assert torch.isnan(got[2]).all()
    others = [0, 1, 3, 4]
    assert rel_mean_err(got[others], want[others]) < 1e-6


# ---------------------------------------------------------------------------------------------------
# Bad arguments: clear errors naming the argument, before any launch
# ---------------------------------------------------------------------------------------------------
M_, K_, N_ = 4, 64, 6


def _args(dtype=INT8):
    a = rand_q((M_, K_), dtype)
    b = make_b(K_, N_, dtype, "t")
    return a, b, torch.ones(1), torch.ones(1)


def _blockwise_args():
    a, b = rand_q((M_, K_), FP8), make_b(K_, N_, FP8, "t")
    return a, b, torch.ones(M_, 1), torch.ones(1, 1)


BAD_MM = [
    (lambda a, b, sa, sb: qf.scaled_mm(a.float(), b, sa, sb), TypeError, ["a", "float32"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a.to(torch.int32), b.to(torch.int32), sa, sb), TypeError, ["a", "int32"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b.to(torch.int32), sa, sb), TypeError, ["b", "int32"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b.to(FP8), sa, sb), TypeError, ["b", "dtype of a"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), sa, sb), TypeError, ["a", "float8_e5m2"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b[:-1], sa, sb), ValueError, ["b", "K"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a[:, :0], b[:0], sa, sb), ValueError, ["a", "K"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b.reshape(1, K_, N_), sa, sb), ValueError, ["b", "2-D"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a.t(), b, sa, sb), ValueError, ["a", "contiguous"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, torch.ones(3), sb), ValueError, ["scale_a", "numel"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, torch.ones(N_), sb), ValueError, ["scale_a", "numel"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, torch.ones(M_)), ValueError, ["scale_b", "numel"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa.double(), sb), TypeError, ["scale_a", "float64"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb.half()), TypeError, ["scale_b", "float16"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, torch.int8), TypeError, ["out_dtype", "int8"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, torch.float64), TypeError, ["out_dtype", "float64"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, bias=torch.ones(N_ + 1)), ValueError, ["bias", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, bias=torch.ones(1, N_)), ValueError, ["bias", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, bias=torch.ones(N_, dtype=torch.int32)), TypeError, ["bias", "int32"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, azp=torch.zeros(M_, dtype=torch.int32)), ValueError, ["azp", "azp_adj"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a.to(FP8), b.to(FP8), sa, sb, azp_adj=torch.zeros(N_, dtype=torch.int32)), ValueError, ["azp_adj", "int8"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, azp_adj=torch.zeros(N_, dtype=torch.int64)), TypeError, ["azp_adj", "int64"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, azp_adj=torch.zeros(N_ + 2, dtype=torch.int32)), ValueError, ["azp_adj", "numel"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, azp_adj=torch.zeros(N_, dtype=torch.int32), azp=torch.zeros(M_ + 1, dtype=torch.int32)), ValueError, ["azp", "numel"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, sb, azp_adj=torch.zeros(N_, dtype=torch.int32), azp=torch.zeros(M_, dtype=torch.int8)), TypeError, ["azp", "int8"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a.numpy(), b, sa, sb), TypeError, ["a", "Tensor"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, sa, torch.ones(1, device="meta")), ValueError, ["scale_b", "device"]),
    (lambda a, b, sa, sb: qf.scaled_mm(a, b, torch.ones(1, device="meta"), sb), ValueError,
     ["scale_a", "the device of a)"]),
]

BAD_BLOCKWISE = [
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a.view(torch.int8), b.view(torch.int8), sa, sb), TypeError, ["a", "int8"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b.view(torch.int8), sa, sb), TypeError, ["b", "int8"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b[:-1], sa, sb), ValueError, ["b", "K"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa.reshape(-1), sb), ValueError, ["scale_a", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, torch.ones(M_, 2), sb), ValueError, ["scale_a", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, torch.ones(1, M_), sb), ValueError, ["scale_a", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa.double(), sb), TypeError, ["scale_a", "float64"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, torch.ones(1)), ValueError, ["scale_b", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, torch.ones(1, 2)), ValueError, ["scale_b", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb.half()), TypeError, ["scale_b", "float16"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb, block=(1, 128)), ValueError, ["block"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb, block=(128, 64)), ValueError, ["block"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb, block=128), ValueError, ["block", "(128, 128)"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb, torch.int8), TypeError, ["out_dtype"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a, b, sa, sb, bias=torch.ones(N_ - 1)), ValueError, ["bias", "shape"]),
    (lambda a, b, sa, sb: qf.scaled_mm_blockwise(a.t(), b, sa, sb), ValueError, ["a"]),
]


@pytest.fixture
def no_launch(monkeypatch, triton_backend):
    """Any kernel launch (or reference fallback) fails the test: errors must come from validation."""

    def boom(*args, **kwargs):
        raise AssertionError("launched before the arguments were validated")

    for name in ("scaled_mm", "scaled_mm_blockwise", "_launch_reduce"):
        monkeypatch.setattr(kmm, name, boom)
    monkeypatch.setattr(ref, "scaled_mm", boom)
    monkeypatch.setattr(ref, "scaled_mm_blockwise", boom)


def _check_raises(call, args, exc, words):
    with pytest.raises(exc) as info:
        call(*args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert str(info.value).split(":")[0].strip() == words[0], str(info.value)


@pytest.mark.parametrize("call,exc,words", BAD_MM)
def test_bad_arguments_scaled_mm(no_launch, call, exc, words):
    _check_raises(call, _args(), exc, words)


@pytest.mark.parametrize("call,exc,words", BAD_BLOCKWISE)
def test_bad_arguments_blockwise(no_launch, call, exc, words):
    _check_raises(call, _blockwise_args(), exc, words)


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda b: qf.azp_adjustment(b.to(FP8)), TypeError, ["b_q", "float8_e4m3fn"]),
        (lambda b: qf.azp_adjustment(b.reshape(-1)), ValueError, ["b_q", "2-D"]),
        (lambda b: qf.azp_adjustment(b, torch.zeros(2, dtype=torch.int32)), ValueError, ["azp", "numel"]),
        (lambda b: qf.azp_adjustment(b, torch.zeros(1)), TypeError, ["azp", "float32"]),
    ],
)
def test_bad_arguments_azp_adjustment(call, exc, words):
    _check_raises(call, (make_b(K_, N_, INT8, "t"),), exc, words)


def test_azp_adjustment_values():
    b = make_b(300, 17, INT8, "t")
    colsum = b.to(torch.int64).sum(0)
    assert qf.azp_adjustment(b).dtype == torch.int32
    assert torch.equal(qf.azp_adjustment(b).to(torch.int64), colsum)
    z = torch.tensor([-77], dtype=torch.int32)
    assert torch.equal(qf.azp_adjustment(b, z).to(torch.int64), -77 * colsum)
    assert torch.equal(kmm.azp_adjustment(b, z), qf.azp_adjustment(b, z))


# ---------------------------------------------------------------------------------------------------
# Fake implementations: shapes for torch.compile without running anything
# ---------------------------------------------------------------------------------------------------
def test_fake_impls():
    with FakeTensorMode():
        a = torch.empty(2, 5, 64, dtype=INT8)
        b = torch.empty(96, 64, dtype=INT8).t()
        sa, sb = torch.empty(10, 1), torch.empty(96)
        adj, azp = torch.empty(96, dtype=torch.int32), torch.empty(10, dtype=torch.int32)
        bias = torch.empty(96, dtype=torch.bfloat16)
        out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.float16, bias, adj, azp)
        assert out.shape == (2, 5, 96) and out.dtype == torch.float16
        out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias=bias, azp_adj=adj, azp=azp)
        assert out.shape == (2, 5, 96) and out.dtype == torch.bfloat16
        af = torch.empty(7, 300, dtype=FP8)
        bf = torch.empty(200, 300, dtype=FP8).t()
        out = torch.ops.quantfuse.scaled_mm(af, bf, torch.empty(1), torch.empty(1), torch.float32, None, None, None)
        assert out.shape == (7, 200) and out.dtype == torch.float32
        sab, sbb = torch.empty(3, 7).t(), torch.empty(3, 2)
        out = torch.ops.quantfuse.scaled_mm_blockwise(af, bf, sab, sbb, torch.bfloat16, None)
        assert out.shape == (7, 200) and out.dtype == torch.bfloat16
        out = qf.scaled_mm_blockwise(af, bf, sab, sbb, torch.float32)
        assert out.shape == (7, 200) and out.dtype == torch.float32


def test_torch_compile_fullgraph(triton_backend):
    m, n, k = 5, 24, 40
    a, b = rand_q((m, k), INT8), make_b(k, n, INT8, "t")
    sa, sb, bias = rand_scale(m), rand_scale(n), torch.randn(n)
    adj, azp = qf.azp_adjustment(b), torch.randint(-5, 5, (m,), dtype=torch.int32)
    af, bf = rand_q((m, 256), FP8), make_b(256, n, FP8, "t")
    sab, sbb = torch.rand(m, 2) * 0.01 + 1e-3, torch.rand(2, 1) * 0.01 + 1e-3

    def f(a, b, af, bf):
        return (qf.scaled_mm(a, b, sa, sb, torch.float32, bias, adj, azp),
                qf.scaled_mm_blockwise(af, bf, sab, sbb, torch.float32))

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(a, b, af, bf), f(a, b, af, bf)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------
# large-M config choice (pure Python: tables, wave efficiency)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,expect_block_n", [
    # the H100 measurements behind the sm90 fp8 rows (132 SMs): 128x256 where its waves are full,
    # 128x128 where 128x256 leaves the last wave part-empty
    (1024, 4096, 256), (1024, 6144, 128), (1024, 10240, 128), (1024, 28672, 256), (1024, 8192, 256),
    (4096, 6144, 256), (4096, 10240, 256),
])
def test_wave_pick_fp8_rows_match_the_sweep(m, n, expect_block_n):
    # the tl candidates (what runs where the Gluon kernels do not apply)
    fp8_large = [c for c in kmm._bucket(kmm.CONFIGS["sm90"], m, n) if isinstance(c, kmm.MMConfig)]
    assert kmm._wave_pick(fp8_large, m, n, 132).block_n == expect_block_n


def test_large_m_table_runs_tma_persistent_first(monkeypatch):
    # sm90, M >= 1024: the tensor-descriptor, persistent candidates lead (fp8 128x256 / 1 program per SM,
    # 128x128 / 2 where 128x256 leaves the last wave part-empty; int8 128x128 / 2 programs per SM)
    monkeypatch.setattr(kmm, "arch_key", lambda *a: "sm90")
    monkeypatch.setattr(kmm, "sm_count", lambda device: 132)
    monkeypatch.setattr(kmm, "_autotune_enabled", lambda: False)
    dev = torch.device("cuda")
    fp8 = kmm._pick_config(kmm.CONFIGS, 4096, 8192, 28672, dev, None, None)
    assert (fp8.block_n, fp8.tma, fp8.persistent) == (256, True, 1)
    fp8_partial_wave = kmm._pick_config(kmm.CONFIGS, 1024, 6144, 4096, dev, None, None)
    assert (fp8_partial_wave.block_n, fp8_partial_wave.tma, fp8_partial_wave.persistent) == (128, True, 2)
    int8 = kmm._pick_config(kmm.CONFIGS, 4096, 8192, 4096, dev, None, None, "int8")
    assert (int8.block_n, int8.tma, int8.persistent) == (128, True, 2)
    # int8 with a long K (Llama-3-70B's down projection) from 2048 rows: 128x256 / 1 program per SM
    int8_long_k = kmm._pick_config(kmm.CONFIGS, 4096, 8192, 28672, dev, None, None, "int8")
    assert (int8_long_k.block_n, int8_long_k.num_warps, int8_long_k.persistent) == (256, 8, 1)
    int8_long_k_1024 = kmm._pick_config(kmm.CONFIGS, 1024, 8192, 28672, dev, None, None, "int8")
    assert (int8_long_k_1024.block_n, int8_long_k_1024.persistent) == (128, 2)


def test_float32_output_skips_tiles_over_the_shared_memory(monkeypatch):
    """A float32 output doubles what the tl tile's store stages in shared memory: the 128x256x128 3-stage tile
    would need 278528 bytes (+ barriers; the H100 compile failed asking 278552 of 232448), so with 4-byte outputs
    the dispatch takes the next tile; 16-bit outputs pick exactly as before."""
    monkeypatch.setattr(kmm, "arch_key", lambda *a: "sm90")
    monkeypatch.setattr(kmm, "sm_count", lambda device: 132)
    monkeypatch.setattr(kmm, "smem_limit", lambda device: 232448)
    monkeypatch.setattr(kmm, "_autotune_enabled", lambda: False)
    dev = torch.device("cuda")
    wide = kmm.MMConfig(128, 256, 128, 8, 3, 16, tma=True, persistent=1)
    assert kmm.tile_smem_bytes(wide, 4) == 278528 and kmm.tile_smem_bytes(wide, 2) == 212992
    for m, n, k in [(300, 128, 128), (259, 6144, 4096), (4096, 8192, 28672)]:
        assert kmm._pick_config(kmm.CONFIGS, m, n, k, dev, None, None, tma_ok=True, ws_ok=False) == wide
        picked = kmm._pick_config(kmm.CONFIGS, m, n, k, dev, None, None, tma_ok=True, ws_ok=False, out_size=4)
        assert kmm.tile_smem_bytes(picked, 4) <= 232448 and (picked.block_n, picked.num_stages) == (128, 5)
    # int8 without the Gluon kernel at a long K: its 128x256 tile leads, and gives way the same
    int8 = kmm._pick_config(kmm.CONFIGS, 4096, 8192, 28672, dev, None, None, "int8", True, False, 4)
    assert kmm.tile_smem_bytes(int8, 4) <= 232448
    # the Gluon candidates are not tl tiles and stay; nothing fits: the fallback tile
    assert isinstance(kmm._pick_config(kmm.CONFIGS, 4096, 8192, 4096, dev, None, None, "int8", True, True, 4),
                      kmm.WsConfig)
    monkeypatch.setattr(kmm, "smem_limit", lambda device: 100_000)
    assert kmm._pick_config(kmm.CONFIGS, 4096, 8192, 4096, dev, None, None, "int8", True, False, 4) \
        == kmm._FALLBACK_TILE


def test_wave_efficiency_and_int8_rows():
    cfg = kmm.MMConfig(128, 256, 128, 8, 3)
    assert kmm.wave_efficiency(1024, 6144, cfg, 132) == pytest.approx(192 / 264)
    assert kmm.wave_efficiency(1024, 4096, cfg, 128) == 1.0
    # int8 large M has its own choices (the Gluon kernel, cooperative then ping-pong, then the tl tile); the small-M
    # rows are shared with fp8
    assert kmm._bucket(kmm.CONFIGS["sm90_int8"], 4096, 4096)[:3] == [
        kmm.WsConfig(128, 256, 4, 8), kmm.WsConfig(128, 128, 5, 8, pingpong=True),
        kmm.MMConfig(128, 128, 128, 4, 3, tma=True, persistent=2)]
    for m, n in [(1, 4096), (16, 28672), (64, 4096), (256, 4096)]:
        assert kmm._bucket(kmm.CONFIGS["sm90_int8"], m, n) == kmm._bucket(kmm.CONFIGS["sm90"], m, n)
    assert kmm._table_key(kmm.CONFIGS, torch.device("cpu"), "int8") == "default"


# ---------------------------------------------------------------------------------------------------
# Row split: an M just past whole rounds of tiles runs as two calls into one output
# ---------------------------------------------------------------------------------------------------
def test_row_split_model():
    """The rule on the H100's numbers: 1040 x 4096 x 14336 splits after the 1024 rows that fill one round of
    128x128 tiles at two programs per SM; 4096 x 4096 does not pay (a 16-row call streams the weight in about the
    time of the extra round); one program per SM makes the extra round a whole tile's time (28672 x 8192 splits
    there, not with two per SM); no split for whole rounds, tails past the decode sizes, M within them, or an
    unlisted arch."""
    p2 = kmm.MMConfig(128, 128, 128, 4, 3, tma=True, persistent=2)
    ws = kmm.WsConfig(128, 256, 4, 8)
    assert kmm.row_split(1040, 8192, 28672, 1, p2, 132, "sm90") == 0
    assert kmm.row_split(1040, 8192, 28672, 1, ws, 132, "sm90") == 1024  # rounds of 512 rows
    # blockwise: slower decode-sized calls, so a 256-row rest stays in the one call (measured 73 us against 53)
    from quantfuse.kernels.blockwise_wgmma import WgmmaConfig
    bw_ws = WgmmaConfig(128, 128, 8, 4, 8, 1)
    assert kmm.row_split(1040, 4096, 14336, 1, bw_ws, 132, "sm90", "blockwise") == 1024
    assert kmm.row_split(2064, 4096, 14336, 1, bw_ws, 132, "sm90", "blockwise") == 2048
    assert kmm.row_split(1280, 4096, 14336, 1, bw_ws, 132, "sm90", "blockwise") == 0
    assert kmm.row_split(1040, 4096, 4096, 1, bw_ws, 132, "sm90", "blockwise") == 0
    assert kmm.row_split(1040, 4096, 14336, 1, p2, 132, "sm90") == 1024
    assert kmm.row_split(1040, 4096, 14336, 1, ws, 132, "sm90") == 1024  # 8 rows of 16 tiles of 256 columns
    assert kmm.row_split(2064, 4096, 14336, 1, p2, 132, "sm90") == 2048
    # a 256-row tail: its call (products at ~6e14 a second: a 768 + 256 split of 1024 x 10240 x 8192 ran 165 us
    # against 135 for the one call) costs more than the extra round
    assert kmm.row_split(1280, 4096, 14336, 1, p2, 132, "sm90") == 0
    assert kmm.row_split(1024, 10240, 8192, 1, ws, 132, "sm90") == 0
    assert kmm.row_split(1040, 4096, 4096, 1, p2, 132, "sm90") == 0
    assert kmm.row_split(1024, 4096, 14336, 1, p2, 132, "sm90") == 0
    assert kmm.row_split(1300, 4096, 14336, 1, p2, 132, "sm90") == 0  # 276 rows left: not a decode call
    assert kmm.row_split(200, 4096, 14336, 1, p2, 132, "sm90") == 0
    assert kmm.row_split(1040, 4096, 14336, 1, p2, 132, "default") == 0
    assert kmm.row_split(1040, 40960, 14336, 1, p2, 132, "sm90") == 0  # no row fits a round


@pytest.mark.parametrize("dtype,epilogue", [(INT8, "plain"), (INT8, "azp_tensor"), (INT8, "azp_token"), (FP8, "plain")])
@pytest.mark.parametrize("per_token", [True, False])
def test_row_split_equals_one_call(triton_backend, dtype, epilogue, per_token):
    """Forced through split_rows, the two calls write exactly the rows one call writes (each row depends on its own
    row of a, scale and zero point only), into one output, with padded rows of a; bad splits are refused."""
    m, n, k = 23, 20, 70
    a = rand_q((m, k + 6), dtype)[:, 2:2 + k]
    b = make_b(k, n, dtype, "t")
    sa, sb, bias = rand_scale(m if per_token else 1, (m, 1) if per_token else None), rand_scale(n), torch.randn(n)
    azp_adj, azp, _ = make_epilogue(epilogue, a, b)
    whole = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, azp_adj, azp, split_rows=0)
    for rows in (1, 16, 22):
        split = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, azp_adj, azp, split_rows=rows)
        assert torch.equal(split, whole), rows
    for bad in (-1, m, m + 4):
        with pytest.raises(ValueError, match="split_rows"):
            kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, azp_adj, azp, split_rows=bad)


@pytest.mark.parametrize("scale_layout", ["row", "transposed"])
def test_blockwise_row_split_equals_one_call(triton_backend, scale_layout):
    """scaled_mm_blockwise through split_rows: the two calls write exactly the rows of one call (row slices of
    either scale layout), into one output; bad splits are refused."""
    m, k, n = 21, 300, 200
    a, b, sa, sb = blockwise_inputs(m, k, n, scale_layout)
    bias = torch.randn(n) * 0.1
    whole = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16, bias, split_rows=0)
    for rows in (1, 16, 20):
        assert torch.equal(kmm.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16, bias, split_rows=rows), whole), rows
    with pytest.raises(ValueError, match="split_rows"):
        kmm.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16, bias, split_rows=m)


# ---------------------------------------------------------------------------------------------------
# The sm90 build (offline, this Triton's ptxas): the epilogue's loads
# ---------------------------------------------------------------------------------------------------
def _compile_tl_sm90(dtype: str, azp_mode: int):
    """`_scaled_mm_kernel` built for sm90 at the shipped large-M tile of its dtype (int8 128x128 / 4 warps, fp8
    128x256 / 8 warps; both through tensor descriptors, persistent), per-token x per-channel scales + bias."""
    from tests._util import tl_sm90_build

    torch_dtype = {"int8": INT8, "fp8": FP8}[dtype]
    block_n, warps = (128, 4) if dtype == "int8" else (256, 8)
    a, bt = torch.zeros(256, 1024, dtype=torch_dtype), torch.zeros(512, 1024, dtype=torch_dtype)
    args = dict(a_src=kmm.descriptor(a, [128, 128]), b_src=kmm.descriptor(bt, [block_n, 128]),
                out_ptr="*bf16", ws_ptr="*i32", scale_a_ptr="*fp32", scale_b_ptr="*fp32", bias_ptr="*bf16",
                azp_adj_ptr="*i32", azp_ptr="*i32")
    consts = dict(IS_FP8=dtype == "fp8", SCALE_A_PER_ROW=True, SCALE_B_PER_COL=True, HAS_BIAS=True,
                  AZP_MODE=azp_mode, SPLIT_K=1, EVEN_K=True, BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8,
                  TMA=True, PERSISTENT=True, PDL=False, INTERPRET=False)
    return tl_sm90_build(kmm._scaled_mm_kernel, args, consts, lambda _, typ: typ == "i32" or typ.startswith("*"),
                         num_warps=warps, num_stages=3)


@pytest.mark.parametrize("dtype,azp_mode", [("int8", 0), ("int8", 2), ("fp8", 0)])
def test_sm90_epilogue_issues_its_loads_together(tmp_path, dtype, azp_mode):
    """The epilogue's vectors (zero points, scales, bias) are loaded before any of them is used: each one crosses
    shared memory between CTA barriers on its way to the accumulator's layout, and a load written after another
    one's use waited for that exchange (H100: decode up to 1.08x, results/tune_scaled_mm_epilogue_loads.json)."""
    import re

    from tests._util import loads_behind_barriers, sm90_sass

    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_scaled_mm", f"_compile_tl_sm90({dtype!r}, {azp_mode})")
    assert len(re.findall(r"\bLDG\.E\b", sass)) >= 3 + (2 if azp_mode else 0), "the epilogue's loads are not there"
    assert loads_behind_barriers(sass) == []
