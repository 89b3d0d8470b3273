"""The launch-cache key of `launch_kernel` (kernels/_common.py) separates every argument property Triton
specializes on; the launches themselves are checked on the GPU (tests/gpu/test_launch_gpu.py)."""

import pytest
import torch

from quantfuse.kernels._common import TensorDescriptor, _arg_spec, _Fallback


def test_tensor_specs_separate_dtype_and_alignment():
    t = torch.zeros(64, dtype=torch.float32)
    assert _arg_spec(t) == _arg_spec(torch.zeros(8, dtype=torch.float32))
    assert _arg_spec(t) != _arg_spec(t[1:])  # 4-byte offset: not 16-byte aligned
    assert _arg_spec(t) == _arg_spec(t[4:])  # 16 bytes further: aligned again
    assert _arg_spec(t) != _arg_spec(t.to(torch.float16))


@pytest.mark.parametrize("a,b", [(1, 2), (16, 17), (32, 33), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16),
                                 (2**63 - 16, 2**63)])
def test_int_specs_separate_one_divisibility_and_width(a, b):
    assert _arg_spec(a) != _arg_spec(b)


def test_int_specs_share_a_class():
    assert _arg_spec(32) == _arg_spec(4096)
    assert _arg_spec(3) == _arg_spec(4095)


def test_other_runtime_arguments():
    assert _arg_spec(None) is type(None)
    assert _arg_spec(0.5) is float and _arg_spec(True) is bool
    with pytest.raises(_Fallback):
        _arg_spec("a string")


@pytest.mark.skipif(TensorDescriptor is None, reason="this Triton has no host tensor descriptors")
def test_descriptor_specs_key_dtype_and_block():
    t = torch.zeros(64, 64, dtype=torch.float16)
    d = lambda x, block: TensorDescriptor(x, list(x.shape), list(x.stride()), block)  # noqa: E731
    assert _arg_spec(d(t, [16, 16])) == _arg_spec(d(torch.zeros(32, 64, dtype=torch.float16), [16, 16]))
    assert _arg_spec(d(t, [16, 16])) != _arg_spec(d(t, [32, 16]))
    assert _arg_spec(d(t, [16, 16])) != _arg_spec(d(t.to(torch.int16), [16, 16]))


@pytest.mark.skipif(TensorDescriptor is None, reason="this Triton has no host tensor descriptors")
def test_describable_transposed_equals_describable_of_the_view():
    from quantfuse.kernels._common import describable, describable_transposed

    base = torch.zeros(64, 96, dtype=torch.int8)
    odd_rows = torch.zeros(64, 90, dtype=torch.int8)
    cases = [base, base.t(), base[:, :80], base[:, 1:], base[1:], base.t()[:, :48], odd_rows, odd_rows.t(),
             torch.zeros(3, dtype=torch.int8)]
    seen = set()
    for b in cases:
        want = b.dim() == 2 and describable(b.t())
        assert describable_transposed(b) == want
        seen.add(want)
    assert seen == {True, False}


def test_gluon_descriptor_specs_key_dtype_block_and_layout():
    from quantfuse.kernels._common import GluonTensorDescriptor

    if GluonTensorDescriptor is None:
        pytest.skip("this Triton has no Gluon")
    from quantfuse.kernels._gluon import operand_descriptor, unswizzled_layout

    t = torch.zeros(64, 64, dtype=torch.float16)
    swizzled = _arg_spec(operand_descriptor(t, [16, 64]))
    assert swizzled == _arg_spec(operand_descriptor(torch.zeros(32, 64, dtype=torch.float16), [16, 64]))
    assert swizzled != _arg_spec(operand_descriptor(t, [32, 64]))  # block
    assert swizzled != _arg_spec(operand_descriptor(t.to(torch.bfloat16), [16, 64]))  # dtype
    flat = GluonTensorDescriptor(t, [64, 64], [64, 1], [16, 64], unswizzled_layout(16, 2))
    assert swizzled != _arg_spec(flat)  # layout
    assert unswizzled_layout(16, 2) is unswizzled_layout(16, 2)  # made once
