"""The executable spec: every op of SPEC.md in plain PyTorch, on any device.

These functions define what the kernels must compute (tests compare against them) and they are what the
ops run on CPU tensors. They favour obviousness over speed: float32 math, float64 where an exact integer
identity is needed, one final rounding. Validation lives in `quantfuse.ops`; these assume valid input.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
INT32_MIN_F = -2147483648.0
# Largest float32 below 2^31: the upper clamp of a zero point computed in float32 (see `_azp_from_range`).
INT32_MAX_F = 2147483520.0
SCALE_FLOOR = 1e-10


# ----------------------------------------------------------------------------------------------------
# Section 0: rounding and the scale rule
# ----------------------------------------------------------------------------------------------------
def quantize_values(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = sat(rne(v)) for float32 v already divided by its scale.

    int8: round half to even, then saturate. fp8: clamp to +-448, then the round-to-nearest-even cast."""
    v = v.float()
    if dtype == torch.int8:
        return torch.round(v).clamp(-128, 127).nan_to_num(0.0).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    raise TypeError(f"dtype: expected int8 or float8_e4m3fn, got {dtype}")


def quantize_values_azp(v: torch.Tensor, azp: torch.Tensor) -> torch.Tensor:
    """q = sat_int8(rne(v) + azp), computed exactly in float64 (azp is int32 and may lie outside int8)."""
    w = torch.round(v.double()) + azp.double()
    return w.clamp(-128, 127).nan_to_num(0.0).to(torch.int8)


def dynamic_scale(amax: torch.Tensor, dtype: torch.dtype, scale_ub: Optional[torch.Tensor] = None) -> torch.Tensor:
    """scale = max(amax, 1e-10) / qmax, then min(scale, scale_ub) when an upper bound is given."""
    scale = torch.clamp(amax.float(), min=SCALE_FLOOR) / QMAX[dtype]
    if scale_ub is not None:
        scale = torch.minimum(scale, scale_ub.float().reshape(()))
    return scale


def _azp_from_range(xmin: torch.Tensor, xmax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int8: scale = max(max - min, 1e-10) / 255, azp = rne(-128 - min / scale) as int32.

    A (near-)constant region gives a tiny scale and a zero point far outside int8; it is clamped to the
    float32-representable int32 range [-2^31, 2^31 - 128] so it never overflows and never gives NaN."""
    scale = torch.clamp(xmax.float() - xmin.float(), min=SCALE_FLOOR) / 255.0
    azp = torch.round(-128.0 - xmin.float() / scale)
    azp = azp.clamp(INT32_MIN_F, INT32_MAX_F).nan_to_num(0.0).to(torch.int32)
    return scale, azp


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


# ----------------------------------------------------------------------------------------------------
# Section 1: activation quantization
# ----------------------------------------------------------------------------------------------------
def quantize_per_tensor(
    x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None, azp: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Static (given scale [and azp]) or dynamic (amax over the whole tensor) per-tensor quantization."""
    xf = x.float()
    if scale is None:
        scale = dynamic_scale(xf.abs().amax(), dtype).reshape(1)
        return quantize_values(xf / scale, dtype), scale, None
    s = scale.float().reshape(())
    if azp is None:
        return quantize_values(xf / s, dtype), scale, None
    return quantize_values_azp(xf / s, azp.reshape(())), scale, azp


def quantize_per_token(
    x: torch.Tensor, dtype: torch.dtype, scale_ub: Optional[torch.Tensor] = None, symmetric: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One dynamic scale per row of the flattened [M, K] input; asymmetric adds an int32 zero point."""
    rows = _rows(x)
    if symmetric:
        scale = dynamic_scale(rows.abs().amax(dim=1, keepdim=True), dtype, scale_ub)
        return quantize_values(rows / scale, dtype).reshape(x.shape), scale, None
    scale, azp = _azp_from_range(rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True))
    return quantize_values_azp(rows / scale, azp).reshape(x.shape), scale, azp


def quantize_per_group(
    x: torch.Tensor,
    dtype: torch.dtype,
    group_size: int = 128,
    scale_ub: Optional[torch.Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, None]:
    """One dynamic scale per `group_size` consecutive elements of a row: scales [M, K / group_size].

    transposed_scales: the same values, stored as a contiguous [K/g, M] tensor and returned as its
    [M, K/g] transpose view (the layout a blockwise GEMM reads along M)."""
    rows = _rows(x)
    m, k = rows.shape
    groups = rows.reshape(m, k // group_size, group_size)
    scales = dynamic_scale(groups.abs().amax(dim=2), dtype, scale_ub)
    q = quantize_values(groups / scales.unsqueeze(2), dtype).reshape(x.shape)
    if transposed_scales:
        scales = scales.t().contiguous().t()
    return q, scales, None


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    azp: Optional[torch.Tensor] = None,
    group_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x = scale * (q - azp) in float32, one rounding to out_dtype.

    scale: numel 1 (per tensor), [M, 1] (per token) or [M, K/g] with group_size (per group)."""
    rows = _rows(q)
    m, k = rows.shape
    if azp is not None:
        rows = rows - azp.reshape(-1, 1).float() if azp.numel() > 1 else rows - azp.float().reshape(())
    s = scale.float()
    if group_size is not None:
        out = (rows.reshape(m, k // group_size, group_size) * s.reshape(m, k // group_size, 1)).reshape(m, k)
    elif s.numel() == 1:
        out = rows * s.reshape(())
    else:
        out = rows * s.reshape(m, 1)
    return out.to(out_dtype).reshape(q.shape)


# ----------------------------------------------------------------------------------------------------
# Section 2: scaled matmul with fused epilogues
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Section 3: fused SiLU-and-mul with quantization
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Section 4: weight-only quantized GEMM
# ----------------------------------------------------------------------------------------------------
