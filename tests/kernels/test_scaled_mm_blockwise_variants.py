"""Block-scaled fp8 GEMM: every accumulation variant of the blockwise kernel (MMConfig.variant, see
BLOCKWISE_VARIANTS in quantfuse/kernels/scaled_mm.py) forced through `scaled_mm_blockwise(config=...)`
under the interpreter, against `quantfuse.reference.scaled_mm_blockwise`.

Tolerance: the one of the existing blockwise tests (tests/kernels/test_scaled_mm.py), applied per
128-column weight block so that blocks with tiny weight scales are held to it too:
    float32 out: mean|got - want| / mean|want| < 1e-6, bf16/fp16 out: < 1e-3, and elementwise
    `assert_mm_close` (rtol one ulp of the output type, 1e-5 for float32; atol 1e-5 * block max |want|).
Inputs: fp8 codes that are never zero (random sign, magnitudes 2^-3..2^6), weight-block scales
2^uniform(-20, 20), one activation group of exact zeros with scale 0 in every case.
A spy on the kernel launch checks that the forced variant (SCALE_MODE / SB_PER_TILE / PROMOTE) really ran.
"""

import os

import pytest
import torch

from quantfuse import reference as ref
from quantfuse.kernels import scaled_mm as kmm
from tests._util import KernelSpy

from .test_scaled_mm import assert_mm_close, rel_mean_err

FP8 = torch.float8_e4m3fn
VARIANTS = sorted(kmm.BLOCKWISE_VARIANTS)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need TRITON_INTERPRET=1")
REL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
def fp8_codes(shape, device="cpu"):
    """Random fp8 codes, never zero: random sign times 2^uniform(-3, 6) (every binade of that range)."""
    mag = torch.exp2(torch.rand(shape, device=device) * 9 - 3)
    sign = torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    q = (sign * mag).to(FP8)
    assert bool((q.float() != 0).all())
    return q


def make_inputs(m, k, n, scale_layout, zero_group=0, wide=True, device="cpu"):
    """a [M, K], b [K, N] (transpose of a row-major weight), scale_a [M, Kb] in `scale_layout` and
    scale_b [Kb, Nb]; activation group `zero_group % Kb` of row M // 2 is all zero with scale 0."""
    kb, nb = -(-k // 128), -(-n // 128)
    a = fp8_codes((m, k), device)
    b = fp8_codes((n, k), device).t()
    sa = torch.exp2(torch.rand(m, kb, device=device) * 6 - 3) * 0.01
    if wide:
        sb = torch.exp2(torch.rand(kb, nb, device=device) * 40 - 20)
    else:
        sb = torch.exp2(torch.rand(kb, nb, device=device) * 4 - 2)
    row, g = m // 2, zero_group % kb
    a.view(torch.uint8)[row, g * 128:(g + 1) * 128] = 0  # fp8 +0.0 (through the bits: any device)
    sa[row, g] = 0.0
    if scale_layout == "transposed":  # the view quantize_per_group(..., transposed_scales=True) returns
        sa = sa.t().contiguous().t()
        assert m == 1 or kb == 1 or sa.stride() == (1, m)  # (one row or one group: no distinct layouts)
    else:
        assert m == 1 or kb == 1 or sa.stride() == (kb, 1)
    return a, b, sa, sb


def assert_blockwise_close(got, want, out_dtype):
    """The module tolerance, per 128-column weight block (each block has its own scale magnitude)."""
    assert got.shape == want.shape and got.dtype == want.dtype == out_dtype
    for j in range(0, want.shape[1], 128):
        g, w = got[:, j:j + 128], want[:, j:j + 128]
        if not bool(w.float().abs().max() > 0):
            assert torch.equal(g.float(), w.float())
            continue
        err = rel_mean_err(g, w)
        assert err < REL_TOL[out_dtype], (j, err)
        assert_mm_close(g, w, out_dtype, True)


def cfg(variant, block_m=32, block_n=64, block_k=128, split_k=1):
    return kmm.MMConfig(block_m, block_n, block_k, 4, 1, group_m=2, split_k=split_k, variant=variant)


@pytest.fixture
def launches(monkeypatch):
    """Records the constexprs of every blockwise kernel launch (proves which variant ran)."""
    spy = KernelSpy(kmm._blockwise_kernel)
    monkeypatch.setattr(kmm, "_blockwise_kernel", spy)
    return spy.calls


def expected_modes(config):
    bits = config.variant
    return dict(SCALE_MODE=bits & 1, SB_PER_TILE=bool(bits & 2) and 128 % config.block_n == 0,
                PROMOTE=bool(bits & 4))


def check_launch(launches, config):
    assert len(launches) == 1, launches
    seen = launches.pop()
    for key, value in expected_modes(config).items():
        assert seen[key] == value, (key, seen, config)
    assert (seen["BLOCK_M"], seen["BLOCK_N"], seen["BLOCK_K"]) == (config.block_m, config.block_n, config.block_k)
    return seen


# ---------------------------------------------------------------------------------------------------
# Every variant on odd shapes
# ---------------------------------------------------------------------------------------------------
SHAPES = [(m, k, n) for m in (1, 17, 33) for k in (128, 200, 384) for n in (64, 130, 257)]
# tiles rotated over the shapes: BLOCK_N that divides 128 (one weight scale per tile), BLOCK_N = 256 (bit 2
# dropped by the launcher) and BLOCK_K below the 128 group (steps that share a scale); tiles are large
# because the interpreter's time grows with programs x K steps (about 10 ms each), 32-wide K steps only
# where K is short
TILES = [(64, 64, 128), (64, 128, 64), (64, 128, 128), (32, 64, 32), (32, 256, 128)]


# PROMOTE only changes the GPU dot (the interpreter's is a plain float32 product), so under the interpreter
# 5 and 7 run the code of 1 and 3: they get three shapes here and all of the other tests
MATRIX = [(v, i) for v in VARIANTS for i in range(len(SHAPES)) if v < 4 or i % 9 == v]


@needs_interpreter
@pytest.mark.parametrize("variant,idx", MATRIX, ids=[f"v{v}-{'x'.join(map(str, SHAPES[i]))}" for v, i in MATRIX])
def test_variant_matches_reference(launches, variant, idx):
    # layout, bias, tile and the place of the zero group rotate with the shape so every variant sees each
    m, k, n = SHAPES[idx]
    layout = ("row", "transposed")[idx % 2]
    with_bias = (idx // 2) % 2 == 1
    block_m, block_n, block_k = TILES[idx % len(TILES)]
    if k == 384 and block_k < 64:
        block_k = 64
    a, b, sa, sb = make_inputs(m, k, n, layout, zero_group=idx)
    bias = torch.randn(n) * 100 if with_bias else None
    config = cfg(variant, block_m, block_n, block_k)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, config=config)
    check_launch(launches, config)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert_blockwise_close(got, want, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_variant_out_dtypes_layouts_bias(launches, variant, out_dtype):
    m, k, n = 17, 384, 257
    for layout, with_bias in (("row", False), ("transposed", True)):
        # fp16 needs outputs inside its range: moderate weight scales, and the activation scales lowered
        # by a power of two (exact) until |out| < 2^13
        a, b, sa, sb = make_inputs(m, k, n, layout, zero_group=1, wide=out_dtype != torch.float16)
        if out_dtype == torch.float16:
            peak = float(ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32).abs().max())
            sa = sa * 2.0 ** -max(0, int(torch.tensor(peak).log2().ceil()) - 13)
        bias = (torch.randn(n) * 10).to(out_dtype) if with_bias else None
        config = cfg(variant, 32, 128, 128)
        got = kmm.scaled_mm_blockwise(a, b, sa, sb, out_dtype, bias, config=config)
        check_launch(launches, config)
        want = ref.scaled_mm_blockwise(a, b, sa, sb, out_dtype, bias)
        assert_blockwise_close(got, want, out_dtype)


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split_k", [2, 3])
def test_variant_split_k(launches, monkeypatch, variant, split_k):
    reduces = []
    real_reduce = kmm._launch_reduce
    monkeypatch.setattr(kmm, "_launch_reduce", lambda *args: reduces.append(args[8]) or real_reduce(*args))
    m, k, n = 6, 640, 130
    a, b, sa, sb = make_inputs(m, k, n, "transposed", zero_group=2)
    bias = torch.randn(n) * 100
    config = cfg(variant, 16, 64, 64, split_k=split_k)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, config=config)
    assert check_launch(launches, config)["SPLIT_K"] == split_k and reduces == [split_k]
    assert_blockwise_close(got, ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias), torch.float32)


# ---------------------------------------------------------------------------------------------------
# Scales that a naive rescaled accumulator gets wrong: zeros, extremes, non-finite
# ---------------------------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_groups_and_extreme_scales(launches, variant):
    """Zero groups first/middle/last, a row of zero groups only, an all-zero weight block with scale 0 and
    scales spanning 2^-30..2^30 in one row: the module tolerance per row and weight block."""
    m, k, n = 9, 640, 257  # 5 groups, 3 weight blocks
    a, b, sa, sb = make_inputs(m, k, n, "row", zero_group=0)
    for row, groups in [(1, [0]), (2, [2]), (3, [4]), (5, [0, 1, 2, 3, 4]), (6, [1, 3])]:
        for g in groups:
            a.view(torch.uint8)[row, g * 128:(g + 1) * 128] = 0
            sa[row, g] = 0.0
    # ratios between consecutive steps up to 2^60 (times 2^40 from the weight scales): far outside any
    # fixed "safe" ratio window, inside float32 (the documented range: acc / units < float32 max)
    sa[7] = torch.tensor([2.0**-30, 2.0**30, 2.0**-30, 2.0**28, 1.0]) * 0.01
    sa[8] = torch.tensor([2.0**25, 2.0**-25, 1.0, 2.0**-20, 2.0**20]) * 0.01
    b = b.contiguous()  # [K, N] row-major: an all-zero 128x128 weight block with scale 0
    b.view(torch.uint8)[256:384, 128:256] = 0
    sb[2, 1] = 0.0
    bias = torch.randn(n)
    config = cfg(variant, 16, 128, 128)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, config=config)
    check_launch(launches, config)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert torch.isfinite(got).all()
    assert torch.equal(got[5], bias)  # every group of row 5 is zero: the bias alone, exactly
    for i in range(m):  # per row as well: rows 7 and 8 have their own (extreme) magnitudes
        assert_blockwise_close(got[i:i + 1], want[i:i + 1], torch.float32)


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_scale_over_nonzero_codes_documented_deviation(launches, variant):
    """Scale 0 over nonzero codes (no quantizer emits that): variants 0/2 add 0 as the reference does; the
    rescaled ones (1/3/5/7) keep the previous units, i.e. compute the reference with that scale replaced by
    the row's previous group scale (see BLOCKWISE_VARIANTS)."""
    m, k, n = 4, 384, 130
    a, b, sa, sb = make_inputs(m, k, n, "row", zero_group=0)  # row 2, group 0: zero codes, scale 0
    sa[1, 2] = 0.0  # row 1, group 2: nonzero codes, scale 0
    config = cfg(variant, 16, 64, 128)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, config=config)
    check_launch(launches, config)
    as_if = sa.clone()
    if variant & 1:
        as_if[1, 2] = sa[1, 1]
    assert_blockwise_close(got, ref.scaled_mm_blockwise(a, b, as_if, sb, torch.float32), torch.float32)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_scales_stay_in_their_row_and_block(launches, variant, bad):
    m, k, n = 7, 384, 257
    a, b, sa, sb = make_inputs(m, k, n, "transposed", zero_group=0)
    sa, sb = sa.clone(), sb.clone()
    sa[4, 1] = bad
    sb[2, 2] = bad  # columns 256.. (last weight block), every row
    config = cfg(variant, 16, 64, 128)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, config=config)
    check_launch(launches, config)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert not torch.isfinite(got[4]).any() and not torch.isfinite(got[:, 256]).any()
    rows = [i for i in range(m) if i != 4]
    assert_blockwise_close(got[rows][:, :256], want[rows][:, :256], torch.float32)


# ---------------------------------------------------------------------------------------------------
# Config plumbing
# ---------------------------------------------------------------------------------------------------
@needs_interpreter
def test_default_path_runs_variant_0_interpreter_config(launches):
    """Without config= the interpreter runs _INTERPRET_CONFIG (variant 0) whatever the tables say."""
    a, b, sa, sb = make_inputs(5, 200, 70, "row")
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None)
    seen = check_launch(launches, kmm._INTERPRET_CONFIG)
    assert seen["SCALE_MODE"] == 0 and not seen["SB_PER_TILE"] and not seen["PROMOTE"]
    assert_blockwise_close(got, ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32), torch.float32)


def test_mmconfig_compatible_and_tables_unchanged():
    c = kmm.MMConfig(64, 128, 128, 4, 3)
    assert c.variant == 0 and c.group_m == 8 and c.split_k == 0
    assert kmm.MMConfig(64, 128, 128, 4, 3, 8, 0, 3).variant == 3
    assert kmm._INTERPRET_CONFIG.variant == 0
    for bucket in kmm.CONFIGS.values():
        assert all(isinstance(c, kmm.WsConfig) or c.variant == 0 for entry in bucket for c in entry[-1])
    for bucket in kmm.BLOCKWISE_CONFIGS.values():
        assert all(c.variant not in kmm._GPU_INACCURATE_VARIANTS for entry in bucket for c in entry[-1])


@pytest.mark.parametrize("variant,block_n,effective", [
    (0, 64, 0), (1, 64, 1), (2, 64, 2), (3, 128, 3), (5, 32, 5), (7, 128, 7),
    (2, 256, 0), (3, 256, 1), (7, 256, 5),
])
def test_effective_variant(variant, block_n, effective):
    assert kmm.effective_blockwise_variant(kmm.MMConfig(64, block_n, 128, 4, 3, variant=variant)) == effective


@needs_interpreter
def test_bad_variant_configs_raise():
    a, b, sa, sb = make_inputs(3, 130, 40, "row")
    for bad in (kmm.MMConfig(16, 32, 32, 4, 1, variant=4), kmm.MMConfig(16, 32, 32, 4, 1, variant=8),
                kmm.MMConfig(16, 32, 256, 4, 1), kmm.MMConfig(16, 32, 96, 4, 1)):
        with pytest.raises(ValueError, match="config"):
            kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, config=bad)
    with pytest.raises(ValueError, match="variant"):
        kmm.scaled_mm(a, b, sa[:, :1].contiguous(), torch.ones(1), torch.float32, None, None, None,
                      config=kmm.MMConfig(16, 32, 32, 4, 1, variant=1))


# ---------------------------------------------------------------------------------------------------
# GPU (`pytest -m gpu tests/kernels/test_scaled_mm_blockwise_variants.py` on the device): real tiles,
# the spec's bound (mean relative error < 1e-3, float32 out) per weight block
# ---------------------------------------------------------------------------------------------------
GPU_VARIANTS = [v for v in VARIANTS if v not in kmm._GPU_INACCURATE_VARIANTS]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(kmm._GPU_INACCURATE_VARIANTS))
def test_inaccurate_variants_refused_on_gpu(variant):
    a, b, sa, sb = make_inputs(64, 256, 128, "row", device="cuda")
    with pytest.raises(ValueError, match="config.variant"):
        kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None,
                                config=kmm.MMConfig(64, 128, 128, 4, 3, variant=variant))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
@pytest.mark.parametrize("tile", [(64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 256, 8, 3)])
def test_variant_gpu(variant, tile):
    m, k, n = 1000, 4096, 1000
    a, b, sa, sb = make_inputs(m, k, n, "transposed", zero_group=5, device="cuda")
    bias = torch.randn(n, device="cuda") * 100
    config = kmm.MMConfig(tile[0], tile[1], 128, tile[2], tile[3], variant=variant)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, config=config)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert torch.isfinite(got).all()
    errs = [rel_mean_err(got[:, j:j + 128], want[:, j:j + 128]) for j in range(0, n, 128)]
    print(f"variant {variant} tile {tile}: worst block mean rel error {max(errs):.3g}")
    assert max(errs) < 1e-3
