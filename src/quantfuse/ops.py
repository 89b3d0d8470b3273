"""The public op surface of quantfuse (SPEC.md): validation, dispatch and torch.library registration.

Each op validates its arguments (clear ValueError/TypeError before any launch), then calls a
`quantfuse::*` custom op. The custom op runs the Triton kernel for CUDA tensors (or CPU tensors under
`backend("triton")` with TRITON_INTERPRET=1) and the reference (`quantfuse.reference`) otherwise. Fake
implementations give shapes to torch.compile, so every op traces with fullgraph=True and captures in
CUDA graphs (no host syncs anywhere on the GPU path).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference as ref
from ._backend import backend, use_triton
from ._validation import (
    FLOAT_DTYPES,
    QUANT_DTYPES,
    check_dtype_arg,
    check_group_size,
    check_last_dim_contiguous,
    check_same_device,
    check_scale,
    check_tensor,
    rows_view,
)

# Each section below appends its public names to __all__ (quantfuse re-exports them).
__all__ = ["backend"]

Tensor = torch.Tensor


def _kernels():
    # Imported lazily so `import quantfuse` stays cheap and works where Triton cannot compile.
    from .kernels import quantize as kq

    return kq


def _m_of(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _check_activation(x, name: str = "x") -> None:
    check_tensor(name, x, FLOAT_DTYPES, ndim_min=1)
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty last dimension, got shape {tuple(x.shape)}")
    check_last_dim_contiguous(name, x)


def _check_scale_ub(scale_ub, x: Tensor) -> None:
    if scale_ub is not None:
        check_scale("scale_ub", scale_ub, x, (1,))


# ----------------------------------------------------------------------------------------------------
# Section 1: activation quantization
# ----------------------------------------------------------------------------------------------------
__all__ += ["quantize_per_tensor", "quantize_per_token", "quantize_per_group", "dequantize"]

@torch.library.custom_op("quantfuse::quantize_per_tensor_dynamic", mutates_args=())
def _quantize_per_tensor_dynamic(x: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scale = _kernels().quantize_per_tensor(x2d, dtype, None, None)
        return q.view(x.shape), scale
    q, scale, _ = ref.quantize_per_tensor(x, dtype)
    return q, scale


@_quantize_per_tensor_dynamic.register_fake
def _(x, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device), x.new_empty((1,), dtype=torch.float32)


@torch.library.custom_op("quantfuse::quantize_per_tensor_static", mutates_args=())
def _quantize_per_tensor_static(x: Tensor, dtype: torch.dtype, scale: Tensor, azp: Optional[Tensor]) -> Tensor:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, _ = _kernels().quantize_per_tensor(x2d, dtype, scale.reshape(1), None if azp is None else azp.reshape(1))
        return q.view(x.shape)
    return ref.quantize_per_tensor(x, dtype, scale, azp)[0]


@_quantize_per_tensor_static.register_fake
def _(x, dtype, scale, azp):
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def quantize_per_tensor(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor] = None, azp: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """q = sat(rne(x / scale) [+ azp]) with one scale for the whole tensor.

    Dynamic (scale=None): scale = max(amax(|x|), 1e-10) / qmax, returned with shape [1].
    Static: the given float32 `scale` (numel 1) and optional int32 `azp` (numel 1, int8 only) are used as
    is and returned as the same tensor objects. Returns (q, scale, azp_or_None); q has x's shape."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    if scale is None:
        if azp is not None:
            raise ValueError("azp: a zero point needs a static scale; got azp with scale=None")
        q, s = _quantize_per_tensor_dynamic(x, dtype)
        return q, s, None
    check_scale("scale", scale, x, (1,))
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, x)
        if azp.numel() != 1:
            raise ValueError(f"azp: expected numel 1 (per-tensor zero point), got shape {tuple(azp.shape)}")
        if dtype != torch.int8:
            raise ValueError(f"azp: asymmetric quantization needs dtype=torch.int8, got {dtype}")
    return _quantize_per_tensor_static(x, dtype, scale, azp), scale, azp


@torch.library.custom_op("quantfuse::quantize_per_token", mutates_args=())
def _quantize_per_token(
    x: Tensor, dtype: torch.dtype, scale_ub: Optional[Tensor], symmetric: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scale, azp = _kernels().quantize_per_token(x2d, dtype, scale_ub, symmetric)
        q = q.view(x.shape)
    else:
        q, scale, azp = ref.quantize_per_token(x, dtype, scale_ub, symmetric)
    return q, scale, torch.empty(0, dtype=torch.int32, device=x.device) if azp is None else azp


@_quantize_per_token.register_fake
def _(x, dtype, scale_ub, symmetric):
    m = _m_of(x)
    azp = x.new_empty((0,) if symmetric else (m, 1), dtype=torch.int32)
    return torch.empty(x.shape, dtype=dtype, device=x.device), x.new_empty((m, 1), dtype=torch.float32), azp


def quantize_per_token(
    x: Tensor, dtype: torch.dtype, scale_ub: Optional[Tensor] = None, symmetric: bool = True
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One dynamic scale per token (row of the flattened [M, K] input).

    Symmetric: scale[i] = min(max(amax_i, 1e-10) / qmax, scale_ub), q = sat(rne(x / scale)).
    Asymmetric (int8 only): scale[i] = max(max_i - min_i, 1e-10) / 255, azp[i] = rne(-128 - min_i / scale[i])
    as int32, q = sat(rne(x / scale) + azp). Returns (q, scale [M, 1], azp [M, 1] or None)."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    _check_scale_ub(scale_ub, x)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric: expected a bool, got {type(symmetric).__name__}")
    if not symmetric and dtype != torch.int8:
        raise ValueError(f"symmetric: asymmetric quantization needs dtype=torch.int8, got {dtype}")
    if not symmetric and scale_ub is not None:
        raise ValueError("scale_ub: only meaningful for symmetric quantization; got symmetric=False")
    q, scale, azp = _quantize_per_token(x, dtype, scale_ub, symmetric)
    return q, scale, (None if symmetric else azp)


@torch.library.custom_op("quantfuse::quantize_per_group", mutates_args=())
def _quantize_per_group(
    x: Tensor, dtype: torch.dtype, group_size: int, scale_ub: Optional[Tensor], transposed_scales: bool
) -> Tuple[Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scales = _kernels().quantize_per_group(x2d, dtype, group_size, scale_ub, transposed_scales)
        return q.view(x.shape), scales
    q, scales, _ = ref.quantize_per_group(x, dtype, group_size, scale_ub, transposed_scales)
    return q, scales


@_quantize_per_group.register_fake
def _(x, dtype, group_size, scale_ub, transposed_scales):
    m, groups = _m_of(x), x.shape[-1] // group_size
    if transposed_scales:
        scales = x.new_empty((groups, m), dtype=torch.float32).t()
    else:
        scales = x.new_empty((m, groups), dtype=torch.float32)
    return torch.empty(x.shape, dtype=dtype, device=x.device), scales


def quantize_per_group(
    x: Tensor,
    dtype: torch.dtype,
    group_size: int = 128,
    scale_ub: Optional[Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[Tensor, Tensor, None]:
    """One dynamic scale per `group_size` consecutive elements of each row.

    scales[i, g] = min(max(amax(|x[i, g*G:(g+1)*G]|), 1e-10) / qmax, scale_ub); q = sat(rne(x / scale)).
    group_size is a power of two in 16..512 dividing K. transposed_scales=True returns the [M, K/G] scales
    as a view of a contiguous [K/G, M] tensor. Returns (q, scales, None)."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    check_group_size(group_size, x.shape[-1])
    _check_scale_ub(scale_ub, x)
    if not isinstance(transposed_scales, bool):
        raise TypeError(f"transposed_scales: expected a bool, got {type(transposed_scales).__name__}")
    q, scales = _quantize_per_group(x, dtype, group_size, scale_ub, transposed_scales)
    return q, scales, None


@torch.library.custom_op("quantfuse::dequantize", mutates_args=())
def _dequantize(
    q: Tensor, scale: Tensor, azp: Optional[Tensor], group_size: Optional[int], out_dtype: torch.dtype
) -> Tensor:
    if use_triton(q) and q.numel() > 0:
        out = _kernels().dequantize(rows_view(q), scale, azp, group_size, out_dtype)
        return out.view(q.shape)
    return ref.dequantize(q, scale, azp, group_size, out_dtype)


@_dequantize.register_fake
def _(q, scale, azp, group_size, out_dtype):
    return torch.empty(q.shape, dtype=out_dtype, device=q.device)


def dequantize(
    q: Tensor,
    scale: Tensor,
    azp: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """x_hat = scale * (q - azp), float32 math, one rounding to out_dtype. Inverts the quantize ops:
    scale numel 1 (per tensor), numel M (per token), or [M, K/group_size] (per group, any strides)."""
    check_tensor("q", q, QUANT_DTYPES, ndim_min=1)
    check_last_dim_contiguous("q", q)
    check_dtype_arg("out_dtype", out_dtype, FLOAT_DTYPES)
    m, k = _m_of(q), q.shape[-1]
    check_tensor("scale", scale, (torch.float32,))
    check_same_device("scale", scale, q, "q")
    if group_size is not None:
        check_group_size(group_size, k)
        if tuple(scale.shape) != (m, k // group_size):
            raise ValueError(
                f"scale: expected shape {(m, k // group_size)} for group_size={group_size}, got {tuple(scale.shape)}"
            )
    elif scale.numel() not in (1, m):
        raise ValueError(f"scale: expected numel 1 (per tensor) or {m} (per token), got shape {tuple(scale.shape)}")
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, q, "q")
        if q.dtype != torch.int8:
            raise ValueError(f"azp: zero points need int8 codes, got q of dtype {q.dtype}")
        if azp.numel() not in (1, m):
            raise ValueError(f"azp: expected numel 1 or {m}, got shape {tuple(azp.shape)}")
    return _dequantize(q, scale, azp, group_size, out_dtype)


# ----------------------------------------------------------------------------------------------------
# Section 2: scaled matmul with fused epilogues
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Section 3: fused SiLU-and-mul with quantization
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Section 4: weight-only quantized GEMM
# ----------------------------------------------------------------------------------------------------
