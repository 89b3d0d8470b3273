"""Argument checks shared by the public ops. Every failure names the argument, what was expected and
what was received, and fires before any kernel launch."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, dtypes: Optional[Sequence[torch.dtype]] = None, ndim_min: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if t.dim() < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimension(s), got shape {tuple(t.shape)}")


def check_dtype_arg(name: str, dtype, allowed: Sequence[torch.dtype]) -> None:
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise TypeError(f"{name}: expected one of ({_names(allowed)}), got {dtype!r}")


def check_same_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "x") -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (the device of {ref_name}), got {t.device}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dimension (stride 1), got strides {tuple(t.stride())}"
        )


def check_numel(name: str, t: torch.Tensor, allowed: Sequence[int]) -> None:
    if t.numel() not in allowed:
        raise ValueError(f"{name}: expected numel in {tuple(allowed)}, got shape {tuple(t.shape)}")


def check_group_size(group_size, k: int, allowed=(16, 32, 64, 128, 256, 512), name: str = "group_size") -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in allowed:
        raise ValueError(f"{name}: expected a power of two in {tuple(allowed)}, got {group_size!r}")
    if k % group_size != 0:
        raise ValueError(f"{name}: {group_size} must divide the last dimension K={k}")


def check_scale(name: str, scale, ref: torch.Tensor, allowed_numel: Sequence[int], ref_name: str = "x") -> None:
    check_tensor(name, scale, (torch.float32,))
    check_same_device(name, scale, ref, ref_name)
    check_numel(name, scale, allowed_numel)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] without copying whenever the leading dims collapse; padded row strides survive.

    Leading dims that cannot be expressed with one row stride (rare, e.g. a permuted 3-D tensor) are
    copied, which is value-exact."""
    k = x.shape[-1]
    if x.dim() == 2:
        return x
    if x.dim() == 1:
        return x.view(1, k)
    try:
        return x.view(-1, k)
    except RuntimeError:
        return x.reshape(-1, k)
