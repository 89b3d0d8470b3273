"""CPU checks of the Gluon wgmma int4 kernel for prefill-sized M (kernels/weight_only_wgmma.py) and of its int8
per-channel twin: configs, scope, the dispatch rules and the tile model, and their sm90 builds with this Triton
(offline: no GPU needed), whose SASS must show the point of the kernels: wgmma left in flight while the next chunk
converts. The GPU tests (tests/gpu/test_weight_only_wgmma_gpu.py, test_weight_only_w8_wgmma_gpu.py) check their
results."""

import re

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import weight_only_wgmma as ww
from tests._util import gluon_sm90_build, sm90_sass


def test_shipped_configs_are_valid_and_bad_ones_refused():
    for cfg in ww.all_configs("sm90"):
        ww.check_config(cfg)
    for bad in (ww.WgmmaW4Config(96), ww.WgmmaW4Config(512), ww.WgmmaW4Config(128, 2), ww.WgmmaW4Config(128, stages=1),
                ww.WgmmaW4Config(128, row_cost=0.0)):
        with pytest.raises(ValueError, match="config"):
            ww.check_config(bad)


def test_never_applies_on_cpu_tensors():
    qw = qf.quantize_weight(torch.randn(64, 256), bits=4, group_size=128)
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    assert not ww.applies(x, qw.qweight, qw.scales, 4, 128)  # CPU: the tl kernels under the interpreter
    assert qf.weight_only_mm(x, qw).shape == (256, 64)


def test_prefer_rule():
    assert not ww.prefer(128, 6144, 4096, "sm90")  # the tl wide tile keeps M <= 128
    assert ww.prefer(129, 6144, 4096, "sm90") and ww.prefer(512, 6144, 4096, "sm90")
    # from M = 768 only large weights: 4096x6144 (25M codes) lost to dequantize + cuBLAS there
    assert not ww.prefer(768, 6144, 4096, "sm90") and not ww.prefer(1024, 6144, 4096, "sm90")
    assert ww.prefer(1024, 4096, 14336, "sm90") and ww.prefer(768, 10240, 8192, "sm90")
    assert not ww.prefer(1025, 10240, 8192, "sm90") and not ww.prefer(4096, 10240, 8192, "sm90")
    # 16-bit scales (the packed conversion) up to M = 2048, on every size there
    assert ww.prefer(2048, 6144, 4096, "sm90", scale16=True) and not ww.prefer(2049, 10240, 8192, "sm90", True)
    assert not ww.prefer(256, 10240, 8192, "default")


def test_small_m_rule():
    """16-bit scales at M = 32 / 64 / 128 exactly, where the programs fill their last round well enough."""
    for m in (32, 64, 128):
        # 28672 x 4096: 448 tiles, no split: of two rounds of 264 slots at M = 128 (0.85), of 396 at M = 32 / 64
        # (0.57, over SMALL_M_MIN_FILL); 10240 x 8192: 160 tiles, 2 splits, 320 of 396 at M = 32 / 64 (0.81), no
        # split, 160 of 264 at M = 128 (0.61)
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336), (8192, 28672), (10240, 8192)):
            cfg = ww.small_m_config(m, n, k, "sm90", 132, True)
            assert cfg is not None and cfg.block_m == m and cfg.num_warps == 4
            assert cfg.programs_per_sm == (2 if m == 128 else 3) and cfg.stages == 3
        assert ww.small_m_config(m, 6144, 4096, "sm90", 132, False) is None  # float32 scales: the tl tiles
        assert ww.small_m_config(m, 6144, 4096, "default", 132, True) is None
        assert ww.small_m_config(m, 6144, 4096, "sm90", 0, True) is None  # no GPU
    for m in (1, 16, 31, 33, 48, 96, 127, 129):
        assert ww.small_m_config(m, 6144, 4096, "sm90", 132, True) is None
    # 2048 x 8192 at M = 128: 32 column tiles x 8 splits = 256 of 264 slots
    assert ww.small_m_config(128, 2048, 8192, "sm90", 132, True) is not None
    # 6144 x 4096: 96 tiles x 4 splits = 384 of 396 slots at M = 64; x 2 = 192 of 264 at M = 128 (0.73)
    assert ww.splits_for(64, 6144, 4096, ww.SMALL_M_16BIT["sm90"][64], 132) == 4
    assert ww.splits_for(128, 6144, 4096, ww.SMALL_M_16BIT["sm90"][128], 132) == 2
    # the last round's fill at M = 32: 264 tiles of 32 x 64 on 132 SMs, three per SM, no split (264 of 396: 0.67);
    # 25 tiles on 8 SMs, no split (25 of two rounds of 24: 0.52, under SMALL_M_MIN_FILL)
    assert ww.small_m_config(32, 16896, 4096, "sm90", 132, True) is not None
    assert ww.small_m_config(32, 1600, 4096, "sm90", 8, True) is None
    assert set(ww.SMALL_M_16BIT["sm90"].values()) <= set(ww.all_configs("sm90"))


@pytest.mark.parametrize("m,n,k,block_m", [
    (384, 10240, 8192, 128),   # 160 tiles of 256 rows: a nearly empty second wave
    (384, 28672, 4096, 128),
    (512, 10240, 8192, 256),   # 160 tiles: the 14-column tail split 4 ways (152 vs 209 us for 128 rows, one launch)
    (192, 8192, 28672, 256),   # one wave either way; split-K halves the 256-row tile's K loop
    (384, 4096, 14336, 256),
    (768, 10240, 8192, 256),
    (1024, 10240, 8192, 256),
])
def test_tile_model_picks_the_measured_winner(m, n, k, block_m):
    assert ww.pick_config(m, n, k, None, arch="sm90", num_sms=132).block_m == block_m


@pytest.mark.parametrize("m,n,k,block_m,plan", [
    (1024, 10240, 8192, 256, (66, 2)),  # 320 tiles: 2 waves of 33 columns x 4 row tiles, 56 tail tiles split 2 ways
    (512, 10240, 8192, 256, (66, 4)),   # 160 tiles: 28 tail tiles, 4 ways
    (768, 8192, 28672, 256, (44, 2)),
    (768, 10240, 8192, 256, None),      # 108 tail tiles: no room for a second split
    (2048, 6144, 4096, 256, None),      # whole columns fill whole waves
    (256, 6144, 4096, 256, None),       # 48 tiles: split-K over the whole product instead
])
def test_tail_split_plan(m, n, k, block_m, plan):
    cfg = next(c for c in ww.all_configs("sm90") if c.block_m == block_m)
    got = ww.tail_split_for(m, n, k, cfg, 132)
    assert (got if got is None else (got.main_tiles_n, got.splits)) == plan
    if plan is not None:
        assert ww._waves(m, n, k, cfg, 132, got) < ww._waves(m, n, k, cfg, 132, None)


def test_split_k_fills_the_gpu_only_where_tiles_are_few():
    cfg = ww.all_configs("sm90")[0]
    assert ww.splits_for(256, 6144, 4096, cfg, 132) == 2  # 48 tiles
    assert ww.splits_for(1024, 10240, 8192, cfg, 132) == 1
    assert ww.splits_for(256, 100, 200, cfg, 132) == 2  # two chunks: at most one per split


def _compile_sm90(block_m=128, num_warps=8, stages=4, dtype="bf16", scale16=False, has_zero=False, split=False):
    """The kernel built for sm90 by this Triton, with the launcher's divisibility specializations."""
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    x = torch.empty(256, 4096, dtype=tdt)
    w = torch.empty(4096, 512, dtype=torch.int32)
    s = torch.empty(32, 4096, dtype=tdt if scale16 else torch.float32)
    args = dict(x_desc=ww.x_descriptor(x, block_m), w_ptr=w, s_ptr=s, z_ptr=w, bias_ptr=x, out_ptr=x)
    consts = dict(HAS_ZERO=has_zero, HAS_BIAS=True, SPLIT=split, SCALE16=scale16, STAGES=stages, GROUP=8,
                  num_warps=num_warps)
    return gluon_sm90_build(ww._wo_wgmma_kernel, args, consts,
                            lambda a, _: a.endswith("_ptr") or a in ("N", "K", "stride_wn", "stride_om"),
                            num_warps=num_warps)


@pytest.mark.skipif(not ww.GLUON_AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("build,spill_free", [
    ("block_m=128, stages=4, dtype='bf16', has_zero=True", True),
    # the small-M configs of 16-bit scales (SMALL_M_16BIT: 4 warps)
    ("block_m=32, num_warps=4, stages=3, dtype='bf16', scale16=True, split=True", True),
    ("block_m=128, num_warps=4, stages=3, dtype='fp16', scale16=True, split=True", True),
    ("block_m=256, stages=3, dtype='fp16', scale16=True, split=True", True),
    # the 256-row tile with float32 scales sits at 255 registers (ptxas: 20 bytes spilled), measured as shipped
    ("block_m=256, stages=3, dtype='bf16'", False),
])
def test_sm90_build_keeps_wgmma_in_flight(build, spill_free, tmp_path):
    """The point of the kernel, on its sm90 SASS: register-operand HGMMAs whose groups are retired two at a time
    (WARPGROUP.DEPBAR.LE gsb0, 0x2: the chunk before, while this chunk's products run), not waited for one by one
    (a DEPBAR 0x0 behind every HGMMA, what ptxas emits when it serializes the kernel, C7513)."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_weight_only_wgmma", f"_compile_sm90({build})")
    hgmma = re.findall(r"\bHGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass)
    assert len(hgmma) >= 16, "the weight should be the register A operand of 64xNx16 HGMMAs"
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x2\b", sass), "chunk t - 1 retired while chunk t runs"
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", sass)) <= 4, "wgmma serialized (C7513)"
    if spill_free:
        assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"


def test_w8_configs_scope_and_dispatch_rule():
    for cfg in ww.WGMMA_W8_CONFIGS.values():
        ww.check_config(cfg)
    assert not ww.prefer_w8(255, "sm90") and ww.prefer_w8(256, "sm90") and ww.prefer_w8(2048, "sm90")
    assert not ww.prefer_w8(2049, "sm90") and not ww.prefer_w8(1024, "default")
    qw = qf.quantize_weight(torch.randn(64, 256), bits=8, group_size=-1)
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    assert not ww.applies_w8(x, qw.qweight, qw.scales, 8)  # CPU: the tl kernels under the interpreter
    cfg = ww.WGMMA_W8_CONFIGS["sm90"]
    # 256 x 6144 on 132 SMs: 48 tiles of 256 x 128, two K splits of 32 chunks; 1024 x 10240: 320 tiles, none
    assert ww.w8_splits(256, 6144, 4096, cfg, 132) == 2 and ww.w8_splits(1024, 10240, 8192, cfg, 132) == 1
    assert ww.w8_splits(256, 100, 100, cfg, 132) == 2  # two 64-code chunks: at most one per split


def _compile_w8_sm90(block_m=256, num_warps=8, stages=3, dtype="bf16", has_zero=False, split=False):
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    x = torch.empty(256, 4096, dtype=tdt)
    w = torch.empty(4096, 1024, dtype=torch.int32)
    s = torch.empty(1, 4096, dtype=torch.float32)
    args = dict(x_desc=ww.x_descriptor(x, block_m), w_ptr=w, s_ptr=s, z_ptr=w, bias_ptr=x, out_ptr=x)
    consts = dict(HAS_ZERO=has_zero, HAS_BIAS=True, SPLIT=split, STAGES=stages, GROUP=8, num_warps=num_warps)
    return gluon_sm90_build(ww._w8_wgmma_kernel, args, consts,
                            lambda a, _: a.endswith("_ptr") or a in ("N", "K", "stride_wn", "stride_om"),
                            num_warps=num_warps)


@pytest.mark.skipif(not ww.GLUON_AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("build", ["", "dtype='fp16', has_zero=True, split=True", "block_m=128, stages=6"])
def test_w8_sm90_build_keeps_wgmma_in_flight(build, tmp_path):
    """As for int4: register-operand HGMMAs, chunk t - 1's group retired while chunk t's runs (one product per
    64-code chunk: WARPGROUP.DEPBAR.LE gsb0, 0x1), not serialized, and no spills."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_weight_only_wgmma", f"_compile_w8_sm90({build})")
    hgmma = re.findall(r"\bHGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass)
    assert len(hgmma) >= 8, "the converted weight should be the register A operand of 64xNx16 HGMMAs"
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", sass), "chunk t - 1 retired while chunk t runs"
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", sass)) <= 4, "wgmma serialized (C7513)"
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"
