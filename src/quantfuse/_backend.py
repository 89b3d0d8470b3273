"""Which implementation an op runs: the Triton kernels or the PyTorch reference.

Default: CUDA tensors run Triton, CPU tensors run the reference, so the library works without a GPU.
`backend("triton")` forces the kernels (on CPU tensors this needs `TRITON_INTERPRET=1`, which is how the
CPU test-suite checks the kernels' own logic); `backend("reference")` forces the spec implementation.
The environment variable QUANTFUSE_BACKEND sets the same choice process-wide.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

_CHOICES = ("auto", "triton", "reference")
_state = {"backend": os.environ.get("QUANTFUSE_BACKEND", "auto")}
if _state["backend"] not in _CHOICES:
    raise ValueError(f"QUANTFUSE_BACKEND must be one of {_CHOICES}, got {_state['backend']!r}")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def current() -> str:
    return _state["backend"]


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Force ops inside the block to run `name` ('auto', 'triton' or 'reference')."""
    if name not in _CHOICES:
        raise ValueError(f"backend: expected one of {_CHOICES}, got {name!r}")
    previous = _state["backend"]
    _state["backend"] = name
    try:
        yield
    finally:
        _state["backend"] = previous


def use_triton(t: torch.Tensor) -> bool:
    choice = _state["backend"]
    if choice == "reference":
        return False
    if t.is_cuda:
        return True
    if choice == "triton":
        if not interpreting():
            raise RuntimeError(
                "backend('triton') on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
            )
        return True
    return False
