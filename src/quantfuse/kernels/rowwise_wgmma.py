"""Scaled INT8 / FP8 GEMM for Hopper (sm90) in Gluon: persistent, warp-specialized, 128x256 tiles.

Same math and epilogues as `scaled_mm._scaled_mm_kernel` (SPEC section 2, the module docstring of scaled_mm):
acc = a_q @ b_q (int32 exact for int8, float32 for fp8), corr subtracted in int32, then
out = (scale_a[i] * scale_b[j]) * float(acc - corr) + bias[j], one rounding to the output dtype.

Structure: a loader partition (one thread issues the copies) walks this program's tiles and K steps and keeps
STAGES shared-memory slots of A [128, 128] and B^T [256, 128] full through the copy engine (a ready / empty
mbarrier pair per slot, zero fill past M, N and K); two consumer warpgroups each own one 64-row half of every
tile (64x256: two 64x128 accumulators, 128 registers per thread) and chain one K step's pair of wgmma groups
into them, keeping one step in flight and handing each slot back as soon as the step that read it has retired.
The epilogue runs one 128-column half at a time while the loader already fills the next tile's slots; a 16-bit
result is rounded in the accumulators' register layout and moved through shared memory into a layout of 16-byte
stores per thread (the register layout holds pairs of adjacent columns: 4-byte stores), a float32 one is stored
from the register layout (its exchange would not fit beside four slots).

Measured (H100, bf16 out + bias, CUDA graphs): with the register-layout store (tune_scaled_mm_ws.json) int8 ran
1.05-1.16x the `tl` tiles at K = 28672, 1.06-1.10x at K = 14336 and 0.87-0.96x at K = 4096; the 16-byte stores made
it 1.01-1.22x faster (tune_scaled_mm_ws_store.json), 1.01-1.08x the `tl` tiles at K = 4096 and 8192, so the table
(scaled_mm.CONFIGS) takes it for int8 from 1024 rows at every K, and since stop 61 for fp8 too (within 3% of the
`tl` tiles where both fill their last round: tune_scaled_mm_ws_dispatch_rot.json), in the ping-pong schedule up to
K = 4096 and where its 128x128 tiles fill the last round better (scaled_mm._ws_pick); since stop 62 from 257 rows,
fp8 where its tiles fill a round (0.985-1.08x the `tl` tiles there), int8 also below one round of tiles, where the
`tl` int8 tile trails by up to 1.6x (tune_scaled_mm_ws_mid_m.json, scaled_mm.WS_MIN_ROUND_FILL); both dtypes at
116..128 and 231..256 rows, 0.93-1.37x the split-K `tl` tiles (tune_scaled_mm_ws_small_m.json,
scaled_mm.WS_MIN_ROW_FILL).

Ping-pong (WsConfig.pingpong, `_pingpong_consumer`): the same loader and ring, but each consumer warpgroup takes every
other tile of the program whole (128x128 as two 64x128 accumulators) and the two main loops take turns through two
`turn` mbarriers, so one consumer's epilogue runs under the other's main loop (CUTLASS's ping-pong schedule). It
moves 1.7x the bytes into shared memory per product (32 KiB per 128x128x128 step against 48 KiB per 128x256x128),
which costs up to 13% at long K.

Scope (`applies`): sm90 exactly, Gluon with aggregates importable, int8 or fp8 e4m3 operands a [M, K] and b^T
[N, K] both describable (K-contiguous, 16-byte aligned rows and base). The `tl` kernel is the executable twin
tested on the CPU (Gluon has no interpreter) and runs everything else.
"""

# no `from __future__ import annotations`: _Flags' field annotations must stay types for Triton's aggregate

from typing import Optional

import torch

from ._common import INTERPRET, cdiv, launch_kernel
from ._gluon import GLUON_AVAILABLE, WS_CONSUMER_REGS, WS_MAXNREG, sm90_exactly
from .configs import sm_count
from .scaled_mm import WsConfig, tma_applies

_aggregate = None
if GLUON_AVAILABLE:
    from ._gluon import gl, gluon, mbarrier, operand_descriptor, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import fill_tiles as _fill_tiles
    from ._gluon import store_layout
    from ._gluon import tile_coords as _tile_coords
    try:
        from triton.language.core import _aggregate
    except ImportError:  # a Triton without it: the kernel is off
        pass


def applies(a2d: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel can run a [M, K] @ b [K, N] (see the module doc)."""
    return (GLUON_AVAILABLE and _aggregate is not None and not INTERPRET
            and a2d.dtype in (torch.int8, torch.float8_e4m3fn) and b.dtype == a2d.dtype
            and sm90_exactly(a2d.device.type, a2d.device.index) and tma_applies(a2d, b))


if GLUON_AVAILABLE and _aggregate is not None:

    @_aggregate
    class _Flags:
        """The kernel's constexprs in one aggregate: Triton 3.6's warp_specialize turns plain int / bool arguments
        of a partition into runtime values."""
        SCALE_A_PER_ROW: gl.constexpr
        SCALE_B_PER_COL: gl.constexpr
        HAS_BIAS: gl.constexpr
        AZP_MODE: gl.constexpr
        GROUP_M: gl.constexpr
        STAGES: gl.constexpr
        CONSUMER: gl.constexpr  # which 64-row half of the tile a consumer owns (the loader ignores it)

        @gluon.constexpr_function
        def __init__(self, SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, GROUP_M, STAGES, CONSUMER):
            self.SCALE_A_PER_ROW = gl.constexpr(SCALE_A_PER_ROW)
            self.SCALE_B_PER_COL = gl.constexpr(SCALE_B_PER_COL)
            self.HAS_BIAS = gl.constexpr(HAS_BIAS)
            self.AZP_MODE = gl.constexpr(AZP_MODE)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.STAGES = gl.constexpr(STAGES)
            self.CONSUMER = gl.constexpr(CONSUMER)

    @gluon.jit
    def _loader(a_desc, b_desc, a_smem, b_smem, ready, empty, turn, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                azp_adj_ptr, azp_ptr, M, N, K, stride_om, cfg):
        """Every K step of every tile of this program, in order, into the slot ring."""
        _fill_tiles(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, cfg.GROUP_M, cfg.STAGES)

    @gluon.jit
    def _epilogue(acc, row0, col0, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr, out_ptr, M, N,
                  stride_om, cfg):
        """One 64x128 half of a consumer's tile (rows row0.., columns col0..): corrections in int32, scales, bias,
        one rounding. A 16-bit result goes through shared memory into a layout of 16-byte stores per thread
        (stored from the accumulator's layout, pairs of adjacent columns and 4-byte stores, this kernel ran
        0.82-0.99x as fast at K = 4096 .. 28672: results/tune_scaled_mm_ws_store.json); a float32 one, whose
        exchange would not fit beside four slots, is stored from the accumulator's layout."""
        HALF_M: gl.constexpr = acc.shape[0]
        HALF_N: gl.constexpr = acc.shape[1]
        rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc.type.layout))
        cols = col0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, acc.type.layout))
        row_ok = rows < M
        col_ok = cols < N
        if cfg.AZP_MODE == 1:
            acc = acc - gl.load(azp_adj_ptr + cols, mask=col_ok, other=0)[None, :]
        elif cfg.AZP_MODE == 2:
            adj = gl.load(azp_adj_ptr + cols, mask=col_ok, other=0)
            acc = acc - gl.load(azp_ptr + rows, mask=row_ok, other=0)[:, None] * adj[None, :]
        if cfg.SCALE_A_PER_ROW:
            sa = gl.load(scale_a_ptr + rows, mask=row_ok, other=0.0)[:, None]
        else:
            sa = gl.load(scale_a_ptr)
        if cfg.SCALE_B_PER_COL:
            sb = gl.load(scale_b_ptr + cols, mask=col_ok, other=0.0)[None, :]
        else:
            sb = gl.load(scale_b_ptr)
        out = (sa * sb) * acc.to(gl.float32)
        if cfg.HAS_BIAS:
            out = out + gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        OUT_BITS: gl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth
        if OUT_BITS == 16:
            out_l: gl.constexpr = store_layout(HALF_N, OUT_BITS, 4)
            res = gl.convert_layout(out.to(out_ptr.dtype.element_ty), out_l)
            orows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, out_l))
            ocols = col0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, out_l))
            o_ptrs = out_ptr + orows.to(gl.int64)[:, None] * stride_om + ocols[None, :]
            gl.store(o_ptrs, res, mask=(orows < M)[:, None] & (ocols < N)[None, :])
        else:
            o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @gluon.jit
    def _consumer(a_desc, b_desc, a_smem, b_smem, ready, empty, turn, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                  azp_adj_ptr, azp_ptr, M, N, K, stride_om, cfg):
        """Rows CONSUMER * 64 .. + 64 of each of this program's tiles, as two 64x128 accumulators (the left and
        right halves of the tile's columns): Triton 3.6 lowers integer wgmma up to n = 128, so a 256-wide int8
        tile takes two instructions per K slice anyway, and two tensors let the epilogue finish one half (its
        column vectors: scale_b, bias, azp_adj) before it loads the other's, within the register budget."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF_M: gl.constexpr = BLOCK_M // 2
        HALF_N: gl.constexpr = BLOCK_N // 2
        STAGES: gl.constexpr = cfg.STAGES
        ACC_DTYPE: gl.constexpr = gl.int32 if a_desc.dtype == gl.int8 else gl.float32
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 32])
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        c = 0  # this program's running K step (the loader's count)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, cfg.GROUP_M)
            acc0 = gl.zeros([HALF_M, HALF_N], ACC_DTYPE, mma_layout)
            acc1 = gl.zeros([HALF_M, HALF_N], ACC_DTYPE, mma_layout)
            for ks in range(k_steps):
                slot = (c + ks) % STAGES
                mbarrier.wait(ready.index(slot), ((c + ks) // STAGES) & 1)
                a = a_smem.index(slot).slice(cfg.CONSUMER * HALF_M, HALF_M)
                b = b_smem.index(slot)
                acc0 = warpgroup_mma(a, b.slice(0, HALF_N).permute((1, 0)), acc0, is_async=True)
                acc1 = warpgroup_mma(a, b.slice(HALF_N, HALF_N).permute((1, 0)), acc1, is_async=True)
                # step ks-1's two groups have retired: its slot goes back to the loader
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                mbarrier.arrive(empty.index((c + ks + STAGES - 1) % STAGES), count=1, pred=ks > 0)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES), count=1)
            c += k_steps

            row0 = pid_m * BLOCK_M + cfg.CONSUMER * HALF_M
            col0 = pid_n * BLOCK_N
            _epilogue(acc0, row0, col0, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr, out_ptr, M, N,
                      stride_om, cfg)
            _epilogue(acc1, row0, col0 + HALF_N, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr, out_ptr,
                      M, N, stride_om, cfg)

    @gluon.jit
    def _pingpong_consumer(a_desc, b_desc, a_smem, b_smem, ready, empty, turn, out_ptr, scale_a_ptr, scale_b_ptr,
                           bias_ptr, azp_adj_ptr, azp_ptr, M, N, K, stride_om, cfg):
        """Every other tile of this program (CONSUMER 0 the even ones, 1 the odd ones), whole: 128 x BLOCK_N as
        two 64-row accumulators. The main loops take turns (CUTLASS's ping-pong schedule): a consumer starts one
        after the other has issued its whole main loop (the `turn` mbarriers), so each consumer's epilogue runs
        under the other's main loop, and each consumer waits on a slot's ready barrier at most one phase ahead of
        its fill (the loader fills the one ring in tile order; each slot is read by one consumer)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF_M: gl.constexpr = BLOCK_M // 2
        STAGES: gl.constexpr = cfg.STAGES
        ACC_DTYPE: gl.constexpr = gl.int32 if a_desc.dtype == gl.int8 else gl.float32
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        step = gl.num_programs(0)
        c = cfg.CONSUMER * k_steps  # ring position of this consumer's first tile's first K step
        j = 0  # this consumer's tile count
        for tile in range(gl.program_id(0) + cfg.CONSUMER * step, num_tiles, 2 * step):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, cfg.GROUP_M)
            # my turn: consumer 0's j-th main loop follows consumer 1's (j-1)-th, consumer 1's j-th consumer 0's j-th
            if cfg.CONSUMER == 0:
                mbarrier.wait(turn.index(0), (j + 1) & 1, pred=j > 0)
            else:
                mbarrier.wait(turn.index(1), j & 1)
            acc0 = gl.zeros([HALF_M, BLOCK_N], ACC_DTYPE, mma_layout)
            acc1 = gl.zeros([HALF_M, BLOCK_N], ACC_DTYPE, mma_layout)
            for ks in range(k_steps):
                slot = (c + ks) % STAGES
                mbarrier.wait(ready.index(slot), ((c + ks) // STAGES) & 1)
                b = b_smem.index(slot).permute((1, 0))
                acc0 = warpgroup_mma(a_smem.index(slot).slice(0, HALF_M), b, acc0, is_async=True)
                acc1 = warpgroup_mma(a_smem.index(slot).slice(HALF_M, HALF_M), b, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                mbarrier.arrive(empty.index((c + ks + STAGES - 1) % STAGES), count=1, pred=ks > 0)
            mbarrier.arrive(turn.index(1 - cfg.CONSUMER), count=1)  # the other consumer's turn
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES), count=1)
            c += 2 * k_steps
            j += 1

            row0 = pid_m * BLOCK_M
            col0 = pid_n * BLOCK_N
            _epilogue(acc0, row0, col0, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr, out_ptr, M, N,
                      stride_om, cfg)
            _epilogue(acc1, row0 + HALF_M, col0, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr, out_ptr,
                      M, N, stride_om, cfg)

    @gluon.jit
    def _rowwise_ws_kernel(
        a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
        M, N, K, stride_om,
        SCALE_A_PER_ROW: gl.constexpr, SCALE_B_PER_COL: gl.constexpr, HAS_BIAS: gl.constexpr,
        AZP_MODE: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr, PINGPONG: gl.constexpr = False,
    ):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ping-pong's turn-taking
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            if PINGPONG:
                mbarrier.init(empty.index(s), count=1)  # each slot is read by one consumer
            else:
                mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        shared = (a_desc, b_desc, a_smem, b_smem, ready, empty, turn, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                  azp_adj_ptr, azp_ptr, M, N, K, stride_om)
        args0 = shared + (_Flags(SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, GROUP_M, STAGES, 0), )
        args1 = shared + (_Flags(SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, GROUP_M, STAGES, 1), )
        if PINGPONG:
            gl.warp_specialize([(_loader, args0), (_pingpong_consumer, args0), (_pingpong_consumer, args1)],
                               [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
        else:
            gl.warp_specialize([(_loader, args0), (_consumer, args0), (_consumer, args1)], [4, 4],
                               [CONSUMER_REGS, CONSUMER_REGS])


BLOCK_K = 128  # one K step: 16 KiB of A and 32 KiB of B^T per slot at block_n 256
SMEM_BYTES = 227 * 1024 - 1024  # sm90's per-block shared memory, less the barriers
# the two consumers' exchange buffers of a 16-bit epilogue (sm90 builds of Triton 3.6 / 3.9: 8 KiB each; 7 slots of
# 32 KiB with them need 245,912 bytes, over the 232,448 a block may have)
EXCHANGE_BYTES = 16 * 1024


def scaled_mm_ws(a2d: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype, bias: Optional[torch.Tensor], azp_adj: Optional[torch.Tensor],
                 azp: Optional[torch.Tensor], config: Optional[WsConfig] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Gluon kernel; the caller checked `applies(a2d, b)` and validated the arguments (scaled_mm's contract:
    contiguous flat scales of numel 1, M or N, int32 azp_adj / azp; out, where given, [M, N] of out_dtype with unit
    column stride)."""
    cfg = config or WsConfig()
    slot_bytes = (cfg.block_m + cfg.block_n) * BLOCK_K
    # a 16-bit result goes through an exchange buffer per consumer (the compiler's, beside the slots)
    max_stages = (SMEM_BYTES - (EXCHANGE_BYTES if torch.finfo(out_dtype).bits == 16 else 0)) // slot_bytes
    if (cfg.block_m != 128 or cfg.block_n not in ((128,) if cfg.pingpong else (128, 256))
            or not 2 <= cfg.stages <= max_stages):
        raise ValueError(f"config: the warp-specialized kernel takes block_m 128 (two 64-row consumers), block_n "
                         f"128 or 256 (ping-pong: 128, a whole tile's accumulators per consumer) and 2 to "
                         f"{max_stages} stages of {slot_bytes} bytes for {out_dtype} out, got {cfg}")
    m, k = a2d.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a2d.device)
    if out.numel() == 0:  # a tensor map cannot describe an empty operand
        return out
    a_desc = operand_descriptor(a2d, [cfg.block_m, BLOCK_K])
    b_desc = operand_descriptor(b.t(), [cfg.block_n, BLOCK_K])
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    azp_mode = 0 if azp_adj is None else (1 if azp is None else 2)
    launch_kernel(_rowwise_ws_kernel, (max(1, min(tiles, sm_count(a2d.device))),),
        a_desc, b_desc, out, scale_a, scale_b,
        bias if bias is not None else out, azp_adj if azp_adj is not None else scale_a,
        azp if azp is not None else scale_a,
        m, n, k, out.stride(0),
        SCALE_A_PER_ROW=scale_a.numel() > 1, SCALE_B_PER_COL=scale_b.numel() > 1, HAS_BIAS=bias is not None,
        AZP_MODE=azp_mode, GROUP_M=cfg.group_m, STAGES=cfg.stages, CONSUMER_REGS=WS_CONSUMER_REGS, num_warps=4,
        PINGPONG=cfg.pingpong, maxnreg=WS_MAXNREG,
    )
    return out
