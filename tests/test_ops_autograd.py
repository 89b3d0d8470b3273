"""quantfuse ops under autograd: every input that requires grad goes through the registered custom op, so a plain
tensor and an nn.Parameter behave alike (no autograd formula: backward raises), and no_grad calls take the eager
fast path with outputs that track nothing."""

import pytest
import torch
from torch import nn

import quantfuse as qf


@pytest.mark.parametrize("make", [lambda x: x.clone().requires_grad_(True), lambda x: nn.Parameter(x.clone())],
                         ids=["tensor", "parameter"])
def test_backward_through_an_op_raises_on_every_path(make):
    x = torch.randn(4, 64)
    leaf = make(x)
    q, scale, _ = qf.quantize_per_token(leaf, torch.int8)
    assert scale.requires_grad
    with pytest.raises(RuntimeError, match="autograd"):
        scale.sum().backward()
    with torch.no_grad():
        q2, scale2, _ = qf.quantize_per_token(leaf, torch.int8)
    assert not scale2.requires_grad and torch.equal(q2, q) and torch.equal(scale2, scale.detach())
