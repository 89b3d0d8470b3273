"""The byte-view W8A16 decode kernel (kernels/w8_decode.py) on the GPU, through the public op's dispatch at full size.

Bound (the scale after the sums: x @ W.T with the unrounded W = (u - z) * s), per output element, float64 reference:
    |y - x @ W.T - bias| <= u |ref| + 2^-20 (|x| @ |W|.T + |bias|)        u = 2^-8 (bf16), 2^-11 (fp16)
i.e. one output rounding plus float32 accumulation noise; and the looser bound of test_weight_only_gpu against
x @ w_hat.T. Identity rows equal w_hat bit for bit (one exact u - z times s, rounded as the reference rounds w_hat).
Every dispatch case checks that weight_only_mm ran this kernel (M = 2..32, int8 per channel); the configs are also run
directly past their block of M rows (several program rows)."""

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import w8_decode as kwd
from tests._util import KernelSpy
from tests.gpu.test_weight_only_gpu import assert_gemm_within_bound

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"
UNIT = {BF16: 2.0**-8, FP16: 2.0**-11}
SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192), (11008, 4096),
          (10944, 100), (7392, 257), (192, 257), (200, 100), (4104, 1000)]
MS = [2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32]


@pytest.fixture
def spy(monkeypatch):
    s = KernelSpy(kwd._w8_decode_kernel)
    monkeypatch.setattr(kwd, "_w8_decode_kernel", s)
    return s


def _unrounded(qw):
    return (qw.biased_codes().double() - qw.zero_points().double().t()) * qw.scales.double().t()


def assert_scale_after_bound(y, x, qw, bias=None, label=""):
    w = _unrounded(qw)
    xd = x.double().reshape(-1, x.shape[-1])
    want = xd @ w.t()
    mag = xd.abs() @ w.abs().t()
    if bias is not None:
        want, mag = want + bias.double(), mag + bias.double().abs()
    err = (y.double().reshape(want.shape) - want).abs()
    ratio = float((err / (UNIT[y.dtype] * want.abs() + 2.0**-20 * mag + 1e-30)).max())
    print(f"{label}: worst err / scale-after bound {ratio:.3g}")
    assert ratio <= 1.0, f"{label}: error {float(err.max())} exceeds the bound (ratio {ratio})"


def _cases():
    cases = []
    for i, (k, n) in enumerate(SHAPES):
        for j in range(2):
            t = 2 * i + j
            cases.append((MS[t % len(MS)], k, n, t % 3 != 1, (BF16, FP16)[t % 2],
                          (torch.float32, torch.float32, None)[t % 3], t % 4 == 1))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{'s' if c[3] else 'a'}-"
                         f"{str(c[4])[6:]}-s{'x' if c[5] is None else 'f32'}{'-bias' if c[6] else ''}")
def test_dispatch_runs_here_within_bounds(spy, case):
    m, k, n, symmetric, dtype, scale_dtype, has_bias = case
    w = torch.randn(n, k, device=DEV) * torch.exp2(torch.randint(-3, 4, (n, 1), device=DEV).float())
    qw = qf.quantize_weight(w, bits=8, group_size=-1, symmetric=symmetric, scale_dtype=scale_dtype or dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype) if has_bias else None
    y = qf.weight_only_mm(x, qw, bias)
    assert len(spy.calls) == 1
    assert y.shape == (m, n) and y.dtype == dtype and bool(torch.isfinite(y).all())
    label = f"M{m} K{k} N{n}"
    assert_scale_after_bound(y, x, qw, bias, label)
    assert_gemm_within_bound(y, x, qw.dequantize(dtype), bias, label)


@pytest.mark.parametrize("m", [16, 20])  # the 16-row config; the 32-row one (M = 17..32)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_identity_rows_equal_w_hat(dtype, splits, m):
    k, n = 4104, 1000  # K_pad 4160: a partial last step
    qw = qf.quantize_weight(torch.randn(n, k, device=DEV), bits=8, group_size=-1, symmetric=False)
    cols = torch.tensor([0, 1, 15, 16, 63, 64, 255, 256, 1000, 2047, 2048, 4095, 4096, 4100, 4102, 4103, 2, 127, 128,
                         3000], device=DEV)[:m]
    x = torch.zeros(cols.numel(), k, device=DEV, dtype=dtype)
    x[torch.arange(cols.numel(), device=DEV), cols] = 1
    y = kwd.w8_decode_mm(x, qw.qweight, qw.scales, qw.zeros, None, n, splits=splits)
    want = qw.dequantize(dtype)[:, cols].t().contiguous()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_padded_rows_nan_isolation_and_cuda_graph(spy):
    k, n = 14336, 4096
    qw = qf.quantize_weight(torch.randn(n, k, device=DEV), bits=8, group_size=-1)
    big = torch.randn(9, k + 8, device=DEV).to(BF16)
    x = big[:, :k]
    y = qf.weight_only_mm(x, qw)
    assert torch.equal(y, qf.weight_only_mm(x.contiguous(), qw))
    poisoned = x.clone()
    poisoned[4, 777] = float("nan")
    yp = qf.weight_only_mm(poisoned, qw)
    assert bool(torch.isnan(yp[4]).all())
    others = [0, 1, 2, 3, 5, 6, 7, 8]
    assert torch.equal(yp[others], y[others])
    # CUDA graph capture and replay on new inputs
    static_x = x.contiguous().clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = qf.weight_only_mm(static_x, qw)
    fresh = torch.randn(9, k, device=DEV).to(BF16)
    static_x.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, qf.weight_only_mm(fresh, qw))
    assert len(spy.calls) >= 4


@pytest.mark.parametrize("cfg", list(kwd.W8_DECODE_CONFIGS["sm90"]), ids=lambda c: f"block_m{c.block_m}")
@pytest.mark.parametrize("m", [17, 33, 64, 100])
def test_configs_past_their_block_of_rows(cfg, m):
    # M past block_m: ceil(M / block_m) program rows over the same weight tiles (the last one partial), split-K as
    # the plan says and forced
    k, n = 8192, 1000
    w = torch.randn(n, k, device=DEV) * torch.exp2(torch.randint(-3, 4, (n, 1), device=DEV).float())
    qw = qf.quantize_weight(w, bits=8, group_size=-1, symmetric=False)
    x = torch.randn(m, k, device=DEV).to(BF16)
    bias = torch.randn(n, device=DEV).to(BF16)
    for splits in (None, 3):
        y = kwd.w8_decode_mm(x, qw.qweight, qw.scales, qw.zeros, bias, n, config=cfg, splits=splits)
        assert y.shape == (m, n) and bool(torch.isfinite(y).all())
        assert_scale_after_bound(y, x, qw, bias, f"block_m {cfg.block_m} M{m} splits {splits}")
