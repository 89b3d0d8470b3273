"""Block-scaled FP8 GEMM for Hopper (sm90) written in Gluon: asynchronous wgmma with lagged promotion.

Math (SPEC section 2, 1x128 activation groups, 128x128 weight blocks):
    out[i, j] = sum_kb (scale_a[i, kb] * scale_b[kb, j // 128]) * dot(a[i, kb-block], b[kb-block, j]) + bias[j]

Why a second kernel: in the `tl` kernel (scaled_mm._blockwise_kernel) each K step's tensor-core partial must
be scaled before it joins the float32 accumulator, and Triton waits for every wgmma whose result is not a
loop-carried dot accumulator (`warp_group_dot_wait {pendings = 0}` in its sm90 TTGIR), so the tensor cores
idle while the partial is scaled: 0.45-0.67x of the rowwise kernel on the H100. Gluon exposes the wgmma
commit groups, so here step t's wgmma is issued into a fresh register tile and left in flight
(`warpgroup_mma_wait(num_outstanding=1)`) while step t-1's partial is scaled into the accumulator: the
tensor cores always have the next 128-deep product queued (DeepSeek-V3's promotion every 128, without
warp specialization).

Pipeline: STAGES shared-memory slots filled by the copy engine (tensor descriptors, zero fill past M, N and
K), one mbarrier per slot. Slot s is refilled with step t-1+STAGES once step t-1's wgmma has retired, behind
a CTA barrier (both warpgroups read the weight tile). Scales are read one step ahead of their use.

The warp-specialized variant (`_ws_kernel`, the sm90 default; WgmmaConfig.specialized): the same consumer loop
in two 64-row warpgroups, persistent over the tiles, fed by a loader warpgroup through ready / empty mbarrier
pairs (so neither consumer waits on the other, and the next tile's operands load during the epilogue). With
scale_a in the transposed layout the loader also brings each step's activation scales into the slot (copy
engine) and stores the step's weight-block scale beside them (loaded three steps ahead): the consumers read both
from shared memory. A global load still in flight when a wgmma is issued holds that wgmma back, which is what the
scale loads of the pointer path cost (probe on the H100, scales replaced by constants: 4-13% faster).

Numerics: every partial starts at zero (use_acc=False) and covers one 128-deep group, so the tensor core's
reduced-precision accumulation spans 128 products only, as in the `tl` kernel's variant 0/2; then
acc += (sa * sb) * partial in float32 (one scale product per row, one FMA per element: the same rounding as
variant 2). Non-finite scales propagate as in the reference.

Scope (`applies`): sm90 exactly (wgmma is sm90a-only), fp8 e4m3 operands a [M, K] and b^T [N, K] both
describable (K-contiguous, 16-byte aligned rows and base), BLOCK_N dividing 128 so a tile has one weight-block
scale per step. Anything else, and the Triton interpreter (Gluon has none), runs the `tl` kernel, which stays
the executable twin tested on the CPU.
"""

# no `from __future__ import annotations`: _WsFlags' field annotations must stay types for Triton's aggregate

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ._common import INTERPRET, cdiv, launch_kernel
from ._gluon import GLUON_AVAILABLE, WS_CONSUMER_REGS, WS_MAXNREG, sm90_exactly
from .configs import arch_key, sm_count
from .scaled_mm import _BIG, BLOCKWISE_SCALE_BLOCK as SCALE_BLOCK, tma_applies

_aggregate = None
if GLUON_AVAILABLE:
    from ._gluon import TensorDescriptor as GluonTensorDescriptor
    from ._gluon import cta_barrier as _cta_barrier
    from ._gluon import gl, gluon, mbarrier, operand_descriptor, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait
    from ._gluon import store_layout
    from ._gluon import tile_coords as _tile_coords
    from ._gluon import ring_load as _ring_load
    from ._gluon import tma_load as _tma_load
    try:
        from triton.language.core import _aggregate
    except ImportError:  # a Triton without it: only the warp-specialized kernel is off
        pass


@dataclass(frozen=True)
class WgmmaConfig:
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    group_m: int = 8
    # 1: the warp-specialized persistent kernel (_ws_kernel: a loader warpgroup, two consumer warpgroups of 64
    # rows each, so block_m = 128 and num_warps = 8 count the consumers); 0: _blockwise_wgmma_kernel
    specialized: int = 0


# Per architecture, (max_m, candidates); the first candidate runs, the rest are what the tuner sweeps by
# default. BLOCK_K is the scale group (128).
# 128x128 with two warpgroups (one 64-row half each) keeps acc + two partials at 3 x 64 float32 registers per
# thread (220 in the sm90 build); 4 slots of 32 KiB. H100 sweep (benchmarks/tune_blockwise_wgmma.py, results/
# tune_blockwise_wgmma.json; the six Llama-3 (K, N) at M = 1024 and 4096, CUDA graphs, bf16 out + bias): 128x128
# 4 stages 0.70-0.91x our rowwise fp8 (840-966 TFLOPS); 3 or 5 stages and group 16 within the run's noise
# (+-5%), 128x64 0.42-0.55x, 64x128 (4 warps) 0.47-0.61x in the first sweep.
# The warp-specialized persistent kernel (specialized=1; same tile, a loader warpgroup ahead of the two consumers,
# activation scales in the slot ring) in one run with the kernel above (tune_blockwise_ws_smem.json, same twelve
# shapes): 877-1091 TFLOPS against 877-1028, 0.73-0.86x rowwise against 0.70-0.79x; ahead on 10 of 12 shapes
# (behind at 1024x4096x28672, 940 vs 959, and level at 4096x14336x4096). 3 stages lose 10-15%
# (tune_blockwise_ws.json); 5 stages do not fit beside the epilogue's layout-conversion scratch. A 192-row tile with
# three consumer warpgroups (each step's partial waited for: acc + two partials do not fit four warpgroups' registers)
# lost on 16 of 18 shapes, 0.58-0.96x rowwise (tune_blockwise_ws3.json; not kept).
WGMMA_CONFIGS: Dict[str, List[Tuple[int, List[WgmmaConfig]]]] = {
    "sm90": [(_BIG, [WgmmaConfig(128, 128, 8, 4, 8, 1), WgmmaConfig(128, 128, 8, 4), WgmmaConfig(128, 128, 8, 4, 16, 1),
                     WgmmaConfig(128, 128, 8, 3)])],
}

# Rows from which this kernel runs: from MIN_M always; below, where its 128-row tiles are at least
# BATCH_MIN_ROW_FILL full (96..128 and 192..256 rows); elsewhere the `tl` kernel's decode / split-K tiles
# (scaled_mm.BLOCKWISE_CONFIGS). H100, the six Llama-3 shapes, CUDA graphs, bf16 out + bias, one timing each with
# the tl tile right before this kernel (results/tune_blockwise_ws_small_m.json, ..._below_128.json): against the
# tl tiles 1.40-1.63x at 384 and 512 rows, 1.34-1.51x at 256, 0.90-1.40x at 192 (behind at 8192x10240 only, 69.3 us
# vs 62.5), 1.02-1.40x at 128, 0.99-1.38x at 96; at 160 rows (tiles 5/8 full) 0.84-1.34x and at 64 (half full)
# 0.69-1.27x: the tl tiles stay there.
MIN_M = 257
BATCH_MIN_ROW_FILL = 0.75


def takes_m(m: int) -> bool:
    """Whether the default dispatch runs this kernel at m rows (see MIN_M)."""
    return m >= MIN_M or m >= BATCH_MIN_ROW_FILL * cdiv(m, 128) * 128  # the shipped tiles' 128 rows


def pick_config(m: int, n: int, device: torch.device) -> WgmmaConfig:
    rows = WGMMA_CONFIGS.get(arch_key(device.type, device.index))
    if rows is None:
        raise ValueError(f"no wgmma blockwise configs for device {device}")
    return next(cfgs for max_m, cfgs in rows if m <= max_m)[0]


def applies(a2d: torch.Tensor, b: torch.Tensor, any_m: bool = False) -> bool:
    """Whether scaled_mm_blockwise runs the Gluon kernel for a [M, K] and b [K, N] (see module doc); any_m:
    whether it can (an explicit WgmmaConfig), at decode-sized M too."""
    return (
        GLUON_AVAILABLE
        and not INTERPRET
        and (any_m or takes_m(a2d.shape[0]))
        and a2d.dtype == torch.float8_e4m3fn
        and b.dtype == torch.float8_e4m3fn
        and sm90_exactly(a2d.device.type, a2d.device.index)
        and tma_applies(a2d, b)
    )


if GLUON_AVAILABLE:

    @gluon.jit
    def _refill(a_desc, b_desc, a_smem, b_smem, ready, step, k_steps, off_m, off_n, STAGES: gl.constexpr, valid):
        """Step `step`'s A and B tiles into slot step % STAGES (nothing past the last step, nor when not
        `valid`). The CTA barrier first: the slot's previous wgmma has retired in this warpgroup, and must have
        in the other too."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        _cta_barrier()
        slot = step % STAGES
        fill = (step < k_steps) & valid
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=fill)
        _tma_load(a_desc, [off_m, step * BLOCK_K], ready.index(slot), a_smem.index(slot), pred=fill)
        _tma_load(b_desc, [off_n, step * BLOCK_K], ready.index(slot), b_smem.index(slot), pred=fill)

    @gluon.jit
    def _promote(acc, scale, part):
        """acc + scale[:, None] * part, pinned before the next wgmma: the empty wait takes the sum as a
        dependency, so LLVM cannot sink these FMAs past the wgmma that overwrites `part`'s registers (it
        would then copy `part` first, inside the wgmma's pipeline stage, and ptxas serializes the wgmma)."""
        acc += scale[:, None] * part
        return warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))

    @gluon.jit
    def _step_scale(sa_ptrs, row_ok, sb_ptr, step, stride_sak, stride_sbk):
        """sa[:, step] * sb[step, tile's weight block]: one float32 per row (rows past M: 0)."""
        return gl.load(sa_ptrs + step * stride_sak, mask=row_ok, other=0.0) * gl.load(sb_ptr + step * stride_sbk)

    @gluon.jit
    def _blockwise_wgmma_kernel(
        a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
        M, N, K,
        stride_om, stride_sam, stride_sak, stride_sbk, stride_sbn,
        HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALE_BLOCK: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BLOCK_K == SCALE_BLOCK, "one activation scale per row per K step")
        gl.static_assert(SCALE_BLOCK % BLOCK_N == 0, "one weight-block scale per tile per K step")

        pid_m, pid_n = _tile_coords(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        # one warp per 16 rows (warpgroup = 64 rows); each wgmma instruction is the whole BLOCK_N wide
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        k_steps = gl.cdiv(K, BLOCK_K)
        for s in gl.static_range(STAGES):
            _refill(a_desc, b_desc, a_smem, b_smem, ready, s, k_steps, off_m, off_n, STAGES, True)

        rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
        row_ok = rows < M
        sa_ptrs = scale_a_ptr + rows.to(gl.int64) * stride_sam
        sb_ptr = scale_b_ptr + (off_n // SCALE_BLOCK) * stride_sbn
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)

        # Two partial tiles in fixed registers, two K steps per iteration: step t's wgmma is issued over
        # tile 0's last (already promoted) value, then step t-1's partial (tile 1) is retired and promoted
        # while it runs, and the same again with the roles swapped; the last wgmma of an iteration stays in
        # flight across the back edge. Each wgmma writes over the registers its input lives in
        # (use_acc=False ignores their values), so the loop-carried tiles never need copying: a copy of
        # registers a wgmma is still writing makes ptxas serialize every wgmma (C7514 in the sm90 build).
        part0 = zero
        tile1 = warpgroup_mma_init(zero)  # "step -1": nothing in flight, promoted with scale 0
        scale1 = gl.zeros([BLOCK_M], gl.float32, row_layout)
        for pair in range(0, k_steps // 2):
            t = 2 * pair
            slot = t % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            tile0 = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), part0, use_acc=False,
                                  is_async=True)
            scale0 = _step_scale(sa_ptrs, row_ok, sb_ptr, t, stride_sak, stride_sbk)
            part1 = warpgroup_mma_wait(num_outstanding=1, deps=(tile1, ))
            _refill(a_desc, b_desc, a_smem, b_smem, ready, t - 1 + STAGES, k_steps, off_m, off_n, STAGES, t > 0)
            acc = _promote(acc, scale1, part1)

            slot = (t + 1) % STAGES
            mbarrier.wait(ready.index(slot), ((t + 1) // STAGES) & 1)
            tile1 = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), part1, use_acc=False,
                                  is_async=True)
            scale1 = _step_scale(sa_ptrs, row_ok, sb_ptr, t + 1, stride_sak, stride_sbk)
            part0 = warpgroup_mma_wait(num_outstanding=1, deps=(tile0, ))
            _refill(a_desc, b_desc, a_smem, b_smem, ready, t + STAGES, k_steps, off_m, off_n, STAGES, True)
            acc = _promote(acc, scale0, part0)
        if k_steps % 2 == 1:
            t = k_steps - 1
            slot = t % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            tile0 = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), part0, use_acc=False,
                                  is_async=True)
            scale0 = _step_scale(sa_ptrs, row_ok, sb_ptr, t, stride_sak, stride_sbk)
            part1 = warpgroup_mma_wait(num_outstanding=1, deps=(tile1, ))
            acc += scale1[:, None] * part1
            part0 = warpgroup_mma_wait(num_outstanding=0, deps=(tile0, ))
            acc += scale0[:, None] * part0
        else:
            part1 = warpgroup_mma_wait(num_outstanding=0, deps=(tile1, ))
            acc += scale1[:, None] * part1
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        # epilogue in a row-major blocked layout: 16-byte stores along N
        out_layout: gl.constexpr = store_layout(BLOCK_N, out_ptr.dtype.element_ty.primitive_bitwidth, num_warps)
        out = gl.convert_layout(acc, out_layout)
        orows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
        ocols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
        col_ok = ocols < N
        if HAS_BIAS:
            out += gl.load(bias_ptr + ocols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        o_ptrs = out_ptr + orows.to(gl.int64)[:, None] * stride_om + ocols[None, :]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(orows < M)[:, None] & col_ok[None, :])


if GLUON_AVAILABLE and _aggregate is not None:

    # scale boxes: one row of float32, unswizzled (a 512-byte row is wider than any swizzle span)
    _SCALE_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)

    @_aggregate
    class _WsFlags:
        """The warp-specialized kernel's constexprs in one aggregate: Triton 3.6's warp_specialize turns plain
        int / bool arguments of a partition into runtime values."""
        HAS_BIAS: gl.constexpr
        GROUP_M: gl.constexpr
        STAGES: gl.constexpr
        SCALE_BLOCK: gl.constexpr
        CONSUMER: gl.constexpr  # which 64-row half of the tile a consumer partition owns (the loader ignores it)
        SCALE_SMEM: gl.constexpr  # scales ride with the operands in the slot ring (see _ws_kernel)

        @gluon.constexpr_function
        def __init__(self, HAS_BIAS, GROUP_M, STAGES, SCALE_BLOCK, CONSUMER, SCALE_SMEM):
            self.SCALE_SMEM = gl.constexpr(SCALE_SMEM)
            self.HAS_BIAS = gl.constexpr(HAS_BIAS)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.STAGES = gl.constexpr(STAGES)
            self.SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)
            self.CONSUMER = gl.constexpr(CONSUMER)

    @gluon.jit
    def _sb_at(sb_col, step, k_steps, stride_sbk):
        """The weight block's scale at K step `step` (0 past the last step: never stored)."""
        return gl.load(sb_col + step * stride_sbk, mask=step < k_steps, other=0.0)

    @gluon.jit
    def _ws_loader(a_desc, b_desc, sa_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr,
                   scale_a_ptr, scale_b_ptr, bias_ptr, M, N, K, stride_om, stride_sam, stride_sak, stride_sbk,
                   stride_sbn, cfg):
        """Every K step of every tile of this program, in order, into the slot ring (zero fill past M, N, K)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = cfg.STAGES
        SB_WIDTH: gl.constexpr = sb_smem.shape[2]
        SA_BYTES: gl.constexpr = sa_desc.block_type.nbytes if cfg.SCALE_SMEM else 0
        sb_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        c = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, cfg.GROUP_M)
            if cfg.SCALE_SMEM:
                # the weight block's scales three steps ahead (sb1..sb3: steps ks..ks+2): each step's store then
                # waits on a load issued three steps earlier instead of one whose whole latency it would sit out
                sb_col = scale_b_ptr + (pid_n * BLOCK_N // cfg.SCALE_BLOCK) * stride_sbn
                sb1 = _sb_at(sb_col, 0, k_steps, stride_sbk)
                sb2 = _sb_at(sb_col, 1, k_steps, stride_sbk)
                sb3 = _sb_at(sb_col, 2, k_steps, stride_sbk)
            for ks in range(k_steps):
                slot = _ring_load(a_desc, b_desc, a_smem, b_smem, ready, empty, c, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                  ks * BLOCK_K, STAGES, SA_BYTES)
                if cfg.SCALE_SMEM:
                    # the step's activation scales into the same slot (counted in the expect above)
                    _tma_load(sa_desc, [ks, pid_m * BLOCK_M], ready.index(slot), sa_smem.index(slot))
                    # the weight block's scale, one float, stored by this partition (the copy engine faulted on
                    # it: an illegal instruction on the H100 with every box tried) and released by the second
                    # arrival the slot's ready barrier counts; the barrier first, so every store precedes it
                    sb = sb1
                    sb1 = sb2
                    sb2 = sb3
                    sb3 = _sb_at(sb_col, ks + 3, k_steps, stride_sbk)
                    sb_smem.index(slot).reshape([SB_WIDTH]).store(gl.full([SB_WIDTH], sb, gl.float32, sb_layout))
                    _cta_barrier()
                    mbarrier.arrive(ready.index(slot), count=1)
                c += 1

    @gluon.jit
    def _ws_issue(a_smem, b_smem, ready, c, STAGES: gl.constexpr, CONSUMER: gl.constexpr, part):
        """Step c's wgmma over this consumer's 64 rows, left in flight, writing over `part` (use_acc=False)."""
        HALF: gl.constexpr = a_smem.shape[1] // 2
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        return warpgroup_mma(a_smem.index(slot).slice(CONSUMER * HALF, HALF), b_smem.index(slot).permute((1, 0)),
                             part, use_acc=False, is_async=True)

    @gluon.jit
    def _ws_scale(sa_smem, sb_smem, c, sa_ptrs, row_ok, sb_ptr, step, stride_sak, stride_sbk, cfg,
                  row_layout: gl.constexpr):
        """sa[rows, step] * sb[step, tile's weight block] for this consumer's rows (rows past M: 0): from the
        slot's shared-memory copies when the scales came with the operands, else from global memory (see the
        module doc for why)."""
        if cfg.SCALE_SMEM:
            BLOCK_M: gl.constexpr = sa_smem.shape[2]
            HALF: gl.constexpr = BLOCK_M // 2
            slot = c % cfg.STAGES
            sa = sa_smem.index(slot).reshape([BLOCK_M]).slice(cfg.CONSUMER * HALF, HALF).load(row_layout)
            # the slot's scale_b row holds one copy per consumer row (no reduction: gl.max is a `tl` function,
            # which Gluon cannot call under the interpreter)
            return sa * sb_smem.index(slot).reshape([HALF]).load(row_layout)
        else:
            return _step_scale(sa_ptrs, row_ok, sb_ptr, step, stride_sak, stride_sbk)

    @gluon.jit
    def _ws_consumer(a_desc, b_desc, sa_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr,
                     scale_a_ptr, scale_b_ptr, bias_ptr, M, N, K, stride_om, stride_sam, stride_sak, stride_sbk,
                     stride_sbn, cfg):
        """Rows CONSUMER * 64 .. + 64 of each of this program's tiles: _blockwise_wgmma_kernel's lagged
        promotion (two partial tiles, one wgmma group in flight while the previous partial is scaled in), with
        each slot handed back to the loader (empty barrier, one arrival per consumer) as soon as the wgmma that
        read it has retired, and the epilogue overlapping the loader's fill of the next tile."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF: gl.constexpr = BLOCK_M // 2
        STAGES: gl.constexpr = cfg.STAGES
        CONSUMER: gl.constexpr = cfg.CONSUMER
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        out_layout: gl.constexpr = store_layout(BLOCK_N, out_ptr.dtype.element_ty.primitive_bitwidth, 4)
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        zero = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
        c = 0  # this program's running K step (the loader's count)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, cfg.GROUP_M)
            rows = pid_m * BLOCK_M + CONSUMER * HALF + gl.arange(0, HALF, layout=row_layout)
            row_ok = rows < M
            sa_ptrs = scale_a_ptr + rows.to(gl.int64) * stride_sam
            sb_ptr = scale_b_ptr + (pid_n * BLOCK_N // cfg.SCALE_BLOCK) * stride_sbn
            acc = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
            part0 = zero
            tile1 = warpgroup_mma_init(zero)  # "step -1": nothing in flight, promoted with scale 0
            scale1 = gl.zeros([HALF], gl.float32, row_layout)
            for pair in range(0, k_steps // 2):
                t = 2 * pair
                tile0 = _ws_issue(a_smem, b_smem, ready, c + t, STAGES, CONSUMER, part0)
                scale0 = _ws_scale(sa_smem, sb_smem, c + t, sa_ptrs, row_ok, sb_ptr, t, stride_sak, stride_sbk, cfg,
                                   row_layout)
                part1 = warpgroup_mma_wait(num_outstanding=1, deps=(tile1, ))
                mbarrier.arrive(empty.index((c + t + STAGES - 1) % STAGES), count=1, pred=t > 0)
                acc = _promote(acc, scale1, part1)

                tile1 = _ws_issue(a_smem, b_smem, ready, c + t + 1, STAGES, CONSUMER, part1)
                scale1 = _ws_scale(sa_smem, sb_smem, c + t + 1, sa_ptrs, row_ok, sb_ptr, t + 1, stride_sak, stride_sbk,
                                   cfg, row_layout)
                part0 = warpgroup_mma_wait(num_outstanding=1, deps=(tile0, ))
                mbarrier.arrive(empty.index((c + t) % STAGES), count=1)
                acc = _promote(acc, scale0, part0)
            if k_steps % 2 == 1:
                t = k_steps - 1
                tile0 = _ws_issue(a_smem, b_smem, ready, c + t, STAGES, CONSUMER, part0)
                scale0 = _ws_scale(sa_smem, sb_smem, c + t, sa_ptrs, row_ok, sb_ptr, t, stride_sak, stride_sbk, cfg,
                                   row_layout)
                part1 = warpgroup_mma_wait(num_outstanding=1, deps=(tile1, ))
                mbarrier.arrive(empty.index((c + t + STAGES - 1) % STAGES), count=1, pred=t > 0)
                acc += scale1[:, None] * part1
                part0 = warpgroup_mma_wait(num_outstanding=0, deps=(tile0, ))
                mbarrier.arrive(empty.index((c + t) % STAGES), count=1)
                acc += scale0[:, None] * part0
            else:
                part1 = warpgroup_mma_wait(num_outstanding=0, deps=(tile1, ))
                mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES), count=1)
                acc += scale1[:, None] * part1
            c += k_steps

            out = gl.convert_layout(acc, out_layout)
            orows = pid_m * BLOCK_M + CONSUMER * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_layout))
            ocols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
            col_ok = ocols < N
            if cfg.HAS_BIAS:
                out += gl.load(bias_ptr + ocols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
            o_ptrs = out_ptr + orows.to(gl.int64)[:, None] * stride_om + ocols[None, :]
            gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(orows < M)[:, None] & col_ok[None, :])

    @gluon.jit
    def _ws_kernel(
        a_desc, b_desc, sa_desc, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
        M, N, K,
        stride_om, stride_sam, stride_sak, stride_sbk, stride_sbn,
        HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALE_BLOCK: gl.constexpr,
        SCALE_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Persistent and warp-specialized (one program per SM, tiles in grouped order): the default partition
        (num_warps = 4; one thread issues the copies) keeps STAGES slots of A [128, 128] and B^T [BLOCK_N, 128]
        full through a ready / empty mbarrier pair per slot, across tile boundaries; two consumer warpgroups
        take the two 64-row halves of every tile. Same math and rounding as _blockwise_wgmma_kernel."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BLOCK_K == SCALE_BLOCK, "one activation scale per row per K step")
        gl.static_assert(SCALE_BLOCK % BLOCK_N == 0, "one weight-block scale per tile per K step")
        gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        # the slot's scale_b: BLOCK_M // 2 copies of one float, one per row of a consumer's half
        sb_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M // 2], _SCALE_SMEM_LAYOUT)
        if SCALE_SMEM:
            sa_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], sa_desc.layout)
        else:  # unused: a token buffer, since partitions take one signature
            sa_smem = gl.allocate_shared_memory(gl.float32, [1, 1, 4], _SCALE_SMEM_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            # the copies' expected bytes, and with the scales in the ring the loader's scale_b store
            mbarrier.init(ready.index(s), count=2 if SCALE_SMEM else 1)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        shared = (a_desc, b_desc, sa_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, out_ptr,
                  scale_a_ptr, scale_b_ptr, bias_ptr, M, N, K, stride_om, stride_sam, stride_sak, stride_sbk,
                  stride_sbn)
        args0 = shared + (_WsFlags(HAS_BIAS, GROUP_M, STAGES, SCALE_BLOCK, 0, SCALE_SMEM), )
        args1 = shared + (_WsFlags(HAS_BIAS, GROUP_M, STAGES, SCALE_BLOCK, 1, SCALE_SMEM), )
        gl.warp_specialize([(_ws_loader, args0), (_ws_consumer, args0), (_ws_consumer, args1)], [4, 4],
                           [CONSUMER_REGS, CONSUMER_REGS])


def _box_rows(t: torch.Tensor) -> bool:
    """A 2-D float32 view the copy engine can read in [1, n] boxes: unit inner stride, 16-byte aligned base
    and row stride."""
    return (t.dtype == torch.float32 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]
            and (t.stride(0) * 4) % 16 == 0 and t.data_ptr() % 16 == 0)


def _scale_a_view(scale_a: torch.Tensor) -> Optional[torch.Tensor]:
    """scale_a^T [K/128, M] when the copy engine can bring each K step's activation scales with the operands: the
    transposed layout of SPEC section 3 (a K step's scales contiguous over the rows), 16-byte aligned."""
    return scale_a.t() if _box_rows(scale_a.t()) else None


def _scale_descriptor(t: torch.Tensor, block: List[int]):
    return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), block, _SCALE_SMEM_LAYOUT)


def scaled_mm_blockwise_wgmma(
    a2d: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    config: Optional[WgmmaConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The Gluon blockwise GEMM; the caller checked `applies(a2d, b)` and validated the arguments; out, where
    given, is [M, N] of out_dtype with unit column stride."""
    m, k = a2d.shape
    n = b.shape[1]
    cfg = config or pick_config(m, n, a2d.device)
    if SCALE_BLOCK % cfg.block_n or cfg.block_m < 16 * cfg.num_warps:
        raise ValueError(f"config: block_n must divide {SCALE_BLOCK} and block_m >= 16 * num_warps, got {cfg}")
    if cfg.specialized and (cfg.block_m != 128 or cfg.num_warps != 8 or _aggregate is None):
        raise ValueError(f"config: the warp-specialized kernel takes block_m 128 and num_warps 8 (two consumer "
                         f"warpgroups) on a Triton with aggregates, got {cfg}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a2d.device)
    a_desc = operand_descriptor(a2d, [cfg.block_m, SCALE_BLOCK])
    b_desc = operand_descriptor(b.t(), [cfg.block_n, SCALE_BLOCK])
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if cfg.specialized:
        sa_view = _scale_a_view(scale_a)
        sa_desc = _scale_descriptor(sa_view, [1, cfg.block_m]) if sa_view is not None else a_desc
        launch_kernel(_ws_kernel, (min(tiles, sm_count(a2d.device)),),
            a_desc, b_desc, sa_desc, out, scale_a, scale_b, bias if bias is not None else out,
            m, n, k,
            out.stride(0), scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
            HAS_BIAS=bias is not None, GROUP_M=cfg.group_m, STAGES=cfg.stages, SCALE_BLOCK=SCALE_BLOCK,
            SCALE_SMEM=sa_view is not None, CONSUMER_REGS=WS_CONSUMER_REGS, num_warps=4,
            maxnreg=WS_MAXNREG,
        )
        return out
    grid = (tiles,)
    launch_kernel(_blockwise_wgmma_kernel, grid,
        a_desc, b_desc, out, scale_a, scale_b, bias if bias is not None else out,
        m, n, k,
        out.stride(0), scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
        HAS_BIAS=bias is not None, GROUP_M=cfg.group_m, STAGES=cfg.stages, SCALE_BLOCK=SCALE_BLOCK,
        num_warps=cfg.num_warps,
    )
    return out
