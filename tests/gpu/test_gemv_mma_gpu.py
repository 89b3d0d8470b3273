"""The Gluon tensor-core int4 decode kernel (kernels/gemv_mma.py: weight-only decode at M = 1..16 on sm90) on the
GPU.

Bound (as test_gemv_tma_gpu.py: each chunk's float32 product of u - z with x is scaled by its group's scale):
against the product with the unrounded weights W = (u - z) * s in float32,
    |y - x @ W.T - b| <= u |x @ W.T + b| + 2^-20 (|x| @ |W|.T + |b|) + 2^-24 (fp16 only),
one output rounding plus room for the float32 accumulation; identity rows give w_hat bit for bit (u - z exact in
x's dtype, times 1, one float32 scale multiply and one rounding). Every candidate config at the M of its bucket
(1..8, 9..16), group 128 / 256 / per channel, symmetric and not, float32 and 16-bit scales, bf16 / fp16, K with a
partial chunk (200, 7392), odd N (100, 257), splits forced to 1 / 3 / every chunk with and without the fused
reduction; NaN / inf / all-zero x, dispatch from quantfuse.weight_only_mm, CUDA graph replay.
"""

import dataclasses

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import gemv_mma as gm
from quantfuse.kernels import weight_only as kw
from tests.gpu.test_gemv_tma_gpu import _check_bound, _weight
from tests.gpu import sm90_gluon_marks

pytestmark = sm90_gluon_marks("decode kernel")

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"
# (group, symmetric, scale dtype; "x": the activation dtype)
SCHEMES = [(128, True, torch.float32), (128, False, torch.float32), (256, False, "x"), (-1, True, torch.float32),
           (-1, False, "x")]
SHAPES = [(4096, 6144), (7392, 257), (200, 100)]
MS = [1, 2, 3, 7, 8, 9, 15, 16]


def _run(x, qw, bias=None, cfg=None, splits=None, fused=True):
    n = qw.shape[0]
    if fused:
        return kw.gemv_mma_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, n, config=cfg, splits=splits)
    return gm.gemv_mma(x, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, n, config=cfg, splits=splits,
                       counters=None, num_sms=kw._num_sms(x.device))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"g{s[0]}{'s' if s[1] else 'a'}-{str(s[2])[6:]}")
def test_every_config_vs_unrounded_weights(scheme, dtype):
    group, sym, sdt = scheme
    sdt = dtype if sdt == "x" else sdt
    for k, n in SHAPES:
        if group > 0 and k < group:
            continue
        qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=group, symmetric=sym, scale_dtype=sdt)
        bias = torch.randn(n, device=DEV).to(dtype)
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(dtype)
            assert gm.applies(x, qw.qweight, qw.scales, 4, group, k), "the case must reach the Gluon kernel"
            for cfg in gm.candidates(m, x.device):  # M's bucket (each bucket's M range: one or two n-tiles)
                y = _run(x, qw, bias, cfg)
                _check_bound(y, x, qw, bias, f"{cfg}-g{group}-K{k}N{n}M{m}-{dtype}")


@pytest.mark.parametrize("early", [False, True], ids=["refill-after", "early-refill"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-reduce", "reduce-kernel"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_forced_splits_agree(m, fused, early):
    k, n = 7392, 257
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128, symmetric=False)
    x = torch.randn(m, k, device=DEV).to(BF16)
    bias = torch.randn(n, device=DEV).to(BF16)
    chunks = -(-k // gm.CHUNK)
    # the M <= 16 pick reduces with the kernel; early refill with odd and even chunk counts per split (58 chunks:
    # 58, 20 + 20 + 18, 1 each)
    cfg = gm.MmaDecodeConfig(128, 4, 4, fused_reduce=fused, early_refill=early)
    for splits in (1, 3, chunks):
        y = _run(x, qw, bias, cfg=cfg, splits=splits, fused=fused)
        _check_bound(y, x, qw, bias, f"splits={splits}-fused={fused}-M{m}")
    for _ in range(3):  # the counters are left at zero: repeated fused launches stay right
        _check_bound(_run(x, qw, bias, cfg=cfg, splits=3, fused=fused), x, qw, bias, "repeat")


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("scheme", [(128, False), (-1, True)], ids=["g128-asym", "per-channel-sym"])
def test_evict_first_hint_changes_no_result(m, scheme):
    """MmaDecodeConfig.evict_first (the L2 hint on the codes and group scales) is a cache hint only: each M bucket's
    shipped pick with it gives the same bits as without, split or not, K past the last whole chunk included."""
    group, sym = scheme
    k, n = 7392, 257
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=group, symmetric=sym)
    x = torch.randn(m, k, device=DEV).to(BF16)
    bias = torch.randn(n, device=DEV).to(BF16)
    for cfg in gm.candidates(m, x.device)[:1] + [gm.MmaDecodeConfig(128, 4, 4, early_refill=True)]:
        hinted = dataclasses.replace(cfg, evict_first=True)
        for splits in (1, 3):
            want = _run(x, qw, bias, cfg=cfg, splits=splits)
            got = _run(x, qw, bias, cfg=hinted, splits=splits)
            assert torch.equal(got, want), (cfg, splits)
            _check_bound(got, x, qw, bias, f"evict-first {cfg} splits={splits}")


@pytest.mark.parametrize("x_group", [2, 4])
@pytest.mark.parametrize("m", [1, 8, 9, 16])
def test_x_ring_splits_and_row_strides(m, x_group):
    """x through the shared-memory ring (MmaDecodeConfig.x_group): splits whose chunk counts end inside a group and
    on its last chunk (58 chunks, a partial last one: 58, 20 + 20 + 18, 9 x 6 + 4, 1 each), rows padded to a
    16-byte aligned stride (the copy engine reads them) and to an unaligned one (the register path runs)."""
    k, n = 7392, 257
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128, symmetric=False)
    bias = torch.randn(n, device=DEV).to(BF16)
    cfg = gm.MmaDecodeConfig(128, 8 if m <= 8 else 4, 2, m <= 8, True, x_group=x_group)
    x = torch.randn(m, k, device=DEV).to(BF16)
    for splits in (1, 3, 7, -(-k // gm.CHUNK)):
        _check_bound(_run(x, qw, bias, cfg=cfg, splits=splits), x, qw, bias, f"splits={splits}-M{m}")
    for pad in (8, 4):  # row strides of 14800 bytes (describable) and 14792 bytes (not)
        xp = torch.randn(m, k + pad, device=DEV).to(BF16)[:, :k]
        _check_bound(_run(xp, qw, bias, cfg=cfg), xp, qw, bias, f"row stride {k + pad}-M{m}")


@pytest.mark.parametrize("group,sym", [(128, True), (256, False), (-1, False)])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_identity_rows_equal_w_hat(group, sym, dtype):
    k, n = 4096, 257
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=group, symmetric=sym, scale_dtype=dtype)
    w_hat = qw.dequantize(dtype)
    picks = (0, 17, 63, 64, 127, 128, 2053, k - 1)
    e = torch.zeros(len(picks), k, device=DEV, dtype=dtype)  # M = 8 one-hot rows at once
    for i, kk in enumerate(picks):
        e[i, kk] = 1
    for cfg in gm.all_configs("sm90")[:3] + [gm.pick_config(16, e.device)]:
        for rows in (e, torch.cat([e, e])):  # M = 8 and 16 (one and two n-tiles of the instruction)
            got = _run(rows, qw, cfg=cfg)
            for i, kk in enumerate(picks * (rows.shape[0] // len(picks))):
                assert torch.equal(got[i].view(torch.int16), w_hat[:, kk].contiguous().view(torch.int16)), (cfg, kk)


@pytest.mark.parametrize("m", [1, 12])
def test_nan_inf_and_zero_rows(m):
    k, n = 4096, 6144
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128)
    bias = torch.randn(n, device=DEV).to(BF16)
    x = torch.randn(m, k, device=DEV).to(BF16)
    x[0] = 0
    x[m - 1, 1000] = float("nan") if m > 1 else x[m - 1, 1000]
    y = _run(x, qw, bias)
    assert torch.equal(y[0], bias), "an all-zero row gives the bias exactly"
    if m > 1:
        assert bool(torch.isnan(y[m - 1]).all()), "a NaN in a row poisons that row"
        assert bool(torch.isfinite(y[1:m - 1]).all()), "and only that row"
    x = torch.zeros(m, k, device=DEV, dtype=BF16)
    x[:, 5] = float("inf")
    assert not bool(torch.isfinite(_run(x, qw, bias)).any())


def test_public_op_dispatch(monkeypatch):
    """weight_only_mm takes this kernel where `weight_only.prefer_gemv_mma` says so (int4, measured ranges)."""
    calls = []
    real = gm.gemv_mma
    monkeypatch.setattr(gm, "gemv_mma", lambda *a, **kw_: calls.append(1) or real(*a, **kw_))
    for k, n in ((4096, 4096), (4096, 14336), (2048, 3072)):  # 2048x3072: a Llama-3.2-1B shape
        qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128)
        for m in (1, 4, 8, 9, 16, 17):
            calls.clear()
            x = torch.randn(m, k, device=DEV).to(BF16)
            y = qf.weight_only_mm(x, qw)
            here = kw.prefer_gemv_mma(m, n, k)
            assert bool(calls) == here, (m, n, k)
            assert here == (1 <= m <= 16), "the measured ranges (GEMV_MMA_MIN_WEIGHTS)"
            if here:
                _check_bound(y, x, qw, torch.zeros(n, device=DEV, dtype=BF16), f"public op M={m}")
    calls.clear()
    qw32 = qf.quantize_weight(_weight(n, k), bits=4, group_size=32)
    assert not gm.applies(torch.randn(1, k, device=DEV).to(BF16), qw32.qweight, qw32.scales, 4, 32, k)
    # a column-strided x goes to the tl kernels; padded rows (row stride > K, not 16-byte aligned) run here
    xs = torch.randn(2, 2 * k, device=DEV).to(BF16)[:, ::2]
    assert not gm.applies(xs, qw.qweight, qw.scales, 4, 128, k), "column stride 2: the tl kernels"
    xv = torch.randn(3, k + 8, device=DEV).to(BF16)[:, :k]
    assert gm.applies(xv, qw.qweight, qw.scales, 4, 128, k)
    _check_bound(_run(xv, qw), xv, qw, torch.zeros(n, device=DEV, dtype=BF16), "padded rows of x")
    # M = 16 on rows the copy engine cannot read (8196-byte stride): the register pick instead of the x ring
    qw = qf.quantize_weight(_weight(4096, 4096), bits=4, group_size=128)
    xu = torch.randn(16, 4096 + 2, device=DEV).to(BF16)[:, :4096]
    assert gm.auto_config(xu, 4096).x_group == 0 and gm.auto_config(xu.contiguous(), 4096).x_group > 0
    _check_bound(qf.weight_only_mm(xu, qw), xu, qw, torch.zeros(4096, device=DEV, dtype=BF16), "unaligned rows")


def test_cuda_graph_replay():
    k, n = 14336, 4096
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128)
    x = torch.randn(4, k, device=DEV).to(BF16)
    eager = _run(x, qw)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(x, qw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = _run(x, qw)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
