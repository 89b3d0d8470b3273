"""The Gluon blockwise FP8 kernel (kernels/blockwise_wgmma.py) without a GPU: when it is chosen, that a CPU
caller can never reach it, and its sm90 build. Its numerics are tested on the GPU
(tests/gpu/test_scaled_mm_gpu.py); under the interpreter scaled_mm_blockwise runs the `tl` twin."""

import re

import pytest
import torch

from quantfuse.kernels import blockwise_wgmma as bw
from quantfuse.kernels import _gluon
from quantfuse.kernels import scaled_mm as kmm
from tests._util import gluon_sm90_build, sm90_sass

FP8 = torch.float8_e4m3fn


def _operands(m=512, k=1024, n=256):
    a = (torch.randn(m, k) * 4).to(FP8)
    w = (torch.randn(n, k) * 4).to(FP8)
    sa = torch.rand(m, -(-k // 128)) + 0.5
    sb = torch.rand(-(-k // 128), -(-n // 128)) + 0.5
    return a, w.t(), sa, sb


def test_never_applies_to_cpu_tensors():
    a, b, _, _ = _operands()
    assert not bw.applies(a, b)
    assert not bw.applies(a, b, any_m=True)


def test_explicit_config_refused_off_sm90():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="config: a WgmmaConfig needs sm90"):
        kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, bw.WgmmaConfig(128, 128, 8, 4))


def test_rows_the_gluon_kernel_takes():
    # from 257 rows always; below, 96..128 and 192..256 rows, where its 128-row tiles are at least 3/4 full
    # (tune_blockwise_ws_small_m.json, ..._below_128.json: 0.90-1.51x the tl tiles at 96 / 128 / 192 / 256 rows, under
    # 1 on 2 of 24 shapes; at 64 and 160 rows 0.69-1.34x, under 1 on 6 of 12)
    assert [m for m in range(1, 257) if bw.takes_m(m)] == list(range(96, 129)) + list(range(192, 257))
    assert all(bw.takes_m(m) for m in (257, 300, 1000, 4096))


def test_table_shape():
    for _, cands in bw.WGMMA_CONFIGS["sm90"]:
        for cfg in cands:
            assert bw.SCALE_BLOCK % cfg.block_n == 0 and cfg.block_m >= 16 * cfg.num_warps


def _compile_sm90(cfg: bw.WgmmaConfig, scale_smem: bool = True):
    """The kernel `cfg` selects, built for sm90 by this Triton; scale_smem: the warp-specialized kernel's
    shared-memory scale path."""
    a, b, sa, sb = _operands()
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    a_desc = _gluon.operand_descriptor(a, [cfg.block_m, bw.SCALE_BLOCK])
    args = dict(a_desc=a_desc, b_desc=_gluon.operand_descriptor(b.t(), [cfg.block_n, bw.SCALE_BLOCK]),
                out_ptr=out, scale_a_ptr=sa, scale_b_ptr=sb, bias_ptr=out)
    consts = dict(HAS_BIAS=True, GROUP_M=cfg.group_m, STAGES=cfg.stages, SCALE_BLOCK=bw.SCALE_BLOCK,
                  num_warps=cfg.num_warps)
    fn, options = bw._blockwise_wgmma_kernel, dict(num_warps=cfg.num_warps)
    if cfg.specialized:
        sa_t = sa.t().contiguous()  # the transposed layout: [K/128, M], rows of 512 floats
        args["sa_desc"] = bw._scale_descriptor(sa_t, [1, cfg.block_m]) if scale_smem else a_desc
        consts.update(SCALE_SMEM=scale_smem, CONSUMER_REGS=bw.WS_CONSUMER_REGS, num_warps=4)
        fn, options = bw._ws_kernel, dict(num_warps=4, maxnreg=bw.WS_MAXNREG)
    return gluon_sm90_build(fn, args, consts, **options)


def _build_expression(cfg: bw.WgmmaConfig, scale_smem: bool) -> str:
    fields = ", ".join(str(int(v)) for v in (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.group_m,
                                              cfg.specialized))
    return f"_compile_sm90(bw.WgmmaConfig({fields}), {bool(scale_smem)})"


# the pointer-loaded kernel, and the warp-specialized one with either scale path (the table's first config)
@pytest.mark.skipif(not bw.GLUON_AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("cfg,scale_smem", [(bw.WgmmaConfig(128, 128, 8, 4), True),
                                            (bw.WgmmaConfig(128, 128, 8, 4, 8, 1), True),
                                            (bw.WgmmaConfig(128, 128, 8, 4, 8, 1), False)], ids=str)
def test_sm90_build_keeps_wgmma_asynchronous(tmp_path, cfg, scale_smem):
    """A regression guard on the point of the kernel: ptxas serializes every wgmma (waits for each right after
    issuing it) when non-wgmma code touches registers a wgmma is still writing; the fast build issues each
    K step's four wgmma back to back as one group and retires groups at depth 1."""
    if cfg.specialized and bw._aggregate is None:
        pytest.skip("this Triton has no aggregates: the warp-specialized kernel is off")
    sass, usage = sm90_sass(tmp_path, "tests.kernels.test_blockwise_wgmma", _build_expression(cfg, scale_smem))
    mma = re.findall(r"\bQGMMA\.[^;]*", sass)
    committed = [m for m in mma if "gsb0" in m]
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert len(mma) >= 8
    # one commit (gsb0) per K step of four 32-deep wgmma; a serialized build commits and waits for each one
    assert 4 * len(committed) <= len(mma), f"{len(committed)} of {len(mma)} wgmma committed one by one: serialized"
    assert "0x1" in waits, "no wgmma left in flight anywhere"
    regs = re.findall(r"REG:(\d+)", usage)
    assert regs and int(regs[0]) <= 255
