"""Weight-only INT4/INT8 GEMM (SPEC section 4): magic-number dequantization fused into the matmul.

Packed layout (built by `quantfuse.weights.pack_codes`): codes are stored *biased* (unsigned,
u = q + 2^(bits-1) for symmetric weights, so the zero point is a plain integer) in int32 words, one row
of words per output channel, qweight [N, K_pad / (32 / bits)]. K is cut into chunks of 16 words
(128 codes for int4, 64 for int8) and *interleaved* inside a chunk: field i (bits i*b .. i*b+b-1) of
word j holds k = chunk * 16 * (32 / b) + 16 * i + j. Extracting field i of a [BLOCK_N, 16] word tile
therefore yields the weight for 16 *consecutive* k, so every field feeds one [BLOCK_N, 16] x [16, BLOCK_M]
tensor-core product against a contiguous slice of x: no shuffles, no reshapes, no gathers. K_pad rounds
K up to a whole chunk with code 0; x is masked to 0 there.

Conversion (the FasterTransformer trick, seed 003, in plain Triton bit arithmetic): OR-ing a code
(< 2^23) into the mantissa of 2^23 (0x4B000000) gives the float32 2^23 + u exactly, so
`bitcast(u | 0x4B000000) - (2^23 + z)` is the exact integer u - z with one shift, one AND/OR (one LOP3)
and one FADD: no integer-to-float instruction. Then w_hat = round(dtype, (u - z) * s): the zero point is
subtracted exactly before the one scaling multiply, never folded into a rounded FMA (SPEC section 4).

Kernels:
- `_wo_mm_kernel` computes the transposed tile out^T[BLOCK_N, BLOCK_M] = W_hat x^T so the dequantized
  operand is the left (register) operand of the MMA, where Hopper takes it from registers. For decode
  (M <= 16) the K range is split over programs (split-K) so that every SM streams its share of the
  weight once; partial sums (float32) are reduced by the tile's last program up to the table's
  `fused_reduce_max_m` (else, for the GEMV kernel, or without a counter slot: `_splitk_reduce_kernel`),
  with bias and the one
  rounding. Scales (and zero points) are loaded once per group per chunk. CHUNKS (tile key `chunks`)
  chunks are loaded per K-loop iteration ([BLOCK_N, CHUNKS, 16] words) and each field is one
  [BLOCK_N, 16 * CHUNKS] x [16 * CHUNKS, BLOCK_M] product: fewer, larger loads and MMAs per weight.
  BLOCK_N 16 / 32 give mma.sync on Hopper instead of wgmma. Tile key `wide` (the shipped tiles from M = 17
  up): the chunk's fields side by side in k order, one [BLOCK_N, CHUNK] x [CHUNK, BLOCK_M] product per chunk
  instead of one per field, so Hopper waits once per chunk for its register-operand wgmma instead of once per
  field (1.1-1.3x at M = 32..128, 1.2-1.9x at M = 256 over dequantize + cuBLAS; tune_weight_only_wide*.json).
- `_wo_gemv_kernel`: the same product without tensor cores for M <= 4 (tile key kernel="gemv"): the
  weights (widened to float32) times x broadcast, accumulated elementwise per row, reduced once after the K
  loop. With the scale after the sums (tile key scale "auto"/"after", the shipped M = 1 tile) it multiplies
  the exact u - z by x (LOP3 + FADD + FFMA per weight, no per-weight scale multiply or rounding) and scales
  each group's float32 sum: x @ W.T with the unrounded W = (u - z) * s, within one rounding per weight of
  x @ w_hat.T (1.3x faster than rounding w_hat first on the H100).
- Both take CONVERT (tile key `convert`): "shift" (above) or "inplace" (`_field_minus_zero`: the field is
  OR-ed where it lies into a power of two whose mantissa LSB has its weight; no shift for most fields);
  both give the exact u - z, hence the same w_hat bit for bit.
- "packed" (CONVERT 2, `_wo_mm_kernel` only; `_pair_convert`): two weights per 32-bit register in packed
  16-bit arithmetic, in x's dtype. Fields p and p + F/2 (F = 32 / bits fields per word) sit at bits
  bits*p and 16 + bits*p, so after one shift of the word, `(v & MASK) | MAGIC2` (MASK 0x000F000F for
  int4, 0x00FF00FF for int8; MAGIC2 0x43004300 in bfloat16, 0x64006400 in float16) is the pair
  (MAGIC + u_lo, MAGIC + u_hi), MAGIC = 128 in bfloat16 (7 mantissa bits: exact for u < 128) or 1024 in
  float16 (exact for u < 1024). An HFMA2 by 1.0 adds the pair -(MAGIC + z) (exact: u - z, small
  integers) and an HFMA2 with -0.0 added multiplies by the pair of scales, rounding once: LOP3 + 2 HFMA2
  (ptxas: HADD2 + HMUL2 on sm_90) per two weights, plus a PRMT or so regrouping them into the MMA
  operand, instead of LOP3 + FADD + FMUL per weight and an F2FP per two. Each half takes the zero point
  and scale of its own field's group (fields p and p + F/2 fall in different groups when group_size is
  less than a chunk), packed once per group. Exact, and equal to the float32 path bit for bit, only
  when the scales are values of x's dtype (then float32 (u - z) * s is exact and both round it once to
  x's dtype) and MAGIC + u and MAGIC + z are exact (int4: either dtype; int8: float16 only; zero points
  0 .. 2^bits): `packed_applies`. Elsewhere (and in the GEMV kernel) a "packed" tile runs "inplace".
  Under the interpreter, which cannot run PTX, the same packed operands go through a float32 twin (exact
  up to the one rounding), so the CPU tests check which field and group land where and the GPU tests
  check the PTX.
- `gemv_tma` (Gluon, sm90, M = 1): the scale-after GEMV with the weight streamed by TMA through a shared-memory
  ring; `weight_only_mm` runs it for int8 weights and for int4 where the tl GEMV is under-filled
  (`prefer_gemv_tma`), where it measured faster on the H100.
- `gemv_mma` (Gluon, sm90, int4, M <= 16): the scale-after product on mma.sync, the packed words converted in
  registers straight into the A operand (two weights per LOP3 + HADD2); `weight_only_mm` runs it in the measured
  M and N x K ranges of `GEMV_MMA_MIN_WEIGHTS` (M = 1 from 6M codes up, 2..16 from 4M codes up).
- `weight_only_wgmma` (Gluon, sm90, int4, prefill-sized M): the same w_hat into an asynchronous register-operand
  wgmma, so converting the next chunk overlaps the current chunk's product (the `tl` kernel waits for each
  chunk's product first); `weight_only_mm` runs it where `weight_only_wgmma.prefer` says (M = 129..1024, from
  768 on only weights of 32M codes or more; up to 2048 with 16-bit scales), ahead of the tl wide tiles and of
  dequantize + cuBLAS there, and with 16-bit scales at M = 32 / 64 / 128 where `weight_only_wgmma.small_m_config`
  says.
- `weight_only_ws` (Gluon, sm90, int4, M >= 256): the conversion in a producer warpgroup of its own, feeding
  shared-memory wgmma in two consumer warpgroups; `weight_only_mm` runs it where `weight_only_ws.prefer` says
  (M = 1024..2048, and M = 256..1023 where the wgmma kernel's model keeps whole-K 256 x 128 tiles), ahead of the
  register-operand kernel and of dequantize + cuBLAS there.
- `weight_only_wgmma.wgmma_w8_mm` (Gluon, sm90, int8 codes with per-channel scales, M = 256..2048): the int4
  kernel's pipeline on 64-code chunks, the exact u - z as the register operand and the scale applied to the sums;
  ahead of this module's int8 tiles (M < 512) and of dequantize + cuBLAS (M >= 512) there.
- `w8_decode` (tl, int8 codes with per-channel scales, M = 2..32 on sm90): the packed words read as a byte matrix
  straight into the dot (x permuted to the bytes' K order in registers), the exact u - z by the 2^23 trick, the
  scale applied to the sums; `weight_only_mm` runs it where `w8_decode.prefer` says, ahead of this module's int8
  tiles (which stay for grouped int8 weights and other architectures).
- `_dequant_kernel` writes w_hat [N, K] (for `QuantizedWeight.dequantize` and for large M, where
  dequantize-once + cuBLAS can beat the fused kernel; the crossover is data in `_DISPATCH`).
Launchers assume the arguments were validated by `quantfuse.ops`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import gemv_mma, gemv_tma, w8_decode, weight_only_wgmma, weight_only_ws
from ._common import (INTERPRET, cap_splits, cast_to, cdiv, grid_dependency_sync, launch_kernel, next_pow2,
                      pdl_launch_options)
from ._common import tile_counters as _tile_counters
from .configs import arch_key, decode_pdl, sm_count

WORDS_PER_CHUNK = 16


def codes_per_word(bits: int) -> int:
    return 32 // bits


def chunk_codes(bits: int) -> int:
    """K elements covered by one 16-word chunk: 128 for int4, 64 for int8."""
    return WORDS_PER_CHUNK * codes_per_word(bits)


# Launch configurations, keyed by architecture. Each entry: rows M up to `max_m` use this tile (an entry
# with `bits` only for weights of that width: `pick_from`).
# `programs_per_sm`: split-K target (decode). cublas_min_m: from this M on, dequantize once + cuBLAS.
# `chunks`: chunks of 16 words per K-loop iteration; `kernel`: "mma" (tensor cores) or "gemv" (no tensor
# cores, block_m <= 4); `convert`: "shift", "inplace" or "packed" (same w_hat; "packed" where
# `packed_applies`, else "inplace"); `scale`: "before" (default; the dot takes w_hat), "after" (the dot
# takes u - z, group sums scaled) or "auto" ("after" where it measured faster; `_scale_code`). The sm90
# rows from M = 2 to 64 are the
# winners of benchmarks/tune_weight_only.py on the H100 (W4A16 g128, five Llama-3 shapes, CUDA graphs;
# geometric-mean speedup over the previous table 1.37x at M=1, 1.40x at 4, 1.38x at 16, 1.42x at 32,
# 1.34x at 64); "gemv" (then rounding w_hat first) never won a shape there. Every tensor-core row says "packed" (but
# the int8 row for float32 scales, where "packed" never applies): it runs where the scales are 16-bit values of x's
# dtype and falls back to "inplace" elsewhere. Rows naming `scale_bytes` serve only scales of that width
# (`pick_from`). Measured on the H100
# (tune_weight_only_packed.json vs tune_weight_only_m64_m128.json / weight_only.json): with bfloat16
# scales "packed" beats "inplace" by 1.3-1.6x at every M (16-bit scale loads slow "inplace" down), but
# against float32 scales + "inplace" it gains only 2-5% at M <= 16 and loses 10-30% at M = 32..128 (ptxas
# serializes the wide tiles' wgmma under the packed conversion: C7515), so the quantize_ configs keep float32 scales
# unless asked (scale_dtype); with 16-bit scales M = 32 / 64 / 128 run `weight_only_wgmma` where its small_m_config
# says.
_DISPATCH = {
    "sm90": {
        "tiles": [
            # M = 1: the CUDA-core GEMV with the scale after the sums (exact u - z: LOP3 + FADD + FFMA per
            # weight), 8 programs per SM (tune_weight_only_gemv2.json, W4A16 g128: 1.04-1.21x the tensor-core
            # tile below on the five shapes, 1.82-2.57x bf16; the same GEMV scaling each weight first: 1.3x
            # slower, tune_weight_only_krule.json). From M = 2 the tensor-core tiles win.
            # int8 weights: 128 columns per program (tune_weight_only_w8.json, W8A16 per channel)
            dict(max_m=1, bits=8, block_m=1, block_n=128, num_warps=4, num_stages=2, programs_per_sm=8, chunks=1,
                 kernel="gemv", convert="inplace", scale="auto"),
            dict(max_m=1, block_m=1, block_n=64, num_warps=4, num_stages=2, programs_per_sm=8, chunks=1,
                 kernel="gemv", convert="inplace", scale="auto"),
            # (int8 with one scale per channel runs `w8_decode` at M = 2..32 on sm90: the two int8 rows below serve
            # grouped int8 weights, and were the per-channel path before it, tune_weight_only_w8_decode.json)
            # int8 weights with float32 scales (no Gluon decode kernel for int8): 64 columns, two chunks (128
            # contiguous bytes of each weight row) per K step, the winner of the staged W8A16 sweep at M = 16
            # (tune_weight_only_w8_m16.json); same-call A/B against the row below at M = 2 / 4 / 8 / 16
            # (tune_weight_only_w8_chunks.json, five shapes): 1.14-1.30x on four shapes (28672x8192 M = 16 108.3
            # vs 136.0 us), 0.97-1.00x at 4096x6144; geometric mean 1.14x
            dict(max_m=16, bits=8, scale_bytes=4, block_m=16, block_n=64, num_warps=4, num_stages=3,
                 programs_per_sm=4, chunks=2, kernel="mma", convert="inplace"),
            # int8 weights with 16-bit scales: the tile above reads them per weight (scale before the dot, two
            # chunks) and ran 8-15% slower than this one on all five shapes at M = 16 (24.4-156.5 us against
            # 21.3-140.6: the notes of weight_only_bfloat16.json, stop 47); here one product per chunk with the
            # scale after the sums
            # (tune_weight_only_wide_decode_w8.json: 17.5-135.9 us against 18.2-139.5 one field at a time); for int4
            # the wide tile lost on 4 of 5 shapes (tune_weight_only_wide_decode_w4.json), so the row below stays one
            # field at a time
            dict(max_m=16, bits=8, block_m=16, block_n=128, num_warps=4, num_stages=3, programs_per_sm=4,
                 chunks=1, kernel="mma", convert="packed", scale="auto", wide=True),
            dict(max_m=16, block_m=16, block_n=128, num_warps=4, num_stages=3, programs_per_sm=4,
                 chunks=1, kernel="mma", convert="packed", scale="auto"),
            # one product per chunk, 4 stages (tune_weight_only_wide2.json, float32 scales, the five shapes: 14.5-78.9
            # us against 17.3-94.2 for this tile one field at a time with 3 stages)
            dict(max_m=32, block_m=32, block_n=128, num_warps=4, num_stages=4, programs_per_sm=2,
                 chunks=1, kernel="mma", convert="packed", scale="auto", wide=True),
            # one chunk, 4 stages, 2 programs per SM (tune_weight_only_packed.json, bfloat16 scales:
            # 8192x10240 56.9 us vs 92.5 for the earlier 2-chunk, 3-stage, 1-program tile; 28672x8192
            # 127.6 vs 157.5; with float32 scales tune_weight_only_m64_m128.json: 28672x8192 111.2 vs 128.5),
            # and one product per chunk (wide; tune_weight_only_wide.json, float32 scales, the five shapes:
            # 17.6-94.5 us against 22.5-115.5 for the same tile one field at a time)
            dict(max_m=64, block_m=64, block_n=128, num_warps=4, num_stages=4, programs_per_sm=2,
                 chunks=1, kernel="mma", convert="packed", scale="auto", wide=True),
            # M 65..128 and the catch-all up to cublas_min_m: one 128-row block dequantizes each weight tile
            # once (tune_weight_only_m64_m128.json, M=128: 1.73x the previous 64x128 catch-all, geomean of
            # five shapes; 8192x10240 73.7 us vs 152), one product per chunk (tune_weight_only_wide.json:
            # M = 128 26.2-129.9 us vs 31.7-149.0; M = 256 43.3-241.5 us vs 52.7-291.7 one field at a time and
            # 53.9-453.2 for dequantize + cuBLAS)
            dict(max_m=128, block_m=128, block_n=256, num_warps=8, num_stages=3, programs_per_sm=1,
                 chunks=1, kernel="mma", convert="packed", scale="auto", wide=True),
            dict(max_m=1 << 62, block_m=128, block_n=256, num_warps=8, num_stages=3, programs_per_sm=1,
                 chunks=1, kernel="mma", convert="packed", scale="auto", wide=True),
        ],
        # dequantize + cuBLAS against the wide catch-all: M = 1024 99.5-908.6 us vs 134.1-872.9
        # (tune_weight_only_wide.json); M = 512 63.3-567.9 vs 67.0-437.8, ahead on 2 of 5 shapes and by up to 1.28x
        # (8192x10240; tune_weight_only_wide2.json)
        "cublas_min_m": 512,
        # (min M, max N x K codes): small weights whose dequantize + cuBLAS beats every kernel path from that M on,
        # ahead of the Gluon kernels (their tiles and K splits are latency-bound there). H100, same-run A/B against
        # the dispatch (benchmarks/probe_dequant_cublas.py, results/probe_dequant_cublas.json; W4A16 g128 and W8A16,
        # float32 scales, Llama-3.2-1B / 3B shapes): 2048x2048 / 2048x3072 at M = 128..2048 1.12-1.45x (one loss:
        # W8 2048x2048 M = 2048 0.96x); 3072x3072 at M = 512..2048 1.04-1.23x. Weights of 15M codes and up are
        # mixed (3072x5120 1.07-1.26x at M >= 1024, 8192x2048 / 4096x4096 0.83-1.00x) and stay on the kernels.
        "cublas_small_weights": ((128, 6_815_744), (512, 9_961_472)),  # 6.5M, 9.5M codes
        # the automatic K split leaves each split two chunks at least (results/probe_small_splits.json, H100:
        # 2048x2048 at M = 32 / 64, 16 one-chunk splits 8.8 / 11.0 us, 8 splits 7.5 / 8.8)
        "min_chunks_per_split": 2,
        # the last program of a tile reduces the split-K partials up to this M (H100, CUDA graphs: Llama-3-8B
        # layer at batch 1, int4 linears 110 us vs 125 with the reduce kernel; at M = 16 that program's
        # serial read of splits x 16 rows made it slower, 137 us vs 122), the reduce kernel above it
        "fused_reduce_max_m": 1,
    },
    "default": {
        "tiles": [
            dict(max_m=16, block_m=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2,
                 chunks=1, kernel="mma", convert="shift"),
            dict(max_m=1 << 62, block_m=32, block_n=32, num_warps=4, num_stages=2, programs_per_sm=1,
                 chunks=1, kernel="mma", convert="shift"),
        ],
        "cublas_min_m": 1 << 62,
        "fused_reduce_max_m": 1 << 62,
    },
}


def _table(device: torch.device):
    return _DISPATCH[arch_key(device.type, device.index)]


def prefer_dequant_cublas_small(m: int, n: int, k: int, table: dict) -> bool:
    """Whether a small weight (`cublas_small_weights` of the dispatch table) takes dequantize + cuBLAS at this M."""
    return any(m >= min_m and n * k <= max_codes for min_m, max_codes in table.get("cublas_small_weights", ()))


def _num_sms(device: torch.device) -> int:
    return sm_count(device)  # cached; 4 under the interpreter: a little split-K so the CPU tests reduce


@triton.jit
def _codes_minus_zero(words, SHIFT: tl.constexpr, MASK: tl.constexpr, zero_plus_magic):
    """Field (words >> SHIFT) & MASK minus its zero point, exact, as float32.

    zero_plus_magic = 2^23 + z. (u | 0x4B000000) reinterpreted is the float 2^23 + u, so one float
    subtraction leaves the exact integer u - z (|u - z| < 2^9, far inside float32's 24 bits)."""
    code = (words >> SHIFT) & MASK
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - zero_plus_magic


@triton.jit
def _group_params(s_ptr, z_ptr, k_start, group_size, num_groups, N, offs_n, n_mask,
                  HAS_ZERO: tl.constexpr, BITS: tl.constexpr, NEED_SCALE: tl.constexpr):
    """Scale [BLOCK_N] and 2^23 + zero point [BLOCK_N] of the group holding k_start (NEED_SCALE False:
    kernels that scale after the dot; no scale is loaded and s is 1)."""
    g = tl.minimum(k_start // group_size, num_groups - 1)
    if NEED_SCALE:
        # scales may be stored as float16 / bfloat16 (then exactly representable): widening is exact
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        s = tl.full((g * N + offs_n).shape, 1.0, tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 2 ** (BITS - 1), tl.float32)
    return s, z + 8388608.0


@triton.jit
def _field_minus_zero(words, words_hi, field_mask, I: tl.constexpr, BITS: tl.constexpr, zero):
    """Field I of `words` minus its zero point, exact, as float32, with no shift for most fields
    ("inplace" conversion, bit-identical to `_codes_minus_zero`).

    A field sitting at bit P of the mantissa (P + BITS <= 23) is OR-ed as it stands into the float
    2^(23 - P), whose mantissa LSB weighs 2^-P: the float is 2^(23 - P) + u exactly, and subtracting
    2^(23 - P) + z (exact: a small integer plus a power of two far above it) leaves the exact u - z. One
    LOP3 (AND field mask, OR magic) replaces SHF + LOP3 per weight. Fields too high for that (int4
    fields 5..7, int8 fields 2..3) come from words_hi = words >> 12 (one shift per word), where they sit
    at bits 8..19. field_mask = 2^BITS - 1 is a runtime argument on purpose: ptxas then keeps the shifted
    masks in registers instead of re-materialising a constant before every LOP3."""
    if I * BITS + BITS <= 23:
        P: tl.constexpr = I * BITS
        code = (words & (field_mask << P)) | ((150 - P) << 23)
    else:
        P: tl.constexpr = I * BITS - 12
        code = (words_hi & (field_mask << P)) | ((150 - P) << 23)
    return code.to(tl.float32, bitcast=True) - (zero + 2.0 ** (23 - P))


@triton.jit
def _field_exact(words, words_hi, field_mask, I: tl.constexpr, BITS: tl.constexpr, zm, CONVERT: tl.constexpr):
    """u - z of field I, exact, as float32, zm = 2^23 + z (from `_group_params`). CONVERT 0: shift + mask
    + magic 2^23 (`_codes_minus_zero`); 1: in place (`_field_minus_zero`). Both give the exact u - z."""
    if CONVERT == 1:
        return _field_minus_zero(words, words_hi, field_mask, I, BITS, zm - 8388608.0)
    else:
        return _codes_minus_zero(words, I * BITS, (1 << BITS) - 1, zm)


@triton.jit
def _dequant_field(words, words_hi, field_mask, I: tl.constexpr, BITS: tl.constexpr, s, zm,
                   CONVERT: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr, SCALED: tl.constexpr):
    """Field I as a DTYPE dot operand: w_hat = round(DTYPE, float32(u - z) * s) (SCALED), or the exact
    u - z (kernels that scale after the dot). Every CONVERT gives the same values bit for bit."""
    d = _field_exact(words, words_hi, field_mask, I, BITS, zm, CONVERT)
    if SCALED:
        return cast_to(d * s, DTYPE, INTERPRET)
    else:
        return cast_to(d, DTYPE, INTERPRET)


def _pair_asm(mask: int, magic: int, one: int, ty: str) -> str:
    """PTX of `_pair_convert`: $2 = the (shifted) word, $3 = the pair -(MAGIC + z), $4 = the pair of
    scales; $0 / $1 = w_hat of the low / high half.

    fma.rn by 1.0 adds and fma.rn with -0.0 added multiplies: the same values as add.rn / mul.rn (adding
    -0.0 leaves every product, a signed zero included, unchanged), but the .bf16x2 fma assembles for
    sm_80 too, where add/sub/mul.bf16x2 need sm_90 (ptxas makes them HADD2 / HMUL2 there)."""
    return ("{\n.reg .b32 t, one, mz;\n"
            f"mov.b32 one, {one:#010x};\n"
            "mov.b32 mz, 0x80008000;\n"
            f"lop3.b32 t, $2, {mask:#010x}, {magic:#010x}, 0xEA;\n"  # (a & b) | c
            f"fma.rn.{ty} t, t, one, $3;\n"
            f"fma.rn.{ty} t, t, $4, mz;\n"
            "mov.b32 {$0, $1}, t;\n"
            "}")


def _pair_sub_asm(mask: int, magic: int, one: int, ty: str) -> str:
    """PTX of `_pair_convert` with SCALED False: `_pair_asm` without the scaling, $0 / $1 = u - z of the low /
    high half."""
    return ("{\n.reg .b32 t, one;\n"
            f"mov.b32 one, {one:#010x};\n"
            f"lop3.b32 t, $2, {mask:#010x}, {magic:#010x}, 0xEA;\n"  # (a & b) | c
            f"fma.rn.{ty} t, t, one, $3;\n"
            "mov.b32 {$0, $1}, t;\n"
            "}")


_PAIR_ASM_BF16_INT4 = tl.constexpr(_pair_asm(0x000F000F, 0x43004300, 0x3F803F80, "bf16x2"))
_PAIR_ASM_F16_INT4 = tl.constexpr(_pair_asm(0x000F000F, 0x64006400, 0x3C003C00, "f16x2"))
_PAIR_ASM_F16_INT8 = tl.constexpr(_pair_asm(0x00FF00FF, 0x64006400, 0x3C003C00, "f16x2"))
_PAIR_SUB_BF16_INT4 = tl.constexpr(_pair_sub_asm(0x000F000F, 0x43004300, 0x3F803F80, "bf16x2"))
_PAIR_SUB_F16_INT4 = tl.constexpr(_pair_sub_asm(0x000F000F, 0x64006400, 0x3C003C00, "f16x2"))
_PAIR_SUB_F16_INT8 = tl.constexpr(_pair_sub_asm(0x00FF00FF, 0x64006400, 0x3C003C00, "f16x2"))


@triton.jit
def _half_params(s_ptr, z_ptr, k_start, group_size, num_groups, N, offs_n, n_mask,
                 HAS_ZERO: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr, NEED_SCALE: tl.constexpr):
    """The DTYPE bit patterns of -(MAGIC + z) and of s for the group holding k_start, each in the low 16
    bits of an int32. MAGIC = 128 (bfloat16) or 1024 (float16), the value the magic OR of
    `_pair_convert` adds to a code. Integer arithmetic only, on purpose: -(MAGIC + z) is the bit pattern
    of -MAGIC plus z (z < 2^7 / 2^10 only fills the mantissa), and the scales, DTYPE values already (the
    launcher checks scales.dtype == x.dtype), are loaded as their int16 bits. Float conversions or
    bitcasts here stop Triton from giving the whole chain the MMA operand's register layout (measured
    offline for sm90: the weights then take a round trip through shared memory). NEED_SCALE False (scale
    applied after the dot): s is 0 and no scale is loaded."""
    g = tl.minimum(k_start // group_size, num_groups - 1)
    if NEED_SCALE:
        s = tl.load(s_ptr.to(tl.pointer_type(tl.int16)) + g * N + offs_n, mask=n_mask, other=0).to(tl.int32)
    else:
        s = tl.zeros(offs_n.shape, tl.int32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0)
    else:
        z = tl.full(s.shape, 2 ** (BITS - 1), tl.int32)
    if DTYPE == tl.bfloat16:
        nz = 0xC300 + z  # bfloat16 -128.0
    else:
        nz = 0xE400 + z  # float16 -1024.0
    return nz, s


@triton.jit
def _pair_params(s_ptr, z_ptr, k_lo, k_hi, group_size, num_groups, N, offs_n, n_mask,
                 HAS_ZERO: tl.constexpr, BITS: tl.constexpr, SAME_GROUP: tl.constexpr, DTYPE: tl.constexpr,
                 NEED_SCALE: tl.constexpr):
    """Packed 16-bit pairs for `_pair_convert`: nz = (-(MAGIC + z_lo), -(MAGIC + z_hi)) and ss = (s_lo, s_hi),
    low half for the field at k_lo, high half for the one at k_hi (different groups when a group is
    shorter than a chunk; SAME_GROUP: the launcher knows they share one and the second load is skipped)."""
    nz_lo, s_lo = _half_params(s_ptr, z_ptr, k_lo, group_size, num_groups, N, offs_n, n_mask, HAS_ZERO, BITS, DTYPE,
                               NEED_SCALE)
    if SAME_GROUP:
        nz_hi = nz_lo
        s_hi = s_lo
    else:
        nz_hi, s_hi = _half_params(s_ptr, z_ptr, k_hi, group_size, num_groups, N, offs_n, n_mask, HAS_ZERO, BITS,
                                   DTYPE, NEED_SCALE)
    return (nz_lo & 0xFFFF) | (nz_hi << 16), (s_lo & 0xFFFF) | (s_hi << 16)


@triton.jit
def _lane(bits, DTYPE: tl.constexpr):
    """The low 16 bits of an int32 read as a DTYPE value, widened (exactly) to float32."""
    return (bits & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)


@triton.jit
def _magic_pair(v, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """(v & MASK) | (MAGIC, MAGIC): the DTYPE pair (MAGIC + u_lo, MAGIC + u_hi) of the packed conversions
    (the interpreter twins compute with it; the PTX does the same in its LOP3)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if DTYPE == tl.bfloat16:
        return (v & (MASK | (MASK << 16))) | 0x43004300
    else:
        return (v & (MASK | (MASK << 16))) | 0x64006400


@triton.jit
def _pair_convert(v, nz, ss, BITS: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
                  SCALED: tl.constexpr):
    """w_hat of the two fields at bits 0..BITS-1 (lo) and 16..16+BITS-1 (hi) of v, in DTYPE, with
    packed 16-bit arithmetic ("packed" conversion): t = (v & MASK) | (MAGIC, MAGIC) is the DTYPE pair
    (MAGIC + u_lo, MAGIC + u_hi), exact (u < 2^7 below MAGIC = 128 for bfloat16, u < 2^10 below 1024 for
    float16); t + nz = (u - z) exactly (small integers); then one rounding of (u - z) * s, which is the
    reference's round(DTYPE, float32(u - z) * s) because s is a DTYPE value, so that float32 product of
    a <= 9-bit integer and an 8- / 11-bit significand is exact. Three instructions (LOP3, HFMA2, HFMA2)
    per two weights. The interpreter cannot run PTX: there the twin does the same arithmetic on the same
    packed operands in float32 (exact up to the one rounding), so the CPU tests check the pair and group
    bookkeeping bit for bit and the GPU tests the PTX. SCALED False (kernels that scale after the dot; ss
    unused): the first two steps alone, the exact u - z pair (LOP3 + one HFMA2 per two weights)."""
    if INTERPRET:
        t = _magic_pair(v, BITS, DTYPE)
        lo = _lane(t, DTYPE) + _lane(nz, DTYPE)
        hi = _lane(t >> 16, DTYPE) + _lane(nz >> 16, DTYPE)
        if SCALED:
            lo = lo * _lane(ss, DTYPE)
            hi = hi * _lane(ss >> 16, DTYPE)
        lo = cast_to(lo, DTYPE, INTERPRET)
        hi = cast_to(hi, DTYPE, INTERPRET)
    elif SCALED:
        if DTYPE == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(_PAIR_ASM_BF16_INT4, "=h,=h,r,r,r", [v, nz, ss],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        elif BITS == 4:
            lo, hi = tl.inline_asm_elementwise(_PAIR_ASM_F16_INT4, "=h,=h,r,r,r", [v, nz, ss],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_PAIR_ASM_F16_INT8, "=h,=h,r,r,r", [v, nz, ss],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        if DTYPE == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(_PAIR_SUB_BF16_INT4, "=h,=h,r,r", [v, nz],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        elif BITS == 4:
            lo, hi = tl.inline_asm_elementwise(_PAIR_SUB_F16_INT4, "=h,=h,r,r", [v, nz],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_PAIR_SUB_F16_INT8, "=h,=h,r,r", [v, nz],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _packed_params(s_ptr, z_ptr, k_base, P: tl.constexpr, cc, c_end, group_size, num_groups, N, offs_n, n_mask,
                   HAS_ZERO: tl.constexpr, BITS: tl.constexpr, SAME_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                   CHUNKS: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr, NEED_SCALE: tl.constexpr):
    """`_pair_params` of fields P and P + HALF of each of the iteration's chunks, [BLOCK_N, CHUNKS, 1].
    Loaded as [BLOCK_N, CHUNKS] and expanded, not as [BLOCK_N, CHUNKS, 1] like the words: then Triton
    gives the whole conversion the MMA operand's register layout (sm90 compile: otherwise the weights
    take a round trip through shared memory). Chunks past the split's end get scale 0."""
    ci2 = tl.arange(0, CHUNKS)[None, :]
    if CHUNKS == 1:
        valid2 = n_mask[:, None]
    else:
        valid2 = n_mask[:, None] & (cc + ci2 < c_end)
    k_lo = k_base + ci2 * CHUNK + 16 * P
    nz, ss = _pair_params(s_ptr, z_ptr, k_lo, k_lo + 16 * HALF, group_size, num_groups, N, offs_n[:, None], valid2,
                          HAS_ZERO, BITS, SAME_GROUP, DTYPE, NEED_SCALE)
    return nz[:, :, None], ss[:, :, None]


@triton.jit
def _field_dot(acc, w, x_cols, k, k_end, m_mask, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
               INTERPRET: tl.constexpr):
    """acc + w [BLOCK_N, CHUNKS, 16] (one field of each chunk) @ x^T at the k offsets of its dot rows."""
    xt = tl.load(x_cols + k[:, None], mask=(k[:, None] < k_end) & m_mask[None, :], other=0.0)
    w = tl.reshape(w, [BLOCK_N, 16 * CHUNKS])
    if INTERPRET:
        # The interpreter's dot mishandles bfloat16 operands; float32 of the same values is exact.
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        return acc + tl.dot(w, xt)


@triton.jit
def _cat2(a, b):
    """[R, C] and [R, C] -> [R, 2C], a's columns first (join, then the new axis moved ahead of the columns)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [a.shape[0], 2 * a.shape[1]])


@triton.jit
def _chunk_operand(w0, w1, w2, w3, w4, w5, w6, w7, FIELDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fields' [BLOCK_N, 1, 16] operands side by side, [BLOCK_N, 16 * FIELDS]: column 16 * i + j is field i
    of word j, i.e. k = 16 * i + j of the chunk (the interleave), so one dot takes the whole chunk against x's
    CHUNK consecutive columns. FIELDS 4 (int8) ignores w4..w7."""
    a = _cat2(tl.reshape(w0, [BLOCK_N, 16]), tl.reshape(w1, [BLOCK_N, 16]))
    b = _cat2(tl.reshape(w2, [BLOCK_N, 16]), tl.reshape(w3, [BLOCK_N, 16]))
    if FIELDS == 8:
        c = _cat2(tl.reshape(w4, [BLOCK_N, 16]), tl.reshape(w5, [BLOCK_N, 16]))
        d = _cat2(tl.reshape(w6, [BLOCK_N, 16]), tl.reshape(w7, [BLOCK_N, 16]))
        return _cat2(_cat2(a, b), _cat2(c, d))
    else:
        return _cat2(a, b)


@triton.jit
def _wide_field(words, words_hi, field_mask, I: tl.constexpr, GROUP_FIELDS: tl.constexpr, s, zm, s_ptr, z_ptr, k_base,
                ci, group_size, num_groups, N, n3, valid, HAS_ZERO: tl.constexpr, BITS: tl.constexpr,
                CONVERT: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Field I's w_hat [BLOCK_N, 1, 16] (one chunk per iteration), with the group parameters reloaded where a
    group starts at this field; returns them for the next field."""
    CHUNK: tl.constexpr = 16 * (32 // BITS)
    if I % GROUP_FIELDS == 0:
        s, zm = _group_params(s_ptr, z_ptr, k_base + ci * CHUNK + 16 * I, group_size, num_groups, N, n3, valid,
                              HAS_ZERO, BITS, True)
    return _dequant_field(words, words_hi, field_mask, I, BITS, s, zm, CONVERT, DTYPE, INTERPRET, True), s, zm


@triton.jit
def _wide_fields(words, words_hi, field_mask, FIRST: tl.constexpr, GROUP_FIELDS: tl.constexpr, s, zm, s_ptr, z_ptr,
                 k_base, ci, group_size, num_groups, N, n3, valid, HAS_ZERO: tl.constexpr, BITS: tl.constexpr,
                 CONVERT: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """`_wide_field` for fields FIRST .. FIRST + 3, in order (the group parameters carried from one to the next)."""
    a, s, zm = _wide_field(words, words_hi, field_mask, FIRST, GROUP_FIELDS, s, zm, s_ptr, z_ptr, k_base, ci,
                           group_size, num_groups, N, n3, valid, HAS_ZERO, BITS, CONVERT, DTYPE, INTERPRET)
    b, s, zm = _wide_field(words, words_hi, field_mask, FIRST + 1, GROUP_FIELDS, s, zm, s_ptr, z_ptr, k_base, ci,
                           group_size, num_groups, N, n3, valid, HAS_ZERO, BITS, CONVERT, DTYPE, INTERPRET)
    c, s, zm = _wide_field(words, words_hi, field_mask, FIRST + 2, GROUP_FIELDS, s, zm, s_ptr, z_ptr, k_base, ci,
                           group_size, num_groups, N, n3, valid, HAS_ZERO, BITS, CONVERT, DTYPE, INTERPRET)
    d, s, zm = _wide_field(words, words_hi, field_mask, FIRST + 3, GROUP_FIELDS, s, zm, s_ptr, z_ptr, k_base, ci,
                           group_size, num_groups, N, n3, valid, HAS_ZERO, BITS, CONVERT, DTYPE, INTERPRET)
    return a, b, c, d, s, zm


@triton.jit
def _wide_dot(acc, w, x_cols, k, k_end, m_mask, INTERPRET: tl.constexpr):
    """acc + w [BLOCK_N, CHUNK] @ x^T at k: the WIDE kernel's one product per chunk (see `_field_dot`)."""
    xt = tl.load(x_cols + k[:, None], mask=(k[:, None] < k_end) & m_mask[None, :], other=0.0)
    if INTERPRET:
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(w, xt, acc)


@triton.jit
def _group_scale(s_ptr, k, group_size, num_groups, N, offs_n, n_mask):
    """The float32 scales [BLOCK_N, 1] of the group holding k (scale-after kernels)."""
    g = tl.minimum(k // group_size, num_groups - 1)
    return tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _accumulate_field(acc, acc_g, w, I: tl.constexpr, GROUP_FIELDS: tl.constexpr, SCALE: tl.constexpr,
                      x_cols, k_base, r_k, k_end, m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask,
                      BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, INTERPRET: tl.constexpr):
    """Field I's dot operand w [BLOCK_N, CHUNKS, 16] times x into the accumulators. SCALE 0: w is w_hat,
    acc += w @ x^T. Scale after the dot (w the exact u - z, CHUNKS 1): SCALE 1, the group's partial sum
    acc_g, restarted at the group's first field, is scaled into acc after its last; SCALE 2, one group for
    all of K: acc stays unscaled, the caller scales once at the end."""
    k = k_base + 16 * I + r_k
    if SCALE == 1:
        if I % GROUP_FIELDS == 0:
            acc_g = _field_dot(tl.zeros_like(acc_g), w, x_cols, k, k_end, m_mask, BLOCK_N, CHUNKS, INTERPRET)
        else:
            acc_g = _field_dot(acc_g, w, x_cols, k, k_end, m_mask, BLOCK_N, CHUNKS, INTERPRET)
        if I % GROUP_FIELDS == GROUP_FIELDS - 1:
            acc += acc_g * _group_scale(s_ptr, k_base + 16 * I, group_size, num_groups, N, offs_n, n_mask)
    else:
        acc = _field_dot(acc, w, x_cols, k, k_end, m_mask, BLOCK_N, CHUNKS, INTERPRET)
    return acc, acc_g


@triton.jit
def _split_words(w_ptr, N, K, chunks_per_split, stride_wn,
                 BITS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """This program's output columns, the pointers of its [BLOCK_N, CHUNKS, 16] word tile, and its split's
    chunk range [c_begin, c_end) with the K limit past which x is masked to 0."""
    CHUNK: tl.constexpr = 16 * (32 // BITS)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ci = tl.arange(0, CHUNKS)[None, :, None]  # chunk within the iteration
    j3 = tl.arange(0, 16)[None, None, :]
    n3 = offs_n[:, None, None]
    w_tile = w_ptr + n3.to(tl.int64) * stride_wn + ci * 16 + j3
    c_begin = tl.program_id(1) * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(K, CHUNK))
    if CHUNKS == 1:
        k_end = K
    else:
        k_end = tl.minimum(K, c_end * CHUNK)
    return offs_n, n_mask, ci, j3, n3, w_tile, c_begin, c_end, k_end


@triton.jit
def _load_words(w_tile, cc, ci, n3_mask, c_end, CHUNKS: tl.constexpr, CONVERT: tl.constexpr):
    """Words of the chunks cc .. cc + CHUNKS - 1 (0 past the split's end), their validity, and for the
    in-place conversion the words shifted right by 12 (`_field_minus_zero`)."""
    if CHUNKS == 1:
        valid = n3_mask
    else:
        valid = n3_mask & (cc + ci < c_end)
    words = tl.load(w_tile + cc * 16, mask=valid, other=0)
    if CONVERT == 1:
        words_hi = words >> 12
    else:
        words_hi = words
    return valid, words, words_hi


@triton.jit
def _wo_mm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, num_groups, group_size, chunks_per_split, field_mask, splits,
    stride_xm, stride_wn, stride_om,
    BITS: tl.constexpr, GROUP_FIELDS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr, CONVERT: tl.constexpr, SCALE: tl.constexpr, WIDE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[m, n] = sum_k x[m, k] * w_hat[n, k] (+ bias[n]), fp32 accumulation, computed as out^T tiles.

    WIDE (SCALE 0, CHUNKS 1): the chunk's fields are converted first and laid side by side in k order
    (`_chunk_operand`), so the chunk is one [BLOCK_N, CHUNK] x [CHUNK, BLOCK_M] product instead of one 16-deep
    product per field. On Hopper a 16-deep product whose left operand comes from registers is a wgmma group the
    kernel waits for before converting the next field (offline sm90 PTX: 8 `wgmma.wait_group 0` per int4
    chunk); the whole chunk is 8 k-steps in flight, one wait. The same products, accumulated in the same field order.

    SCALE 0 ("before"): each weight is rounded to w_hat in x's dtype before its product, as the reference.
    SCALE 1 / 2 ("after", CHUNKS 1 only): the dot takes the exact integers u - z (exact in x's dtype) and
    each group's float32 partial sum is multiplied by its scale (1), or, with one group for all of K
    (per channel), the whole sum once at the end (2): sum_g s_g * sum_{k in g} x_k (u_k - z_g), the
    product with the unrounded dequantized weight, which differs from x @ w_hat.T by at most one rounding
    of each weight (u |x| @ |w_hat|.T) and drops the per-weight scale multiply and its rounding.

    Grid (n blocks, K splits, m blocks). SPLIT: write float32 partials [splits, M, N]; with FUSED_REDUCE
    the program of each output tile that finishes last (an acq_rel counter per tile in count_ptr, reset by
    that program for the next launch) sums the tile's partials in split order (+ bias) and stores it,
    instead of a second kernel (whose launch cost 5-6 us at decode on the H100, Nsight Compute).
    Each K-loop iteration loads CHUNKS consecutive chunks of words, a [BLOCK_N, CHUNKS, 16] tile (16 *
    CHUNKS contiguous words, 64 * CHUNKS bytes, per row), and for each field makes one tensor-core
    product [BLOCK_N, 16 * CHUNKS] x [16 * CHUNKS, BLOCK_M]: dot row 16 * c + j is k = (chunk + c) *
    CHUNK + 16 * field + j. A split's chunk count need not be a multiple of CHUNKS: chunks at or past
    the split's end load words 0 and scale 0 (so w_hat = 0 there, never NaN) and x is masked to 0 from
    min(K, split end) on, so nothing is counted twice and the K padding of the last chunk contributes 0.
    BLOCK_N / BLOCK_M: any powers of two >= 16 (tl.dot); on Hopper BLOCK_N < 64 gives mma.sync (MMAv2)
    instead of wgmma."""
    FIELDS: tl.constexpr = 32 // BITS
    CHUNK: tl.constexpr = 16 * FIELDS
    HALF: tl.constexpr = FIELDS // 2
    grid_dependency_sync(PDL)  # PDL: launched early (configs.decode_pdl); nothing is read before the wait
    pid_s = tl.program_id(1)
    offs_n, n_mask, ci, j3, n3, w_tile, c_begin, c_end, k_end = _split_words(
        w_ptr, N, K, chunks_per_split, stride_wn, BITS, BLOCK_N, CHUNKS)
    nm3 = n_mask[:, None, None]
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    r = tl.arange(0, 16 * CHUNKS)  # dot row -> k offset from the iteration's first chunk (minus 16 * field)
    if CHUNKS == 1:
        r_k = r
    else:
        r_k = (r // 16) * CHUNK + r % 16
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    x_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # the current group's unscaled sum (SCALE 1)
    if SCALE != 0:
        tl.static_assert(CHUNKS == 1, "scale after the dot: one chunk per iteration (one group per field)")
    if WIDE:
        tl.static_assert(SCALE == 0 and CHUNKS == 1, "one product per chunk: w_hat before the dot, one chunk")
    for cc in range(c_begin, c_end, CHUNKS):
        valid, words, words_hi = _load_words(w_tile, cc, ci, nm3, c_end, CHUNKS, CONVERT)
        k_base = cc * CHUNK
        if WIDE:
            if CONVERT == 2:
                nz, ss = _packed_params(s_ptr, z_ptr, k_base, 0, cc, c_end, group_size, num_groups, N, offs_n,
                                        n_mask, HAS_ZERO, BITS, GROUP_FIELDS == FIELDS, CHUNK, CHUNKS, HALF, x_dtype,
                                        True)
                w0, w_h0 = _pair_convert(words, nz, ss, BITS, x_dtype, INTERPRET, True)
                w1, w_h1 = _pair_convert(words >> BITS, nz, ss, BITS, x_dtype, INTERPRET, True)
                if HALF == 4:
                    if GROUP_FIELDS == 2:
                        nz, ss = _packed_params(s_ptr, z_ptr, k_base, 2, cc, c_end, group_size, num_groups, N,
                                                offs_n, n_mask, HAS_ZERO, BITS, False, CHUNK, CHUNKS, HALF, x_dtype,
                                                True)
                    w2, w_h2 = _pair_convert(words >> (2 * BITS), nz, ss, BITS, x_dtype, INTERPRET, True)
                    w3, w_h3 = _pair_convert(words >> (3 * BITS), nz, ss, BITS, x_dtype, INTERPRET, True)
                    w = _chunk_operand(w0, w1, w2, w3, w_h0, w_h1, w_h2, w_h3, FIELDS, BLOCK_N)
                else:
                    w = _chunk_operand(w0, w1, w_h0, w_h1, w0, w0, w0, w0, FIELDS, BLOCK_N)
            else:
                s = tl.zeros([BLOCK_N, 1, 1], tl.float32)
                w0, w1, w2, w3, s, zm = _wide_fields(words, words_hi, field_mask, 0, GROUP_FIELDS, s, s, s_ptr, z_ptr,
                                                     k_base, ci, group_size, num_groups, N, n3, valid, HAS_ZERO, BITS,
                                                     CONVERT, x_dtype, INTERPRET)
                if FIELDS == 8:
                    w4, w5, w6, w7, s, zm = _wide_fields(words, words_hi, field_mask, 4, GROUP_FIELDS, s, zm, s_ptr,
                                                         z_ptr, k_base, ci, group_size, num_groups, N, n3, valid,
                                                         HAS_ZERO, BITS, CONVERT, x_dtype, INTERPRET)
                    w = _chunk_operand(w0, w1, w2, w3, w4, w5, w6, w7, FIELDS, BLOCK_N)
                else:
                    w = _chunk_operand(w0, w1, w2, w3, w0, w0, w0, w0, FIELDS, BLOCK_N)
            acc = _wide_dot(acc, w, x_cols, k_base + tl.arange(0, CHUNK), k_end, m_mask, INTERPRET)
        elif CONVERT == 2:
            # Fields p and p + HALF sit at bits BITS*p and 16 + BITS*p: one shift and one packed conversion
            # per pair. The products go in field order (the low fields' now, the high fields' after them),
            # the accumulation order of the one-field conversions: the same output bit for bit.
            tl.static_assert(GROUP_FIELDS >= 2, "packed conversion: a group spans at least two fields")
            nz, ss = _packed_params(s_ptr, z_ptr, k_base, 0, cc, c_end, group_size, num_groups, N, offs_n, n_mask,
                                    HAS_ZERO, BITS, GROUP_FIELDS == FIELDS, CHUNK, CHUNKS, HALF, x_dtype, SCALE == 0)
            w0, w_h0 = _pair_convert(words, nz, ss, BITS, x_dtype, INTERPRET, SCALE == 0)
            acc, acc_g = _accumulate_field(acc, acc_g, w0, 0, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end, m_mask,
                                           s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N, CHUNKS, INTERPRET)
            w1, w_h1 = _pair_convert(words >> BITS, nz, ss, BITS, x_dtype, INTERPRET, SCALE == 0)
            acc, acc_g = _accumulate_field(acc, acc_g, w1, 1, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end, m_mask,
                                           s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N, CHUNKS, INTERPRET)
            if HALF == 4:
                if GROUP_FIELDS == 2:  # fields 2 and 6 start the next groups
                    nz, ss = _packed_params(s_ptr, z_ptr, k_base, 2, cc, c_end, group_size, num_groups, N, offs_n,
                                            n_mask, HAS_ZERO, BITS, False, CHUNK, CHUNKS, HALF, x_dtype, SCALE == 0)
                w2, w_h2 = _pair_convert(words >> (2 * BITS), nz, ss, BITS, x_dtype, INTERPRET, SCALE == 0)
                acc, acc_g = _accumulate_field(acc, acc_g, w2, 2, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                               m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N,
                                               CHUNKS, INTERPRET)
                w3, w_h3 = _pair_convert(words >> (3 * BITS), nz, ss, BITS, x_dtype, INTERPRET, SCALE == 0)
                acc, acc_g = _accumulate_field(acc, acc_g, w3, 3, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                               m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N,
                                               CHUNKS, INTERPRET)
            acc, acc_g = _accumulate_field(acc, acc_g, w_h0, HALF, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                           m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N, CHUNKS,
                                           INTERPRET)
            acc, acc_g = _accumulate_field(acc, acc_g, w_h1, HALF + 1, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                           m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N, CHUNKS,
                                           INTERPRET)
            if HALF == 4:
                acc, acc_g = _accumulate_field(acc, acc_g, w_h2, 6, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                               m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N,
                                               CHUNKS, INTERPRET)
                acc, acc_g = _accumulate_field(acc, acc_g, w_h3, 7, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                               m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N,
                                               CHUNKS, INTERPRET)
        else:
            for i in tl.static_range(FIELDS):
                if i % GROUP_FIELDS == 0:
                    # group of each chunk's field i (a group may end inside a chunk: GROUP_FIELDS < FIELDS)
                    s, zm = _group_params(s_ptr, z_ptr, k_base + ci * CHUNK + 16 * i, group_size, num_groups, N,
                                          n3, valid, HAS_ZERO, BITS, SCALE == 0)
                w = _dequant_field(words, words_hi, field_mask, i, BITS, s, zm, CONVERT, x_dtype, INTERPRET, SCALE == 0)
                acc, acc_g = _accumulate_field(acc, acc_g, w, i, GROUP_FIELDS, SCALE, x_cols, k_base, r_k, k_end,
                                               m_mask, s_ptr, group_size, num_groups, N, offs_n, n_mask, BLOCK_N,
                                               CHUNKS, INTERPRET)

    if SCALE == 2:
        acc = acc * _group_scale(s_ptr, 0, group_size, num_groups, N, offs_n, n_mask)
    # int64 row offsets: M * N can pass 2^31 (e.g. a large-vocabulary head at prefill on the fused path)
    rows64 = offs_m.to(tl.int64)[None, :]
    out_offs = rows64 * stride_om + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        part_tile = rows64 * N + offs_n[:, None]
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + part_tile, acc, mask=out_mask)
        if FUSED_REDUCE:
            _last_split_reduces(part_ptr, bias_ptr, out_ptr, count_ptr, splits, M, N, offs_n, n_mask, offs_m, m_mask,
                                stride_om, HAS_BIAS, INTERPRET)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_offs, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=out_mask)


@triton.jit
def _last_split_reduces(part_ptr, bias_ptr, out_ptr, count_ptr, splits, M, N, offs_n, n_mask, offs_m, m_mask,
                        stride_om, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """Fused split-K reduction, after this program stored its partial of the output tile (offs_n x offs_m):
    the program of the tile that finishes last (an acq_rel counter per tile in count_ptr, reset by that
    program for the next launch) sums the tile's partials in split order (+ bias) and stores the output."""
    tile_id = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    # barrier, then release: every thread's share of this partial is visible before the count moves
    # (fences are cumulative); acquire: the last program sees every other partial (read past L1, which is
    # not coherent across SMs)
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if done == splits - 1:
        rows64 = offs_m.to(tl.int64)[None, :]
        part_tile = rows64 * N + offs_n[:, None]
        out_mask = n_mask[:, None] & m_mask[None, :]
        total = tl.zeros(part_tile.shape, dtype=tl.float32)
        for sidx in range(0, splits):
            total += tl.load(part_ptr + sidx * M * N + part_tile, mask=out_mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows64 * stride_om + offs_n[:, None], cast_to(total, out_ptr.dtype.element_ty, INTERPRET),
                 mask=out_mask)
        tl.atomic_xchg(count_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_row(acc, w, x_row, k, row: tl.constexpr, M, m0, k_end, stride_xm, FIRST: tl.constexpr):
    """acc + w * x[m0 + row, k] (float32), or with FIRST (a group's first term) the product alone, not a
    zeroed tile plus one; x is masked to 0 from k_end on, and everywhere for a row past M - 1 (its limit
    drops to 0)."""
    k_lim = tl.where(m0 + row < M, k_end, 0)
    xw = w * tl.load(x_row + row * stride_xm + k, mask=k < k_lim, other=0.0).to(tl.float32)
    if FIRST:
        return xw
    else:
        return acc + xw


@triton.jit
def _gemv_rows(a0, a1, a2, a3, w, x_row, k, M, m0, k_end, stride_xm, BLOCK_M: tl.constexpr, FIRST: tl.constexpr):
    """`_gemv_row` for each of the program's rows (BLOCK_M <= 4; the tiles of absent rows are returned as is)."""
    a0 = _gemv_row(a0, w, x_row, k, 0, M, m0, k_end, stride_xm, FIRST)
    if BLOCK_M > 1:
        a1 = _gemv_row(a1, w, x_row, k, 1, M, m0, k_end, stride_xm, FIRST)
    if BLOCK_M > 2:
        a2 = _gemv_row(a2, w, x_row, k, 2, M, m0, k_end, stride_xm, FIRST)
    if BLOCK_M > 3:
        a3 = _gemv_row(a3, w, x_row, k, 3, M, m0, k_end, stride_xm, FIRST)
    return a0, a1, a2, a3


@triton.jit
def _gemv_store(acc, row: tl.constexpr, m0, M, N, offs_n, n_mask, pid_s, bias_ptr, out_ptr, part_ptr, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    m = (m0 + row).to(tl.int64)
    ok = offs_n < tl.where(m0 + row < M, N, 0)  # (a scalar-and-tensor mask trips the interpreter)
    if SPLIT:
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + m * N + offs_n, y, mask=ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, cast_to(y, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


@triton.jit
def _wo_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, num_groups, group_size, chunks_per_split, field_mask, splits,
    stride_xm, stride_wn, stride_om, group_shift,
    BITS: tl.constexpr, GROUP_FIELDS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_M_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, CONVERT: tl.constexpr, SCALE: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """The same product without tensor cores, for very small M (BLOCK_M <= 4 rows per program).

    SCALE 0: per field the [BLOCK_N, CHUNKS, 16] w_hat tile (the same exact conversion and rounding to x's
    dtype, then widened to float32) is multiplied by each row's x values broadcast along n and accumulated
    elementwise into one float32 tile per row; each tile is reduced (tl.sum) once, after the K loop.
    SCALE 1 / 2 (scale after, see `_wo_mm_kernel`): the tile holds the exact float32 u - z (no rounding, no
    scale multiply per weight: LOP3 + FADD + one FFMA per row); 1: a second elementwise tile per row sums
    each group and is scaled into the first at the group's last field (every chunk of the iteration with
    its own group's scales); 2: the one group's scale multiplies the tile once after the K loop.
    Grid, split-K partials (and the fused reduction, over BLOCK_M_P2 = the power of two >= BLOCK_M rows,
    masked) and the K / split-end masking are those of `_wo_mm_kernel`."""
    tl.static_assert(BLOCK_M >= 1 and BLOCK_M <= 4, "gemv kernel: BLOCK_M must be 1..4")
    FIELDS: tl.constexpr = 32 // BITS
    CHUNK: tl.constexpr = 16 * FIELDS
    grid_dependency_sync(PDL)  # PDL: launched early (configs.decode_pdl); nothing is read before the wait
    pid_s = tl.program_id(1)
    offs_n, n_mask, ci, j3, n3, w_tile, c_begin, c_end, k_end = _split_words(
        w_ptr, N, K, chunks_per_split, stride_wn, BITS, BLOCK_N, CHUNKS)
    nm3 = n_mask[:, None, None]
    m0 = tl.program_id(2) * BLOCK_M
    k3 = ci * CHUNK + j3  # [1, CHUNKS, 16]: k offset of field 0 of each word from the iteration's start
    x_row = x_ptr + m0.to(tl.int64) * stride_xm
    x_dtype = x_ptr.dtype.element_ty

    acc0 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    # the current group's sums (SCALE 1)
    grp0 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    grp1 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    grp2 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    grp3 = tl.zeros([BLOCK_N, CHUNKS, 16], dtype=tl.float32)
    for cc in range(c_begin, c_end, CHUNKS):
        valid, words, words_hi = _load_words(w_tile, cc, ci, nm3, c_end, CHUNKS, CONVERT)
        k_base = cc * CHUNK
        for i in tl.static_range(FIELDS):
            k_field = k_base + ci * CHUNK + 16 * i  # [1, CHUNKS, 1]
            k = k_base + 16 * i + k3
            if SCALE == 0:
                if i % GROUP_FIELDS == 0:
                    s, zm = _group_params(s_ptr, z_ptr, k_field, group_size, num_groups, N, n3, valid, HAS_ZERO, BITS,
                                          True)
                w = _dequant_field(words, words_hi, field_mask, i, BITS, s, zm, CONVERT, x_dtype, INTERPRET, True)
                acc0, acc1, acc2, acc3 = _gemv_rows(acc0, acc1, acc2, acc3, w.to(tl.float32), x_row, k, M, m0, k_end,
                                                    stride_xm, BLOCK_M, False)
            else:
                if i % GROUP_FIELDS == 0:
                    _, zm = _group_params(s_ptr, z_ptr, k_field, group_size, num_groups, N, n3, valid, HAS_ZERO, BITS,
                                          False)
                w = _field_exact(words, words_hi, field_mask, i, BITS, zm, CONVERT)
                if SCALE == 2:
                    acc0, acc1, acc2, acc3 = _gemv_rows(acc0, acc1, acc2, acc3, w, x_row, k, M, m0, k_end, stride_xm,
                                                        BLOCK_M, False)
                else:
                    grp0, grp1, grp2, grp3 = _gemv_rows(grp0, grp1, grp2, grp3, w, x_row, k, M, m0, k_end, stride_xm,
                                                        BLOCK_M, i % GROUP_FIELDS == 0)
                    if i % GROUP_FIELDS == GROUP_FIELDS - 1:
                        # groups are powers of two here (32 .. 256): a shift, not an integer division
                        g = tl.minimum(k_field >> group_shift, num_groups - 1)
                        s = tl.load(s_ptr + g * N + n3, mask=valid, other=0.0).to(tl.float32)
                        acc0 += grp0 * s
                        if BLOCK_M > 1:
                            acc1 += grp1 * s
                        if BLOCK_M > 2:
                            acc2 += grp2 * s
                        if BLOCK_M > 3:
                            acc3 += grp3 * s
    if SCALE == 2:
        s = tl.load(s_ptr + n3, mask=nm3, other=0.0).to(tl.float32)
        acc0 = acc0 * s
        acc1 = acc1 * s
        acc2 = acc2 * s
        acc3 = acc3 * s

    _gemv_store(acc0, 0, m0, M, N, offs_n, n_mask, pid_s, bias_ptr, out_ptr, part_ptr, stride_om,
                HAS_BIAS, SPLIT, INTERPRET)
    if BLOCK_M > 1:
        _gemv_store(acc1, 1, m0, M, N, offs_n, n_mask, pid_s, bias_ptr, out_ptr, part_ptr, stride_om,
                    HAS_BIAS, SPLIT, INTERPRET)
    if BLOCK_M > 2:
        _gemv_store(acc2, 2, m0, M, N, offs_n, n_mask, pid_s, bias_ptr, out_ptr, part_ptr, stride_om,
                    HAS_BIAS, SPLIT, INTERPRET)
    if BLOCK_M > 3:
        _gemv_store(acc3, 3, m0, M, N, offs_n, n_mask, pid_s, bias_ptr, out_ptr, part_ptr, stride_om,
                    HAS_BIAS, SPLIT, INTERPRET)
    if SPLIT and FUSED_REDUCE:
        r = tl.arange(0, BLOCK_M_P2)
        _last_split_reduces(part_ptr, bias_ptr, out_ptr, count_ptr, splits, M, N, offs_n, n_mask, m0 + r,
                            (r < BLOCK_M) & (m0 + r < M), stride_om, HAS_BIAS, INTERPRET)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, splits, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out = sum over splits of the float32 partials (+ bias), one rounding to the output dtype. PDL: launched
    early behind the split-K kernel; waits for its partials before the first load."""
    grid_dependency_sync(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sidx in range(0, splits):
        acc += tl.load(part_ptr + sidx * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    m = offs // N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def splitk_reduce(part: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, pdl: bool = False) -> None:
    """out [M, N] = the sum of the float32 split-K partials part [splits, M, N] (+ bias), rounded once: the
    second kernel of the split-K products that have no counter slot for the fused reduction. pdl: launched
    early behind a producer that signals its dependents (`configs.split_k_reduce_pdl`)."""
    splits, m, n = part.shape
    block = 1024
    launch_kernel(_splitk_reduce_kernel, (cdiv(m * n, block),),
        part, bias if bias is not None else part, out, m, n, splits, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, INTERPRET=INTERPRET, num_warps=4,
        **pdl_launch_options(pdl),
    )


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K, num_groups, group_size, stride_wn, stride_on,
    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """w_hat[n, k] = round(dtype, (u[n, k] - z[g, n]) * s[g, n]) for one chunk of K per program.

    A chunk's words hold field f of word j at k = 16 f + j, so the [BLOCK_N, fields, 16] tensor of fields is the
    chunk's row segment in k order: one contiguous store of the segment per row (a store per field wrote 32-byte
    pieces of every row: 2.26-2.37 TB/s against 2.44-2.54 on the H100, tune_weight_only_dequant.json)."""
    FIELDS: tl.constexpr = 32 // BITS
    CHUNK: tl.constexpr = 16 * FIELDS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    c = tl.program_id(1)
    field = tl.arange(0, FIELDS)
    field_k = c * CHUNK + 16 * field
    words = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + c * 16 + tl.arange(0, 16)[None, :],
                    mask=n_mask[:, None], other=0)
    g = tl.minimum(field_k // group_size, num_groups - 1)
    sz_offs = g[None, :] * N + offs_n[:, None]
    sz_mask = n_mask[:, None] & (field_k < K)[None, :]
    s = tl.load(s_ptr + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + sz_offs, mask=sz_mask, other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 2 ** (BITS - 1), tl.float32)
    code = (words[:, None, :] >> (field * BITS)[None, :, None]) & ((1 << BITS) - 1)
    # (u | 0x4B000000) is the float 2^23 + u: one subtraction leaves the exact u - z (`_codes_minus_zero`)
    d = (code | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)[:, :, None]
    w = tl.reshape(d * s[:, :, None], (BLOCK_N, CHUNK))
    k = c * CHUNK + tl.arange(0, CHUNK)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + k[None, :],
             cast_to(w, out_ptr.dtype.element_ty, INTERPRET), mask=n_mask[:, None] & (k[None, :] < K))


def _group_fields(group_size: int, k: int, bits: int) -> int:
    """How many consecutive 16-code fields share one group: scales are reloaded every that many."""
    fields = codes_per_word(bits)
    if group_size == -1 or group_size >= k:
        return fields
    return max(1, min(fields, group_size // 16))


def _effective_group(group_size: int, k: int) -> int:
    return k if group_size == -1 else group_size


# `_dequant_kernel`'s rows per program and warps: the best or within 1% of it on each of twelve Llama-3 weights
# (int4 g128 with float32 / bfloat16 scales, int8 per channel) among 17 tiles of 16..64 rows, one to four chunks
# per program, 4 or 8 warps (H100, tune_weight_only_dequant.json)
DEQUANT_CONFIG = dict(block_n=32, num_warps=4)


def dequantize(qweight, scales, zeros, bits: int, group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """w_hat [N, K] in `dtype` (packed order of K, i.e. before any act-order permutation is undone)."""
    n = qweight.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    cfg = DEQUANT_CONFIG
    grid = (cdiv(n, cfg["block_n"]), cdiv(k, chunk_codes(bits)))
    launch_kernel(_dequant_kernel, grid,
        qweight, scales, zeros if zeros is not None else scales, out, n, k, scales.shape[0],
        _effective_group(group_size, k), qweight.stride(0), out.stride(0),
        BITS=bits, HAS_ZERO=zeros is not None, BLOCK_N=cfg["block_n"], INTERPRET=INTERPRET,
        num_warps=cfg["num_warps"],
    )
    return out


def pick_from(tiles, m: int, bits: int, scale_bytes: int = 4) -> dict:
    """The first tile covering M rows whose `bits` and `scale_bytes` (where it names them) are the weights' bit width
    and the byte width of their scales."""
    for tile in tiles:
        if (m <= tile["max_m"] and tile.get("bits", bits) == bits
                and tile.get("scale_bytes", scale_bytes) == scale_bytes):
            return tile
    return tiles[-1]


def pick_tile(m: int, device: torch.device, bits: int = 4, scale_bytes: int = 4) -> dict:
    return pick_from(_table(device)["tiles"], m, bits, scale_bytes)


_KERNELS = ("mma", "gemv")
_CONVERTS = {"shift": 0, "inplace": 1, "packed": 2}


_SCALES = ("before", "after", "auto")


def packed_applies(x_dtype: torch.dtype, scale_dtype: torch.dtype, bits: int, scale_after: bool = False) -> bool:
    """Whether convert="packed" is exact: MAGIC + u is exact in the activation dtype (int4 in bfloat16 or
    float16, int8 in float16 only: 128 + u needs 9 bits past bfloat16's 8), and, when the scale is applied
    before the dot (`_pair_convert`), the scales are values of the activation dtype (so the 16-bit product
    rounds once, like the reference). With the scale after the dot (`_pair_convert` unscaled) only u - z is
    converted, so any scale dtype will do."""
    return (scale_after or scale_dtype == x_dtype) and (bits == 4 or x_dtype == torch.float16)


def _scale_code(tile: dict, num_groups: int, mma: bool) -> int:
    """SCALE of a launch: 0 for scale="before"; for "after" 1 (per group), or 2 when one group covers all
    of K (per channel: scaled once at the end). "auto" is "after" where it measured faster on the H100
    (W4A16 g128): the GEMV kernel (1.3x, tune_weight_only_krule.json) and tensor-core tiles with block_n
    <= 32 and one chunk per iteration, which run mma.sync with register accumulators on Hopper (1.45x,
    tune_weight_only_mmav2_after.json); "before" on wgmma tiles (block_n >= 64), where rescaling each
    group waits for its asynchronous MMAs (10-30% slower, tune_weight_only_scale_after.json; per channel
    no gain either: W8A16 M=1 28672x8192 134.8 vs 135.0 us)."""
    scale = tile.get("scale", "before")
    if scale == "before":
        return 0
    if scale == "auto" and mma and (tile["block_n"] > 32 or tile.get("chunks", 1) != 1):
        return 0
    return 2 if num_groups == 1 else 1


def _convert_code(tile: dict, x_dtype: torch.dtype, scale_dtype: torch.dtype, bits: int, mma: bool,
                  scale_after: bool = False) -> int:
    """CONVERT of a launch: the tile's conversion, except that "packed" runs only on the tensor-core
    kernel and where `packed_applies`; elsewhere it falls back to "inplace" (the same values)."""
    convert = tile.get("convert", "shift")
    if convert == "packed" and not (mma and packed_applies(x_dtype, scale_dtype, bits, scale_after)):
        convert = "inplace"
    return _CONVERTS[convert]


def check_tile(tile: dict) -> None:
    """Raise ValueError for a tile dict the kernels cannot run (forced tiles, tuning candidates)."""
    kind = tile.get("kernel", "mma")
    if kind not in _KERNELS:
        raise ValueError(f"tile kernel: expected one of {_KERNELS}, got {kind!r}")
    if tile.get("convert", "shift") not in _CONVERTS:
        raise ValueError(f"tile convert: expected one of {tuple(_CONVERTS)}, got {tile.get('convert')!r}")
    if tile.get("bits", 4) not in (4, 8):
        raise ValueError(f"tile bits: expected 4 or 8 (the weights a table row is for), got {tile.get('bits')!r}")
    if tile.get("scale_bytes", 4) not in (2, 4):
        raise ValueError(f"tile scale_bytes: expected 2 or 4 (the scales a table row is for), got "
                         f"{tile.get('scale_bytes')!r}")
    if tile.get("scale", "before") not in _SCALES:
        raise ValueError(f"tile scale: expected one of {_SCALES}, got {tile.get('scale')!r}")
    pow2 = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0  # noqa: E731
    chunks, bm, bn = tile.get("chunks", 1), tile["block_m"], tile["block_n"]
    if not pow2(chunks) or chunks > 8:
        raise ValueError(f"tile chunks: expected a power of two <= 8, got {chunks!r}")
    if tile.get("scale", "before") == "after" and kind == "mma" and chunks != 1:
        raise ValueError(f"tile scale: 'after' on the mma kernel needs chunks=1 (one group per dot), "
                         f"got chunks={chunks}")
    if tile.get("wide", False) and (kind != "mma" or chunks != 1 or tile.get("scale", "before") == "after"):
        raise ValueError(f"tile wide: one product per chunk needs kernel 'mma', chunks=1 and the scale before the "
                         f"dot, got {tile!r}")
    if not pow2(bn) or bn < 16:
        raise ValueError(f"tile block_n: expected a power of two >= 16, got {bn!r}")
    if kind == "mma" and (not pow2(bm) or bm < 16):
        raise ValueError(f"tile block_m: the mma kernel needs a power of two >= 16, got {bm!r}")
    if kind == "gemv" and bm not in (1, 2, 3, 4):
        raise ValueError(f"tile block_m: the gemv kernel takes 1..4 rows, got {bm!r}")


def fused_mm(x2d, qweight, scales, zeros, bias, bits: int, group_size: int, n: int,
             tile: Optional[dict] = None, splits: Optional[int] = None) -> torch.Tensor:
    """out [M, N] = x2d @ w_hat.T (+ bias) with the fused dequantizing kernel.

    tile: a `_DISPATCH` entry (default: `pick_tile(M)`); keys block_m, block_n, num_warps, num_stages,
    programs_per_sm, and optionally chunks (chunks of 16 words per K-loop iteration, default 1),
    kernel ("mma": tensor cores, `_wo_mm_kernel`, default; "gemv": `_wo_gemv_kernel`, block_m <= 4),
    convert ("shift", default, "inplace" or "packed": the same values with fewer instructions; "packed"
    runs on the mma kernel where `packed_applies`, else as "inplace") and scale ("before", default: the
    product takes w_hat; "after": it takes u - z and the group sums are scaled, on the mma kernel with
    chunks=1 only; "auto": `_scale_code`) and wide (one product per chunk, `_wo_mm_kernel`'s WIDE; with the scale
    before the dot and chunks=1, else ignored). splits:
    force the number of K splits (rounded so every split has the same whole number of chunks, the last
    possibly fewer)."""
    m, k = x2d.shape
    if tile is None:
        tile = pick_tile(m, x2d.device, bits, scales.element_size())  # the shipped table (checked by the tests)
    else:
        check_tile(tile)
    block_m, block_n = tile["block_m"], tile["block_n"]
    chunks = tile.get("chunks", 1)
    kernel = _wo_gemv_kernel if tile.get("kernel", "mma") == "gemv" else _wo_mm_kernel
    grid_n, grid_m = cdiv(n, block_n), cdiv(m, block_m)
    total_chunks = cdiv(k, chunk_codes(bits))
    if splits is None:
        target = tile["programs_per_sm"] * _num_sms(x2d.device)
        splits = cap_splits(target // max(1, grid_n * grid_m), total_chunks,
                            _table(x2d.device).get("min_chunks_per_split", 1))
    chunks_per_split = cdiv(total_chunks, splits)
    splits = cdiv(total_chunks, chunks_per_split)
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    split = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x2d.device) if split else out
    has_bias = bias is not None
    counts = None
    if split and m <= _table(x2d.device)["fused_reduce_max_m"]:
        counts = _tile_counters(x2d.device, grid_n * grid_m)
    fused = counts is not None
    mma = kernel is _wo_mm_kernel
    scale_code = _scale_code(tile, scales.shape[0], mma)
    group = _effective_group(group_size, k)
    if mma:
        extra = dict(FUSED_REDUCE=fused, WIDE=runs_wide(tile, scale_code))
    else:
        # group_shift: the GEMV's per-group scaling (SCALE 1) locates groups by shift; group sizes with
        # several groups are powers of two (validated by quantfuse.ops / QuantizedWeight)
        extra = dict(group_shift=group.bit_length() - 1, FUSED_REDUCE=fused, BLOCK_M_P2=next_pow2(block_m))
    pdl = decode_pdl(x2d.device, m, bits)
    launch_kernel(kernel, (grid_n, splits, grid_m),
        x2d, qweight, scales, zeros if zeros is not None else scales, bias if has_bias else scales,
        out, part, counts if fused else scales, m, n, k, scales.shape[0], group,
        chunks_per_split, (1 << bits) - 1, splits, x2d.stride(0), qweight.stride(0), out.stride(0),
        BITS=bits, GROUP_FIELDS=_group_fields(group_size, k, bits), HAS_ZERO=zeros is not None,
        HAS_BIAS=has_bias, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, CHUNKS=chunks,
        CONVERT=_convert_code(tile, x2d.dtype, scales.dtype, bits, mma, scale_code != 0), SCALE=scale_code,
        INTERPRET=INTERPRET, PDL=pdl,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **extra, **pdl_launch_options(pdl),
    )
    if split and not fused:
        splitk_reduce(part, bias, out)
    return out


def runs_wide(tile: dict, scale_code: int) -> bool:
    """Whether a launch of `tile` takes `_wo_mm_kernel`'s WIDE path (one product per chunk): a wide mma tile of
    one chunk per iteration with the scale before the dot (`_scale_code` 0)."""
    return (tile.get("kernel", "mma") == "mma" and bool(tile.get("wide", False)) and tile.get("chunks", 1) == 1
            and scale_code == 0)


def _dequantize_linear(x2d, qweight, scales, zeros, bias, bits: int, group_size: int, k: int) -> torch.Tensor:
    """w_hat once in x's dtype, then cuBLAS (F.linear)."""
    return torch.nn.functional.linear(x2d, dequantize(qweight, scales, zeros, bits, group_size, k, x2d.dtype), bias)


def weight_only_mm(x2d, qweight, scales, zeros, bias, bits: int, group_size: int, n: int) -> torch.Tensor:
    """Dispatch by M: the fused kernel (split-K for decode, tiled for larger M), the Gluon warp-specialized or
    wgmma kernel where `weight_only_ws.prefer` / `weight_only_wgmma.prefer` say so (int4, sm90, prefill-sized M),
    the Gluon int8 wgmma kernel where `weight_only_wgmma.prefer_w8` says so (int8 per channel, sm90, M = 256..2048),
    the Gluon decode kernels (`gemv_mma`: int4, M <= 16; `gemv_tma`: M = 1), the byte-view int8 decode kernel where
    `w8_decode.prefer` says so (per-channel int8, M = 2..32, sm90), or for M at least `cublas_min_m` dequantize once
    and call cuBLAS (measured faster there; see bench_weight_only.py), first of all for the small weights of
    `cublas_small_weights` (`prefer_dequant_cublas_small`)."""
    m, k = x2d.shape
    # the shape rule first: decode calls skip the scope checks (descriptor strides, device capability)
    arch = arch_key(x2d.device.type, x2d.device.index)
    table = _DISPATCH[arch]
    scale16 = scales.dtype == x2d.dtype
    sms = _num_sms(x2d.device) if x2d.is_cuda else 0
    if prefer_dequant_cublas_small(m, n, k, table):  # CPU / other GPUs: no entry in their table
        return _dequantize_linear(x2d, qweight, scales, zeros, bias, bits, group_size, k)
    if sms and weight_only_ws.prefer(m, n, k, arch, sms) \
            and weight_only_ws.applies(x2d, qweight, scales, bits, group_size, zeros):
        return weight_only_ws.ws_w4_mm(x2d, qweight, scales, zeros, bias, group_size, n,
                                       tail=weight_only_ws.tail_plan(m, n, k, arch, sms))
    if weight_only_wgmma.prefer(m, n, k, arch, scale16) \
            and weight_only_wgmma.applies(x2d, qweight, scales, bits, group_size):
        return weight_only_wgmma.wgmma_w4_mm(x2d, qweight, scales, zeros, bias, group_size, n)
    small = weight_only_wgmma.small_m_config(m, n, k, arch, sms, scale16)
    if small is not None and weight_only_wgmma.applies(x2d, qweight, scales, bits, group_size):
        return weight_only_wgmma.wgmma_w4_mm(x2d, qweight, scales, zeros, bias, group_size, n, config=small)
    if weight_only_wgmma.prefer_w8(m, arch) and weight_only_wgmma.applies_w8(x2d, qweight, scales, bits):
        return weight_only_wgmma.wgmma_w8_mm(x2d, qweight, scales, zeros, bias, n)
    if x2d.is_cuda and m >= table["cublas_min_m"]:
        return _dequantize_linear(x2d, qweight, scales, zeros, bias, bits, group_size, k)
    if gemv_mma.applies(x2d, qweight, scales, bits, group_size, k) and prefer_gemv_mma(m, n, k):
        return gemv_mma_mm(x2d, qweight, scales, zeros, bias, group_size, n)
    if w8_decode.prefer(m, arch) and w8_decode.applies(x2d, qweight, scales, bits):
        return w8_decode.w8_decode_mm(x2d, qweight, scales, zeros, bias, n, num_sms=_num_sms(x2d.device), arch=arch)
    if m == 1 and gemv_tma.applies(x2d, qweight, scales, bits, group_size, k) and prefer_gemv_tma(
            bits, n, k, pick_tile(1, x2d.device, bits), _num_sms(x2d.device)):
        return gemv_tma_mm(x2d, qweight, scales, zeros, bias, bits, group_size, n)
    return fused_mm(x2d, qweight, scales, zeros, bias, bits, group_size, n)


# Where the Gluon tensor-core decode kernel beats the tl kernels (H100, W4A16 g128, bf16 x, CUDA graphs, weights
# rotated past L2; benchmarks/tune_gemv_mma.py, results/tune_gemv_mma.json, same run): M = 1 1.02-1.25x the tl
# GEMV from 4096x14336 up (28672x8192 56.2 us = 0.74 of copy bandwidth, 3.0x bf16) but 0.92-0.97x on 4096x1024 /
# 4096x4096 / 4096x6144; M = 2..8 1.16-1.37x the tl mma tile from 4096x4096 up, 0.91-1.03x at 4096x1024. M = 9..16
# (two n-tiles of the instruction; gemv_mma's second bucket, split-K reduced by the reduce kernel): 1.06-1.24x the
# tl mma tile on all eight shapes from 4096x1024 up (results/tune_gemv_mma_m16.json, M = 9 / 12 / 16). With early
# refill (gemv_mma's M <= 8 pick since results/tune_gemv_mma_early_refill.json) M = 1 also wins at 4096x4096 (7.2
# us vs 7.9 for the tl GEMV) and 4096x6144 (9.7 vs 10.0). Smaller weights (Llama-3.2-1B / 3B shapes, the early-refill
# pick against the dispatch without this kernel, same run: results/tune_gemv_mma_small_shapes.json): M = 1 wins from
# 2048x3072 (6M codes: 5.70 vs 5.96 us; 3072x3072 6.48 vs 7.04, 3072x5120 7.15 vs 7.86) and loses at 4M (2048x2048
# 4.85 vs 4.49, 4096x1024 5.80 vs 4.80); M = 4 / 8 win 1.13-1.57x from 4M (4096x1024 8.70 vs 10.23 us at M = 4).
GEMV_MMA_MIN_WEIGHTS = ((1, 6 << 20), (16, 4 << 20))  # (largest M, smallest N x K), by increasing M


def prefer_gemv_mma(m: int, n: int, k: int) -> bool:
    """Whether an int4 product runs the Gluon tensor-core decode kernel (where `gemv_mma.applies`): the measured
    M and N x K ranges of `GEMV_MMA_MIN_WEIGHTS`."""
    for max_m, min_weights in GEMV_MMA_MIN_WEIGHTS:
        if m <= max_m:
            return n * k >= min_weights
    return False


def gemv_mma_mm(x2d, qweight, scales, zeros, bias, group_size: int, n: int,
                config: Optional["gemv_mma.MmaDecodeConfig"] = None, splits: Optional[int] = None) -> torch.Tensor:
    """The Gluon tensor-core int4 decode kernel (`gemv_mma`, sm90, M <= 16) with this module's split-K counters and
    SM count; the caller checked `gemv_mma.applies`."""
    cfg = config or gemv_mma.auto_config(x2d, n)
    counters = _tile_counters(x2d.device, cdiv(n, cfg.block_n)) if cfg.fused_reduce else None
    return gemv_mma.gemv_mma(x2d, qweight, scales, zeros, bias, group_size, n, config=cfg, splits=splits,
                             counters=counters, num_sms=_num_sms(x2d.device))


def prefer_gemv_tma(bits: int, n: int, k: int, tl_tile: dict, num_sms: int) -> bool:
    """Whether M = 1 runs the Gluon GEMV rather than the tl one (where `gemv_tma.applies`): int8 weights always
    (1.04-1.40x the tl GEMV on eight Llama-3 shapes with its 64-row pick: tune_gemv_tma_w8_64rows.json); int4 only
    where the tl GEMV's tile cannot reach its programs-per-SM target even with one chunk per split (N x K too small:
    4096x1024 1.26x), since elsewhere the Gluon kernel's conversion is issue-bound and the tl GEMV is faster."""
    if bits == 8:
        return True
    programs = cdiv(n, tl_tile["block_n"]) * cdiv(k, chunk_codes(bits))
    return programs < tl_tile["programs_per_sm"] * num_sms


def gemv_tma_mm(x2d, qweight, scales, zeros, bias, bits: int, group_size: int, n: int,
                config: Optional["gemv_tma.GemvConfig"] = None, splits: Optional[int] = None) -> torch.Tensor:
    """The Gluon TMA-fed GEMV (`gemv_tma`, sm90, M = 1) with this module's split-K counters and SM count; the
    caller checked `gemv_tma.applies`."""
    cfg = config or gemv_tma.pick_config(bits, x2d.device)
    counters = None
    if _table(x2d.device)["fused_reduce_max_m"] >= 1:
        counters = _tile_counters(x2d.device, cdiv(n, cfg.block_n))
    return gemv_tma.gemv_tma(x2d, qweight, scales, zeros, bias, bits, group_size, n, config=cfg, splits=splits,
                             counters=counters, num_sms=_num_sms(x2d.device))
