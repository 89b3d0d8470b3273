"""Weight-only decode GEMV for Hopper (sm90) in Gluon: the packed weight streamed by TMA through a deep ring.

Math (SPEC section 4, M = 1): out[n] = sum_k x[k] * (u[n, k] - z[g(k), n]) * s[g(k), n] (+ bias[n]), with the
scale applied once per group to the float32 sum of the exact integers u - z times x (the shipped GEMV's
"scale after": x @ W.T for the unrounded W = (u - z) * s, within one rounding per weight of x @ w_hat.T).

Why a second GEMV: the `tl` GEMV (weight_only._wo_gemv_kernel) loads each [BLOCK_N, 16] word tile with
plain loads and converts it as soon as it arrives, so every program has one tile in flight and waits out the
DRAM latency once per iteration: ncu on the H100 showed it latency-bound (long-scoreboard stalls ~64% of
stall cycles) at 0.41-0.60 of copy bandwidth. Here the copy engine keeps STAGES tiles of every program in
flight (TMA into shared memory, one mbarrier per slot, zero fill past N and past the packed K), and the warps
only read finished tiles: conversion never waits for DRAM while the ring has data.

Packed layout: `weight_only` module doc (chunks of 16 int32 words, field i of word j = k chunk*CHUNK + 16i + j).
The descriptor views qweight [N, words] as [N, words / 16, 16] and a tile is [BLOCK_N, CHUNKS, 16] words; a
thread holds 4 consecutive words (16 bytes) of R rows, so one x value (loaded once per tile and field) serves
R weights. Conversion per weight: one LOP3 + one FADD (the in-place magic-number trick of
`weight_only._field_minus_zero`: exact u - z) and one FFMA with x. x is loaded one tile ahead, before the wait for
the words: loaded after them, each tile's products waited out an L2 round trip for x, which cost 4096x6144 (int8,
3 tiles per program) 9% of its time (results/tune_gemv_tma_x_ahead.json).

Split-K: programs (row block, K split) write float32 partials; the last program of a row block to arrive
(an acq_rel counter, reset by it) adds them in split order with the bias and rounds once.

Scope (`applies`): sm90 exactly, M = 1, float16 / bfloat16 x with 16-byte-aligned base, qweight with
contiguous rows whose stride and base are 16-byte aligned, groups that are whole fields of a chunk (g <= CHUNK,
a power of two) or one group (per channel). Anything else, and the Triton interpreter, runs the `tl` GEMV,
the executable twin tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ._common import INTERPRET, cdiv, launch_kernel, pdl_launch_options
from ._gluon import GLUON_AVAILABLE, sm90_exactly
from .configs import arch_key, decode_pdl

if GLUON_AVAILABLE:
    from ._gluon import TensorDescriptor as GluonTensorDescriptor
    from ._gluon import cta_barrier as _cta_barrier
    from ._gluon import gl, gluon, mbarrier
    from ._gluon import grid_dependency_sync as _grid_dependency_sync
    from ._gluon import tma_load as _tma_load
    from ._gluon import unswizzled_layout as _unswizzled_layout

WORDS_PER_CHUNK = 16


@dataclass(frozen=True)
class GemvConfig:
    """block_n rows x chunks of 16 words per tile; stages tiles in flight per program; programs_per_sm sets
    the split-K target (row blocks x splits ~ programs_per_sm x SMs)."""
    block_n: int
    chunks: int
    num_warps: int
    stages: int
    programs_per_sm: int

    def rows_per_thread(self) -> int:
        return self.block_n // ((32 // (4 * self.chunks)) * self.num_warps)


# Per architecture and weight width, the candidates; the first runs, the rest are what the tuner sweeps.
# H100 sweep (benchmarks/tune_gemv_tma.py, results/tune_gemv_tma.json; M = 1, bf16 x, float32 scales, eight
# Llama-3 shapes, CUDA graphs, same run as the tl GEMV):
# - int8 per channel: 32 rows x 4 chunks, 4 warps, 3 stages, 6 programs per SM, with x one tile ahead
#   (results/tune_gemv_tma_x_ahead.json, same run as the kernel before that change at its pick, 64 rows x 4 chunks x
#   4 warps x 3 stages x 4 programs per SM, eight shapes, min of 3 alternated rounds): 1.01-1.13x on all eight
#   (4096x6144 14.38 us vs 15.78, 14336x4096 27.05 vs 29.43, 8192x10240 36.13 vs 38.68, 4096x14336 26.11 vs
#   29.45, 4096x28672 49.63 vs 50.30, 28672x8192 90.46 vs 91.85); the old pick on the new kernel gains 0.98-1.10x,
#   the 32-row tiles 4 stages deep lose (0.86-1.02x). Earlier picks (results/tune_gemv_tma_w8_64rows.json,
#   tune_gemv_tma.json) measured 1.04-1.40x the tl GEMV.
# - int4 g128: the conversion's ~3.9 instructions per weight (LOP3 + FADD + FFMA and x) make it issue-bound at
#   0.47-0.65 of copy bandwidth, behind the tl GEMV (8 programs per SM) on five of eight shapes (0.83-0.94x);
#   ahead where the tl GEMV cannot fill the GPU (4096x1024: 1.26x) and at 28672x8192 (1.10x). `weight_only`
#   runs int4 here only where its tl tile is under-filled (`weight_only.prefer_gemv_tma`). With x one tile ahead
#   the pick is 32 rows x 4 chunks x 4 warps x 3 stages x 6 programs per SM: 1.07-1.22x the kernel before at its
#   pick (128 rows x 2 chunks x 4 warps x 4 stages x 3 programs per SM) on 4096x1024, 1024x4096, 2048x4096 and
#   4096x2048, g128 (4096x1024 4.90 us vs 5.98; results/tune_gemv_tma_x_ahead_int4.json), where that old pick on
#   the new kernel runs 0.96-0.98x.
_INT4 = [GemvConfig(32, 4, 4, 3, 6), GemvConfig(128, 2, 4, 4, 3), GemvConfig(128, 2, 4, 6, 2),
         GemvConfig(64, 2, 4, 4, 6), GemvConfig(128, 1, 4, 8, 2), GemvConfig(256, 2, 8, 4, 1),
         GemvConfig(128, 4, 8, 3, 2)]
_INT8 = [GemvConfig(32, 4, 4, 3, 6), GemvConfig(64, 4, 4, 3, 4), GemvConfig(32, 4, 4, 3, 8),
         GemvConfig(128, 4, 8, 3, 2), GemvConfig(64, 4, 4, 3, 3), GemvConfig(128, 2, 4, 4, 3),
         GemvConfig(64, 2, 4, 4, 6), GemvConfig(128, 2, 4, 6, 2), GemvConfig(256, 2, 8, 4, 1)]
GEMV_CONFIGS: Dict[str, Dict[int, List[GemvConfig]]] = {"sm90": {4: _INT4, 8: _INT8}}


def check_config(cfg: GemvConfig) -> None:
    if cfg.chunks not in (1, 2, 4, 8):
        raise ValueError(f"config chunks: expected 1, 2, 4 or 8, got {cfg.chunks}")
    rows = (32 // (4 * cfg.chunks)) * cfg.num_warps
    if cfg.block_n < rows or cfg.block_n % rows or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"config block_n: expected a power of two multiple of {rows} (rows one pass of "
                         f"{cfg.num_warps} warps covers at {cfg.chunks} chunks), got {cfg.block_n}")
    if cfg.stages < 2 or cfg.programs_per_sm < 1:
        raise ValueError(f"config stages >= 2 and programs_per_sm >= 1 expected, got {cfg}")


def pick_config(bits: int, device: torch.device) -> GemvConfig:
    return GEMV_CONFIGS[arch_key(device.type, device.index)][bits][0]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def applies(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
            k: int) -> bool:
    """Whether the M = 1 product runs here (module doc); the caller validated the arguments."""
    if not GLUON_AVAILABLE or INTERPRET or x2d.shape[0] != 1 or not x2d.is_cuda:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or bits not in (4, 8):
        return False
    if not sm90_exactly(x2d.device.type, x2d.device.index):
        return False
    words = qweight.shape[1]
    chunk = WORDS_PER_CHUNK * (32 // bits)
    per_channel = scales.shape[0] == 1
    whole_fields = group_size <= chunk and group_size % 16 == 0 and group_size & (group_size - 1) == 0
    return (
        (per_channel or whole_fields)
        and x2d.stride(1) == 1 and _aligned(x2d)
        and qweight.dtype == torch.int32 and qweight.stride(1) == 1 and words % WORDS_PER_CHUNK == 0
        and qweight.stride(0) % 4 == 0 and _aligned(qweight)
    )


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _word_layout(block_n, chunks, num_warps):
        # 4 words (16 bytes) per thread along j, a row's CHUNKS x 16 words across 4 * CHUNKS threads: a quarter
        # warp reads 128 contiguous bytes of the unswizzled tile (no bank conflicts)
        rows = 32 // (4 * chunks)
        return gl.BlockedLayout([block_n // (rows * num_warps), 1, 4], [rows, chunks, 4], [num_warps, 1, 1],
                                [2, 1, 0])

    @gluon.jit
    def _fill(w_desc, smem, ready, tile, n_tiles, off_n, c_begin, STAGES: gl.constexpr):
        """Tile `tile` of this program's K range into slot tile % STAGES (nothing past the last tile)."""
        CHUNKS: gl.constexpr = w_desc.block_type.shape[1]
        slot = tile % STAGES
        fill = tile < n_tiles
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes, pred=fill)
        _tma_load(w_desc, [off_n, c_begin + tile * CHUNKS, 0], ready.index(slot), smem.index(slot), pred=fill)

    @gluon.jit
    def _add(a, b):
        # gl.sum's combine function is a @triton.jit one, an interpreter object under TRITON_INTERPRET (where the
        # CPU tests still build this kernel for sm90)
        return a + b

    @gluon.jit
    def _field_minus_zero(words, words_hi, field_mask, I: gl.constexpr, BITS: gl.constexpr, zero):
        """u - z of field I, exact, in float32 (`weight_only._field_minus_zero`, the same bits): the field
        OR-ed where it lies into the float 2^(23 - P); fields past bit 23 come from words >> 12."""
        if I * BITS + BITS <= 23:
            P: gl.constexpr = I * BITS
            code = (words & (field_mask << P)) | ((150 - P) << 23)
        else:
            P: gl.constexpr = I * BITS - 12
            code = (words_hi & (field_mask << P)) | ((150 - P) << 23)
        return code.to(gl.float32, bitcast=True) - (zero + 2.0 ** (23 - P))

    @gluon.jit
    def _x_quad(x_ptr, xk, k_end):
        """x of four consecutive fields (k = xk, xk + 16, + 32, + 48), 0 from k_end on."""
        return (gl.load(x_ptr + xk, mask=xk < k_end, other=0.0),
                gl.load(x_ptr + xk + 16, mask=xk + 16 < k_end, other=0.0),
                gl.load(x_ptr + xk + 32, mask=xk + 32 < k_end, other=0.0),
                gl.load(x_ptr + xk + 48, mask=xk + 48 < k_end, other=0.0))

    @gluon.jit
    def _fields(acc, grp, zero, words, words_hi, x0, x1, x2, x3, k0, nc_ci, nc_rows, nc_ok, s_ptr, z_ptr, N,
                num_groups, field_mask, group_shift, FIRST: gl.constexpr, BITS: gl.constexpr,
                GROUP_FIELDS: gl.constexpr, HAS_ZERO: gl.constexpr, PER_CHANNEL: gl.constexpr, CHUNK: gl.constexpr):
        """Fields FIRST .. FIRST + 3 of a tile's words times their x (x0 .. x3) into the sums: per channel
        straight into acc, else each group's products in grp, scaled into acc at the group's last field."""
        for i in gl.static_range(FIRST, FIRST + 4):
            if i % GROUP_FIELDS == 0:
                g = gl.minimum((k0 + nc_ci * CHUNK + 16 * i) >> group_shift, num_groups - 1)
                if HAS_ZERO:
                    zero = gl.load(z_ptr + g * N + nc_rows, mask=nc_ok, other=0).to(gl.float32)
            d = _field_minus_zero(words, words_hi, field_mask, i, BITS, zero[:, :, None])
            if i - FIRST == 0:
                xv = x0.to(gl.float32)[None, :, :]
            elif i - FIRST == 1:
                xv = x1.to(gl.float32)[None, :, :]
            elif i - FIRST == 2:
                xv = x2.to(gl.float32)[None, :, :]
            else:
                xv = x3.to(gl.float32)[None, :, :]
            if PER_CHANNEL:
                acc += d * xv
            else:
                if i % GROUP_FIELDS == 0:
                    grp = d * xv
                else:
                    grp += d * xv
                if i % GROUP_FIELDS == GROUP_FIELDS - 1:  # (the group may have begun in the other call)
                    g = gl.minimum((k0 + nc_ci * CHUNK + 16 * (i + 1 - GROUP_FIELDS)) >> group_shift, num_groups - 1)
                    scale = gl.load(s_ptr + g * N + nc_rows, mask=nc_ok, other=0.0).to(gl.float32)
                    acc += grp * scale[:, :, None]
        return acc, grp, zero

    @gluon.jit
    def _wo_gemv_tma_kernel(
        w_desc, x_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
        N, K, num_groups, chunks_per_split, splits, field_mask, group_shift,
        BITS: gl.constexpr, GROUP_FIELDS: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr, FUSED_REDUCE: gl.constexpr, PER_CHANNEL: gl.constexpr, K_MULTIPLE_OF_16: gl.constexpr,
        STAGES: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
    ):
        _grid_dependency_sync(PDL)  # PDL: launched early (configs.decode_pdl); nothing is read before the wait
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        CHUNKS: gl.constexpr = w_desc.block_type.shape[1]
        FIELDS: gl.constexpr = 32 // BITS
        CHUNK: gl.constexpr = w_desc.block_type.shape[2] * FIELDS
        layout: gl.constexpr = _word_layout(BLOCK_N, CHUNKS, num_warps)
        nc_layout: gl.constexpr = gl.SliceLayout(2, layout)  # [BLOCK_N, CHUNKS]: one value per row and chunk
        cj_layout: gl.constexpr = gl.SliceLayout(0, layout)  # [CHUNKS, 16]: x, shared by the rows
        row_layout: gl.constexpr = gl.SliceLayout(1, nc_layout)

        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        off_n = pid_n * BLOCK_N
        c_begin = pid_s * chunks_per_split
        c_end = gl.minimum(c_begin + chunks_per_split, gl.cdiv(K, CHUNK))
        k_end = gl.minimum(K, c_end * CHUNK)  # x is 0 from here on (K tail, the next split's chunks)
        if K_MULTIPLE_OF_16:
            k_end = gl.multiple_of(k_end, 16)  # x's mask is then uniform over a thread's 4 values: one 8-byte load
        n_tiles = gl.cdiv(c_end - c_begin, CHUNKS)

        WORDS: gl.constexpr = w_desc.block_type.shape[2]  # 16 per chunk
        smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, CHUNKS, WORDS], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES):
            _fill(w_desc, smem, ready, s, n_tiles, off_n, c_begin, STAGES)

        rows = off_n + gl.arange(0, BLOCK_N, layout=row_layout)
        row_ok = rows < N
        nc_rows = rows[:, None]
        nc_ci = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, nc_layout))[None, :]
        nc_ok = row_ok[:, None] & (nc_ci < CHUNKS)
        x_off = (gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, cj_layout))[:, None] * CHUNK
                 + gl.arange(0, WORDS, layout=gl.SliceLayout(0, cj_layout))[None, :])

        acc = gl.zeros([BLOCK_N, CHUNKS, WORDS], gl.float32, layout)
        grp = gl.zeros([BLOCK_N, CHUNKS, WORDS], gl.float32, layout)
        zero = gl.full([BLOCK_N, CHUNKS], 2 ** (BITS - 1), gl.float32, nc_layout)
        # x one tile ahead: the first four fields' x of tile t + 1 are loaded at the top of iteration t, before the
        # wait for tile t's words (int4's last four fields of tile t there too), so no x load waits out its L2
        # latency between a tile's arrival and its products
        x0, x1, x2, x3 = _x_quad(x_ptr, c_begin * CHUNK + x_off, k_end)
        for t in range(0, n_tiles):
            slot = t % STAGES
            k0 = (c_begin + t * CHUNKS) * CHUNK
            n0, n1, n2, n3 = _x_quad(x_ptr, k0 + CHUNKS * CHUNK + x_off, k_end)
            if FIELDS == 8:
                h0, h1, h2, h3 = _x_quad(x_ptr, k0 + 64 + x_off, k_end)
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            words = smem.index(slot).load(layout)
            _cta_barrier()  # every warp has its words: the slot can take the tile STAGES ahead
            _fill(w_desc, smem, ready, t + STAGES, n_tiles, off_n, c_begin, STAGES)
            words_hi = words >> 12
            acc, grp, zero = _fields(acc, grp, zero, words, words_hi, x0, x1, x2, x3, k0, nc_ci, nc_rows, nc_ok, s_ptr,
                                     z_ptr, N, num_groups, field_mask, group_shift, 0, BITS, GROUP_FIELDS, HAS_ZERO,
                                     PER_CHANNEL, CHUNK)
            if FIELDS == 8:
                acc, grp, zero = _fields(acc, grp, zero, words, words_hi, h0, h1, h2, h3, k0, nc_ci, nc_rows, nc_ok,
                                         s_ptr, z_ptr, N, num_groups, field_mask, group_shift, 4, BITS, GROUP_FIELDS,
                                         HAS_ZERO, PER_CHANNEL, CHUNK)
            x0, x1, x2, x3 = n0, n1, n2, n3
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        y = gl.reduce(gl.reduce(acc, 2, _add), 1, _add)  # [BLOCK_N] in row_layout
        if PER_CHANNEL:
            y = y * gl.load(s_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
        if SPLIT:
            gl.store(part_ptr + pid_s * N + rows, y, mask=row_ok)
            if FUSED_REDUCE:
                _cta_barrier()  # every thread's partial is stored before the release below
                done = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if done == splits - 1:
                    total = gl.zeros([BLOCK_N], gl.float32, row_layout)
                    for p in range(0, splits):
                        total += gl.load(part_ptr + p * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        total += gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
                    gl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)
                    gl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                y += gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
            gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _descriptor(qweight: torch.Tensor, cfg: GemvConfig):
    n, words = qweight.shape
    return GluonTensorDescriptor(qweight, [n, words // WORDS_PER_CHUNK, WORDS_PER_CHUNK],
                                 [qweight.stride(0), WORDS_PER_CHUNK, 1],
                                 [cfg.block_n, cfg.chunks, WORDS_PER_CHUNK], _unswizzled_layout(32, 3))


def gemv_tma(x2d, qweight, scales, zeros, bias, bits: int, group_size: int, n: int,
             config: Optional[GemvConfig] = None, splits: Optional[int] = None,
             counters: Optional[torch.Tensor] = None, num_sms: Optional[int] = None) -> torch.Tensor:
    """out [1, N] = x2d @ W.T (+ bias); the caller checked `applies` and validated the arguments. counters:
    a zeroed int32 slot per row block for the fused split-K reduction (None: a second kernel reduces)."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    cfg = config or pick_config(bits, x2d.device)
    check_config(cfg)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count
    k = x2d.shape[1]
    chunk = WORDS_PER_CHUNK * (32 // bits)
    per_channel = scales.shape[0] == 1
    group = k if per_channel else group_size
    grid_n = cdiv(n, cfg.block_n)
    total_chunks = cdiv(k, chunk)
    if splits is None:
        splits = max(1, min(cdiv(total_chunks, cfg.chunks), cfg.programs_per_sm * num_sms // grid_n))
    # whole tiles per split, so a tile never straddles two splits except at the end of K
    tiles_per_split = cdiv(cdiv(total_chunks, cfg.chunks), splits)
    chunks_per_split = tiles_per_split * cfg.chunks
    splits = cdiv(total_chunks, chunks_per_split)
    out = torch.empty((1, n), dtype=x2d.dtype, device=x2d.device)
    split = splits > 1
    part = torch.empty((splits, n), dtype=torch.float32, device=x2d.device) if split else out
    fused = split and counters is not None and counters.numel() >= grid_n
    has_bias = bias is not None
    group_fields = 32 // bits if per_channel else group // 16  # per channel: one zero-point load per tile
    pdl = decode_pdl(x2d.device, 1, bits)
    launch_kernel(_wo_gemv_tma_kernel, (grid_n, splits),
        _descriptor(qweight, cfg), x2d, scales, zeros if zeros is not None else scales,
        bias if has_bias else scales, out, part, counters if fused else scales,
        n, k, scales.shape[0], chunks_per_split, splits, (1 << bits) - 1, max(group, 1).bit_length() - 1,
        BITS=bits, GROUP_FIELDS=group_fields, HAS_ZERO=zeros is not None, HAS_BIAS=has_bias, SPLIT=split,
        FUSED_REDUCE=fused, PER_CHANNEL=per_channel, K_MULTIPLE_OF_16=k % 16 == 0, STAGES=cfg.stages,
        num_warps=cfg.num_warps, PDL=pdl, **pdl_launch_options(pdl),
    )
    if split and not fused:
        splitk_reduce(part.view(splits, -1, n), bias, out)
    return out
