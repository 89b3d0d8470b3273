"""Activation quantization kernels (SPEC section 1) and their launchers.

Design (memory-bound; the floor is one read of x and one write of q):
- per token: a program owns BLOCK_M whole rows; rows up to MAX_SINGLE_PASS_K elements stay in registers
  between the amax reduction and the quantization (x is read once); longer rows are read twice, the
  second read mostly from L2.
- per group: a program owns a [BLOCK_M, BLOCK_K] tile (BLOCK_K a multiple of G), reshaped to
  [BLOCK_M, BLOCK_K/G, G] for the group amax: plain row-contiguous loads, several groups per row.
- dynamic per tensor: a partial-amax kernel writes one float per program, then the quantize kernel
  reduces those partials itself (tiny, L2-resident) and quantizes. No host sync, no atomics, no memset:
  deterministic and CUDA-graph safe.
Launchers assume arguments were validated by `quantfuse.ops`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, cast_to, cdiv, launch_kernel, next_pow2, quantize_value, rne_f32_any, to_int8_sat_azp
from .configs import max_partials, quantize_tile

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@triton.jit
def _region_scale(amax, QMAX: tl.constexpr, HAS_UB: tl.constexpr, ub_ptr):
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, QMAX, tl.float32))
    if HAS_UB:
        scale = tl.minimum(scale, tl.load(ub_ptr).to(tl.float32))
    return scale


@triton.jit
def _asym_params(xmin, xmax):
    """scale = max(max - min, 1e-10) / 255; azp = rne(-128 - min / scale) clamped to float32-exact int32."""
    scale = tl.math.div_rn(tl.maximum(xmax - xmin, 1e-10), tl.full(xmin.shape, 255.0, tl.float32))
    azp_f = rne_f32_any(-128.0 - tl.math.div_rn(xmin, scale))
    azp_f = tl.minimum(tl.maximum(azp_f, -2147483648.0), 2147483520.0)
    return scale, azp_f.to(tl.int32)


@triton.jit
def _per_token_kernel(
    x_ptr, q_ptr, scale_ptr, azp_ptr, ub_ptr,
    M, K, stride_xm, stride_qm,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_UB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    q_rows = q_ptr + rows64[:, None] * stride_qm

    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SYMMETRIC:
            amax = tl.max(tl.abs(x), axis=1)
        else:
            xmax = tl.max(tl.where(mask, x, float("-inf")), axis=1)
            xmin = tl.min(tl.where(mask, x, float("inf")), axis=1)
    else:
        if SYMMETRIC:
            acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        else:
            acc_max = tl.full([BLOCK_M, BLOCK_K], float("-inf"), tl.float32)
            acc_min = tl.full([BLOCK_M, BLOCK_K], float("inf"), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (cols[None, :] + k0 < K)
            xk = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SYMMETRIC:
                acc = tl.maximum(acc, tl.abs(xk))
            else:
                acc_max = tl.maximum(acc_max, tl.where(mask, xk, float("-inf")))
                acc_min = tl.minimum(acc_min, tl.where(mask, xk, float("inf")))
        if SYMMETRIC:
            amax = tl.max(acc, axis=1)
        else:
            xmax = tl.max(acc_max, axis=1)
            xmin = tl.min(acc_min, axis=1)

    if SYMMETRIC:
        scale = _region_scale(amax, QMAX, HAS_UB, ub_ptr)
    else:
        scale, azp = _asym_params(xmin, xmax)
        tl.store(azp_ptr + rows, azp, mask=row_mask)
    tl.store(scale_ptr + rows, scale, mask=row_mask)

    if SINGLE_PASS:
        v = tl.math.div_rn(x, scale[:, None])
        if SYMMETRIC:
            q = quantize_value(v, IS_FP8, INTERPRET)
        else:
            q = to_int8_sat_azp(v, azp[:, None])
        tl.store(q_rows + cols[None, :], q, mask=mask)
    else:
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (cols[None, :] + k0 < K)
            xk = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            v = tl.math.div_rn(xk, scale[:, None])
            if SYMMETRIC:
                q = quantize_value(v, IS_FP8, INTERPRET)
            else:
                q = to_int8_sat_azp(v, azp[:, None])
            tl.store(q_rows + k0 + cols[None, :], q, mask=mask)


@triton.jit
def _per_group_kernel(
    x_ptr, q_ptr, scale_ptr, ub_ptr,
    M, K, stride_xm, stride_qm, stride_sm, stride_sg,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, HAS_UB: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    # A [BLOCK_M, BLOCK_K] tile of whole rows' chunks, viewed as [BLOCK_M, BLOCK_K / GROUP, GROUP] for the
    # per-group amax: loads stay plain row-contiguous 2-D (full-width vectors, no per-region index math).
    # GROUP divides K and BLOCK_K, so the K mask never splits a group.
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_M, GROUPS, GROUP))
    scale = _region_scale(tl.max(tl.abs(x3), axis=2), QMAX, HAS_UB, ub_ptr)
    q = quantize_value(tl.math.div_rn(x3, scale[:, :, None]), IS_FP8, INTERPRET)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], tl.reshape(q, (BLOCK_M, BLOCK_K)), mask=mask)
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    s_mask = (rows[:, None] < M) & (grp[None, :] < K // GROUP)
    tl.store(scale_ptr + rows[:, None] * stride_sm + grp[None, :] * stride_sg, scale, mask=s_mask)


@triton.jit
def _amax_partial_kernel(
    x_ptr, partial_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    # A few programs per SM stride over all tiles, so the quantize kernel has few partials to reduce.
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_k
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for t in range(pid, num_tiles, tl.num_programs(0)):
        rows = ((t // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (t % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _per_tensor_kernel(
    x_ptr, q_ptr, scale_ptr, azp_ptr, partial_ptr, num_partials,
    M, K, stride_xm, stride_qm,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, DYNAMIC: tl.constexpr, HAS_AZP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if DYNAMIC:
        offs = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(partial_ptr + offs, mask=offs < num_partials, other=0.0), axis=0)
        scale = _region_scale(amax, QMAX, False, partial_ptr)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_ptr, scale)
        # walk the rows backwards: the amax pass read the last rows last, so they are still in L2
        pid_m = tl.num_programs(0) - 1 - pid_m
    else:
        scale = tl.load(scale_ptr)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v = tl.math.div_rn(x, tl.full([BLOCK_M, BLOCK_K], 1.0, tl.float32) * scale)
    if HAS_AZP:
        # as a [BLOCK_M, 1] tensor: to_int8_sat_azp reduces over its zero points, which a scalar cannot
        q = to_int8_sat_azp(v, tl.zeros([BLOCK_M, 1], dtype=tl.int32) + tl.load(azp_ptr))
    else:
        q = quantize_value(v, IS_FP8, INTERPRET)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)


@triton.jit
def _dequant_kernel(
    q_ptr, out_ptr, scale_ptr, azp_ptr,
    M, K, stride_qm, stride_om, stride_sm, stride_sg,
    SCALE_MODE: tl.constexpr, AZP_MODE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    # SCALE_MODE 0: per tensor, 1: per row, 2: per group. AZP_MODE 0: none, 1: per tensor, 2: per row.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < K)
    q = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask).to(tl.float32)
    if AZP_MODE == 1:
        q = q - tl.load(azp_ptr).to(tl.float32)
    elif AZP_MODE == 2:
        q = q - tl.load(azp_ptr + rows, mask=row_mask, other=0).to(tl.float32)[:, None]
    if SCALE_MODE == 0:
        out = q * tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        out = q * tl.load(scale_ptr + rows * stride_sm, mask=row_mask, other=0.0)[:, None]
    else:
        s = tl.load(scale_ptr + rows[:, None] * stride_sm + (cols[None, :] // GROUP) * stride_sg, mask=mask, other=0.0)
        out = q * s
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], cast_to(out, out_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers: x2d is [M, K] with a unit last stride and any row stride.
# ----------------------------------------------------------------------------------------------------
def _empty_like_rows(x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((x2d.shape[0], x2d.shape[1]), dtype=dtype, device=x2d.device)


def quantize_per_token(
    x2d: torch.Tensor, dtype: torch.dtype, scale_ub: Optional[torch.Tensor], symmetric: bool
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    m, k = x2d.shape
    q = _empty_like_rows(x2d, dtype)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    azp = None if symmetric else torch.empty((m, 1), dtype=torch.int32, device=x2d.device)
    tile = quantize_tile(x2d.device, "per_token", k)
    launch_kernel(_per_token_kernel, (cdiv(m, tile.block_m),),
        x2d, q, scale, azp if azp is not None else scale, scale_ub if scale_ub is not None else scale,
        m, k, x2d.stride(0), q.stride(0),
        QMAX=_QMAX[dtype], IS_FP8=dtype == torch.float8_e4m3fn, SYMMETRIC=symmetric,
        HAS_UB=scale_ub is not None, BLOCK_M=tile.block_m, BLOCK_K=tile.block_k,
        SINGLE_PASS=tile.single_pass, INTERPRET=INTERPRET, num_warps=tile.num_warps,
    )
    return q, scale, azp


def quantize_per_group(
    x2d: torch.Tensor, dtype: torch.dtype, group_size: int, scale_ub: Optional[torch.Tensor], transposed: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    m, k = x2d.shape
    groups = k // group_size
    q = _empty_like_rows(x2d, dtype)
    if transposed:
        scales = torch.empty((groups, m), dtype=torch.float32, device=x2d.device).t()
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=x2d.device)
    tile = quantize_tile(x2d.device, "per_group", k, group_size)
    launch_kernel(_per_group_kernel, (cdiv(m, tile.block_m), cdiv(k, tile.block_k)),
        x2d, q, scales, scale_ub if scale_ub is not None else scales,
        m, k, x2d.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
        QMAX=_QMAX[dtype], IS_FP8=dtype == torch.float8_e4m3fn, HAS_UB=scale_ub is not None,
        GROUP=group_size, BLOCK_M=tile.block_m, BLOCK_K=tile.block_k, INTERPRET=INTERPRET,
        num_warps=tile.num_warps,
    )
    return q, scales


def quantize_per_tensor(
    x2d: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], azp: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    m, k = x2d.shape
    q = _empty_like_rows(x2d, dtype)
    tile = quantize_tile(x2d.device, "per_tensor", k)
    grid = (cdiv(m, tile.block_m), cdiv(k, tile.block_k))
    dynamic = scale is None
    if dynamic:
        num_partials = min(grid[0] * grid[1], max_partials(x2d.device))
        partials = torch.empty(num_partials, dtype=torch.float32, device=x2d.device)
        launch_kernel(_amax_partial_kernel, (num_partials,),
            x2d, partials, m, k, x2d.stride(0), BLOCK_M=tile.block_m, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps,
        )
        scale = torch.empty(1, dtype=torch.float32, device=x2d.device)
    else:
        partials = scale
    launch_kernel(_per_tensor_kernel, grid,
        x2d, q, scale, azp if azp is not None else scale, partials, partials.numel(),
        m, k, x2d.stride(0), q.stride(0),
        QMAX=_QMAX[dtype], IS_FP8=dtype == torch.float8_e4m3fn, DYNAMIC=dynamic, HAS_AZP=azp is not None,
        BLOCK_M=tile.block_m, BLOCK_K=tile.block_k, BLOCK_P=next_pow2(partials.numel()),
        INTERPRET=INTERPRET,
        num_warps=tile.num_warps,
    )
    return q, scale


def dequantize(
    q2d: torch.Tensor,
    scale: torch.Tensor,
    azp: Optional[torch.Tensor],
    group_size: Optional[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    m, k = q2d.shape
    out = torch.empty((m, k), dtype=out_dtype, device=q2d.device)
    if group_size is not None:
        scale_mode, stride_sm, stride_sg = 2, scale.stride(0), scale.stride(1)
    elif scale.numel() == 1:
        scale_mode, stride_sm, stride_sg = 0, 0, 0
    else:
        scale = scale.reshape(m).contiguous()
        scale_mode, stride_sm, stride_sg = 1, 1, 0
    azp_mode = 0 if azp is None else (1 if azp.numel() == 1 else 2)
    if azp_mode == 2:
        azp = azp.reshape(m).contiguous()
    tile = quantize_tile(q2d.device, "elementwise", k)
    grid = (cdiv(m, tile.block_m), cdiv(k, tile.block_k))
    launch_kernel(_dequant_kernel, grid,
        q2d, out, scale, azp if azp is not None else scale,
        m, k, q2d.stride(0), out.stride(0), stride_sm, stride_sg,
        SCALE_MODE=scale_mode, AZP_MODE=azp_mode, GROUP=group_size or 1,
        BLOCK_M=tile.block_m, BLOCK_K=tile.block_k, INTERPRET=INTERPRET, num_warps=tile.num_warps,
    )
    return out
