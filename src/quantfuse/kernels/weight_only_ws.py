"""Weight-only INT4 GEMM for prefill-sized M on Hopper (sm90) in Gluon, warp-specialized: a producer warpgroup
dequantizes each chunk of the packed weight into shared memory, two consumer warpgroups run a plain
shared-memory wgmma over it.

Math (SPEC section 4): out[m, n] = sum_k x[m, k] * w_hat[n, k] (+ bias[n]) with w_hat = round(dtype, (u - z) * s),
bit for bit the conversion of `weight_only_wgmma` (the zero point subtracted exactly before the one scaling multiply).

Why a second prefill kernel: in `weight_only_wgmma._wo_wgmma_kernel` the same warps convert the weight and issue the
register-operand wgmma, so every conversion instruction competes with the product for those warps' issue slots
and registers. Here the conversion runs in its own warpgroup and the consumers' main loop is a shared-memory wgmma
like cuBLAS's.

Structure (persistent, one program per SM, tiles in grouped order): the out^T tile [BLOCK_N = 128 weight rows,
BLOCK_M = 256 tokens] = W [128, K] @ x^T [K, 256]. Per 128-code chunk the producer (the default partition, 4
warps) waits for two free half-chunk slots, has the copy engine bring x's two [256, 64] boxes, converts the
chunk's words and stores w_hat as two [128, 64] K-major tiles, then fences the stores for the async proxy and
arrives on both slots' ready barriers (which also count the copies' bytes). The words, scales and zero points
come by the copy engine too, AUX chunks ahead, into a small ring of their own. Consumer c owns weight rows
64 c .. 64 c + 63 of the tile (acc 64x256 float32: 128 registers per thread), issues each half chunk's wgmma group,
keeps one in flight and hands a slot back when the group before has retired. The epilogue converts 64-token pieces
of the accumulator into rows of 8 contiguous output columns (16-byte stores).

What bounds it (H100, results/tune_weight_only_ws_probe.json, an earlier version of this kernel with diagnostic
variants): the producer. With the conversion and the word loads taken out, the same pipeline ran 0.97-1.15x bf16
cuBLAS on the four Llama-3 shapes at M = 1024 whose tiles fill whole waves; with the loads only, 0.82-1.00x; in
shipped form, 0.72-0.88x (float32 scales). So the producer's instruction stream is the budget:
- the words are not prefetched into registers: the proxy fence that publishes each converted chunk waits for
  every global load the thread has in flight (ncu: the fence and the first use of the words were the producer's
  top stalls), so a register prefetch's latency came back into every chunk;
- one LOP3 per field (PTX): written as an and / or of two immediates ptxas emits two;
- one fence and one partition barrier per chunk, not per half;
- the aux cursor's tile coordinates (integer divisions) worked out once per tile, not per chunk: 0.96-1.09x the
  version before, median 1.06 (results/tune_weight_only_ws_cursor.json, same call, bit-identical output).
The packed conversion of 16-bit scales (1.5 instructions per weight) keeps the producer ahead of float32 scales'
(3.5: OR, subtract, multiply, half a pack), yet both now beat the register-operand kernel. In one run
(results/tune_weight_only_ws.json, W4A16 g128,
five Llama-3 shapes, CUDA graphs, weights rotated past L2, minimum of two rounds): 1.04-1.15x `weight_only_wgmma`
with bfloat16 scales and 1.01-1.16x with float32 scales at M = 1024 and 2048; 0.79-1.01x bf16 cuBLAS.

Wave quantization: where `weight_only_wgmma.plan` splits the last wave's column tiles over K (`TailSplit`, same
256 x 128 tile), this kernel runs the whole waves and `weight_only_wgmma.run_tail` the rest (`tail_plan`).

Tried on the H100 and dropped (same-call A/Bs, bit-identical or within the bound, GPU tests passed on each):
- stream-K (every program an even share of all tiles' chunks, cut tiles fixed up through float32 partials and a
  release / acquire flag): 0.80-0.99x; programs starting at different K chunks read x and the weight from DRAM
  again (ncu: about 136 MB against 64 MB at K4096 N6144 M2048; results/tune_weight_only_ws_stream_k.json);
- the tail split inside this kernel (the tail tiles' K pieces side by side in the last wave, piece 0 adding the
  others' partials behind a flag): 0.86-1.00x run_tail (results/tune_weight_only_ws_tail_in_kernel.json);
- converting chunk q + 1 before publishing chunk q (to hide the proxy fence's wait): 0.88-1.00x, the consumers
  then see one published chunk of the two-chunk ring (results/tune_weight_only_ws_fence_pipelined.json);
- 136 / 152 producer registers (consumers 184 / 176): 0.88-1.03x (results/tune_weight_only_ws_regs.json);
- a second producer warpgroup: 16 warps cap the registers at 128, the consumers' 64x256 float32 wgmma needs 154.
- for M = 64 / 128 (issue 5's lines there): 64- or 128-token tiles with split-K over whole chunks, one producer or two
  taking the chunks in turn: 0.70-0.99x the tl wide tiles on every shape; ~1930 cycles per chunk per SM whatever the
  tile, aux depth or producer count (ncu: producer issuing on a third of its cycles, waiting on the words' shared
  loads and the fence + partition barrier); with the 256-token tile and forced splits at M = 256..768, 0.72-1.14x
  the shipped dispatch (results/tune_weight_only_ws_small.json, tune_weight_only_ws_mid.json; code in 6c125d3).

Scope (`applies`): as `weight_only_wgmma.applies`, M >= 256 (the tile's token rows; the last tile moved back to end
at M), packed words, scales and zero points the copy engine can read (16-byte aligned rows). The Triton interpreter
has no Gluon: the `tl` kernels are the executable twins.
"""

# no `from __future__ import annotations`: _WsFlags' field annotations must stay types for Triton's aggregate

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ._common import cdiv, describable, launch_kernel
from ._gluon import GLUON_AVAILABLE
from .configs import sm_count
from . import weight_only_wgmma as _ww

_aggregate = None
if GLUON_AVAILABLE:
    from ._gluon import TensorDescriptor as GluonTensorDescriptor
    from ._gluon import cta_barrier as _cta_barrier
    from ._gluon import fence_async_shared as _fence_async_shared
    from ._gluon import gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import tile_coords as _tile_coords
    from ._gluon import tma_load as _tma_load
    from ._gluon import unswizzled_layout
    from .gemv_mma import convert_word_pairs as _convert_word_pairs
    from .gemv_mma import half_pair as _half_pair
    from .gemv_mma import magic_zero_pair as _magic_zero_pair
    from .weight_only_wgmma import fields_to_half as _tile4
    from .weight_only_wgmma import scaled_field as _scaled
    try:
        from triton.language.core import _aggregate
    except ImportError:  # a Triton without it: the kernel is off
        pass

CHUNK = 128  # int4 codes per chunk of 16 words (one K step)
HALF = 64  # codes per x box / w_hat tile (128 bytes of a 16-bit dtype: the swizzle span)
WORDS_PER_CHUNK = 16
BLOCK_M = 256  # tokens per tile (the wgmma's N)
BLOCK_N = 128  # weight rows per tile (two consumers x 64)
SMEM_BYTES = 227 * 1024 - 1024
EPILOGUE_BYTES = 2 * 64 * 64 * 2  # the consumers' layout-conversion scratch (a 64x64 piece each)


@dataclass(frozen=True)
class WsW4Config:
    """stages: half-chunk slots of the operand ring (x [256, 64] 32 KiB + w_hat [128, 64] 16 KiB each); aux_stages:
    chunks of packed words, scales and zero points the copy engine brings ahead of the conversion (8.5-9 KiB
    each); group: weight-row tiles per grouped band; consumer_regs / maxnreg: the register split (setmaxnreg for
    the consumers; the launch's cap for all 12 warps)."""
    stages: int = 4
    aux_stages: int = 2
    group: int = 8
    consumer_regs: int = 192
    maxnreg: int = 168


def _aux_bytes(scale_bytes: int, has_zero: bool) -> int:
    return BLOCK_N * WORDS_PER_CHUNK * 4 + BLOCK_N * scale_bytes + (BLOCK_N * 4 if has_zero else 0)


def check_config(cfg: WsW4Config, scale_bytes: int = 4, has_zero: bool = True) -> None:
    slot = (BLOCK_M + BLOCK_N) * HALF * 2
    room = SMEM_BYTES - EPILOGUE_BYTES - cfg.aux_stages * _aux_bytes(scale_bytes, has_zero)
    if cfg.aux_stages < 1 or not 2 <= cfg.stages <= room // slot or cfg.group < 1:
        raise ValueError(f"config: expected aux_stages >= 1, 2 <= stages <= {room // slot} ({slot}-byte slots beside "
                         f"{cfg.aux_stages} aux slots), group >= 1, got {cfg}")


# Where weight_only_mm runs this kernel (`prefer`): bands of M from min_m to max_m, where the product fills the SMs
# without a split over K (and, with same_tile, where the model picked this kernel's 256 x 128 tile), float32 or
# 16-bit scales. H100:
# - M = 1024..2048 (results/tune_weight_only_ws.json of stop 45, five Llama-3 shapes): 1.01-1.16x weight_only_wgmma at
#   M = 1024 and 2048 and ahead of dequantize + cuBLAS on 18 of 20 rows (4096x6144 at M = 2048 with float32 scales
#   166 vs 160 us, 14336x4096 at 2048 with bf16 scales 369 vs 372); at M = 1536 ahead or tied on 9 of 10, at M = 4096
#   dequantize + cuBLAS ahead on 9 of 10 (this kernel 0.92-1.01x it; results/tune_weight_only_ws_m1536_m4096.json).
# - M = 256..1023 where the model picked this kernel's tile (results/tune_weight_only_ws_m256_m768.json, five Llama-3
#   shapes at M = 256 / 512 / 768, both scale dtypes, 4 alternated rounds): on the 20 of 30 rows this band takes,
#   0.99-1.14x weight_only_wgmma (median 1.08; 4096x6144 at 768, dequantize + cuBLAS before: 74.2 vs 75.9 us); at
#   M = 384 / 640 / 896 (another call, 18 rows) 0.98-1.23x, median 1.07. Where the model splits K or picks 128 x 128
#   tiles it leaves weight_only_wgmma (14336x4096 at M = 512: 104 vs 163 us).
WS_W4_DISPATCH: Dict[str, List[Dict[str, int]]] = {
    "sm90": [dict(min_m=256, max_m=1023, same_tile=True), dict(min_m=1024, max_m=2048, same_tile=False)],
}


def prefer(m: int, n: int, k: int, arch: str, num_sms: int) -> bool:
    """Whether weight_only_mm runs this kernel at this shape (where `applies`) on `arch`: WS_W4_DISPATCH."""
    for band in WS_W4_DISPATCH.get(arch, ()):
        if band["min_m"] <= m <= band["max_m"]:
            cfg, splits, _ = _ww.plan(m, n, k, arch, num_sms)
            return splits == 1 and (not band["same_tile"] or (cfg.block_m, cfg.block_n) == (BLOCK_M, BLOCK_N))
    return False


def tail_plan(m: int, n: int, k: int, arch: str, num_sms: int):
    """The (config, TailSplit) that `weight_only_wgmma.plan` makes for this shape where it splits the last wave's
    column tiles and its tiles are this kernel's (256 tokens x 128 weight rows), else None: the first launch then
    runs here, whole waves of persistent tiles."""
    cfg, splits, tail = _ww.plan(m, n, k, arch, num_sms)
    return (cfg, tail) if tail is not None and (cfg.block_m, cfg.block_n) == (BLOCK_M, BLOCK_N) else None


def applies(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
            zeros: Optional[torch.Tensor] = None) -> bool:
    """Whether the kernel can run the product (module doc): the copy engine also brings the packed words, scales
    and zero points, so those must be describable too; the caller validated the arguments."""
    return (_aggregate is not None and x2d.shape[0] >= BLOCK_M
            and _ww.applies(x2d, qweight, scales, bits, group_size)
            and all(_rows_describable(t) for t in (qweight, scales, zeros) if t is not None))


def _rows_describable(t: torch.Tensor) -> bool:
    """`describable`, where a single row's stride (which no box steps over) may be anything."""
    return t.dim() == 2 and (describable(t) if t.shape[0] > 1 else (t.stride(1) == 1 and t.data_ptr() % 16 == 0))




def _fields_ptx() -> str:
    """Fields F = 0..3 of an int4 word ($8) and of its high half, each OR-ed where it lies into 2^23 (0x4B000000):
    the float32 2^23 + u 2^(4 F), one LOP3 each (plus one shift for the high half)."""
    lines = [f"lop3.b32 ${f}, $8, {0xF << (4 * f):#010x}, 0x4b000000, 0xea;" for f in range(4)]
    lines.append("shr.u32 h, $8, 16;")
    lines += [f"lop3.b32 ${4 + f}, h, {0xF << (4 * f):#010x}, 0x4b000000, 0xea;" for f in range(4)]
    return "{ .reg .b32 h; " + " ".join(lines) + " }"


if GLUON_AVAILABLE and _aggregate is not None:

    _FIELDS_ASM = gl.constexpr(_fields_ptx())
    _WORDS = gl.constexpr(WORDS_PER_CHUNK)
    _BM = gl.constexpr(BLOCK_M)
    _BN = gl.constexpr(BLOCK_N)
    _CHUNK = gl.constexpr(CHUNK)
    _HALF = gl.constexpr(HALF)

    @_aggregate
    class _WsFlags:
        """The kernel's constexprs in one aggregate: Triton 3.6's warp_specialize turns plain int / bool arguments
        of a partition into runtime values."""
        HAS_ZERO: gl.constexpr
        HAS_BIAS: gl.constexpr
        SCALE16: gl.constexpr
        STAGES: gl.constexpr
        GROUP: gl.constexpr
        PART: gl.constexpr  # which 64-row half of the tile's weight rows a consumer multiplies (the producer: 0)
        AUX: gl.constexpr  # chunks of words / scales / zero points in flight ahead of the conversion

        @gluon.constexpr_function
        def __init__(self, HAS_ZERO, HAS_BIAS, SCALE16, STAGES, GROUP, PART, AUX):
            self.HAS_ZERO = gl.constexpr(HAS_ZERO)
            self.HAS_BIAS = gl.constexpr(HAS_BIAS)
            self.SCALE16 = gl.constexpr(SCALE16)
            self.STAGES = gl.constexpr(STAGES)
            self.GROUP = gl.constexpr(GROUP)
            self.PART = gl.constexpr(PART)
            self.AUX = gl.constexpr(AUX)

    @gluon.jit
    def _tile_rows(tile, M, N, GROUP: gl.constexpr):
        """(first weight row, first token row loaded, first token row stored) of a tile: the last token tile moved
        back to end at M (rows shared with the tile before are computed again and not stored; rows the copy engine
        zero-fills run slower than real ones, see weight_only_wgmma)."""
        pid_n, pid_m = _tile_coords(tile, N, M, _BN, _BM, GROUP)
        off_m = pid_m * _BM
        return pid_n * _BN, gl.maximum(gl.minimum(off_m, M - _BM), 0), off_m

    @gluon.jit
    def _fields_f32(words, z, s, DT: gl.constexpr):
        """The eight fields of each word as `weight_only_wgmma.scaled_field` takes them, the OR into 2^23 one LOP3 per
        field (PTX: the and / or of two immediates written as two operations becomes two LOP3s), returned as the
        halves' field tuples."""
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _FIELDS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True, pack=1)
        return ((_scaled(v0, 0, z, s, DT), _scaled(v1, 1, z, s, DT), _scaled(v2, 2, z, s, DT),
                 _scaled(v3, 3, z, s, DT)),
                (_scaled(v4, 0, z, s, DT), _scaled(v5, 1, z, s, DT), _scaled(v6, 2, z, s, DT),
                 _scaled(v7, 3, z, s, DT)))

    @gluon.jit
    def _dequant(words, zero, scale, DT: gl.constexpr, SCALE16: gl.constexpr):
        """[rows, 16] words of a chunk -> its two [rows, 64] halves of w_hat (k < 64, k >= 64)."""
        if SCALE16:
            l0, h0, l1, h1, l2, h2, l3, h3 = _convert_word_pairs(words, zero[:, None], scale[:, None], DT, True)
            return _tile4(l0, l1, l2, l3), _tile4(h0, h1, h2, h3)
        else:
            lo, hi = _fields_f32(words, zero[:, None], scale[:, None], DT)
            return _tile4(lo[0], lo[1], lo[2], lo[3]), _tile4(hi[0], hi[1], hi[2], hi[3])

    @gluon.jit
    def _produce_chunk(x_desc, x_smem, w_smem, ready, empty, words, zero, scale, c, t, load_m, cfg):
        """Chunk t's two halves into half-chunk slots c and c + 1: both slots' x boxes requested from the copy
        engine as soon as the slots are free, the conversion (both halves at once: the packed pairs hold one field
        of each) while they are in flight, then both halves published behind one fence and one partition barrier
        (each costs the producer about as much as converting a quarter chunk)."""
        DT: gl.constexpr = x_desc.dtype
        STAGES: gl.constexpr = cfg.STAGES
        s0 = c % STAGES
        s1 = (c + 1) % STAGES
        mbarrier.wait(empty.index(s0), ((c // STAGES) & 1) ^ 1)  # fresh barriers: returns at once
        mbarrier.expect(ready.index(s0), x_desc.block_type.nbytes)
        _tma_load(x_desc, [load_m, t * _CHUNK], ready.index(s0), x_smem.index(s0))
        lo, hi = _dequant(words, zero, scale, DT, cfg.SCALE16)
        w_smem.index(s0).store(lo)
        mbarrier.wait(empty.index(s1), (((c + 1) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s1), x_desc.block_type.nbytes)
        _tma_load(x_desc, [load_m, t * _CHUNK + _HALF], ready.index(s1), x_smem.index(s1))
        w_smem.index(s1).store(hi)
        # every thread's stores visible to the wgmma (async proxy), all of them before the partition's arrivals
        _fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(ready.index(s0), count=1)
        mbarrier.arrive(ready.index(s1), count=1)

    @gluon.jit
    def _aux_issue(wq_desc, s_desc, z_desc, wq_smem, s_smem, z_smem, aux_bar, q, off_n, t, group_chunk_shift, cfg):
        """Chunk t of the tile whose weight rows start at off_n: its packed words and its group's scales (and zero
        points) into aux slot q % AUX by the copy engine (zero fill past N)."""
        slot = q % cfg.AUX
        g = t >> group_chunk_shift
        if cfg.HAS_ZERO:
            nbytes: gl.constexpr = wq_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = wq_desc.block_type.nbytes + s_desc.block_type.nbytes
        mbarrier.expect(aux_bar.index(slot), nbytes)
        _tma_load(wq_desc, [off_n, t * _WORDS], aux_bar.index(slot), wq_smem.index(slot))
        _tma_load(s_desc, [g, off_n], aux_bar.index(slot), s_smem.index(slot))
        if cfg.HAS_ZERO:
            _tma_load(z_desc, [g, off_n], aux_bar.index(slot), z_smem.index(slot))

    @gluon.jit
    def _cursor_next(a_tile, a_off_n, a_t, n_chunks, num_tiles, M, N, GROUP: gl.constexpr):
        """The aux cursor's next (tile, its first weight row, chunk) in this program's sequence: the tile's
        coordinates (integer divisions) worked out once per tile, not per chunk (the producer bounds the kernel)."""
        a_t += 1
        if a_t == n_chunks:
            a_t = 0
            a_tile += gl.num_programs(0)
            if a_tile < num_tiles:
                a_off_n, a_load_m, a_off_m = _tile_rows(a_tile, M, N, GROUP)
        return a_tile, a_off_n, a_t

    @gluon.jit
    def _producer(x_desc, wq_desc, s_desc, z_desc, bias_ptr, out_ptr, x_smem, w_smem, wq_smem, s_smem, z_smem,
                  ready, empty, aux_bar, M, N, K, stride_om, group_chunk_shift, cfg):
        """Every chunk of every tile of this program, in order, into the operand ring: x by the copy engine, w_hat
        converted here from words, scales and zero points the copy engine brought AUX chunks ahead. (Not global
        loads into registers: the fence that publishes each converted half waits for every load the thread has
        in flight, which would bring a register prefetch's latency back into every chunk.)"""
        DT: gl.constexpr = x_desc.dtype
        AUX: gl.constexpr = cfg.AUX
        # a thread holds 8 consecutive words of a row: each field becomes 8 consecutive k (one 16-byte store)
        w_l: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, w_l)
        num_tiles = gl.cdiv(M, _BM) * gl.cdiv(N, _BN)
        n_chunks = gl.cdiv(K, _CHUNK)
        # the aux cursor walks this program's (tile, chunk) sequence AUX chunks ahead of the conversion
        a_tile = gl.program_id(0)
        a_off_n, a_load_m, a_off_m = _tile_rows(a_tile, M, N, cfg.GROUP)  # the grid has at most num_tiles programs
        a_t = 0
        for q in gl.static_range(AUX):
            if a_tile < num_tiles:
                _aux_issue(wq_desc, s_desc, z_desc, wq_smem, s_smem, z_smem, aux_bar, q, a_off_n, a_t,
                           group_chunk_shift, cfg)
            a_tile, a_off_n, a_t = _cursor_next(a_tile, a_off_n, a_t, n_chunks, num_tiles, M, N, cfg.GROUP)
        q = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_n, load_m, off_m = _tile_rows(tile, M, N, cfg.GROUP)
            for t in range(n_chunks):
                slot = q % AUX
                mbarrier.wait(aux_bar.index(slot), (q // AUX) & 1)
                words = wq_smem.index(slot).load(w_l)
                s = s_smem.index(slot).reshape([_BN]).load(row_l)
                if cfg.HAS_ZERO:
                    z = z_smem.index(slot).reshape([_BN]).load(row_l)
                else:
                    z = gl.full([_BN], 8, gl.int32, row_l)
                if cfg.SCALE16:
                    zero = _magic_zero_pair(z, DT)
                    scale = _half_pair(s)
                else:
                    zero = z.to(gl.float32)
                    scale = s
                _produce_chunk(x_desc, x_smem, w_smem, ready, empty, words, zero, scale, 2 * q, t, load_m, cfg)
                # the slot's values were converted and published (behind the partition's barrier): refill it
                if a_tile < num_tiles:
                    _aux_issue(wq_desc, s_desc, z_desc, wq_smem, s_smem, z_smem, aux_bar, q + AUX, a_off_n, a_t,
                               group_chunk_shift, cfg)
                a_tile, a_off_n, a_t = _cursor_next(a_tile, a_off_n, a_t, n_chunks, num_tiles, M, N, cfg.GROUP)
                q += 1

    @gluon.jit
    def _store_piece(piece, n_idx, m0, M, N, off_m, out_ptr, stride_om):
        """A [64 weight rows, 64 tokens] piece of out^T into out [M, N] (tokens >= off_m and < M, rows < N)."""
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        res = gl.convert_layout(piece.to(out_ptr.dtype.element_ty), out_l)
        ns = n_idx + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
        ms = m0 + gl.arange(0, 64, layout=gl.SliceLayout(0, out_l))
        mask = (ns < N)[:, None] & ((ms >= off_m) & (ms < M))[None, :]
        gl.store(out_ptr + ms.to(gl.int64)[None, :] * stride_om + ns[:, None], res, mask=mask)

    @gluon.jit
    def _consumer(x_desc, wq_desc, s_desc, z_desc, bias_ptr, out_ptr, x_smem, w_smem, wq_smem, s_smem, z_smem,
                  ready, empty, aux_bar, M, N, K, stride_om, group_chunk_shift, cfg):
        """Weight rows 64 CONSUMER .. + 64 of each of this program's tiles against the tile's 256 tokens."""
        STAGES: gl.constexpr = cfg.STAGES
        ROWS: gl.constexpr = _BN // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _BM, 16])
        num_tiles = gl.cdiv(M, _BM) * gl.cdiv(N, _BN)
        n_chunks = gl.cdiv(K, _CHUNK)
        c = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_n, load_m, off_m = _tile_rows(tile, M, N, cfg.GROUP)
            acc = gl.zeros([ROWS, _BM], gl.float32, mma)
            for h in range(2 * n_chunks):
                slot = (c + h) % STAGES
                mbarrier.wait(ready.index(slot), ((c + h) // STAGES) & 1)
                acc = warpgroup_mma(w_smem.index(slot).slice(cfg.PART * ROWS, ROWS),
                                    x_smem.index(slot).permute((1, 0)), acc, is_async=True)
                # the half chunk before has retired: its slot goes back to the producer
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((c + h + STAGES - 1) % STAGES), count=1, pred=h > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((c + 2 * n_chunks - 1) % STAGES), count=1)
            c += 2 * n_chunks

            n_idx = off_n + cfg.PART * ROWS
            if cfg.HAS_BIAS:
                ns = n_idx + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
                acc += gl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(gl.float32)[:, None]
            # four 64-token pieces by register renaming (token bits 64 and 128 are register bits of the layout)
            q = gl.permute(gl.reshape(acc, [ROWS, 2, 2, 64]), (0, 3, 1, 2))  # [n, b, a1, a0]: token 128 a1 + 64 a0 + b
            e0, e1 = gl.split(q)
            p0, p2 = gl.split(e0)
            p1, p3 = gl.split(e1)
            _store_piece(p0, n_idx, load_m, M, N, off_m, out_ptr, stride_om)
            _store_piece(p1, n_idx, load_m + 64, M, N, off_m, out_ptr, stride_om)
            _store_piece(p2, n_idx, load_m + 128, M, N, off_m, out_ptr, stride_om)
            _store_piece(p3, n_idx, load_m + 192, M, N, off_m, out_ptr, stride_om)

    @gluon.jit
    def _wo_ws_kernel(
        x_desc, wq_desc, s_desc, z_desc, bias_ptr, out_ptr,
        M, N, K, stride_om, group_chunk_shift,
        HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, SCALE16: gl.constexpr, STAGES: gl.constexpr,
        AUX: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        DT: gl.constexpr = x_desc.dtype
        gl.static_assert(x_desc.block_type.shape[0] == _BM, "x boxes of BLOCK_M tokens")
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, _HALF], DT)
        x_smem = gl.allocate_shared_memory(DT, [STAGES, _BM, _HALF], x_desc.layout)
        w_smem = gl.allocate_shared_memory(DT, [STAGES, _BN, _HALF], w_layout)
        wq_smem = gl.allocate_shared_memory(gl.int32, [AUX, _BN, _WORDS], wq_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [AUX, 1, _BN], s_desc.layout)
        if HAS_ZERO:
            z_smem = gl.allocate_shared_memory(gl.int32, [AUX, 1, _BN], z_desc.layout)
        else:  # unused: a token buffer, since partitions take one signature
            z_smem = gl.allocate_shared_memory(gl.int32, [1, 1, 4], z_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        aux_bar = gl.allocate_shared_memory(gl.int64, [AUX, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=2)  # the copy's expect (with its bytes) + the producer's stores
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        for s in gl.static_range(AUX):
            mbarrier.init(aux_bar.index(s), count=1)
        shared = (x_desc, wq_desc, s_desc, z_desc, bias_ptr, out_ptr, x_smem, w_smem, wq_smem, s_smem, z_smem,
                  ready, empty, aux_bar, M, N, K, stride_om, group_chunk_shift)
        args0 = shared + (_WsFlags(HAS_ZERO, HAS_BIAS, SCALE16, STAGES, GROUP, 0, AUX), )
        args1 = shared + (_WsFlags(HAS_ZERO, HAS_BIAS, SCALE16, STAGES, GROUP, 1, AUX), )
        gl.warp_specialize([(_producer, args0), (_consumer, args0), (_consumer, args1)], [4, 4],
                           [CONSUMER_REGS, CONSUMER_REGS])


def x_descriptor(x2d: torch.Tensor):
    return _ww.x_descriptor(x2d, BLOCK_M)


def _row_descriptor(t: torch.Tensor, block):
    """Unswizzled boxes (the producer reads them with plain shared loads)."""
    layout = unswizzled_layout(t.element_size() * 8, 2)
    # a single row's stride is never stepped over: give it the row's length (torch may report 1 there)
    row_bytes = -(-t.shape[1] * t.element_size() // 16) * 16
    strides = list(t.stride()) if t.shape[0] > 1 else [row_bytes // t.element_size(), 1]
    return GluonTensorDescriptor(t, list(t.shape), strides, list(block), layout)


def ws_w4_mm(x2d, qweight, scales, zeros, bias, group_size: int, n: int, config: Optional[WsW4Config] = None,
             tail: Optional[Tuple["_ww.WgmmaW4Config", "_ww.TailSplit"]] = None) -> torch.Tensor:
    """out [M, N] = x2d @ w_hat.T (+ bias) for int4 codes; the caller checked `applies` and validated the
    arguments. tail (`tail_plan`): this kernel runs the split's first main_tiles_n column tiles and
    `weight_only_wgmma.run_tail` the rest, split over K, with that config; None: the whole product here."""
    cfg = config or WsW4Config()
    check_config(cfg, scales.element_size(), zeros is not None)
    m, k = x2d.shape
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if tail is not None and not (tail[0].block_m == BLOCK_M and tail[0].block_n == BLOCK_N):
        raise ValueError(f"tail: expected a plan of {BLOCK_M}-token x {BLOCK_N}-row tiles (this kernel's), got {tail}")
    if tail is not None:
        _ww._check_tail(tail[1], n, k, tail[0])
    n_main = n if tail is None else tail[1].main_tiles_n * BLOCK_N
    # the main columns as views (the kernel's N): descriptors and pointers keep the full tensors' strides
    qw_main = qweight[:n_main]
    s_main = scales[:, :n_main]
    z_main = None if zeros is None else zeros[:, :n_main]
    tiles = cdiv(m, BLOCK_M) * cdiv(n_main, BLOCK_N)
    s_desc = _row_descriptor(s_main, [1, BLOCK_N])
    x_desc = x_descriptor(x2d)  # the same [256, 64] boxes as the tail launch's (same tile): built once
    launch_kernel(_wo_ws_kernel, (max(1, min(tiles, sm_count(x2d.device))),),
        x_desc, _row_descriptor(qw_main, [BLOCK_N, WORDS_PER_CHUNK]), s_desc,
        _row_descriptor(z_main, [1, BLOCK_N]) if z_main is not None else s_desc,
        bias if bias is not None else scales, out, m, n_main, k, out.stride(0),
        _ww.group_chunk_shift(scales, group_size),
        HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SCALE16=scales.dtype == x2d.dtype,
        STAGES=cfg.stages, AUX=cfg.aux_stages, GROUP=cfg.group, CONSUMER_REGS=cfg.consumer_regs, num_warps=4,
        maxnreg=cfg.maxnreg,
    )
    if tail is not None:
        _ww.run_tail(out, x2d, qweight, scales, zeros, bias, group_size, n, tail[0], tail[1], x_desc)
    return out
