"""The Gluon TMA-fed GEMV (kernels/gemv_tma.py) without a GPU: when it is chosen, its configs, and its sm90 build.
Its numerics are tested on the GPU (tests/gpu/test_gemv_tma_gpu.py); under the interpreter weight_only_mm runs
the `tl` GEMV (the twin)."""

import re

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import gemv_tma as gt
from tests._util import gluon_sm90_build, sm90_sass


def _qw(n=256, k=512, bits=4, group=128):
    return qf.quantize_weight(torch.randn(n, k), bits=bits, group_size=group)


def test_never_applies_to_cpu_tensors():
    qw = _qw()
    x = torch.randn(1, 512).to(torch.bfloat16)
    assert not gt.applies(x, qw.qweight, qw.scales, 4, 128, 512)


@pytest.mark.parametrize("bits", [4, 8])
def test_table_configs_are_valid(bits):
    for cfg in gt.GEMV_CONFIGS["sm90"][bits]:
        gt.check_config(cfg)
        assert cfg.rows_per_thread() >= 1


@pytest.mark.parametrize("cfg,match", [
    (gt.GemvConfig(128, 3, 4, 4, 2), "chunks"),
    (gt.GemvConfig(16, 2, 4, 4, 2), "block_n"),     # 4 warps x 4 rows cover 16: fine; 8 warps do not
    (gt.GemvConfig(96, 1, 4, 4, 2), "block_n"),
    (gt.GemvConfig(128, 1, 4, 1, 2), "stages"),
])
def test_bad_configs_refused(cfg, match):
    if cfg.block_n == 16:
        cfg = gt.GemvConfig(16, 2, 8, 4, 2)
    with pytest.raises(ValueError, match=match):
        gt.check_config(cfg)


def _compile_sm90(cfg: gt.GemvConfig, bits: int = 4, per_channel: bool = False):
    """The kernel built for sm90 by this Triton, with the launcher's divisibility specializations."""
    n, k = 4096, 4096
    qw = torch.zeros(n, k * bits // 32, dtype=torch.int32)
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    s = torch.zeros(k // 128, n)
    args = dict(w_desc=gt._descriptor(qw, cfg), x_ptr=x, s_ptr=s, z_ptr=s, bias_ptr=x, out_ptr=x, part_ptr=s,
                count_ptr=torch.zeros(4, dtype=torch.int32))
    consts = dict(BITS=bits, GROUP_FIELDS=32 // bits if per_channel else 8, HAS_ZERO=False, HAS_BIAS=True, SPLIT=True,
                  FUSED_REDUCE=True, PER_CHANNEL=per_channel, K_MULTIPLE_OF_16=True, STAGES=cfg.stages,
                  num_warps=cfg.num_warps)
    return gluon_sm90_build(gt._wo_gemv_tma_kernel, args, consts, lambda a, _: a.endswith("_ptr") or a in ("N", "K"),
                            num_warps=cfg.num_warps)


@pytest.mark.skipif(not gt.GLUON_AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("bits", [4, 8])
def test_sm90_build_streams_by_tma_without_spills(bits, tmp_path):
    """The point of the kernel, checked on its sm90 SASS: weight tiles come by TMA (UTMALDG), are read from shared
    memory 16 bytes at a time, x comes in 8-byte loads (one per thread, field and tile), and nothing spills. And x is
    loaded one tile ahead: before the first wait on a tile's words, the prologue's loads of the first tile's first
    four fields and the loop's loads for the next tile (int4: and this tile's last four fields) are issued."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_gemv_tma",
                        f"_compile_sm90(gt.GEMV_CONFIGS['sm90'][{bits}][0], {bits}, per_channel={bits == 8})")
    assert re.search(r"\bUTMALDG\.3D\b", sass)
    assert re.search(r"\bLDS\.128\b", sass)
    assert re.search(r"\bLDG\.E\.64\b", sass), "x's 4 values per thread should be one 8-byte load"
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"
    first_wait = re.search(r"\bSYNCS\.PHASECHK\b", sass)
    assert first_wait, "no mbarrier wait found"
    ahead = len(re.findall(r"\bLDG\.E\.64\b", sass[:first_wait.start()]))
    assert ahead >= (12 if bits == 4 else 8), f"{ahead} x loads issued before the first wait on the words"


def test_prefer_rule():
    from quantfuse.kernels import weight_only as kw

    tile = dict(block_n=64, programs_per_sm=8)
    assert kw.prefer_gemv_tma(8, 4096, 4096, tile, 132)  # int8: always
    assert kw.prefer_gemv_tma(4, 1024, 4096, tile, 132)  # 16 column blocks x 32 chunks < 8 x 132
    assert not kw.prefer_gemv_tma(4, 4096, 4096, tile, 132)  # 64 x 32 >= 1056: the tl GEMV
