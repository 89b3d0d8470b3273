"""Randomized cases through the public ops on the GPU: shapes, dtypes, layouts and options drawn from a fixed seed
per case (the case id is the seed, so a failure reproduces with `-k fuzz_<op>[<seed>]`), checked against the
reference with the bounds the other GPU test modules state and use:
- weight_only_mm: `test_weight_only_gpu.assert_gemm_within_bound` (one rounding of each weight and of the output);
- scaled_mm: `test_scaled_mm_gpu.assert_within_bound` (int8 exact accumulation, fp8 reduced-precision accumulation);
- scaled_mm_blockwise: mean relative error < 1e-3 in float32 and the 16-bit output within one rounding of it;
- quantize_per_token / quantize_per_group: codes equal to the reference's, scales bit for bit;
- silu_and_mul_quant: `test_silu_quant_gpu.assert_close_outputs` (SPEC section 0's rounding-tie allowance).

Why, beside the fixed grids of those modules: the dispatch has many bands (decode kernels by M and N x K, split-K
counts, tile tables, the Gluon kernels' M ranges, tail splits, row splits of M) and the fixed grids pin a few
points of each. Here M is drawn around every band edge and K, N (including ones that are no multiple of 8, 16 or
128, where the ops allow them) at random, with the layouts and options of each op, so an off-by-one at a band edge
or a mask missed for an odd size shows up as a bound violation or a non-finite output."""

import os
import random

import pytest
import torch

import quantfuse as qf
from quantfuse import reference as ref
from tests._util import assert_codes_equal
from tests.gpu.test_scaled_mm_gpu import _operands as scaled_operands
from tests.gpu.test_scaled_mm_gpu import assert_within_bound as assert_scaled_within_bound
from tests.gpu.test_silu_quant_gpu import assert_close_outputs
from tests.gpu.test_weight_only_gpu import _weight as weight_with_block_magnitudes
from tests.gpu.test_weight_only_gpu import assert_gemm_within_bound

pytestmark = pytest.mark.gpu

INT8, FP8 = torch.int8, torch.float8_e4m3fn
BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
DEV = "cuda"

# M around the dispatch's band edges (decode kernels, mma tiles, Gluon wgmma / warp-specialized bands, cuBLAS)
M_EDGES = [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 383, 511,
           512, 513, 639, 767, 1023, 1024, 1025, 1535, 2048, 2049]
# QUANTFUSE_FUZZ_CASES: more seeds for a longer sweep (a failing seed reproduces at any count)
CASES = int(os.environ.get("QUANTFUSE_FUZZ_CASES", "40"))


def _m(rng: random.Random, cap: int) -> int:
    m = rng.choice(M_EDGES) if rng.random() < 0.7 else rng.randint(1, 2100)
    return min(m, cap)


def _size(rng: random.Random, align: int, big: bool) -> int:
    """A K or N: a Llama-3 size, or random (a multiple of `align`), small or up to ~15k."""
    if rng.random() < 0.35:
        return rng.choice([1024, 4096, 6144, 8192, 10240, 14336])
    hi = 15000 if big else 700
    return max(align, rng.randint(1, hi) // align * align)


def _cap_m(k: int, n: int) -> int:
    """Rows that keep one case's reference product under ~2^34 multiply-adds (the float64 / float32 references)."""
    return max(1, min(2100, (1 << 34) // max(1, k * n)))


@pytest.mark.parametrize("seed", range(CASES))
def test_fuzz_weight_only_mm(seed):
    rng = random.Random(1000 + seed)
    torch.manual_seed(1000 + seed)
    bits = rng.choice([4, 4, 8])
    group = rng.choice([32, 64, 128, 128, 256, -1])
    symmetric = rng.random() < 0.6
    dtype = rng.choice([BF16, FP16])
    scale_dtype = rng.choice([F32, F32, dtype])
    k = _size(rng, 8, rng.random() < 0.7)
    n = _size(rng, 1, rng.random() < 0.7)
    m = _m(rng, _cap_m(k, n))
    has_bias = rng.random() < 0.4
    padded = rng.random() < 0.25
    label = (f"seed{seed}-M{m}-K{k}-N{n}-w{bits}g{group}{'s' if symmetric else 'a'}-{str(dtype)[6:]}"
             f"-s{str(scale_dtype)[6:]}{'-bias' if has_bias else ''}{'-padded' if padded else ''}")
    qw = qf.quantize_weight(weight_with_block_magnitudes(n, k), bits=bits, group_size=group, symmetric=symmetric,
                            scale_dtype=scale_dtype)
    if padded:  # a padded-row view: row stride K + 8
        x = torch.randn(m, k + 8, device=DEV).to(dtype)[:, :k]
    else:
        x = torch.randn(m, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype) if has_bias else None
    y = qf.weight_only_mm(x, qw, bias)
    assert y.shape == (m, n) and y.dtype == dtype, label
    assert bool(torch.isfinite(y).all()), label
    assert_gemm_within_bound(y, x, qw.dequantize(dtype), bias, label)


def _scaled_operands(rng, m, k, n, dtype):
    a, b = scaled_operands(m, k, n, dtype)  # b = w.t(), K-contiguous
    w = b.t()
    layout = rng.choice(["kmajor", "kmajor", "nmajor", "sliced"])
    if layout == "nmajor":
        b = w.t().contiguous()
    elif layout == "sliced":  # both strides non-unit: every other row and column of a larger [2K, 2N] matrix
        big = torch.zeros(2 * k, 2 * n, dtype=torch.int8, device=DEV)
        big[::2, ::2] = w.t().view(torch.int8)
        b = big.view(dtype)[::2, ::2]
    if rng.random() < 0.25:  # padded-row view of a
        a_full = torch.zeros(m, k + 32, dtype=torch.int8, device=DEV)
        a_full[:, 16:16 + k] = a.view(torch.int8)
        a = a_full.view(dtype)[:, 16:16 + k]
    return a, b, layout


@pytest.mark.parametrize("seed", range(CASES))
def test_fuzz_scaled_mm(seed):
    rng = random.Random(2000 + seed)
    torch.manual_seed(2000 + seed)
    dtype = rng.choice([INT8, FP8])
    out_dtype = rng.choice([BF16, BF16, FP16, F32])
    k = _size(rng, 1, rng.random() < 0.7)
    n = _size(rng, 1, rng.random() < 0.7)
    m = _m(rng, _cap_m(k, n))
    a, b, layout = _scaled_operands(rng, m, k, n, dtype)
    per_token, per_channel = rng.random() < 0.7, rng.random() < 0.7
    sa = torch.rand(m if per_token else 1, 1, device=DEV) * 1e-3 + 1e-4
    sb = torch.rand(n if per_channel else 1, device=DEV) * 1e-3 + 1e-4
    bias_dtype = rng.choice([None, BF16, F32, FP16])
    bias = None if bias_dtype is None else torch.randn(n, device=DEV).to(bias_dtype)
    adj = azp = None
    if dtype == INT8 and rng.random() < 0.3:
        if rng.random() < 0.5:  # per-tensor zero point folded into the adjustment
            adj = qf.azp_adjustment(b, torch.tensor([rng.randint(-128, 127)], dtype=torch.int32, device=DEV))
        else:  # per-token zero points
            adj = qf.azp_adjustment(b)
            azp = torch.randint(-300, 300, (m, 1), dtype=torch.int32, device=DEV)
    out = qf.scaled_mm(a, b, sa, sb, out_dtype, bias, adj, azp)
    assert out.shape == (m, n) and out.dtype == out_dtype
    print(f"seed{seed}: M{m} K{k} N{n} {dtype} -> {out_dtype} b {layout} a-stride {a.stride(0)} "
          f"tok {per_token} ch {per_channel} bias {bias_dtype} azp {adj is not None}/{azp is not None}")
    assert_scaled_within_bound(out, a, b, sa, sb, bias, adj, azp)


@pytest.mark.parametrize("seed", range(CASES // 2))
def test_fuzz_scaled_mm_blockwise(seed):
    rng = random.Random(3000 + seed)
    torch.manual_seed(3000 + seed)
    k = _size(rng, 16, rng.random() < 0.7)  # fp8 rows of 16-byte multiples (the op's alignment rule)
    n = _size(rng, 16, rng.random() < 0.7)
    m = _m(rng, _cap_m(k, n))
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device=DEV) * 3 / 8).to(FP8)
    sa = torch.rand(m, kb, device=DEV) * 0.1 + 0.01
    if rng.random() < 0.5:
        sa = sa.t().contiguous().t()
    b = (torch.randn(n, k, device=DEV) * 60).to(FP8).t()
    sb = torch.rand(kb, nb, device=DEV) * 1e-3 + 1e-4
    bias = torch.randn(n, device=DEV).to(BF16) if rng.random() < 0.5 else None
    print(f"seed{seed}: M{m} K{k} N{n} scales {'M-contiguous' if sa.stride(0) == 1 else 'K-contiguous'}")
    out32 = qf.scaled_mm_blockwise(a, b, sa, sb, F32, bias)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, F32, bias)
    rel = float((out32 - want).abs().mean() / want.abs().mean())
    assert rel < 1e-3, rel
    out = qf.scaled_mm_blockwise(a, b, sa, sb, BF16, bias)
    assert bool(((out.float() - out32).abs() <= 2.0**-8 * out32.abs() + 1e-30).all())


def _activations(rng, tokens, hidden, in_dtype):
    """x and the rows whose outputs are compared: with special rows, row 0 all zero (compared) and a NaN and an inf
    in two other rows (a non-finite value only has to stay inside its row's scaled region: those rows are left
    out, as in the CPU tests' poison checks)."""
    x = torch.randn(tokens, hidden, device=DEV) * rng.choice([1e-3, 1.0, 40.0])
    poisoned = set()
    if rng.random() < 0.3:
        x[0] = 0.0
        if tokens > 2:
            x[tokens // 2, hidden // 2] = float("nan")
            x[-1, 0] = float("inf")
            poisoned = {tokens // 2, tokens - 1}
    keep = torch.tensor([i for i in range(tokens) if i not in poisoned], device=DEV)
    return x.to(in_dtype), keep


def _rows(outputs, keep):
    return tuple(None if t is None else t.reshape(-1, t.shape[-1])[keep] for t in outputs)


@pytest.mark.parametrize("seed", range(CASES // 2))
def test_fuzz_activation_quantization(seed):
    rng = random.Random(4000 + seed)
    torch.manual_seed(4000 + seed)
    in_dtype = rng.choice([BF16, FP16, F32])
    tokens = rng.choice([1, 2, 7, 33, 256, 1000, 4097])
    hidden = rng.choice([16, 100, 1000, 4096, 5137, 8192, 14336])
    x, keep = _activations(rng, tokens, hidden, in_dtype)
    dtype = rng.choice([INT8, FP8])
    symmetric = dtype == FP8 or rng.random() < 0.6
    print(f"seed{seed}: tokens {tokens} hidden {hidden} {in_dtype} -> {dtype} symmetric {symmetric} "
          f"compared rows {keep.numel()}")
    got = _rows(qf.quantize_per_token(x, dtype, symmetric=symmetric), keep)
    want = _rows(ref.quantize_per_token(x, dtype, symmetric=symmetric), keep)
    assert_codes_equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    if not symmetric:
        assert torch.equal(got[2], want[2])
    groups = [g for g in (16, 32, 64, 128, 256) if hidden % g == 0]
    if groups:
        g = rng.choice(groups)
        transposed = rng.random() < 0.5
        got = _rows(qf.quantize_per_group(x, dtype, g, transposed_scales=transposed), keep)
        want = _rows(ref.quantize_per_group(x, dtype, g, transposed_scales=transposed), keep)
        assert_codes_equal(got[0], want[0])
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("seed", range(CASES // 2))
def test_fuzz_silu_and_mul_quant(seed):
    rng = random.Random(5000 + seed)
    torch.manual_seed(5000 + seed)
    in_dtype = rng.choice([BF16, FP16, F32])
    tokens = rng.choice([1, 3, 16, 100, 1024, 4097])
    hidden = rng.choice([128, 512, 1024, 2048, 5120, 14336])
    x, keep = _activations(rng, tokens, 2 * hidden, in_dtype)
    dtype = rng.choice([INT8, FP8])
    mode = rng.choice(["group", "group", "token", "static"])
    if mode == "group":
        g = rng.choice([g for g in (16, 32, 64, 128, 256) if hidden % g == 0])
        transposed = rng.random() < 0.5
        got = qf.silu_and_mul_quant(x, dtype, group_size=g, transposed_scales=transposed)
        want = ref.silu_and_mul_quant(x, dtype, group_size=g, transposed_scales=transposed)
    elif mode == "token":
        got = qf.silu_and_mul_quant(x, dtype)
        want = ref.silu_and_mul_quant(x, dtype)
    else:
        s = torch.tensor([0.05], device=DEV)
        got = qf.silu_and_mul_quant(x, dtype, scale=s)
        want = ref.silu_and_mul_quant(x, dtype, scale=s)
    print(f"seed{seed}: tokens {tokens} hidden {hidden} {in_dtype} -> {dtype} {mode}, compared rows {keep.numel()}")
    if mode == "static":  # one scale for the tensor: only the codes are per row
        assert torch.equal(got[1], want[1])
        got, want = (got[0][keep], got[1]), (want[0][keep], want[1])
    else:
        got, want = _rows(got, keep), _rows(want, keep)
    assert_close_outputs(got, want)
