"""Fused SiLU-and-mul + quantization (SPEC section 3): kernels, launchers and their launch table.

    y[i, j] = silu(gate[i, j]) * up[i, j] = gate / (1 + exp(-gate)) * up      (float32, true division)
    q = sat(rne(y / scale)) to int8 or fp8-e4m3, scale per group / per token (dynamic) or per tensor (static)

with x[i] = [gate_i | up_i] of width 2H. y never leaves registers, so x is read once and q (plus one
float per scaled region) is written once.

Design. Every kernel works on "regions": a region is WIDTH consecutive output columns of one row, and a
program owns BLOCK_R regions laid out as a [BLOCK_R, WIDTH] tile. One launch therefore covers any token
count with full-width 16-byte loads, several groups per program at large T and down to one group per
program at small T (so a single token still spreads over the whole GPU). The same tile code runs every mode:
- per group: WIDTH = group_size; the region is the scaled region, its amax is a row reduction of the tile.
- per token, rows that fit in registers: WIDTH = next_pow2(H), one region per row (masked tail).
- per token, long rows or few tokens: rows split into WIDTH-column chunks; a first kernel writes each
  chunk's amax, the second reduces a row's partials (a few floats, L2-resident), recomputes y from x
  (read again, from L2 at the token counts where this path is chosen) and quantizes. Deterministic, no
  atomics, CUDA-graph safe.
- per tensor, static: WIDTH-column chunks with the given scale.

Exactness. On the GPU exp is libdevice's expf (the same function as torch's CUDA exp, unlike tl.exp,
which is ex2.approx), so kernel and reference agree bit for bit; the interpreter uses numpy's exp.
The division by a region's scale shares the divisor across the region: one correctly rounded reciprocal
r = 1/s per region, then q0 = y*r and one Markstein correction q = fma(y - q0*s, r, q0) (3 FMAs instead
of a full div.rn per element; `_common.div_rn_by`, also used by the encoder's attention). This is the
correctly rounded y/s for normal scales (checked against exact division on 2e7 random and near-tie cases);
programs with a scale outside [2^-126, 2^126] take the plain true division instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import DIV_BY_MAX, DIV_BY_MIN, INTERPRET, cdiv, div_rn_by, launch_kernel, next_pow2, quantize_value
from .configs import arch_key
from .quantize import _QMAX, _region_scale

try:  # Triton >= 3.0 on CUDA; the interpreter never traces the libdevice branch
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    libdevice = None

# Launch table, one entry per architecture (values picked for H100; others use "default").
#   elements:            outputs per program at large token counts
#   min_programs:        shrink the tile (down to one region) until at least this many programs run
#   token_single_max:    widest row (next power of two of H) a per-token program keeps in registers
#   token_split_rows:    below this many tokens the per-token path splits rows over programs
#   chunk:               column chunk of the split per-token path and of the static path
#   elements_per_warp:   outputs per warp (num_warps = elements in the tile / this, 1..16)
#   loop_block, loop_rows: column chunk and rows per program of the per-token 'loop' path
# benchmarks/tune_silu_quant.py sweeps these on the GPU. Offline sm90 compiles of the per-group tile
# (elements 4096, group 128: 32 regions, 8 warps) show 156 registers per thread, i.e. one program of 8 warps
# per SM; 2048 elements (16 regions) need 83 at 8 warps or 154 at 4 (three programs per SM). The per-token
# tile that holds a 14336-wide row (width 16384) spills (192 B per thread at 16 warps, 96 B at 32).
SILU_QUANT_CONFIGS = {
    # elements 2048: the per-group winner of benchmarks/tune_silu_quant.py on the H100 at every measured
    # shape (T=4096 H=14336: 116.3 us vs 118.5 us with 4096; T=16384: 444.8 vs 451.3 us)
    "sm90": dict(elements=2048, min_programs=264, token_single_max=16384, token_split_rows=128, chunk=2048,
                 elements_per_warp=512, loop_block=2048, loop_rows=1),
    "default": dict(elements=4096, min_programs=128, token_single_max=8192, token_split_rows=64, chunk=1024,
                    elements_per_warp=512, loop_block=1024, loop_rows=1),
}

_SCALE_OWN, _SCALE_GIVEN, _SCALE_PARTIALS = 0, 1, 2
_TINY_NORMAL = 1.1754943508222875e-38  # 2^-126
_HUGE = 8.507059173023462e37  # 2^126


@dataclass(frozen=True)
class RegionTile:
    width: int  # output columns per region (power of two)
    regions_per_row: int
    block_r: int  # regions per program
    num_warps: int

    def grid(self, rows: int) -> Tuple[int]:
        return (cdiv(rows * self.regions_per_row, self.block_r),)


def _config(device: torch.device) -> dict:
    return SILU_QUANT_CONFIGS[arch_key(device.type, device.index)]


def region_tile(device: torch.device, rows: int, width: int, regions_per_row: int) -> RegionTile:
    cfg = _config(device)
    regions = rows * regions_per_row
    block_r = max(1, cfg["elements"] // width)
    # on CPU tensors (the interpreter) programs run one after another: no parallelism to expose
    min_programs = cfg["min_programs"] if device.type == "cuda" else 1
    while block_r > 1 and cdiv(regions, block_r) < min_programs:
        block_r //= 2
    # default 512 per warp, i.e. 16 outputs per thread: two 16-byte loads of gate and of up for 16-bit inputs
    num_warps = max(1, min(16, (block_r * width) // cfg["elements_per_warp"]))
    return RegionTile(width, regions_per_row, block_r, next_pow2(num_warps))


@triton.jit
def _silu_mul(gate, up, INTERPRET: tl.constexpr):
    """silu(gate) * up = gate / (1 + exp(-gate)) * up in float32 with a true division."""
    if INTERPRET:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    return tl.math.div_rn(gate, 1.0 + e) * up


@triton.jit
def _divide_rows(y, scale, FMA_DIV: tl.constexpr):
    """y / scale[:, None], correctly rounded (see the module docstring for the FMA variant)."""
    if FMA_DIV:
        lo = tl.min(scale, axis=0)
        hi = tl.max(scale, axis=0)
        if (lo >= DIV_BY_MIN) & (hi <= DIV_BY_MAX):
            v = div_rn_by(y, scale[:, None], tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None])
        else:
            v = tl.math.div_rn(y, scale[:, None])
    else:
        v = tl.math.div_rn(y, scale[:, None])
    return v


@triton.jit
def _load_silu_mul(x_ptr, row, cols, mask, H, stride_xm, INTERPRET: tl.constexpr):
    gate_ptrs = x_ptr + row[:, None] * stride_xm + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask, other=0.0).to(tl.float32)
    return _silu_mul(gate, up, INTERPRET)


@triton.jit
def _load_regions(x_ptr, num_regions, regions_per_row, H, stride_xm,
                  WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, MASK_COLS: tl.constexpr, INTERPRET: tl.constexpr):
    """This program's BLOCK_R regions (region = row * regions_per_row + chunk of WIDTH columns) and their
    y = silu(gate) * up in float32 (masked lanes 0)."""
    region = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    region_mask = region < num_regions
    row = region // regions_per_row
    chunk = region % regions_per_row
    cols = chunk[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    mask = region_mask[:, None]
    if MASK_COLS:
        mask = mask & (cols < H)
    y = _load_silu_mul(x_ptr, row, cols, mask, H, stride_xm, INTERPRET)
    return region, region_mask, row, chunk, cols, mask, y


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, ub_ptr, partial_ptr,
    num_regions, regions_per_row, H,
    stride_xm, stride_qm, stride_sm, stride_sg,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_UB: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, MASK_COLS: tl.constexpr, BLOCK_P: tl.constexpr,
    FMA_DIV: tl.constexpr, INTERPRET: tl.constexpr,
):
    region, region_mask, row, chunk, cols, mask, y = _load_regions(
        x_ptr, num_regions, regions_per_row, H, stride_xm, WIDTH, BLOCK_R, MASK_COLS, INTERPRET)

    if SCALE_MODE == 0:
        # the region is the scaled region (a group, or a whole row that fits in the tile);
        # masked lanes hold y = silu(0) * 0 = 0 and never raise the amax
        scale = _region_scale(tl.max(tl.abs(y), axis=1), QMAX, HAS_UB, ub_ptr)
        tl.store(scale_ptr + row * stride_sm + chunk * stride_sg, scale, mask=region_mask)
    elif SCALE_MODE == 1:
        scale = tl.full([BLOCK_R], 1.0, tl.float32) * tl.load(scale_ptr)
    else:
        # the row's amax from the partial kernel: one float per chunk, [rows, regions_per_row]
        p = tl.arange(0, BLOCK_P)
        pmask = region_mask[:, None] & (p[None, :] < regions_per_row)
        partial = tl.load(partial_ptr + row[:, None] * regions_per_row + p[None, :], mask=pmask, other=0.0)
        scale = _region_scale(tl.max(partial, axis=1), QMAX, HAS_UB, ub_ptr)
        tl.store(scale_ptr + row * stride_sm, scale, mask=region_mask & (chunk == 0))

    q = quantize_value(_divide_rows(y, scale, FMA_DIV), IS_FP8, INTERPRET)
    tl.store(q_ptr + row[:, None] * stride_qm + cols, q, mask=mask)


@triton.jit
def _silu_mul_amax_kernel(
    x_ptr, partial_ptr, num_regions, regions_per_row, H, stride_xm,
    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, MASK_COLS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """partial[row, chunk] = max |y| over the chunk (region index = row * regions_per_row + chunk)."""
    region, region_mask, row, chunk, cols, mask, y = _load_regions(
        x_ptr, num_regions, regions_per_row, H, stride_xm, WIDTH, BLOCK_R, MASK_COLS, INTERPRET)
    tl.store(partial_ptr + region, tl.max(tl.abs(y), axis=1), mask=region_mask)


@triton.jit
def _silu_mul_quant_row_loop_kernel(
    x_ptr, q_ptr, scale_ptr, ub_ptr, M, H, stride_xm, stride_qm,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, HAS_UB: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, FMA_DIV: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Per token, ROWS rows per program, walked in BLOCK-column chunks twice: the first walk finds each
    row's amax, the second recomputes y (its x comes back from L2: a program's rows, ~2 * 2H * 2 bytes
    each, are read moments before) and quantizes. Registers hold one chunk, never the row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        mask = row_mask[:, None] & (cols < H)
        y = _load_silu_mul(x_ptr, rows, cols, mask, H, stride_xm, INTERPRET)
        # one reduction over the chunk and the running maximum: tl.max of the pair keeps the NaN
        # behaviour of the one-pass kernels (a NaN anywhere in the row reaches the row's scale)
        pair = tl.join(amax, tl.max(tl.abs(y), axis=1))
        amax = tl.max(pair, axis=1)
    scale = _region_scale(amax, QMAX, HAS_UB, ub_ptr)
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        mask = row_mask[:, None] & (cols < H)
        y = _load_silu_mul(x_ptr, rows, cols, mask, H, stride_xm, INTERPRET)
        q = quantize_value(_divide_rows(y, scale, FMA_DIV), IS_FP8, INTERPRET)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols, q, mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launcher: x2d is [M, 2H] with a unit last stride and any row stride; arguments already validated.
# ----------------------------------------------------------------------------------------------------
def _launch(x2d, q, scales, ub, partials, tile: RegionTile, h, mode, dtype, stride_sm, stride_sg):
    m = x2d.shape[0]
    launch_kernel(_silu_mul_quant_kernel, tile.grid(m),
        x2d, q, scales, ub if ub is not None else scales, partials if partials is not None else scales,
        m * tile.regions_per_row, tile.regions_per_row, h,
        x2d.stride(0), q.stride(0), stride_sm, stride_sg,
        QMAX=_QMAX[dtype], IS_FP8=dtype == torch.float8_e4m3fn, SCALE_MODE=mode, HAS_UB=ub is not None,
        WIDTH=tile.width, BLOCK_R=tile.block_r, MASK_COLS=h % tile.width != 0,
        BLOCK_P=next_pow2(tile.regions_per_row),
        FMA_DIV=(not INTERPRET) and mode != _SCALE_GIVEN, INTERPRET=INTERPRET, num_warps=tile.num_warps,
    )


def per_token_path(device: torch.device, m: int, h: int) -> str:
    """'single' (a row per region, x read once) or 'split' (rows over several programs, two kernels);
    'loop' (a row per program walked twice, second read from L2) is chosen only when forced, until the
    GPU sweep (benchmarks/tune_silu_quant.py) measures it against the other two."""
    cfg = _config(device)
    if next_pow2(h) > cfg["token_single_max"] or m < cfg["token_split_rows"]:
        return "split"
    return "single"


def silu_and_mul_quant(
    x2d: torch.Tensor,
    dtype: torch.dtype,
    group_size: Optional[int],
    scale: Optional[torch.Tensor],
    scale_ub: Optional[torch.Tensor],
    transposed_scales: bool,
    token_path: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (q [M, H], scales): [M, H/g] (maybe a transposed view), [M, 1], or the given scale.

    token_path forces the per-token strategy ('single' or 'split'; benchmarks compare them)."""
    m, h = x2d.shape[0], x2d.shape[1] // 2
    q = torch.empty((m, h), dtype=dtype, device=x2d.device)
    if group_size is not None:
        groups = h // group_size
        if transposed_scales:
            scales = torch.empty((groups, m), dtype=torch.float32, device=x2d.device).t()
        else:
            scales = torch.empty((m, groups), dtype=torch.float32, device=x2d.device)
        tile = region_tile(x2d.device, m, group_size, groups)
        _launch(x2d, q, scales, scale_ub, None, tile, h, _SCALE_OWN, dtype, scales.stride(0), scales.stride(1))
        return q, scales

    if scale is not None:
        width = min(next_pow2(h), _config(x2d.device)["chunk"])
        tile = region_tile(x2d.device, m, width, cdiv(h, width))
        _launch(x2d, q, scale.reshape(1), None, None, tile, h, _SCALE_GIVEN, dtype, 0, 0)
        return q, scale

    scales = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    path = token_path or per_token_path(x2d.device, m, h)
    if path == "loop":
        cfg = _config(x2d.device)
        block = min(next_pow2(h), cfg["loop_block"])
        rows = cfg["loop_rows"]
        launch_kernel(_silu_mul_quant_row_loop_kernel, (cdiv(m, rows),),
            x2d, q, scales, scale_ub if scale_ub is not None else scales, m, h, x2d.stride(0), q.stride(0),
            QMAX=_QMAX[dtype], IS_FP8=dtype == torch.float8_e4m3fn, HAS_UB=scale_ub is not None,
            ROWS=rows, BLOCK=block, FMA_DIV=not INTERPRET, INTERPRET=INTERPRET,
            num_warps=max(1, min(8, rows * block // cfg["elements_per_warp"])),
        )
        return q, scales
    if path == "single":
        tile = region_tile(x2d.device, m, next_pow2(h), 1)
        _launch(x2d, q, scales, scale_ub, None, tile, h, _SCALE_OWN, dtype, 1, 0)
        return q, scales
    width = min(next_pow2(h), _config(x2d.device)["chunk"])
    tile = region_tile(x2d.device, m, width, cdiv(h, width))
    partials = torch.empty((m, tile.regions_per_row), dtype=torch.float32, device=x2d.device)
    launch_kernel(_silu_mul_amax_kernel, tile.grid(m),
        x2d, partials, m * tile.regions_per_row, tile.regions_per_row, h, x2d.stride(0),
        WIDTH=width, BLOCK_R=tile.block_r, MASK_COLS=h % width != 0, INTERPRET=INTERPRET,
        num_warps=tile.num_warps,
    )
    _launch(x2d, q, scales, scale_ub, partials, tile, h, _SCALE_PARTIALS, dtype, 1, 0)
    return q, scales
