"""The Gluon TMA-fed GEMV (kernels/gemv_tma.py: weight-only decode at M = 1 on sm90) on the GPU.

Bound (as test (e) of test_weight_only_gpu.py, the kernel applies each group's scale after the sums): against
the product with the unrounded weights W = (u - z) * s in float32,
    |y - x @ W.T - b| <= u |x @ W.T + b| + 2^-20 (|x| @ |W|.T + |b|) + 2^-24 (fp16 only),
one output rounding plus room for the float32 accumulation; and identity rows give w_hat bit for bit. Every
candidate config of the sm90 table, int4 / int8, group 32 / 64 / 128 / per channel, symmetric and not, float32
and 16-bit scales, K with a partial chunk (200, 7392), odd N (100, 257), split-K forced to 1 / 3 / every tile,
with and without the fused reduction; NaN in x, all-zero x, dispatch from quantfuse.weight_only_mm, CUDA graph.
"""

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import gemv_tma as gt
from quantfuse.kernels import weight_only as kw
from tests.gpu import sm90_gluon_marks

pytestmark = sm90_gluon_marks("GEMV")

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"
UNIT = {BF16: 2.0**-8, FP16: 2.0**-11}
ABS = {BF16: 0.0, FP16: 2.0**-24}
# (bits, group, symmetric, scale dtype; "x": the activation dtype)
SCHEMES = [(4, 128, True, torch.float32), (4, 32, False, torch.float32), (8, -1, True, torch.float32),
           (4, 64, False, "x"), (4, -1, False, "x"), (8, 64, False, torch.float32)]
SHAPES = [(4096, 6144), (7392, 257), (200, 100)]


def _weight(n, k):
    blocks = -(-k // 128)
    mag = torch.exp2(torch.randint(-3, 4, (n, blocks), device=DEV).float()).repeat_interleave(128, dim=1)[:, :k]
    return torch.randn(n, k, device=DEV) * mag


def _run(x, qw, bias=None, cfg=None, splits=None, fused=True):
    n = qw.shape[0]
    if fused:
        return kw.gemv_tma_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.bits, qw.group_size, n, config=cfg,
                              splits=splits)
    return gt.gemv_tma(x, qw.qweight, qw.scales, qw.zeros, bias, qw.bits, qw.group_size, n, config=cfg,
                       splits=splits, counters=None, num_sms=kw._num_sms(x.device))


def _check_bound(y, x, qw, bias, label):
    w = qw.dequantize(torch.float32)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = x.float() @ w.t() + bias.float()
        mag = x.float().abs() @ w.abs().t() + bias.float().abs()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err = (y.float() - want).abs()
    bound = UNIT[y.dtype] * want.abs() + 2.0**-20 * mag + ABS[y.dtype] + 1e-30
    ratio = float((err / bound).max())
    print(f"{label}: worst err / bound {ratio:.3g}")
    assert ratio <= 1.0, label


def _configs(bits):
    return gt.GEMV_CONFIGS["sm90"][bits]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"w{s[0]}g{s[1]}{'s' if s[2] else 'a'}-{str(s[3])[6:]}")
def test_every_config_vs_unrounded_weights(scheme, dtype):
    bits, group, sym, sdt = scheme
    sdt = dtype if sdt == "x" else sdt
    for k, n in SHAPES:
        qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group, symmetric=sym, scale_dtype=sdt)
        x = torch.randn(1, k, device=DEV).to(dtype)
        assert gt.applies(x, qw.qweight, qw.scales, bits, group, k), "the case must reach the Gluon kernel"
        bias = torch.randn(n, device=DEV).to(dtype)
        for cfg in _configs(bits):
            y = _run(x, qw, bias, cfg)
            _check_bound(y, x, qw, bias, f"{cfg}-w{bits}g{group}-K{k}N{n}-{dtype}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused-reduce", "reduce-kernel"])
@pytest.mark.parametrize("bits,group", [(4, 128), (8, -1)])
def test_forced_splits_agree(bits, group, fused):
    k, n = 7392, 257
    qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group, symmetric=False)
    x = torch.randn(1, k, device=DEV).to(BF16)
    bias = torch.randn(n, device=DEV).to(BF16)
    cfg = _configs(bits)[0]
    tiles = -(-k // (kw.chunk_codes(bits) * cfg.chunks))
    for splits in (1, 3, tiles):
        y = _run(x, qw, bias, cfg, splits=splits, fused=fused)
        _check_bound(y, x, qw, bias, f"splits={splits}-fused={fused}-w{bits}")
    for _ in range(3):  # the counters are left at zero: repeated fused launches stay right
        _check_bound(_run(x, qw, bias, cfg, splits=3, fused=fused), x, qw, bias, "repeat")


@pytest.mark.parametrize("bits,group,sym", [(4, 128, True), (4, 32, False), (8, -1, False)])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_identity_rows_equal_w_hat(bits, group, sym, dtype):
    k, n = 4096, 257
    qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group, symmetric=sym, scale_dtype=dtype)
    w_hat = qw.dequantize(dtype)
    for kk in (0, 17, 127, 128, 2053, k - 1):
        e = torch.zeros(1, k, device=DEV, dtype=dtype)
        e[0, kk] = 1
        for cfg in _configs(bits)[:3]:
            got = _run(e, qw, cfg=cfg)
            assert torch.equal(got[0].view(torch.int16), w_hat[:, kk].contiguous().view(torch.int16)), (cfg, kk)


def test_nan_and_zero_inputs():
    k, n = 4096, 6144
    qw = qf.quantize_weight(_weight(n, k), bits=4, group_size=128)
    bias = torch.randn(n, device=DEV).to(BF16)
    x = torch.zeros(1, k, device=DEV, dtype=BF16)
    assert torch.equal(_run(x, qw, bias), bias[None])  # all-zero x: the bias exactly
    x[0, 1000] = float("nan")
    assert bool(torch.isnan(_run(x, qw, bias)).all())
    x[0, 1000] = float("inf")
    y = _run(x, qw, bias)
    assert not bool(torch.isfinite(y).any())  # +-inf or nan (0 * inf where u == z), never a finite value


@pytest.mark.parametrize("bits,group,k,n,here", [(8, -1, 4096, 4096, True), (4, 128, 4096, 1024, True),
                                                   (4, 128, 4096, 4096, False)])
def test_public_op_dispatch(monkeypatch, bits, group, k, n, here):
    """M = 1 int8 runs here; int4 only where the tl GEMV is under-filled (weight_only.prefer_gemv_tma)."""
    calls = []
    real = gt.gemv_tma
    monkeypatch.setattr(gt, "gemv_tma", lambda *a, **kw_: calls.append(1) or real(*a, **kw_))
    qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group)
    x = torch.randn(1, k, device=DEV).to(BF16)
    y = qf.weight_only_mm(x, qw)
    assert bool(calls) == here
    _check_bound(y, x, qw, torch.zeros(n, device=DEV, dtype=BF16), "public op")
    calls.clear()
    qf.weight_only_mm(torch.randn(2, k, device=DEV).to(BF16), qw)
    assert not calls, "M = 2 runs the tl kernels"
    # an unaligned x view (base not 16-byte aligned) falls back to the tl GEMV
    xb = torch.randn(1, k + 1, device=DEV).to(BF16)[:, 1:]
    assert not gt.applies(xb, qw.qweight, qw.scales, bits, group, k)
    _check_bound(qf.weight_only_mm(xb, qw), xb, qw, torch.zeros(n, device=DEV, dtype=BF16), "unaligned x")


def test_cuda_graph_replay():
    k, n = 14336, 4096
    qw = qf.quantize_weight(_weight(n, k), bits=8, group_size=-1)
    x = torch.randn(1, k, device=DEV).to(BF16)
    eager = qf.weight_only_mm(x, qw)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qf.weight_only_mm(x, qw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = qf.weight_only_mm(x, qw)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
