"""Every public op takes an empty batch (M = 0 rows: a MoE expert no token was routed to, a drained request
queue) and returns empty results of the right shapes and dtypes, with the per-tensor dynamic scale of an empty
tensor the floor scale (amax 0): max(0, 1e-10) / qmax (SPEC section 1). CPU here, CUDA in the gpu-marked twin."""

import pytest
import torch

import quantfuse as qf

INT8, FP8, BF16 = torch.int8, torch.float8_e4m3fn, torch.bfloat16
K, N = 256, 128


def _cases(dev):
    x0 = torch.randn(0, K, device=dev)
    a8, b8 = torch.zeros(0, K, dtype=INT8, device=dev), torch.ones(K, N, dtype=INT8, device=dev)
    af, bf = torch.zeros(0, K, device=dev).to(FP8), torch.ones(K, N, device=dev).to(FP8)
    ones = lambda *s: torch.ones(*s, device=dev)  # noqa: E731
    w4 = qf.quantize_weight(torch.randn(N, K, device=dev), bits=4, group_size=128)
    w8 = qf.quantize_weight(torch.randn(N, K, device=dev), bits=8, group_size=-1)
    return {
        "quantize_per_tensor dynamic": (lambda: qf.quantize_per_tensor(x0, INT8), [(0, K), (1,)]),
        "quantize_per_tensor static": (lambda: qf.quantize_per_tensor(x0, FP8, scale=ones(1)), [(0, K), (1,)]),
        "quantize_per_token asymmetric": (lambda: qf.quantize_per_token(x0, INT8, symmetric=False),
                                          [(0, K), (0, 1), (0, 1)]),
        "quantize_per_group": (lambda: qf.quantize_per_group(x0, FP8, group_size=128, transposed_scales=True),
                               [(0, K), (0, 2)]),
        "dequantize": (lambda: qf.dequantize(a8, ones(0, 1)), [(0, K)]),
        "scaled_mm per token": (lambda: qf.scaled_mm(a8, b8, ones(0, 1), ones(1, N), BF16), [(0, N)]),
        "scaled_mm per token azp": (lambda: qf.scaled_mm(a8, b8, ones(0, 1), ones(1, N), BF16, None,
                                                         qf.azp_adjustment(b8),
                                                         torch.zeros(0, dtype=torch.int32, device=dev)), [(0, N)]),
        "scaled_mm fp8 per tensor + bias": (lambda: qf.scaled_mm(af, bf, ones(1), ones(N), BF16,
                                                                 torch.zeros(N, dtype=BF16, device=dev)), [(0, N)]),
        "scaled_mm_blockwise": (lambda: qf.scaled_mm_blockwise(af, bf, ones(0, 2), ones(2, 1), BF16), [(0, N)]),
        "silu_and_mul_quant per group": (lambda: qf.silu_and_mul_quant(torch.randn(0, 2 * K, device=dev), FP8,
                                                                       group_size=128), [(0, K), (0, 2)]),
        "weight_only_mm int4": (lambda: qf.weight_only_mm(torch.randn(0, K, device=dev, dtype=BF16), w4), [(0, N)]),
        "weight_only_mm int8, 3-D x": (lambda: qf.weight_only_mm(torch.randn(2, 0, K, device=dev, dtype=BF16), w8),
                                       [(2, 0, N)]),
    }


def _check_empty_batches(dev):
    for name, (run, shapes) in _cases(dev).items():
        out = run()
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
        assert [tuple(t.shape) for t in outs] == shapes, name
        assert all(t.device.type == torch.device(dev).type for t in outs), name
    _, scale, _ = qf.quantize_per_tensor(torch.randn(0, K, device=dev), INT8)
    assert scale.item() == pytest.approx(1e-10 / 127, rel=1e-6), "an empty tensor's amax is 0: the floor scale"


def test_empty_batches_cpu():
    _check_empty_batches("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_empty_batches_cuda():
    _check_empty_batches("cuda")
