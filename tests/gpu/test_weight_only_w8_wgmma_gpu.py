"""The Gluon wgmma int8 kernel for W8A16 prefill (kernels/weight_only_wgmma.py `wgmma_w8_mm`, sm90) on the GPU.

- Identity rows of x give w_hat bit for bit: each output is one exact u - z times 1 (then exact zeros), times s in
  float32, rounded once, which is how w_hat rounds; symmetric and asymmetric codes, float32 and 16-bit scales,
  bf16 and fp16, with and without split-K, K with a partial chunk, N not a multiple of the tile.
- Random x within the scale-after bound of test_w8_decode_gpu.py (float64 reference from the unrounded
  W = (u - z) * s: one output rounding plus float32 accumulation noise) and within test_weight_only_gpu.py's bound
  against x @ w_hat.T; M not a multiple of the tile (the last row tile moved back to end at M), split-K, bias.
- NaN / inf / all-zero rows of x stay in their own output rows; quantfuse.weight_only_mm runs the kernel at
  M = 256..2048 for int8 per channel only; a padded-row x view falls back; CUDA graph capture and replay.
"""

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import weight_only_wgmma as ww
from tests.gpu import sm90_gluon_marks
from tests.gpu.test_w8_decode_gpu import assert_scale_after_bound
from tests.gpu.test_weight_only_gpu import assert_gemm_within_bound
from tests.gpu.test_weight_only_wgmma_gpu import _graph_replayed as graph_replayed
from tests.gpu.test_weight_only_wgmma_gpu import special_rows_checked

pytestmark = sm90_gluon_marks("int8 wgmma kernel")

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"


def _quantized(n, k, symmetric=True, scale_dtype=torch.float32):
    w = torch.randn(n, k, device=DEV) * torch.exp2(torch.randint(-3, 4, (n, 1), device=DEV).float())
    return qf.quantize_weight(w, bits=8, group_size=-1, symmetric=symmetric, scale_dtype=scale_dtype)


def _run(x, qw, bias=None, splits=None):
    return ww.wgmma_w8_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.shape[0], splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("symmetric,scale", [(True, torch.float32), (False, torch.float32), (False, "x")],
                         ids=["sym-f32", "asym-f32", "asym-x"])
def test_identity_rows_give_w_hat_bit_for_bit(symmetric, scale, dtype, splits):
    k, n = 4104, 1000  # K_pad 4160: a partial last chunk; N: 7 full tiles and a partial one
    qw = _quantized(n, k, symmetric, dtype if scale == "x" else scale)
    cols = torch.tensor([0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 1000, 2047, 2048, 4095,
                         4096, 4100, 4102, 4103], device=DEV)
    x = torch.zeros(cols.numel(), k, device=DEV, dtype=dtype)
    x[torch.arange(cols.numel(), device=DEV), cols] = 1
    y = _run(x, qw, splits=splits)
    want = qw.dequantize(dtype)[:, cols].t().contiguous()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("k,n,m,splits,has_bias,dtype", [
    (4096, 6144, 256, None, True, BF16),
    (4096, 6144, 300, 2, False, FP16),
    (14336, 4096, 1000, None, True, BF16),
    (8192, 1000, 257, 4, True, BF16),
    (200, 257, 511, None, False, FP16),
    (4104, 100, 2048, 3, True, BF16),
    (4096, 512, 100, None, True, BF16),  # fewer rows than the tile: the copy engine zero-fills the box
])
def test_random_x_within_bounds(k, n, m, splits, has_bias, dtype):
    qw = _quantized(n, k, symmetric=m % 2 == 0)
    x = torch.randn(m, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype) if has_bias else None
    y = _run(x, qw, bias, splits)
    assert y.shape == (m, n) and y.dtype == dtype and bool(torch.isfinite(y).all())
    label = f"M{m} K{k} N{n} splits {splits}"
    assert_scale_after_bound(y, x, qw, bias, label)
    assert_gemm_within_bound(y, x, qw.dequantize(dtype), bias, label)


def test_special_rows_stay_in_their_rows():
    special_rows_checked(_run, _quantized(1024, 4096))


def test_bad_splits_refused():
    qw = _quantized(256, 512)
    with pytest.raises(ValueError, match="splits"):
        _run(torch.randn(256, 512, device=DEV).to(BF16), qw, splits=0)


def test_dispatch_graph_and_fallback(monkeypatch):
    qw = _quantized(6144, 4096)
    calls = []
    real = ww.wgmma_w8_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ww, "wgmma_w8_mm", spy)
    for m in (128, 256, 2048, 4096):
        qf.weight_only_mm(torch.randn(m, 4096, device=DEV).to(BF16), qw)
    assert calls == [256, 2048]  # M = 128: the int8 tl tile; 4096: dequantize + cuBLAS
    grouped = qf.quantize_weight(torch.randn(512, 4096, device=DEV), bits=8, group_size=128)
    qf.weight_only_mm(torch.randn(256, 4096, device=DEV).to(BF16), grouped)
    assert calls == [256, 2048]  # grouped int8: the tl tile
    x = torch.randn(256, 4096, device=DEV).to(BF16)
    y = qf.weight_only_mm(x, qw)
    assert calls[-1] == 256 and torch.equal(y, real(x, qw.qweight, qw.scales, qw.zeros, None, 6144))
    # a padded-row view whose row stride (4100 x 2 bytes) no tensor descriptor takes: the tl kernels
    xp = torch.randn(256, 4100, device=DEV).to(BF16)[:, :4096]
    assert not ww.applies_w8(xp, qw.qweight, qw.scales, 8)
    count = len(calls)
    assert_gemm_within_bound(qf.weight_only_mm(xp, qw), xp, qw.dequantize(BF16), None, "padded view")
    assert len(calls) == count
    # CUDA graph capture and replay on fresh values
    x2, static_y = graph_replayed(x, qw)
    assert torch.equal(static_y, real(x2, qw.qweight, qw.scales, qw.zeros, None, 6144))
