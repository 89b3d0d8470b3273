"""The encoder's int8 GEMM for Hopper (sm90) in Gluon: persistent, warp-specialized, two consumer warpgroups in
ping-pong (the schedule CUTLASS calls "pingpong").

Same math and epilogues as `encoder.int8_gemm` (its module docstring): acc = A_q @ W_q^T in int32, then
v = acc * (s_a * s_w[n]) + bias[n] and "residual" (y = v + residual, fp16), "requant" (optionally erf-GELU,
q = sat(rne(v * (1 / s_out))), int8) or "qkv" (head split + requant, V transposed).

Why a second kernel: at the encoder's shapes (K = 768 or 3072) a 128x128 tile's main loop is 6 to 24 K steps,
and the epilogue (dequantize, GELU, requantize: about 30 instructions per element) costs as much as the main
loop. In the `tl` kernel one warpgroup does both, so the tensor cores idle during every epilogue unless a second
program on the SM happens to be in its main loop (profiled: 0.37 instructions issued per scheduler per cycle,
latency-bound). Here the roles are explicit:
  * a loader partition (one thread of it issues the copies) walks this program's tiles and K steps and keeps
    a ring of STAGES shared-memory slots full through the copy engine (ready / empty mbarrier pair per slot);
  * consumer warpgroups 0 and 1 take alternate tiles of the program: while one runs its epilogue, the other
    runs its main loop on the next tile, whose operands the loader fetched during the previous main loop.
Each consumer retires a slot as soon as the wgmma that read it has completed (one wgmma group in flight). The
consumers' main loops take turns (a `turn` mbarrier pair), so slots are consumed in the loader's order: without
it the second consumer waits on a slot two phases ahead, the parity wait passes at once, and the kernel fails
(it did, on the H100, at 4096 tokens).

Measured (H100, tune_encoder_ws_gluon.json): slower than the `tl` kernel where the epilogue is heavy (QKV at 4096
tokens 36.0 us vs 22.5, FC1 41.1 vs 31.4, O 16.5 vs 13.8) and faster only for FC2 at 2048 and 16384 tokens, so the
sm90 table does not select it; a config's ninth element does (benchmarks, tests). Both kernels keep two
warpgroups per SM each running main loop then epilogue (the `tl` kernel as two programs), so the ping-pong buys
no epilogue throughput here, and its QKV stores go straight from the wgmma register layout (2-byte stores).

Scope (`applies`): sm90 exactly, Gluon importable, A and W describable, reciprocal requantization and the fast
GELU (the sm90 table's choices), and for "qkv" tiles lying inside one of Q | K | V with whole heads or head
parts (the `tl` kernel's ALIGNED_QKV). Anything else, and the interpreter, runs `encoder._int8_gemm_kernel`,
the twin tested on the CPU.
"""

# no `from __future__ import annotations`: _Flags' field annotations must stay types for Triton's aggregate
import torch

from ._common import INTERPRET, describable, launch_kernel
from ._gluon import GLUON_AVAILABLE, WS_CONSUMER_REGS, WS_MAXNREG, sm90_exactly

if GLUON_AVAILABLE:
    from ._gluon import gl, gluon, mbarrier, operand_descriptor, tma, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import tile_coords as _tile_coords
    from ._gluon import fill_tiles as _fill_tiles
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
    try:
        from triton.language.core import _aggregate
    except ImportError:  # a Triton without it: the kernel is off
        GLUON_AVAILABLE = False

# registers per thread (_gluon's split): each consumer warpgroup holds a 128x128 int32 accumulator (128 registers)
# plus its epilogue


def applies(a: torch.Tensor, w: torch.Tensor, epilogue_code: int, reciprocal: bool, gelu: bool, fast_gelu: bool,
            aligned_qkv: bool) -> bool:
    return (GLUON_AVAILABLE and not INTERPRET and a.is_cuda and sm90_exactly(a.device.type, a.device.index)
            and describable(a, w) and reciprocal and (fast_gelu or not gelu)
            and (epilogue_code != 2 or aligned_qkv))


if GLUON_AVAILABLE:

    @_aggregate
    class _Flags:
        """The kernel's constexprs, passed to the partitions in one aggregate: Triton 3.6's warp_specialize
        turns plain int / bool arguments of a partition into runtime values."""
        EPILOGUE: gl.constexpr
        RES_MODE: gl.constexpr
        GELU: gl.constexpr
        HEAD_DIM: gl.constexpr
        COLUMN_OUT_SCALE: gl.constexpr
        COLUMN_RES_SCALE: gl.constexpr
        TMA_OUT: gl.constexpr
        GROUP_M: gl.constexpr
        STAGES: gl.constexpr
        CONSUMER: gl.constexpr  # which consumer warpgroup a partition is (the loader ignores it)

        @gluon.constexpr_function
        def __init__(self, EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, TMA_OUT, GROUP_M,
                     STAGES, CONSUMER):
            self.EPILOGUE = gl.constexpr(EPILOGUE)
            self.RES_MODE = gl.constexpr(RES_MODE)
            self.GELU = gl.constexpr(GELU)
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.COLUMN_OUT_SCALE = gl.constexpr(COLUMN_OUT_SCALE)
            self.COLUMN_RES_SCALE = gl.constexpr(COLUMN_RES_SCALE)
            self.TMA_OUT = gl.constexpr(TMA_OUT)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.STAGES = gl.constexpr(STAGES)
            self.CONSUMER = gl.constexpr(CONSUMER)

    @gluon.jit
    def _rcp(x):
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _ex2(x):
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _gelu(v):
        """encoder._gelu's FAST form (A&S 7.1.26 erfc, branch-free), op for op."""
        z = v * 0.7071067811865476
        az = gl.abs(z)
        t = _rcp(1.0 + 0.3275911 * az)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erfc = poly * _ex2(-(az * az) * 1.4426950408889634)
        return 0.5 * v * gl.where(z < 0.0, erfc, 2.0 - erfc)

    @gluon.jit
    def _to_int8_sat(v):
        """_common.to_int8_sat: clamp, round to nearest even through the 1.5 * 2^23 magic number, low byte."""
        v = gl.minimum(gl.maximum(v, -128.0), 127.0)
        return (v + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)

    @gluon.jit
    def _epilogue(acc, c_smem, out_desc, pid_m, pid_n, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr,
                  vt_ptr, M, N, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr,
                  HIDDEN, EPILOGUE: gl.constexpr, RES_MODE: gl.constexpr, GELU: gl.constexpr,
                  HEAD_DIM: gl.constexpr, COLUMN_OUT_SCALE: gl.constexpr, COLUMN_RES_SCALE: gl.constexpr,
                  TMA_OUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        layout: gl.constexpr = acc.type.layout
        rm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        m_ok = rm < M
        n_ok = rn < N
        mask = m_ok[:, None] & n_ok[None, :]
        w_scale = gl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
        bias = gl.load(bias_ptr + rn, mask=n_ok, other=0.0)
        v = acc.to(gl.float32) * (a_scale * w_scale)[None, :] + bias[None, :]
        if EPILOGUE == 0:
            if RES_MODE != 0:
                r = gl.load(res_ptr + rm.to(gl.int64)[:, None] * stride_rm + rn[None, :], mask=mask, other=0)
                if RES_MODE == 1:
                    v = v + r.to(gl.float32)
                elif COLUMN_RES_SCALE:
                    v = v + r.to(gl.float32) * gl.load(res_scale_vec_ptr + rn, mask=n_ok, other=0.0)[None, :]
                else:
                    v = v + r.to(gl.float32) * res_scale
            y = v.to(gl.float16)
        elif EPILOGUE == 1:
            if GELU:
                v = _gelu(v)
            if COLUMN_OUT_SCALE:
                inv = 1.0 / gl.load(out_scale_ptr + rn, mask=n_ok, other=1.0)
                y = _to_int8_sat(v * inv[None, :])
            else:
                y = _to_int8_sat(v * (1.0 / gl.load(out_scale_ptr)))
        else:
            inv = 1.0 / gl.load(out_scale_ptr + rn, mask=n_ok, other=1.0)
            q = _to_int8_sat(v * inv[None, :])
            # encoder._tile_epilogue's ALIGNED_QKV stores: the tile lies inside one of Q | K | V and its
            # columns run through whole runs of SUB = min(BLOCK_N, HEAD_DIM) within one head
            SUB: gl.constexpr = BLOCK_N if BLOCK_N < HEAD_DIM else HEAD_DIM
            col0 = pid_n * BLOCK_N
            which = col0 // HIDDEN
            j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            colw = (col0 - which * HIDDEN) + (j // SUB) * SUB
            head = colw // HEAD_DIM
            d = colw - head * HEAD_DIM + j % SUB
            if which < 2:
                qk_off = ((which * (HIDDEN // HEAD_DIM) + head).to(gl.int64) * M)[None, :] * HEAD_DIM \
                    + rm[:, None] * HEAD_DIM + d[None, :]
                gl.store(out_ptr + qk_off, q, mask=mask)
            else:
                vt_off = (head * HEAD_DIM + d).to(gl.int64)[None, :] * stride_vt + rm[:, None]
                gl.store(vt_ptr + vt_off, q, mask=(rm < vt_rows)[:, None] & n_ok[None, :])
        if EPILOGUE != 2:
            if TMA_OUT:
                # the previous tile's store must have left c_smem before it is overwritten
                tma.store_wait(0)
                c_smem.store(y)
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
            else:
                gl.store(out_ptr + rm.to(gl.int64)[:, None] * stride_om + rn[None, :], y, mask=mask)

    @gluon.jit
    def _consumer(a_desc, w_desc, out_desc, a_smem, w_smem, c_smem, ready, empty, turn,
                  bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr, M, N, K, stride_rm, stride_om,
                  stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr, HIDDEN, cfg):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        STAGES: gl.constexpr = cfg.STAGES
        CONSUMER: gl.constexpr = cfg.CONSUMER
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        my_smem = c_smem.index(CONSUMER)
        local = 0
        for tile in range(pid + CONSUMER * nprog, num_tiles, 2 * nprog):
            # the loader's running step count at this tile: tiles of this program before it times k_steps
            base = ((tile - pid) // nprog) * k_steps
            # Main loops take turns in tile order (the other consumer's previous main loop has ended): a slot's
            # ready barrier is then never waited on more than one phase ahead, where its parity would alias.
            mbarrier.wait(turn.index(CONSUMER), (local & 1) ^ (1 - CONSUMER))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, mma_layout)
            for ks in range(k_steps):
                c = base + ks
                slot = c % STAGES
                mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(slot), w_smem.index(slot).permute((1, 0)), acc, is_async=True)
                # one wgmma group in flight: the previous step's has retired, so its slot goes back
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=ks > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((base + k_steps - 1) % STAGES), count=1)
            mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            local += 1
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, cfg.GROUP_M)
            _epilogue(acc, my_smem, out_desc, pid_m, pid_n, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr,
                      vt_ptr, M, N, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr,
                      HIDDEN, cfg.EPILOGUE, cfg.RES_MODE, cfg.GELU, cfg.HEAD_DIM, cfg.COLUMN_OUT_SCALE,
                      cfg.COLUMN_RES_SCALE, cfg.TMA_OUT, BLOCK_M, BLOCK_N)
        if cfg.TMA_OUT:
            tma.store_wait(0)

    @gluon.jit
    def _loader(a_desc, w_desc, out_desc, a_smem, w_smem, c_smem, ready, empty, turn, bias_ptr, w_scale_ptr,
                out_scale_ptr, res_ptr, out_ptr, vt_ptr, M, N, K, stride_rm, stride_om, stride_vt, vt_rows,
                a_scale, res_scale, res_scale_vec_ptr, HIDDEN, cfg):
        """Every K step of every tile of this program, in order, into the slot ring (zero fill past M, N, K)."""
        _fill_tiles(a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, cfg.GROUP_M, cfg.STAGES)

    @gluon.jit
    def _ws_int8_gemm_kernel(
        a_desc, w_desc, out_desc, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
        M, N, K, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
        EPILOGUE: gl.constexpr, RES_MODE: gl.constexpr, GELU: gl.constexpr, HEAD_DIM: gl.constexpr,
        COLUMN_OUT_SCALE: gl.constexpr, COLUMN_RES_SCALE: gl.constexpr, TMA_OUT: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        if TMA_OUT:
            c_smem = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
        else:  # unused: a token buffer of the same rank, since partitions take one signature
            c_smem = gl.allocate_shared_memory(gl.int8, [2, 8, BLOCK_K], a_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        shared = (a_desc, w_desc, out_desc, a_smem, w_smem, c_smem, ready, empty, turn, bias_ptr, w_scale_ptr,
                  out_scale_ptr, res_ptr, out_ptr, vt_ptr, M, N, K, stride_rm, stride_om, stride_vt, vt_rows, a_scale,
                  res_scale, res_scale_vec_ptr, HIDDEN)
        args0 = shared + (_Flags(EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, TMA_OUT,
                                 GROUP_M, STAGES, 0), )
        args1 = shared + (_Flags(EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, TMA_OUT,
                                 GROUP_M, STAGES, 1), )
        # the loader is the default partition (the kernel's 4 warps; one thread issues the copies): in Triton 3.6
        # only worker partitions carry a warp count that tensors with layouts can be built under
        gl.warp_specialize([(_loader, args0), (_consumer, args0), (_consumer, args1)], [4, 4],
                           [CONSUMER_REGS, CONSUMER_REGS])



def launch(a, w, out, res, vt, bias, w_scale, out_scale, res_scale_vec, *, m, n, k, stride_rm, stride_om, stride_vt,
           vt_rows, a_scale, res_scale, hidden, code, res_mode, gelu, head_dim, column_out_scale, column_res_scale,
           block_m, block_n, block_k, stages, programs_per_sm, tma_out, sms):
    """Launch the warp-specialized kernel (the caller checked `applies` and built the outputs)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    grid = (min(tiles, programs_per_sm * sms),)
    tma_out = tma_out and code != 2 and describable(out)
    a_desc = operand_descriptor(a, (block_m, block_k))
    w_desc = operand_descriptor(w, (block_n, block_k))
    out_desc = operand_descriptor(out, (block_m, block_n)) if tma_out else out
    launch_kernel(_ws_int8_gemm_kernel, grid,
        a_desc, w_desc, out_desc, bias, w_scale, out_scale, res, out, vt,
        m, n, k, stride_rm, stride_om, stride_vt, vt_rows, float(a_scale), float(res_scale), res_scale_vec, hidden,
        EPILOGUE=code, RES_MODE=res_mode, GELU=gelu, HEAD_DIM=head_dim, COLUMN_OUT_SCALE=column_out_scale,
        COLUMN_RES_SCALE=column_res_scale, TMA_OUT=tma_out, GROUP_M=8, STAGES=stages,
        CONSUMER_REGS=WS_CONSUMER_REGS, num_warps=4, maxnreg=WS_MAXNREG)
