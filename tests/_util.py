"""Assertions shared by the tests."""

import torch


def codes(q: torch.Tensor) -> torch.Tensor:
    """Integer view of int8 / fp8 codes, for exact comparisons (fp8 NaN != NaN otherwise). fp8 -0 (0x80)
    reads as +0: the same value, and a product rounding to zero may carry either sign (hardware and
    reference differ there for y = silu(gate) * up underflowing)."""
    if q.dtype != torch.float8_e4m3fn:
        return q.to(torch.int32)
    c = q.view(torch.uint8).to(torch.int32)
    return torch.where(c == 0x80, torch.zeros_like(c), c)


def assert_codes_equal(actual: torch.Tensor, expected: torch.Tensor, tie_rate: float = 0.0) -> None:
    """Exact equality of quantized codes; with tie_rate > 0, a mismatch rate below it is allowed and no
    mismatch may exceed one code step (SPEC section 0, rounding ties)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    a, e = codes(actual), codes(expected)
    diff = (a - e).abs()
    if tie_rate == 0.0:
        bad = int((diff != 0).sum())
        assert bad == 0, f"{bad} of {diff.numel()} codes differ; first at {torch.nonzero(diff)[:5].tolist()}"
        return
    assert int(diff.max()) <= 1, f"a code differs by {int(diff.max())} steps"
    rate = float((diff != 0).float().mean())
    assert rate < tie_rate, f"mismatch rate {rate} >= {tie_rate}"


class KernelSpy:
    """Wraps a Triton kernel: records the keyword arguments (constexprs), the positional arguments ("args")
    and the grid of every launch, then launches it. Install with
    monkeypatch.setattr(module, "_kernel", KernelSpy(module._kernel))."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(dict(kwargs, grid=grid, args=args))
            return self.fn[grid](*args, **kwargs)

        return launch
