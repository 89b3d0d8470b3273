"""CPU checks of the warp-specialized Gluon int4 kernel for prefill-sized M (kernels/weight_only_ws.py): configs,
scope, the dispatch rule and the tail plan it borrows, and its sm90 build with this Triton (offline: no GPU
needed), whose SASS must show the point of the kernel: the conversion in its own warpgroup feeding shared-memory
wgmma. The GPU tests (tests/gpu/test_weight_only_ws_gpu.py) check its results."""

import re

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import weight_only_wgmma as ww
from quantfuse.kernels import weight_only_ws as ws
from tests._util import sm90_sass


def test_default_config_fits_and_bad_ones_are_refused():
    ws.check_config(ws.WsW4Config(), 4, True)
    ws.check_config(ws.WsW4Config(), 2, False)
    for bad in (ws.WsW4Config(stages=1), ws.WsW4Config(stages=5), ws.WsW4Config(aux_stages=0),
                ws.WsW4Config(group=0), ws.WsW4Config(aux_stages=8)):
        with pytest.raises(ValueError, match="config"):
            ws.check_config(bad, 4, True)


def test_never_applies_on_cpu_tensors():
    qw = qf.quantize_weight(torch.randn(256, 256), bits=4, group_size=128, scale_dtype=torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    assert not ws.applies(x, qw.qweight, qw.scales, 4, 128, qw.zeros)
    assert qf.weight_only_mm(x, qw).shape == (512, 256)


def test_single_row_scales_are_describable_whatever_torch_reports_as_their_stride():
    # per-channel scales [1, N] may carry stride (1, 1): no box steps over that row, so it must not disqualify them
    qw = qf.quantize_weight(torch.randn(384, 512), bits=4, group_size=-1, symmetric=False)
    assert qw.scales.shape[0] == 1 and qw.zeros.shape[0] == 1
    assert all(ws._rows_describable(t) for t in (qw.qweight, qw.scales, qw.zeros))
    assert not ws._rows_describable(torch.empty(4, 100, dtype=torch.bfloat16))  # 200-byte rows
    assert not ws._rows_describable(torch.empty(4, 128)[:, 1:])  # a base off the 16-byte grid


def test_prefer_rule():
    # M = 1024..2048, and only where the product fills the SMs without a split over K
    assert ws.prefer(1024, 28672, 4096, "sm90", 132) and ws.prefer(2048, 6144, 4096, "sm90", 132)
    assert ws.prefer(1024, 6144, 4096, "sm90", 132)  # with the tail split (weight_only_wgmma's rule: cuBLAS)
    assert not ws.prefer(4096, 28672, 4096, "sm90", 132) and not ws.prefer(255, 28672, 4096, "sm90", 132)
    assert not ws.prefer(1024, 512, 4096, "sm90", 132)  # 8 tiles: weight_only_wgmma splits K
    assert not ws.prefer(1024, 28672, 4096, "default", 132)
    # M = 256..1023: also only where the model keeps this kernel's 256 x 128 tile
    for m, n, k in ((256, 28672, 4096), (512, 28672, 4096), (512, 6144, 4096), (768, 4096, 14336)):
        cfg, splits, _ = ww.plan(m, n, k, "sm90", 132)
        assert splits == 1 and (cfg.block_m, cfg.block_n) == (ws.BLOCK_M, ws.BLOCK_N)
        assert ws.prefer(m, n, k, "sm90", 132), (m, n, k)
    assert ww.plan(512, 4096, 14336, "sm90", 132)[1] > 1 and not ws.prefer(512, 4096, 14336, "sm90", 132)
    assert ww.plan(256, 10240, 8192, "sm90", 132)[0].block_m == 128 and not ws.prefer(256, 10240, 8192, "sm90", 132)


def test_tail_plan_is_weight_only_wgmma_s_where_the_tiles_match():
    cfg, tail = ws.tail_plan(1024, 10240, 8192, "sm90", 132)
    assert (cfg.block_m, cfg.block_n) == (ws.BLOCK_M, ws.BLOCK_N) and (tail.main_tiles_n, tail.splits) == (66, 2)
    assert ws.tail_plan(2048, 6144, 4096, "sm90", 132) is None  # whole waves
    assert ws.tail_plan(1024, 6144, 4096, "sm90", 132)[1] == ww.tail_split_for(
        1024, 6144, 4096, ww.all_configs("sm90")[0], 132)


def test_fields_ptx_is_one_lop3_per_field():
    ptx = ws._fields_ptx()
    assert len(re.findall(r"\blop3\.b32\b", ptx)) == 8 and len(re.findall(r"\bshr\.u32\b", ptx)) == 1
    for f in range(4):  # field f of each half OR-ed into 2^23 where it lies
        assert f"{0xF << (4 * f):#010x}, 0x4b000000, 0xea" in ptx


def _compile_sm90(scale16=False, has_zero=False):
    """The kernel built for sm90 by this Triton, with the launcher's arguments at aligned shapes."""
    from tests._util import gluon_sm90_build
    x = torch.empty(1024, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, 512, dtype=torch.int32)
    s = torch.empty(32, 4096, dtype=torch.bfloat16 if scale16 else torch.float32)
    z = torch.empty(32, 4096, dtype=torch.int32)
    s_desc = ws._row_descriptor(s, [1, ws.BLOCK_N])
    cfg = ws.WsW4Config()
    args = dict(x_desc=ws.x_descriptor(x), wq_desc=ws._row_descriptor(w, [ws.BLOCK_N, ws.WORDS_PER_CHUNK]),
                s_desc=s_desc, z_desc=ws._row_descriptor(z, [1, ws.BLOCK_N]) if has_zero else s_desc,
                bias_ptr=x, out_ptr=x)
    consts = dict(HAS_ZERO=has_zero, HAS_BIAS=True, SCALE16=scale16, STAGES=cfg.stages, AUX=cfg.aux_stages,
                  GROUP=cfg.group, CONSUMER_REGS=cfg.consumer_regs, num_warps=4)
    return gluon_sm90_build(ws._wo_ws_kernel, args, consts,
                            lambda a, _: a.endswith("_ptr") or a in ("N", "K", "stride_om"),
                            num_warps=4, maxnreg=cfg.maxnreg)


@pytest.mark.skipif(not ws.GLUON_AVAILABLE or ws._aggregate is None, reason="this Triton has no Gluon aggregates")
@pytest.mark.parametrize("build", ["scale16=False, has_zero=True", "scale16=True, has_zero=False"])
def test_sm90_build_converts_in_its_own_warpgroup(build, tmp_path):
    """The point of the kernel, on its sm90 SASS: both wgmma operands in shared memory (64x256x16 HGMMAs on two
    descriptors, one chunk in flight per consumer: DEPBAR 0x1), w_hat stored by the producer in 16-byte pieces
    (8 fields x 2 rows per thread per chunk), published behind one proxy fence per chunk, words / scales / zero
    points brought by the copy engine (no global loads outside the epilogue's bias), and nothing spilled."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_weight_only_ws", f"_compile_sm90({build})")
    hgmma = re.findall(r"\bHGMMA\.64x256x16\.F32(\.BF16)? R\d+, gdesc\[UR\d+\], R\d+", sass)
    assert len(hgmma) == 8, len(hgmma)  # 2 consumers x 4 K slices of 16 (one 64-deep half chunk)
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", sass)
    assert len(re.findall(r"\bSTS\.128\b", sass)) == 16
    # the fences that order the mbarrier initialisations (the preamble, once) are not counted: how many ptxas
    # emits there depends on the code around them (one per barrier pair in some builds)
    assert len(re.findall(r"\bFENCE\.VIEW\.ASYNC\.S\b(?!(?:[^\n]*\n){1,3}[^\n]*SYNCS\.EXCH)", sass)) <= 2
    assert len(re.findall(r"\bUTMALDG\b", sass)) >= 4  # x (two halves), words, scales (and zero points)
    assert len(re.findall(r"\bLDG\b", sass)) <= 4, "global loads other than the bias"
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"
