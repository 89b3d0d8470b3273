"""The byte-view W8A16 decode kernel (kernels/w8_decode.py) under the interpreter: against the product with the
unrounded weights W = (u - z) * s (the scale after the sums), identity rows bit for bit equal to w_hat, split-K,
masks (K not a multiple of the chunk or the step, N not a multiple of the block, M not a multiple of block_m), more
than one block of M rows, padded rows, a NaN row, the dispatch band and bad configs."""

import dataclasses

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import w8_decode as kwd
from quantfuse.kernels import weight_only as kw
from tests._util import KernelSpy

BF16, FP16 = torch.bfloat16, torch.float16
UNIT = {BF16: 2.0**-8, FP16: 2.0**-11}
SM90_CFG = kwd.W8_DECODE_CONFIGS["sm90"][0]
SMALL_CFG = kwd.W8_DECODE_CONFIGS["default"][0]
WIDE_CFG = kwd.W8DecodeConfig(32, 64, 4, 2, 2, block_m=32)


def _qw(n, k, symmetric, scale_dtype=torch.float32):
    return qf.quantize_weight(torch.randn(n, k) * 0.5, bits=8, group_size=-1, symmetric=symmetric,
                              scale_dtype=scale_dtype)


def _run(x, qw, bias=None, **kw_args):
    return kwd.w8_decode_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.shape[0], **kw_args)


def _unrounded(qw):
    """W = (u - z) * s in float64, [N, K]."""
    return (qw.biased_codes().double() - qw.zero_points().double().t()) * qw.scales.double().t()


def assert_scale_after_bound(y, x, qw, bias=None):
    """|y - x @ W.T - bias| <= u |ref| + 2^-20 (|x| @ |W|.T + |bias|): one output rounding plus float32 noise."""
    w = _unrounded(qw)
    xd = x.double()
    want = xd @ w.t()
    mag = xd.abs() @ w.abs().t()
    if bias is not None:
        want, mag = want + bias.double(), mag + bias.double().abs()
    err = (y.double() - want).abs()
    ratio = float((err / (UNIT[y.dtype] * want.abs() + 2.0**-20 * mag + 1e-30)).max())
    assert ratio <= 1.0, f"error {float(err.max())} exceeds the bound (ratio {ratio})"


# (M, K, N, symmetric, dtype, scale dtype, bias, splits, config): K = 8 (one partial chunk), 200 / 264 (K_pad past
# K, a partial step), 4096 (many steps, split), N below / past the block, M = 1 .. 16
CASES = [
    (1, 8, 1, True, BF16, torch.float32, False, None, SMALL_CFG),
    (2, 200, 33, False, BF16, torch.float32, True, 2, SMALL_CFG),
    (5, 576, 130, True, FP16, torch.float16, True, 3, SMALL_CFG),
    (16, 264, 17, False, FP16, torch.float32, False, None, SM90_CFG),
    (7, 1024, 300, True, BF16, torch.bfloat16, True, 1, SM90_CFG),
    (16, 4096, 40, False, BF16, torch.float32, True, 5, SM90_CFG),
    (3, 520, 129, False, FP16, torch.float16, False, 4, SM90_CFG),
    # M past block_m: two and three program rows (the last partial), with and without split-K
    (17, 264, 40, False, BF16, torch.float32, True, None, SMALL_CFG),
    (40, 576, 33, True, FP16, torch.float32, False, 3, SMALL_CFG),
    (33, 200, 65, False, BF16, torch.bfloat16, True, 2, WIDE_CFG),
    (32, 1024, 31, True, BF16, torch.float32, False, 1, WIDE_CFG),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{'s' if c[3] else 'a'}-{c[4]}-"
                         f"s{c[5]}{'-bias' if c[6] else ''}-splits{c[7]}-n{c[8].block_n}-m{c[8].block_m}")
def test_against_the_unrounded_product(case):
    m, k, n, symmetric, dtype, scale_dtype, has_bias, splits, cfg = case
    qw = _qw(n, k, symmetric, scale_dtype)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    y = _run(x, qw, bias, config=cfg, splits=splits, num_sms=4)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_scale_after_bound(y, x, qw, bias)


@pytest.mark.parametrize("cfg", [SMALL_CFG, SM90_CFG, WIDE_CFG], ids=["small", "sm90", "wide"])
@pytest.mark.parametrize("splits", [1, 3])
def test_identity_rows_equal_w_hat_bit_for_bit(cfg, splits):
    # x = rows of the identity: each output is one exact (u - z) times s, rounded as the reference rounds w_hat;
    # the other splits add exact zeros. 20 rows: two program rows of 16, one of 32
    k, n = 200, 70
    qw = _qw(n, k, symmetric=False)
    cols = torch.tensor([0, 1, 2, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 129, 150, 191, 192, 193, 198, 199])
    for dtype in (BF16, FP16):
        x = torch.zeros(cols.numel(), k, dtype=dtype)
        x[torch.arange(cols.numel()), cols] = 1
        y = _run(x, qw, config=cfg, splits=splits, num_sms=4)
        want = qw.dequantize(dtype)[:, cols].t()
        assert torch.equal(y.view(torch.int16), want.contiguous().view(torch.int16))


def test_padded_rows_and_nan_row_isolation():
    k, n = 576, 90
    qw = _qw(n, k, symmetric=True)
    big = torch.randn(6, k + 8).to(BF16)
    x = big[:, :k]
    y = _run(x, qw, config=SMALL_CFG, splits=2, num_sms=4)
    assert torch.equal(y, _run(x.contiguous(), qw, config=SMALL_CFG, splits=2, num_sms=4))
    poisoned = x.clone()
    poisoned[3, 100] = float("nan")
    yp = _run(poisoned, qw, config=SMALL_CFG, splits=2, num_sms=4)
    assert bool(torch.isnan(yp[3]).all())
    others = [0, 1, 2, 4, 5]
    assert torch.equal(yp[others], y[others])


def test_dispatch_band(monkeypatch, triton_backend):
    # as on an sm90 device: int8 per channel at M = 2..32 runs here (17..32 with the 32-row config); M = 1, M = 33,
    # grouped int8 and int4 do not
    monkeypatch.setattr(kw, "arch_key", lambda *a: "sm90")
    spy = KernelSpy(kwd._w8_decode_kernel)
    monkeypatch.setattr(kwd, "_w8_decode_kernel", spy)
    k, n = 256, 48
    per_channel = _qw(n, k, symmetric=True)
    grouped = qf.quantize_weight(torch.randn(n, k), bits=8, group_size=128)
    int4 = qf.quantize_weight(torch.randn(n, k), bits=4, group_size=-1)
    for m, qw, runs in [(2, per_channel, True), (16, per_channel, True), (17, per_channel, True),
                        (32, per_channel, True), (1, per_channel, False), (33, per_channel, False),
                        (4, grouped, False), (4, int4, False)]:
        before = len(spy.calls)
        x = torch.randn(m, k).to(BF16)
        y = qf.weight_only_mm(x, qw)
        assert (len(spy.calls) > before) == runs, (m, qw)
        if runs:
            assert_scale_after_bound(y, x, qw)
            # one program row: the 16-row config up to M = 16, the 32-row one above
            assert spy.calls[-1]["grid"][0] == 1 and spy.calls[-1]["BLOCK_M"] == (16 if m <= 16 else 32)
    assert kwd.prefer(2, "sm90") and kwd.prefer(16, "sm90") and kwd.prefer(32, "sm90")
    assert not kwd.prefer(1, "sm90") and not kwd.prefer(33, "sm90") and not kwd.prefer(8, "default")


def test_split_reduce_launched_early_where_configured(monkeypatch):
    """With split-K and configs.split_k_reduce_pdl: the decode kernel gets PDL (it signals its dependents at its
    start) and the reduce kernel is launched with pdl; without either, neither. Launches recorded, not run: the
    interpreter has no grid dependency control."""
    launches, reduces = [], []
    monkeypatch.setattr(kwd, "launch_kernel", lambda fn, grid, *a, **kw_: launches.append(kw_))
    monkeypatch.setattr(kw, "splitk_reduce", lambda part, bias, out, pdl=False: reduces.append(pdl))
    qw = _qw(48, 256, symmetric=True)
    x = torch.randn(4, 256).to(BF16)
    for reduce_pdl, splits, want_pdl, want_reduces in [(True, 2, True, [True]), (True, 1, False, []),
                                                       (False, 2, False, [False])]:
        monkeypatch.setattr(kwd, "split_k_reduce_pdl", lambda device, v=reduce_pdl: v)
        launches.clear()
        reduces.clear()
        _run(x, qw, config=SMALL_CFG, splits=splits, num_sms=4)
        assert [c["PDL"] for c in launches] == [want_pdl] and reduces == want_reduces, (reduce_pdl, splits)


def test_applies_scope():
    qw = _qw(16, 64, symmetric=True)
    x = torch.randn(4, 64).to(BF16)
    assert kwd.applies(x, qw.qweight, qw.scales, 8)
    assert not kwd.applies(x.float(), qw.qweight, qw.scales, 8)
    assert kwd.applies(torch.randn(17, 64).to(BF16), qw.qweight, qw.scales, 8)  # any M runs; `prefer` picks the band
    assert not kwd.applies(torch.randn(0, 64).to(BF16), qw.qweight, qw.scales, 8)
    assert not kwd.applies(x, qw.qweight, torch.ones(2, 16), 8)
    assert not kwd.applies(x, qw.qweight, qw.scales, 4)
    assert not kwd.applies(torch.randn(64, 4).to(BF16).t(), qw.qweight, qw.scales, 8)


def test_shipped_configs_and_split_plan():
    for configs in kwd.W8_DECODE_CONFIGS.values():
        assert [c.block_m for c in configs] == sorted({c.block_m for c in configs}), "by increasing block_m"
        for cfg in configs:
            kwd.check_config(cfg)
    for arch in ("sm90", "default"):
        for m in (1, 16, 17, 64, 65, 4096):
            cfg = kwd.pick_config(arch, m)
            covering = [c for c in kwd.W8_DECODE_CONFIGS[arch] if m <= c.block_m]
            assert cfg == (covering[0] if covering else kwd.W8_DECODE_CONFIGS[arch][-1])
    # 4096x6144 on 132 SMs: 48 column blocks, 16 steps of 256 bytes, 132 // 48 = 2 splits of 8 steps
    assert kwd.split_plan(6144, 4096, SM90_CFG, 132) == (16, 2, 8)
    # 28672 columns fill the SMs alone: no split; a forced count rounds to whole steps (5 -> 4 per split, 4 splits)
    assert kwd.split_plan(28672, 4096, SM90_CFG, 132) == (16, 1, 16)
    assert kwd.split_plan(6144, 4096, SM90_CFG, 132, splits=5) == (16, 4, 4)
    assert kwd.split_plan(6144, 320, SM90_CFG, 132, splits=8) == (2, 2, 1)
    # M blocks count as programs: 48 column blocks x 2 M blocks = 96 programs, one split per 132 SMs
    assert kwd.split_plan(6144, 4096, SM90_CFG, 132, m=17) == (16, 1, 16)
    assert kwd.split_plan(6144, 4096, SM90_CFG, 264, m=32) == (16, 2, 8)
    # small weights: the SM target alone would give 2048 / 128 = 16 one-step splits at 2048x2048 (M = 17..32's
    # 128-byte steps); the sm90 configs keep two steps per split, a forced count is left alone
    wide = kwd.pick_config("sm90", 32)
    assert wide.min_steps_per_split == 2 and SM90_CFG.min_steps_per_split == 2
    assert kwd.split_plan(2048, 2048, wide, 132, m=32) == (16, 8, 2)
    assert kwd.split_plan(2048, 2048, dataclasses.replace(wide, min_steps_per_split=1), 132, m=32) == (16, 16, 1)
    assert kwd.split_plan(2048, 2048, wide, 132, splits=16, m=32) == (16, 16, 1)


@pytest.mark.parametrize("cfg,match", [
    (kwd.W8DecodeConfig(block_n=96), "block_n"),
    (kwd.W8DecodeConfig(block_n=8), "block_n"),
    (kwd.W8DecodeConfig(block_k=32), "block_k"),
    (kwd.W8DecodeConfig(block_k=192), "block_k"),
    (kwd.W8DecodeConfig(num_warps=3), "num_warps"),
    (kwd.W8DecodeConfig(programs_per_sm=0), "programs_per_sm"),
    (kwd.W8DecodeConfig(block_m=8), "block_m"),
    (kwd.W8DecodeConfig(block_m=48), "block_m"),
    (kwd.W8DecodeConfig(block_m=256), "block_m"),
])
def test_bad_configs(cfg, match):
    qw = _qw(16, 64, symmetric=True)
    with pytest.raises(ValueError, match=match):
        _run(torch.randn(2, 64).to(BF16), qw, config=cfg)
    with pytest.raises(ValueError, match="splits"):
        _run(torch.randn(2, 64).to(BF16), qw, config=SMALL_CFG, splits=0)


def test_launcher_refuses_what_it_cannot_compute():
    qw = _qw(16, 64, symmetric=True)
    with pytest.raises(ValueError, match="x2d"):
        _run(torch.randn(0, 64).to(BF16), qw, config=SMALL_CFG)
    grouped = qf.quantize_weight(torch.randn(16, 64), bits=8, group_size=32)
    with pytest.raises(ValueError, match="scales"):
        _run(torch.randn(2, 64).to(BF16), grouped, config=SMALL_CFG)
