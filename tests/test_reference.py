"""The executable spec against hand-computed cases (SPEC sections 0 and 1)."""

import pytest
import torch

from quantfuse import reference as ref

INT8, FP8 = torch.int8, torch.float8_e4m3fn


def test_int8_rounds_half_to_even_and_saturates():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -127.5, 300.0, -300.0, 2.0**31, -(2.0**31)]])
    q, s, _ = ref.quantize_per_tensor(x, INT8, scale=torch.ones(1))
    assert q.tolist() == [[0, 2, 2, 0, -2, 126, -128, 127, -128, 127, -128]]
    assert s.item() == 1.0


def test_fp8_rounds_to_nearest_even_and_saturates():
    # 17 and 232 are ties that go down to the even mantissa, 19 goes up; 500 saturates to 448.
    x = torch.tensor([[0.5, 17.0, 19.0, 232.0, 236.0, 500.0, -500.0, 2.0**31]])
    q, _, _ = ref.quantize_per_tensor(x, FP8, scale=torch.ones(1))
    assert q.float().tolist() == [[0.5, 16.0, 20.0, 224.0, 240.0, 448.0, -448.0, 448.0]]


def test_dynamic_per_tensor_scale_rule():
    x = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    q, s, azp = ref.quantize_per_tensor(x, INT8)
    assert azp is None and s.shape == (1,)
    assert s.item() == torch.tensor(4.0 / 127.0, dtype=torch.float32).item()
    assert q[0, 1].item() == -127


def test_per_token_all_zero_row_gives_zero_codes_and_tiny_scale():
    x = torch.zeros(2, 8)
    x[1] = torch.arange(8) - 3.0
    q, s, _ = ref.quantize_per_token(x, INT8)
    assert s.shape == (2, 1)
    assert q[0].eq(0).all() and s[0].item() == pytest.approx(1e-10 / 127)
    assert not torch.isnan(s).any()
    assert q[1, -1].item() == 127


def test_scale_ub_caps_the_scale():
    x = torch.tensor([[100.0, 1.0]])
    q, s, _ = ref.quantize_per_token(x, FP8, scale_ub=torch.tensor([0.1]))
    assert s.item() == pytest.approx(0.1)
    assert q.float().tolist() == [[448.0, 10.0]]


def test_asymmetric_per_token_hand_cases():
    x = torch.tensor([[0.0, 255.0, 128.0], [-10.0, 245.0, 0.0]])
    q, s, azp = ref.quantize_per_token(x, INT8, symmetric=False)
    assert s.flatten().tolist() == [1.0, 1.0]
    assert azp.dtype == torch.int32 and azp.flatten().tolist() == [-128, -118]
    assert q.tolist() == [[-128, 127, 0], [-128, 127, -118]]
    x_hat = ref.dequantize(q, s, azp)
    torch.testing.assert_close(x_hat, x)


def test_asymmetric_constant_row_is_finite():
    x = torch.full((1, 4), 1.0)
    q, s, azp = ref.quantize_per_token(x, INT8, symmetric=False)
    assert torch.isfinite(s).all() and azp.item() == -(2**31)
    assert q.eq(127).all()
    assert torch.isfinite(ref.dequantize(q, s, azp)).all()


def test_static_asymmetric_per_tensor():
    x = torch.tensor([[0.0, 1.0, 2.0, -300.0]])
    q, s, azp = ref.quantize_per_tensor(x, INT8, scale=torch.tensor([0.5]), azp=torch.tensor([10], dtype=torch.int32))
    assert q.tolist() == [[10, 12, 14, -128]]


def test_per_group_scales_and_transposed_layout():
    x = torch.arange(64, dtype=torch.float32).reshape(2, 32) - 10.0
    q, s, _ = ref.quantize_per_group(x, INT8, group_size=16)
    assert s.shape == (2, 2)
    expected = torch.tensor([[10.0, 21.0], [37.0, 53.0]]) / 127.0
    torch.testing.assert_close(s, expected, rtol=0, atol=0)
    q2, s2, _ = ref.quantize_per_group(x, INT8, group_size=16, transposed_scales=True)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert s2.stride() == (1, 2)  # a view of a contiguous [K/G, M] tensor


def test_dequantize_per_group_inverts_within_half_step():
    x = torch.randn(4, 64)
    q, s, _ = ref.quantize_per_group(x, INT8, group_size=32)
    x_hat = ref.dequantize(q, s, group_size=32)
    step = s.repeat_interleave(32, dim=1)
    assert ((x_hat - x).abs() <= step / 2 + 1e-7).all()
