"""CPU checks of the Gluon tensor-core int4 decode kernel (kernels/gemv_mma.py): configs, the scope and dispatch
rules, and its sm90 build with this Triton (offline: no GPU needed), whose SASS must show the point of the kernel.
The GPU tests (tests/gpu/test_gemv_mma_gpu.py) check its results."""

import re

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import gemv_mma as gm
from quantfuse.kernels import weight_only as kw
from tests._util import gluon_sm90_build, sm90_sass


def test_shipped_configs_are_valid_and_bad_ones_refused():
    for cfg in gm.all_configs("sm90"):
        gm.check_config(cfg)
    for bad in (gm.MmaDecodeConfig(96, 4, 4), gm.MmaDecodeConfig(32, 4, 4), gm.MmaDecodeConfig(128, 3, 4),
                gm.MmaDecodeConfig(128, 4, 0), gm.MmaDecodeConfig(128, 4, 2, x_group=3),
                gm.MmaDecodeConfig(128, 4, 2, x_group=-2)):
        with pytest.raises(ValueError, match="config"):
            gm.check_config(bad)


def test_x_ring_pick_from_8m_codes_at_two_tiles_only(monkeypatch):
    """M = 9..16 takes x through the shared-memory ring from X_RING_MIN_WEIGHTS codes, the register pick below;
    M <= 8 never does (results/tune_gemv_mma_x_ring.json)."""
    cpu = torch.device("cpu")
    for m in (9, 16):
        assert gm.pick_config(m, cpu, 4096 * 4096, "sm90").x_group == 2
        assert gm.pick_config(m, cpu, 3072 * 3072, "sm90").x_group == 2  # 9.4M codes
        reg = gm.pick_config(m, cpu, 2048 * 3072, "sm90")
        assert reg.x_group == 0 and not reg.early_refill
        assert reg == gm.MmaDecodeConfig(128, 4, 2, False, evict_first=True)
    for m in (1, 8):
        assert gm.pick_config(m, cpu, 28672 * 4096, "sm90") == gm.MmaDecodeConfig(128, 8, 2, early_refill=True)
    # rows the copy engine cannot read (a row stride of 4100 bytes): the register pick, whatever the weight
    seen = []
    real = gm.pick_config
    monkeypatch.setattr(gm, "pick_config",
                        lambda m, dev, weights: seen.append(weights) or real(m, dev, weights, "sm90"))
    assert gm.auto_config(torch.randn(16, 4096 + 2, dtype=torch.bfloat16)[:, :4096], 28672).x_group == 0
    assert gm.auto_config(torch.randn(16, 4096, dtype=torch.bfloat16), 28672).x_group == 2
    assert seen == [28672 * 4096, 0, 28672 * 4096]
    seen.clear()  # M <= 8 never takes the ring: one pick, rows unchecked
    assert gm.auto_config(torch.randn(8, 4096 + 2, dtype=torch.bfloat16)[:, :4096], 28672).x_group == 0
    assert seen == [28672 * 4096]


def test_evict_first_hint_by_m_and_weight_size(monkeypatch):
    """The evict-first hint (EVICT_FIRST_BELOW, results/tune_evict_first*.json): at M = 9..16 on every weight, at
    M <= 8 below 16M codes only; the register pick for rows the copy engine cannot read keeps the weight's
    choice; off on other architectures."""
    cpu = torch.device("cpu")
    for m in (9, 16):
        for weights in (2048 * 2048, 4096 * 4096, 28672 * 8192):
            assert gm.pick_config(m, cpu, weights, "sm90").evict_first
    for m in (1, 8):
        assert gm.pick_config(m, cpu, 3072 * 3072, "sm90").evict_first
        assert gm.pick_config(m, cpu, (16 << 20) - 1, "sm90").evict_first
        for weights in (16 << 20, 4096 * 28672, 28672 * 8192):
            cfg = gm.pick_config(m, cpu, weights, "sm90")
            assert not cfg.evict_first and cfg == gm.candidates(m, cpu, "sm90")[0]
    assert all(not c.evict_first for c in gm.all_configs("sm90"))  # the tuner's candidates stay hint-free
    real = gm.pick_config
    monkeypatch.setattr(gm, "pick_config", lambda m, dev, weights: real(m, dev, weights, "sm90"))
    for m, n, hinted in ((16, 28672, True), (4, 3072, True), (4, 28672, False)):
        strided = gm.auto_config(torch.randn(m, 4096 + 2, dtype=torch.bfloat16)[:, :4096], n)
        assert strided.x_group == 0 and strided.evict_first is hinted
    monkeypatch.setattr(gm, "pick_config", lambda m, dev, weights: real(m, dev, weights, "default"))
    monkeypatch.setitem(gm.MMA_DECODE_CONFIGS, "default", gm.MMA_DECODE_CONFIGS["sm90"])
    assert not gm.auto_config(torch.randn(16, 2048, dtype=torch.bfloat16), 2048).evict_first


def test_never_applies_on_cpu_tensors_or_outside_its_scope():
    qw = qf.quantize_weight(torch.randn(64, 256), bits=4, group_size=128)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not gm.applies(x, qw.qweight, qw.scales, 4, 128, 256)  # CPU tensors: the tl kernels (interpreter)
    y = qf.weight_only_mm(x, qw)
    assert y.shape == (1, 64)


def test_prefer_rule():
    assert kw.prefer_gemv_mma(1, 28672, 4096)
    assert kw.prefer_gemv_mma(1, 14336, 4096)
    assert kw.prefer_gemv_mma(1, 6144, 4096) and kw.prefer_gemv_mma(1, 4096, 4096)  # early refill wins there
    assert kw.prefer_gemv_mma(1, 3072, 2048) and kw.prefer_gemv_mma(1, 3072, 3072)  # small models: from 6M codes
    assert not kw.prefer_gemv_mma(1, 1024, 4096) and not kw.prefer_gemv_mma(1, 2048, 2048)  # the tl GEMV at 4M
    assert kw.prefer_gemv_mma(2, 4096, 4096) and kw.prefer_gemv_mma(8, 4096, 4096)
    assert kw.prefer_gemv_mma(2, 1024, 4096) and kw.prefer_gemv_mma(8, 2048, 2048)  # M = 2..8 from 4M codes
    assert not kw.prefer_gemv_mma(8, 1024, 2048)
    assert kw.prefer_gemv_mma(9, 28672, 4096) and kw.prefer_gemv_mma(16, 4096, 4096)
    assert kw.prefer_gemv_mma(16, 1024, 4096) and not kw.prefer_gemv_mma(16, 1024, 2048)
    assert not kw.prefer_gemv_mma(17, 28672, 4096)


def _compile_sm90(dtype="bf16", per_channel=False, has_zero=False, mp=8, cfg=None, signal=False):
    """The kernel built for sm90 by this Triton, with the launcher's divisibility specializations."""
    cfg = cfg or gm.all_configs("sm90")[0]
    consts = dict(HAS_ZERO=has_zero, HAS_BIAS=True, SPLIT=True, FUSED_REDUCE=True, PER_CHANNEL=per_channel,
                  EVEN_K=True, BLOCK_N=cfg.block_n, MP=mp, num_warps=cfg.num_warps, SIGNAL=signal,
                  EARLY_REFILL=int(cfg.early_refill), GROUP_X=cfg.x_group)
    types = dict(x_ptr="*" + dtype, w_ptr="*i32", s_ptr="*fp32", z_ptr="*i32", bias_ptr="*" + dtype,
                 out_ptr="*" + dtype, part_ptr="*fp32", count_ptr="*i32")
    if cfg.x_group:  # the launcher's descriptor over x in [MP, 64] boxes
        from quantfuse.kernels._gluon import operand_descriptor

        tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
        types["x_desc"] = operand_descriptor(torch.empty(mp, 4096, dtype=tdt), [mp, gm.CHUNK // 2])
    return gluon_sm90_build(gm._wo_mma_decode_kernel, types, consts,
                            lambda a, _: a.endswith("_ptr") or a in ("N", "K", "stride_xm", "stride_wn", "stride_om"),
                            num_warps=cfg.num_warps)


@pytest.mark.skipif(not gm.GLUON_AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("dtype,per_channel,has_zero,mp", [("bf16", False, False, 8), ("fp16", True, True, 16)])
def test_sm90_build_converts_in_registers_without_spills(dtype, per_channel, has_zero, mp, tmp_path):
    """The point of the kernel, on its sm90 SASS: the weight comes in 16-byte loads, x in 8-byte ones; per int4
    word one packed subtract for each of its four register pairs (HADD2, two weights each) feeds HMMA directly
    (the expansion into the operand layout is asserted trivial at build time, so no shuffles or shared memory
    in the loop), and nothing spills."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_gemv_mma",
                        f"_compile_sm90({dtype!r}, {per_channel}, {has_zero}, {mp})")
    suffix = r"\.BF16" if dtype == "bf16" else ""  # ptxas spells the float16 one HMMA.16816.F32
    assert re.search(rf"\bHMMA\.16816\.F32{suffix}\s", sass)
    assert re.search(r"\bLDG\.E\.128\b", sass), "the packed words should come 16 bytes at a time"
    assert re.search(r"\bLDG\.E\.64\b", sass), "x should come 4 values (8 bytes) at a time"
    hadd = len(re.findall(r"\bHADD2(\.BF16_V2)?\b", sass))
    hmma = len(re.findall(r"\bHMMA\.16816\b", sass))
    # per chunk and 16-row tile: 8 words x 4 pairs = 32 HADD2 per lane, 8 x (mp / 8) HMMA (a few HADD2 outside
    # the loop in float16: the epilogue)
    assert 4 * hmma <= hadd * (mp // 8) <= 4 * hmma + 16, (hadd, hmma)
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"


@pytest.mark.skipif(not gm.GLUON_AVAILABLE, reason="this Triton has no Gluon")
def test_sm90_early_refill_build_holds_a_third_buffer_without_spills(tmp_path):
    """Early refill (a buffer's next chunk loaded before its chunk is converted) keeps three chunks of words in
    registers at M <= 8: more registers than the two-buffer loop, still no spills, still 16-byte loads."""
    early = "gm.MmaDecodeConfig(128, 4, 3, early_refill=True)"
    sass, usage = sm90_sass(tmp_path, "tests.kernels.test_gemv_mma", f"_compile_sm90('bf16', False, False, 8, {early})")
    _, usage_late = sm90_sass(tmp_path, "tests.kernels.test_gemv_mma",
                              "_compile_sm90('bf16', False, False, 8, gm.MmaDecodeConfig(128, 4, 3))")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    regs_late = int(re.search(r"REG:(\d+)", usage_late).group(1))
    assert regs > regs_late, (regs, regs_late)
    assert re.search(r"\bLDG\.E\.128\b", sass)
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"


@pytest.mark.skipif(not gm.GLUON_AVAILABLE, reason="this Triton has no Gluon")
def test_sm90_x_ring_build_reads_x_from_shared_memory(tmp_path):
    """The M = 9..16 pick (x through the shared-memory ring, early refill): x comes by the copy engine and is read
    with 8-byte shared loads (no 8-byte global loads of x), the words still 16 bytes at a time, and early refill
    fits beside it without spills."""
    cfg = "gm.MmaDecodeConfig(128, 4, 2, False, True, x_group=2)"
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_gemv_mma", f"_compile_sm90('bf16', False, False, 16, {cfg})")
    assert re.search(r"\bUTMALDG\.2D\b", sass), "x should come through the copy engine"
    assert re.search(r"\bLDS\.64\b", sass) and not re.search(r"\bLDG\.E\.64\b", sass)
    assert re.search(r"\bLDG\.E\.128\b", sass)
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) >= 32
    assert not re.search(r"\b(STL|LDL)\b", sass), "register spills"
