"""Weight-only INT4 GEMM for prefill-sized M on Hopper (sm90) in Gluon: the packed weight dequantized in registers
straight into an asynchronous register-operand wgmma, so converting chunk t + 1 overlaps chunk t's product.

Math (SPEC section 4): out[m, n] = sum_k x[m, k] * w_hat[n, k] (+ bias[n]) with w_hat = round(dtype, (u - z) * s),
as `weight_only._wo_mm_kernel` (the zero point subtracted exactly before the one scaling multiply).

Why: in the `tl` kernel Hopper's register-operand wgmma is waited for before the next chunk is converted
(Triton waits for every dot whose A operand lives in registers), so the tensor cores idle during each
conversion: ~60% of bf16 cuBLAS at M >= 1024. Gluon exposes the wgmma commit groups: here chunk t's two products
are issued asynchronously and chunk t - 1's are retired only after them (`warpgroup_mma_wait(2)`), so the
next conversion always runs beside a product in flight.

Product: the transposed out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ x^T [K, BLOCK_M], W the register A operand
(one 64-row warpgroup per 64 weight rows), x the shared-memory B operand (the copy engine brings each 128-code
chunk as two [BLOCK_M, 64] boxes: 128-byte swizzle spans 64 16-bit values), K-major as wgmma wants it.

No data movement between loading and the MMA: in the packed layout (`weight_only` module doc) field f of word j
of a chunk holds k = 16 f + j, and x's order in shared memory is the natural one, so the A fragment dictates
which words a thread loads. A 16-bit wgmma A operand (k_width 2) gives lane (r, c) of a warp k = 16 s + 2 c +
{0, 1, 8, 9} of rows r and r + 8 for each 16-deep step s: the words j = 2 c + {0, 1, 8, 9} (two 8-byte loads per
row), whose field s is step s. Half h of the chunk (k < 64 or >= 64) is fields 4 h .. 4 h + 3. The fields of a
word expand into the operand by register renaming (join / permute / reshape, asserted trivial at build time).

Conversion, per word (w_hat bit for bit as the `tl` kernels):
- 16-bit scales of x's dtype (SCALE16): per register pair p, ((w >> 4 p) & 0x000F000F) | MAGIC2 is
  (MAGIC + u, MAGIC + u') for fields p and p + 4 (one shift + one LOP3), one packed subtract of (MAGIC + z) pairs
  (exact), one packed multiply by the scale pair (the one rounding): 1.5 instructions per weight plus the
  regrouping of halves into k pairs.
- float32 scales: per field, the float32 2^23 + u by one OR (LOP3 with the shift), minus 2^23 + z (exact), times
  s (float32), rounded to x's dtype two at a time.

Pipeline: STAGES shared-memory slots of x (one mbarrier each), refilled with chunk t - 1 + STAGES once chunk
t - 1's products have retired in both warpgroups (CTA barrier). The packed words, scales and zero points of a
chunk are loaded two chunks ahead into registers. The K loop is unrolled by two so each chunk's A operand
registers stay fixed while its wgmma reads them (a copy of them would make ptxas serialize the wgmma).

Split-K (programs over K ranges, float32 partials reduced by `weight_only.splitk_reduce`) fills the GPU where
the tiles alone would not. Where they fill some whole waves and leave a last wave mostly idle, the tail split
(`TailSplit`) runs the last column tiles in a second launch split over K: H100, same-run alternated rounds, 1.07-1.57x
the one-launch kernel on ten Llama-3 prefill shapes from M = 256 to 1024 (8192x10240 at M = 512: 152 vs 209 us;
results/tune_weight_only_tail.json).

Scope (`applies`): sm90 exactly, int4 codes, float16 / bfloat16 x describable by a tensor descriptor, groups of
a power-of-two number of whole chunks or per channel. Everything else, and the Triton interpreter (Gluon has
none), runs the `tl` kernels.

INT8 codes with one scale per output channel (`wgmma_w8_mm`, `_w8_wgmma_kernel`; W8A16 prefill): the same
pipeline on 64-code chunks, one x box and one product per chunk (an int8 chunk of 16 words is laid out as an int4
half chunk: field f of word j is k = 16 f + j, one byte per field). Each byte becomes the exact u - z (OR-ed under
0x4B000000 it is the float32 2^23 + u; minus 2^23 + z; |u - z| <= 255 is exact in both 16-bit dtypes) and the
per-channel scale multiplies the float32 sums: x @ W.T for the unrounded W = (u - z) * s, within one rounding per
weight of x @ w_hat.T, as `w8_decode`. Scope (`applies_w8`): sm90, int8 per channel, x describable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ._common import INTERPRET, cdiv, describable, launch_kernel
from ._gluon import GLUON_AVAILABLE, sm90_exactly
from .gemv_mma import whole_chunk_groups
from .configs import arch_key, sm_count

if GLUON_AVAILABLE:
    from ._gluon import cta_barrier as _cta_barrier
    from ._gluon import gl, gluon, mbarrier, operand_descriptor, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import tile_coords as _tile_coords
    from ._gluon import tma_load as _tma_load
    from .gemv_mma import convert_word_pairs as _convert_word_pairs
    from .gemv_mma import half_pair as _half_pair
    from .gemv_mma import magic_zero_pair as _magic_zero_pair

CHUNK = 128  # int4 codes per chunk of 16 words
HALF = 64  # codes per x box (128 bytes of a 16-bit dtype: the swizzle span)
WORDS_PER_CHUNK = 16


if GLUON_AVAILABLE:  # the kernel's copies (a @jit function reads constexpr globals only)
    _WORDS = gl.constexpr(WORDS_PER_CHUNK)
    _HALF = gl.constexpr(HALF)


@dataclass(frozen=True)
class WgmmaW4Config:
    """block_m x rows per tile (the wgmma's N: 16..256); num_warps 4 or 8 (one or two 64-row warpgroups: block_n =
    16 x num_warps weight rows); stages x slots; programs_per_sm sets the split-K target (tiles x splits ~
    programs_per_sm x SMs; 0: no split); row_cost: measured time per x row of a full tile relative to the
    256-row tile, for `pick_config`'s wave model."""
    block_m: int
    num_warps: int = 8
    stages: int = 4
    programs_per_sm: int = 1
    group: int = 8
    row_cost: float = 1.0

    @property
    def block_n(self) -> int:
        return 16 * self.num_warps


# Per architecture: the candidates `pick_config` chooses from by its wave model. H100 (W4A16 g128, bf16 x, five
# Llama-3 shapes, CUDA graphs; results/tune_weight_only_wgmma.json): at M = 2048 the 128-row tile takes 1.25x the
# 256-row tile's time per row (728.7 vs 581.0 us at 8192x10240, 2016.7 vs 1604.5 at 28672x8192), and 4 stages
# fit beside it (3 for the 256-row tile: 64 KiB a slot).
WGMMA_W4_CONFIGS: Dict[str, List[WgmmaW4Config]] = {
    "sm90": [WgmmaW4Config(256, 8, 3), WgmmaW4Config(128, 8, 4, row_cost=1.25)],
}

# Where weight_only_mm runs this kernel (`prefer`): M from min_m to max_m (max_m_16bit_scales with scales of x's
# dtype, whose packed conversion is cheaper), and from large_m to max_m only weights of at least large_m_min_weights
# (N x K) codes. H100, same sweeps, W4A16 g128, against the dispatch before (the tl wide tiles below M = 512,
# dequantize + cuBLAS from 512), float32 scales: M = 192 1.2-1.4x on all five shapes, 256 1.2-1.3x, 384 1.0-1.3x,
# 512 1.0-1.5x, 768 and 1024 1.05-1.18x from 8192x10240 / 14336x4096 up but 0.73x / 0.88x at 4096x6144 (144 / 192
# tiles: a nearly empty last wave), 2048 0.9-1.0x; bfloat16 scales at M = 2048: 1.04-1.09x on all five.
WGMMA_W4_DISPATCH: Dict[str, Dict[str, int]] = {
    "sm90": dict(min_m=129, max_m=1024, max_m_16bit_scales=2048, large_m=768, large_m_min_weights=32 << 20),
}


# 16-bit scales of x's dtype at M = 32 / 64 / 128 exactly: one full row tile of M tokens, 64 weight rows a program (4
# warps), split-K for programs_per_sm programs per SM, ahead of the tl wide tiles there (whose packed conversion
# ptxas serializes the wgmma of: C7515 in the sm90 build). H100, W4A16 g128 symmetric, bf16 x, CUDA graphs:
# - two per SM, 4 / 4 / 3 slots (results/tune_weight_only_mid_m_wgmma_bf16.json, bfloat16 scales, five Llama-3
#   shapes, same run as the tl tiles): 1.03-1.14x at M = 32, 1.09-1.19x at 64, 1.18-1.49x at 128 (4096x6144 21.9 us
#   vs 32.0); behind where the grid filled its last round poorly (8192x10240: 160 tiles, one split; 0.76x / 0.81x at
#   M = 32 / 64, 1.02x at 128) and mixed with rows past M (M = 96 on the 128-row tile: the copy engine's zero-filled
#   rows; 0.87-1.37x): those stay on the tl tiles. So do float32 scales, whose tl path is the faster one (these
#   configs won on 2 of 5 shapes at M = 128, results/tune_weight_only_mid_m_wgmma.json; three per SM at M = 32 / 64
#   0.74-0.96x, results/tune_weight_only_mid_m_wgmma_p3.json).
# - three per SM, 3 slots, at M = 32 / 64 (3 of these programs fit an SM: one round of 3 x SMs; bfloat16 scales,
#   same call, tune_weight_only_mid_m_wgmma_p3.json): 1.18-1.28x two per SM at M = 32 and 1.11-1.27x at 64 on
#   4096x6144 / 14336x4096 / 28672x8192 (4096x6144 M = 32 13.1 us vs 16.8, 1.80x bf16; M = 64 14.5 vs 18.4),
#   0.99-1.0x on 4096x28672 (448 tiles, no split either way), 1.21x / 1.28x the tl tiles at 8192x10240 (160 tiles x
#   2 splits now fill 0.81 of the round). At M = 128 three per SM lost on three of five shapes (0.81-0.88x).
# SMALL_M_MIN_FILL: the least fill of the last round of programs_per_sm x SMs; 0.55 keeps 4096x28672 at M = 32 / 64
# (0.57 of two rounds of 396) and 8192x10240 at M = 128 (0.61 of 264; 72.6 us vs 72.6 for the tl tile) here.
SMALL_M_16BIT: Dict[str, Dict[int, WgmmaW4Config]] = {
    "sm90": {32: WgmmaW4Config(32, 4, 3, 3), 64: WgmmaW4Config(64, 4, 3, 3), 128: WgmmaW4Config(128, 4, 3, 2)},
}
SMALL_M_MIN_FILL = 0.55


def all_configs(arch: str) -> List[WgmmaW4Config]:
    """The prefill candidates, then the small-M configs of 16-bit scales (what the tests run)."""
    out = list(WGMMA_W4_CONFIGS[arch])
    return out + [c for c in SMALL_M_16BIT.get(arch, {}).values() if c not in out]


def small_m_config(m: int, n: int, k: int, arch: str, num_sms: int, scale16: bool) -> Optional[WgmmaW4Config]:
    """The config weight_only_mm runs this kernel with at a small M (SMALL_M_16BIT), or None: 16-bit scales, M one
    of the table's full row tiles, and programs (column tiles x `splits_for`) filling at least SMALL_M_MIN_FILL of
    their last round of programs_per_sm x SMs."""
    cfg = SMALL_M_16BIT.get(arch, {}).get(m) if scale16 and num_sms > 0 else None
    if cfg is None:
        return None
    slots = cfg.programs_per_sm * num_sms
    programs = cdiv(n, cfg.block_n) * splits_for(m, n, k, cfg, num_sms)
    return cfg if programs >= SMALL_M_MIN_FILL * cdiv(programs, slots) * slots else None


def check_config(cfg: WgmmaW4Config) -> None:
    if cfg.num_warps not in (4, 8):
        raise ValueError(f"config num_warps: expected 4 or 8 (one or two 64-row warpgroups), got {cfg}")
    if cfg.block_m not in (16, 32, 64, 128, 256):
        raise ValueError(f"config block_m: expected a power of two in 16..256 (the wgmma's N), got {cfg}")
    if cfg.stages < 2 or cfg.programs_per_sm < 0 or cfg.group < 1 or cfg.row_cost <= 0:
        raise ValueError(f"config: expected stages >= 2, programs_per_sm >= 0, group >= 1, row_cost > 0, got {cfg}")


def _model_cost(m: int, n: int, k: int, cfg: WgmmaW4Config, num_sms: int) -> float:
    """Waves of whole-K tiles (`_waves`, with the tail split where it applies) times the tile's row cost."""
    return _waves(m, n, k, cfg, num_sms, tail_split_for(m, n, k, cfg, num_sms)) * cfg.block_m * cfg.row_cost


def pick_config(m: int, n: int, k: int, device: torch.device, arch: Optional[str] = None,
                num_sms: Optional[int] = None) -> WgmmaW4Config:
    """The candidate with the least modelled time: the 256-row tile unless its last wave or its rows past M waste
    more than the 128-row tile's 1.25x cost per row (H100: 8192x10240 at M = 384 137.4 us vs 210.5, 4096x28672
    at M = 384 211.6 vs 231.6; at M = 192 on 28672x8192, where both fill one wave, split-K halves the 256-row
    tile's K loop: 193.7 us vs 240.8)."""
    sms = num_sms or sm_count(device)
    return plan(m, n, k, arch or arch_key(device.type, device.index), sms)[0]


@functools.lru_cache(maxsize=1024)
def plan(m: int, n: int, k: int, arch: str, num_sms: int) -> Tuple[WgmmaW4Config, int, Optional["TailSplit"]]:
    """(config, split-K count, tail split) the model picks for this shape, kept per shape: the model walks every
    candidate's waves with and without a tail split (several microseconds of Python per prefill call)."""
    cfg = min(WGMMA_W4_CONFIGS[arch], key=lambda c: _model_cost(m, n, k, c, num_sms))
    return cfg, splits_for(m, n, k, cfg, num_sms), tail_split_for(m, n, k, cfg, num_sms)


def prefer(m: int, n: int, k: int, arch: str, scale16: bool = False) -> bool:
    """Whether weight_only_mm runs this kernel at this shape (where `applies`) on `arch` (configs.arch_key);
    scale16: the scales are of x's dtype. WGMMA_W4_DISPATCH."""
    rule = WGMMA_W4_DISPATCH.get(arch)
    if rule is None or m < rule["min_m"]:
        return False
    if m > rule["max_m"]:
        return scale16 and m <= rule["max_m_16bit_scales"]
    return m < rule["large_m"] or n * k >= rule["large_m_min_weights"]


def applies(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the product can run here (module doc); the caller validated the arguments."""
    if not GLUON_AVAILABLE or INTERPRET or not x2d.is_cuda or bits != 4:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or not sm90_exactly(x2d.device.type, x2d.device.index):
        return False
    return (whole_chunk_groups(scales, group_size) and describable(x2d) and qweight.dtype == torch.int32
            and qweight.stride(1) == 1 and qweight.shape[1] % WORDS_PER_CHUNK == 0
            and scales.dtype in (torch.float32, x2d.dtype))


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _word_layout(a_ll):
        """[BLOCK_N, 16 words] from the A operand's bases over (n, k) of one 64-deep half chunk: k bits 1, 2, 4, 8
        pick the word (j = k mod 16), k bits 16, 32 are fields inside it. The 8-byte pairs (k bit 1) first."""
        def conv(bases):
            out = []
            for dn, dk in bases:
                if dk >= 16:
                    assert dn == 0, "a basis mixing rows and fields"
                    continue
                out.append([dn, dk])
            return out
        regs = conv(a_ll.reg_bases)
        regs = [b for b in regs if b == [0, 1]] + [b for b in regs if b != [0, 1]]
        return gl.DistributedLinearLayout(regs, conv(a_ll.lane_bases), conv(a_ll.warp_bases), [],
                                          [a_ll.shape[0], WORDS_PER_CHUNK])

    @gluon.jit
    def fields_to_half(v0, v1, v2, v3):
        """Fields f = 0..3 ([rows, 16] each, word j) -> [rows, 64] with k = 16 f + j (register renaming); also the
        warp-specialized kernel's (weight_only_ws)."""
        ROWS: gl.constexpr = v0.shape[0]
        q = gl.join(gl.join(v0, v1), gl.join(v2, v3))  # [n, j, f & 1, f >> 1]
        q = gl.permute(q, (0, 3, 2, 1))  # [n, f >> 1, f & 1, j]
        return gl.reshape(q, [ROWS, _HALF])

    @gluon.jit
    def _half(v0, v1, v2, v3, a_layout: gl.constexpr):
        """`fields_to_half` in the A operand layout."""
        return gl.convert_layout(fields_to_half(v0, v1, v2, v3), a_layout, assert_trivial=True)

    @gluon.jit
    def scaled_field(v, F: gl.constexpr, z, s, DT: gl.constexpr):
        """(2^23 + u 2^(4 F)) as float32 bits (field F OR-ed where it lies into 2^23) -> round(DT, (u - z) * s): minus
        2^23 + z 2^(4 F) and times s 2^(-4 F) (powers of two: exact), one rounding; z, s float32. The float32-scale
        conversion of both this kernel and weight_only_ws."""
        return ((v.to(gl.float32, bitcast=True) - (z * (1 << (4 * F)) + 8388608.0))
                * (s * (1.0 / (1 << (4 * F))))).to(DT)

    @gluon.jit
    def _inplace_field(words, F: gl.constexpr, z, s, DT: gl.constexpr):
        """round(DT, (u - z) * s) of field F (bits 4 F..4 F + 3, F < 4) of `words`; z, s float32 [BLOCK_N, 1]."""
        return scaled_field((words & (0xF << (4 * F))) | 0x4B000000, F, z, s, DT)

    @gluon.jit
    def _operands(words, zero, scale, a_layout: gl.constexpr, DT: gl.constexpr, SCALE16: gl.constexpr):
        """[BLOCK_N, 16] words of a chunk -> its two [BLOCK_N, 64] halves of w_hat in the A operand layout.
        SCALE16: zero = (MAGIC + z) pairs, scale = s pairs (int32 [BLOCK_N]); else zero = z and scale = s (float32
        [BLOCK_N])."""
        if SCALE16:
            l0, h0, l1, h1, l2, h2, l3, h3 = _convert_word_pairs(words, zero[:, None], scale[:, None], DT, True)
            return _half(l0, l1, l2, l3, a_layout), _half(h0, h1, h2, h3, a_layout)
        else:
            # field f' of a 16-bit half sits at bits 4 f'..4 f' + 3: OR-ed where it lies into 2^23 (no shift) it
            # reads 2^23 + u 2^(4 f'); minus 2^23 + z 2^(4 f') and times s 2^(-4 f') (powers of two: exact) it is
            # (u - z) s rounded once, as with the field shifted down first
            hi = words >> 16
            z = zero[:, None]
            s = scale[:, None]
            f0 = _inplace_field(words, 0, z, s, DT)
            f1 = _inplace_field(words, 1, z, s, DT)
            f2 = _inplace_field(words, 2, z, s, DT)
            f3 = _inplace_field(words, 3, z, s, DT)
            f4 = _inplace_field(hi, 0, z, s, DT)
            f5 = _inplace_field(hi, 1, z, s, DT)
            f6 = _inplace_field(hi, 2, z, s, DT)
            f7 = _inplace_field(hi, 3, z, s, DT)
            return _half(f0, f1, f2, f3, a_layout), _half(f4, f5, f6, f7, a_layout)

    @gluon.jit
    def _load_chunk(w_ptrs, w_mask, s_ptr, z_ptr, rows, N, chunk, ok, group_chunk_shift,
                    HAS_ZERO: gl.constexpr, SCALE16: gl.constexpr, DT: gl.constexpr):
        """Chunk `chunk`'s words, and its group's zero term and scale in the form `_operands` takes (0 where not ok:
        nothing past the split's last chunk is loaded)."""
        words = gl.load(w_ptrs, mask=w_mask & ok)
        g = chunk >> group_chunk_shift
        row_ok = (rows < N) & ok
        if HAS_ZERO:
            z = gl.load(z_ptr + g * N + rows, mask=row_ok, other=0)
        else:
            z = gl.full_like(rows, 8)
        if SCALE16:
            return words, _magic_zero_pair(z, DT), _half_pair(gl.load(s_ptr + g * N + rows, mask=row_ok, other=0.0))
        else:
            s = gl.load(s_ptr + g * N + rows, mask=row_ok, other=0.0)
            return words, z.to(gl.float32), s

    @gluon.jit
    def _issue(a0, a1, x_smem, ready, t, acc, STAGES: gl.constexpr):
        """Chunk t's two products (one per x box) into acc, left in flight."""
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        acc = warpgroup_mma(a0, x_smem.index(2 * slot).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma(a1, x_smem.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _refill(x_desc, x_smem, ready, t, n_steps, c_begin, off_m, STAGES: gl.constexpr):
        """Chunk t (of this split) into slot t % STAGES, after every warp retired the slot's previous products."""
        _cta_barrier()
        slot = t % STAGES
        fill = t < n_steps
        k = (c_begin + t) * (2 * _HALF)
        mbarrier.expect(ready.index(slot), 2 * x_desc.block_type.nbytes, pred=fill)
        _tma_load(x_desc, [off_m, k], ready.index(slot), x_smem.index(2 * slot), pred=fill)
        _tma_load(x_desc, [off_m, k + _HALF], ready.index(slot), x_smem.index(2 * slot + 1), pred=fill)

    @gluon.jit
    def _store_out_tile(acc, out_ptr, bias_ptr, s_ptr, off_n, part_row0, load_m, off_m, M, N, stride_om,
                        SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, SCALE_ROWS: gl.constexpr,
                        num_warps: gl.constexpr):
        """The out^T tile acc [BLOCK_N, BLOCK_M] (weight rows from off_n, x rows from load_m) into out [M, N] with
        16-byte stores along N (N is contiguous in out); only x rows from off_m and below M are stored.
        SCALE_ROWS: times the per-channel scale s[n] first. SPLIT: float32 partials [splits, M, .] of split
        program_id(1), columns counted from weight row part_row0; else plus bias, rounded to out's dtype."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        VEC: gl.constexpr = 4 if SPLIT else 8
        out_l: gl.constexpr = gl.BlockedLayout([VEC, 1], [BLOCK_N // VEC, 32 * VEC // BLOCK_N], [1, num_warps],
                                               [0, 1])
        res = gl.convert_layout(acc, out_l)
        orows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
        ocols = load_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_l))
        mask = (orows < N)[:, None] & ((ocols >= off_m) & (ocols < M))[None, :]
        if SCALE_ROWS:
            res = res * gl.load(s_ptr + orows, mask=orows < N, other=0.0).to(gl.float32)[:, None]
        if SPLIT:
            offs = ocols.to(gl.int64)[None, :] * stride_om + (orows - part_row0)[:, None]
            gl.store(out_ptr + gl.program_id(1).to(gl.int64) * M * stride_om + offs, res, mask=mask)
        else:
            offs = ocols.to(gl.int64)[None, :] * stride_om + orows[:, None]
            if HAS_BIAS:
                res += gl.load(bias_ptr + orows, mask=orows < N, other=0.0).to(gl.float32)[:, None]
            gl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _wo_wgmma_kernel(
        x_desc, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
        M, N, K, stride_wn, stride_om, chunks_per_split, group_chunk_shift, n_tile0, n_count,
        HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, SCALE16: gl.constexpr,
        STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = 16 * num_warps
        DT: gl.constexpr = x_desc.dtype
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_l: gl.constexpr = _word_layout(gl.to_linear_layout(a_l, [BLOCK_N, _HALF]))

        # this launch's tiles: weight rows n_tile0 * BLOCK_N .. + n_count (`TailSplit`); a whole number of tiles in,
        # so off_n stays a known multiple of BLOCK_N (aligned vector loads and stores)
        pid_n, pid_m = _tile_coords(gl.program_id(0), n_count, M, BLOCK_N, BLOCK_M, GROUP)
        off_n = (n_tile0 + pid_n) * BLOCK_N
        off_m = pid_m * BLOCK_M
        # rows this tile loads and multiplies: the last row tile moved back to end at row M (where M >= BLOCK_M), its
        # rows shared with the tile before computed again and not stored, so no x box reaches past M: rows the copy
        # engine zero-filled ran slower than real ones (H100, 14336x4096, 256-row tile, no split: M = 257 156.7 us
        # vs 109.5 at M = 511; 107.1 after; results/tune_weight_only_wgmma_last_tile.json)
        load_m = gl.maximum(gl.minimum(off_m, M - BLOCK_M), 0)
        c_begin = gl.program_id(1) * chunks_per_split
        n_steps = gl.minimum(chunks_per_split, gl.cdiv(K, 2 * _HALF) - c_begin)

        x_smem = gl.allocate_shared_memory(DT, [2 * STAGES, BLOCK_M, _HALF], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES - 1):  # the loop's first refill brings chunk STAGES - 1
            _refill(x_desc, x_smem, ready, s, n_steps, c_begin, load_m, STAGES)

        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        rj = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, w_l))
        w_ptrs = w_ptr + rows.to(gl.int64)[:, None] * stride_wn + c_begin * _WORDS + rj[None, :]
        w_mask = (rows < N)[:, None] & (rj < _WORDS)[None, :]

        # chunks 0 and 1 in registers; each buffer is refilled two chunks ahead once converted
        wa, za, sa = _load_chunk(w_ptrs, w_mask, s_ptr, z_ptr, rows, N, c_begin, n_steps > 0, group_chunk_shift,
                                 HAS_ZERO, SCALE16, DT)
        wb, zb, sb = _load_chunk(w_ptrs + _WORDS, w_mask, s_ptr, z_ptr, rows, N, c_begin + 1, n_steps > 1,
                                 group_chunk_shift, HAS_ZERO, SCALE16, DT)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        # "chunk -1": operands of zeros whose (absent) products the first wait retires
        b0 = gl.zeros([BLOCK_N, _HALF], DT, a_l)
        b1 = gl.zeros([BLOCK_N, _HALF], DT, a_l)
        # whole pairs of chunks in the loop and the odd last chunk after it: a conditional issue inside the loop
        # would leave a path on which a wgmma is still in flight when its operand registers are written again,
        # and ptxas then serializes every wgmma of the kernel (C7513)
        for t in range(0, n_steps - 1, 2):
            a0, a1 = _operands(wa, za, sa, a_l, DT, SCALE16)
            wa, za, sa = _load_chunk(w_ptrs + (t + 2) * _WORDS, w_mask, s_ptr, z_ptr, rows, N, c_begin + t + 2,
                                     t + 2 < n_steps, group_chunk_shift, HAS_ZERO, SCALE16, DT)
            acc = _issue(a0, a1, x_smem, ready, t, acc, STAGES)
            acc, b0, b1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, b0, b1))
            _refill(x_desc, x_smem, ready, t - 1 + STAGES, n_steps, c_begin, load_m, STAGES)
            b0, b1 = _operands(wb, zb, sb, a_l, DT, SCALE16)
            wb, zb, sb = _load_chunk(w_ptrs + (t + 3) * _WORDS, w_mask, s_ptr, z_ptr, rows, N, c_begin + t + 3,
                                     t + 3 < n_steps, group_chunk_shift, HAS_ZERO, SCALE16, DT)
            acc = _issue(b0, b1, x_smem, ready, t + 1, acc, STAGES)
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a0, a1))
            _refill(x_desc, x_smem, ready, t + STAGES, n_steps, c_begin, load_m, STAGES)
        if n_steps % 2 == 1:
            a0, a1 = _operands(wa, za, sa, a_l, DT, SCALE16)
            acc = _issue(a0, a1, x_smem, ready, n_steps - 1, acc, STAGES)
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        # partials of a split launch: [splits, M, n_count], this launch's columns
        _store_out_tile(acc, out_ptr, bias_ptr, s_ptr, off_n, n_tile0 * BLOCK_N, load_m, off_m, M, N, stride_om,
                        SPLIT, HAS_BIAS, False, num_warps)


    # ---- int8 codes, one scale per output channel (W8A16 prefill) ----

    @gluon.jit
    def _byte_minus_zero(words, F: gl.constexpr, zm, DT: gl.constexpr):
        """u - z of byte F of `words` in DT, exact (|u - z| <= 255 fits bfloat16's 8 significant bits): the byte
        OR-ed under 0x4B000000 is the float32 2^23 + u, minus zm = 2^23 + z."""
        v = ((words >> (8 * F)) & 0xFF) | 0x4B000000
        return (v.to(gl.float32, bitcast=True) - zm).to(DT)

    @gluon.jit
    def _w8_operand(words, zm, a_layout: gl.constexpr, DT: gl.constexpr):
        """[BLOCK_N, 16] words of a 64-code chunk (field f of word j is k = 16 f + j, as an int4 half chunk) -> the
        exact u - z as the chunk's A operand; zm float32 [BLOCK_N]."""
        z = zm[:, None]
        return _half(_byte_minus_zero(words, 0, z, DT), _byte_minus_zero(words, 1, z, DT),
                     _byte_minus_zero(words, 2, z, DT), _byte_minus_zero(words, 3, z, DT), a_layout)

    @gluon.jit
    def _w8_issue(a, x_smem, ready, t, acc, STAGES: gl.constexpr):
        """Chunk t's product (one x box) into acc, left in flight."""
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        return warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _w8_refill(x_desc, x_smem, ready, t, n_steps, c_begin, off_m, STAGES: gl.constexpr):
        """Chunk t (of this split) into slot t % STAGES, after every warp retired the slot's previous product."""
        _cta_barrier()
        slot = t % STAGES
        fill = t < n_steps
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes, pred=fill)
        _tma_load(x_desc, [off_m, (c_begin + t) * _HALF], ready.index(slot), x_smem.index(slot), pred=fill)

    @gluon.jit
    def _w8_wgmma_kernel(
        x_desc, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
        M, N, K, stride_wn, stride_om, chunks_per_split,
        HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
        GROUP: gl.constexpr, num_warps: gl.constexpr,
    ):
        """out [M, N] (SPLIT: float32 partials [splits, M, N]) = s * (x @ (u - z)^T) (+ bias): `_wo_wgmma_kernel`'s
        pipeline on 64-code int8 chunks, one x box and one product per chunk, the per-channel scale on the sums."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = 16 * num_warps
        DT: gl.constexpr = x_desc.dtype
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_l: gl.constexpr = _word_layout(gl.to_linear_layout(a_l, [BLOCK_N, _HALF]))

        pid_n, pid_m = _tile_coords(gl.program_id(0), N, M, BLOCK_N, BLOCK_M, GROUP)
        off_n = pid_n * BLOCK_N
        off_m = pid_m * BLOCK_M
        load_m = gl.maximum(gl.minimum(off_m, M - BLOCK_M), 0)  # no x box past row M (`_wo_wgmma_kernel`)
        c_begin = gl.program_id(1) * chunks_per_split
        n_steps = gl.minimum(chunks_per_split, gl.cdiv(K, _HALF) - c_begin)

        x_smem = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, _HALF], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            _w8_refill(x_desc, x_smem, ready, s, n_steps, c_begin, load_m, STAGES)

        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        rj = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, w_l))
        w_ptrs = w_ptr + rows.to(gl.int64)[:, None] * stride_wn + c_begin * _WORDS + rj[None, :]
        w_mask = (rows < N)[:, None] & (rj < _WORDS)[None, :]
        if HAS_ZERO:
            zm = gl.load(z_ptr + rows, mask=rows < N, other=0).to(gl.float32) + 8388608.0
        else:
            zm = gl.full([BLOCK_N], 8388736.0, gl.float32, gl.SliceLayout(1, w_l))  # 2^23 + 128: biased codes

        wa = gl.load(w_ptrs, mask=w_mask & (n_steps > 0))
        wb = gl.load(w_ptrs + _WORDS, mask=w_mask & (n_steps > 1))
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        b = gl.zeros([BLOCK_N, _HALF], DT, a_l)  # "chunk -1": the first wait retires its (absent) product
        for t in range(0, n_steps - 1, 2):  # whole pairs, then the odd last chunk (`_wo_wgmma_kernel`: C7513)
            a = _w8_operand(wa, zm, a_l, DT)
            wa = gl.load(w_ptrs + (t + 2) * _WORDS, mask=w_mask & (t + 2 < n_steps))
            acc = _w8_issue(a, x_smem, ready, t, acc, STAGES)
            acc, b = warpgroup_mma_wait(num_outstanding=1, deps=(acc, b))
            _w8_refill(x_desc, x_smem, ready, t - 1 + STAGES, n_steps, c_begin, load_m, STAGES)
            b = _w8_operand(wb, zm, a_l, DT)
            wb = gl.load(w_ptrs + (t + 3) * _WORDS, mask=w_mask & (t + 3 < n_steps))
            acc = _w8_issue(b, x_smem, ready, t + 1, acc, STAGES)
            acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
            _w8_refill(x_desc, x_smem, ready, t + STAGES, n_steps, c_begin, load_m, STAGES)
        if n_steps % 2 == 1:
            a = _w8_operand(wa, zm, a_l, DT)
            acc = _w8_issue(a, x_smem, ready, n_steps - 1, acc, STAGES)
            acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        _store_out_tile(acc, out_ptr, bias_ptr, s_ptr, off_n, 0, load_m, off_m, M, N, stride_om, SPLIT, HAS_BIAS,
                        True, num_warps)


def x_descriptor(x2d: torch.Tensor, block_m: int):
    """x2d in [block_m, 64] boxes (the B operand's K-major halves of a chunk); also weight_only_ws's."""
    return operand_descriptor(x2d, [block_m, HALF])


def splits_for(m: int, n: int, k: int, cfg: WgmmaW4Config, num_sms: int) -> int:
    """Split-K count: enough programs for programs_per_sm x SMs where the tiles alone are fewer (1: none)."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if cfg.programs_per_sm == 0 or tiles >= cfg.programs_per_sm * num_sms:
        return 1
    total = cdiv(k, CHUNK)
    splits = max(1, min(total, cfg.programs_per_sm * num_sms // tiles))
    return cdiv(total, cdiv(total, splits))


@dataclass(frozen=True)
class TailSplit:
    """Two launches instead of one whose last wave of whole-K tiles would leave most SMs idle: the first
    main_tiles_n column tiles (main_tiles_n x block_n weight rows) as whole-K tiles in whole waves, then the
    remaining weight rows split `splits` ways over K (float32 partials, `weight_only.splitk_reduce`), so the last
    wave takes about 1 / splits of a whole tile's time."""
    main_tiles_n: int
    splits: int


MAX_TAIL_SPLITS = 4
# the tail's partial stores and the reduce launch, in waves of whole tiles (a guess that keeps near-ties unsplit)
_TAIL_OVERHEAD = 0.1


def _waves(m: int, n: int, k: int, cfg: WgmmaW4Config, num_sms: int, tail: Optional[TailSplit]) -> float:
    """Modelled duration in waves of whole-K tiles (one program per SM)."""
    tiles_m = cdiv(m, cfg.block_m)
    if tail is None:
        splits = splits_for(m, n, k, cfg, num_sms)
        total = cdiv(k, CHUNK)
        return cdiv(tiles_m * cdiv(n, cfg.block_n) * splits, num_sms) * cdiv(total, splits) / total
    tail_tiles = tiles_m * (cdiv(n, cfg.block_n) - tail.main_tiles_n)
    return (cdiv(tiles_m * tail.main_tiles_n, num_sms) + cdiv(tail_tiles * tail.splits, num_sms) / tail.splits
            + _TAIL_OVERHEAD)


def tail_split_for(m: int, n: int, k: int, cfg: WgmmaW4Config, num_sms: int) -> Optional[TailSplit]:
    """The `TailSplit` for this shape where the model says it is shorter than one launch, else None: the main
    launch takes whole columns of tiles that fill whole waves, the tail gets as many K splits (up to
    MAX_TAIL_SPLITS) as fit the SMs in one wave. Not where split-K already spreads the tiles (`splits_for`)."""
    if splits_for(m, n, k, cfg, num_sms) > 1:
        return None
    tiles_m, tiles_n = cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)
    columns_per_wave = num_sms // tiles_m
    if columns_per_wave == 0:
        return None
    main = tiles_n // columns_per_wave * columns_per_wave
    tail_tiles = (tiles_n - main) * tiles_m
    if main == 0 or tail_tiles == 0:
        return None
    splits = min(MAX_TAIL_SPLITS, num_sms // tail_tiles, cdiv(k, CHUNK))
    if splits < 2:
        return None
    plan = TailSplit(main, splits)
    return plan if _waves(m, n, k, cfg, num_sms, plan) < _waves(m, n, k, cfg, num_sms, None) else None


def _check_tail(tail: TailSplit, n: int, k: int, cfg: WgmmaW4Config) -> None:
    if not (1 <= tail.main_tiles_n < cdiv(n, cfg.block_n) and 2 <= tail.splits <= cdiv(k, CHUNK)):
        raise ValueError(f"tail: expected 1 <= main_tiles_n < {cdiv(n, cfg.block_n)} column tiles of {cfg.block_n} "
                         f"rows and 2 <= splits <= {cdiv(k, CHUNK)} chunks, got {tail}")


def group_chunk_shift(scales: torch.Tensor, group_size: int) -> int:
    """chunk >> this is the chunk's group (groups of a power of two of whole chunks); per channel a shift that
    sends every chunk to group 0."""
    return 30 if scales.shape[0] == 1 else (group_size // CHUNK).bit_length() - 1


def _launch(x_desc, qweight, scales, zeros, bias, dst, m: int, n: int, k: int, group_size: int,
            cfg: WgmmaW4Config, n_first: int, n_count: int, ways: int) -> None:
    """Weight rows n_first .. n_first + n_count (n_first a multiple of block_n) into dst: out itself (ways 1, bias
    added) or float32 partials [ways, M, n_count] of K split `ways` ways in whole chunks."""
    total = cdiv(k, CHUNK)
    split = ways > 1
    has_bias = bias is not None and not split
    launch_kernel(_wo_wgmma_kernel, (cdiv(m, cfg.block_m) * cdiv(n_count, cfg.block_n), ways),
        x_desc, qweight, scales, zeros if zeros is not None else scales, bias if has_bias else scales, dst,
        m, n, k, qweight.stride(0), dst.stride(-2), cdiv(total, ways), group_chunk_shift(scales, group_size),
        n_first // cfg.block_n,
        n_count,
        HAS_ZERO=zeros is not None, HAS_BIAS=has_bias, SPLIT=split, SCALE16=scales.dtype == x_desc.base.dtype,
        STAGES=cfg.stages, GROUP=cfg.group, num_warps=cfg.num_warps,
    )


def _ways(k: int, wanted: int) -> int:
    """K splits of whole chunks: as many as `wanted` allows evenly."""
    total = cdiv(k, CHUNK)
    return cdiv(total, cdiv(total, max(1, min(wanted, total))))


def run_tail(out, x2d, qweight, scales, zeros, bias, group_size: int, n: int, cfg: WgmmaW4Config,
             tail: "TailSplit", x_desc=None) -> None:
    """`tail`'s columns (weight rows from tail.main_tiles_n x block_n on) of out = x2d @ w_hat.T (+ bias), split
    over K and reduced: the second launch of a tail split, whichever kernel ran the first. x_desc: x2d's
    descriptor in [block_m, 64] boxes where the first launch built it."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    m, k = x2d.shape
    n_main = tail.main_tiles_n * cfg.block_n
    ways = _ways(k, tail.splits)
    part = torch.empty((ways, m, n - n_main), dtype=torch.float32, device=x2d.device)
    if x_desc is None:
        x_desc = x_descriptor(x2d, cfg.block_m)
    _launch(x_desc, qweight, scales, zeros, bias, part, m, n, k, group_size, cfg, n_main, n - n_main, ways)
    splitk_reduce(part, None if bias is None else bias[n_main:], out[:, n_main:])


def wgmma_w4_mm(x2d, qweight, scales, zeros, bias, group_size: int, n: int,
                config: Optional[WgmmaW4Config] = None, splits: Optional[int] = None,
                tail: Optional[TailSplit] = None) -> torch.Tensor:
    """out [M, N] = x2d @ w_hat.T (+ bias) for int4 codes; the caller checked `applies` and validated the
    arguments. splits (one launch split over K) and tail (`TailSplit`) override the model's choice; at most one
    of them."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    m, k = x2d.shape
    if splits is not None and tail is not None:
        raise ValueError(f"splits and tail: expected at most one of them, got splits={splits}, tail={tail}")
    if config is None and splits is None and tail is None:
        cfg, splits, tail = plan(m, n, k, arch_key(x2d.device.type, x2d.device.index), sm_count(x2d.device))
    else:
        cfg = config or pick_config(m, n, k, x2d.device)
        if splits is None and tail is None:
            sms = sm_count(x2d.device)
            splits = splits_for(m, n, k, cfg, sms)
            tail = tail_split_for(m, n, k, cfg, sms)
    check_config(cfg)
    if tail is not None:
        _check_tail(tail, n, k, cfg)
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    x_desc = x_descriptor(x2d, cfg.block_m)
    n_main = n if tail is None else tail.main_tiles_n * cfg.block_n
    ways = _ways(k, splits) if tail is None else 1
    if ways == 1:
        _launch(x_desc, qweight, scales, zeros, bias, out, m, n, k, group_size, cfg, 0, n_main, 1)
    else:
        part = torch.empty((ways, m, n), dtype=torch.float32, device=x2d.device)
        _launch(x_desc, qweight, scales, zeros, bias, part, m, n, k, group_size, cfg, 0, n, ways)
        splitk_reduce(part, bias, out)
    if tail is not None:
        run_tail(out, x2d, qweight, scales, zeros, bias, group_size, n, cfg, tail, x_desc)
    return out


# ---- int8 codes, one scale per output channel (W8A16 prefill): `_w8_wgmma_kernel` ----

W8_CHUNK = 64  # int8 codes per chunk of 16 words: one [block_m, 64] x box
# Per architecture, the int8 kernel's config (the int4 kernel's config class: the same fields; row_cost unused).
# H100 (results/tune_weight_only_w8_wgmma.json: W8A16 per channel, float32 scales, five Llama-3 shapes, M = 33..4096,
# CUDA graphs, min of 2 rounds): the 256-row tile with 3 stages was the best or within 2% of it from M = 256 to 4096 on
# every shape; the 128-row tile with 6 stages won only at M = 128, where the int8 tl tile is faster still, and a
# wave model over both (the int4 kernel's) picked the 128-row tile at 6 of 20 points from M = 256 to 2048, each
# time slower (1.09-1.45x the 256-row tile's time), so one config ships.
WGMMA_W8_CONFIGS: Dict[str, WgmmaW4Config] = {"sm90": WgmmaW4Config(256, 8, 3)}
# Where weight_only_mm runs it (`prefer_w8`): M from min_m to max_m. Same sweep, against the dispatch before (the int8
# tl tiles below M = 512, dequantize + cuBLAS from 512): M = 256 1.22-1.56x, 512 1.12-1.61x, 1024 1.07-1.24x on four
# shapes and 0.98x at 4096x6144, 2048 1.01-1.06x; at M = 4096 dequantize + cuBLAS stays (this kernel 0.90-0.96x), and
# at M <= 128 the tl tiles (0.54-0.91x). In weight_only.json's run (stop 50) dequantize + cuBLAS took 0.93-1.24x
# this kernel's time at M = 1024 (less only at 4096x6144) and 0.94-1.05x at 2048: M = 2048 is a tie, kept here
# because dequantize + cuBLAS materializes the bf16 weight (N x K x 2 bytes, 470 MB at 28672x8192) on every call.
WGMMA_W8_DISPATCH: Dict[str, Dict[str, int]] = {"sm90": dict(min_m=256, max_m=2048)}


def applies_w8(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> bool:
    """Whether an int8 product with one scale per output channel can run in `_w8_wgmma_kernel` (sm90, x
    describable by a tensor descriptor); the caller validated the arguments."""
    if not GLUON_AVAILABLE or INTERPRET or not x2d.is_cuda or bits != 8 or scales.shape[0] != 1:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or not sm90_exactly(x2d.device.type, x2d.device.index):
        return False
    return (describable(x2d) and qweight.dtype == torch.int32 and qweight.stride(1) == 1
            and qweight.shape[1] % WORDS_PER_CHUNK == 0)


def prefer_w8(m: int, arch: str) -> bool:
    """Whether weight_only_mm runs the int8 kernel for M rows on `arch` (where `applies_w8`): WGMMA_W8_DISPATCH."""
    rule = WGMMA_W8_DISPATCH.get(arch)
    return rule is not None and rule["min_m"] <= m <= rule["max_m"]


def w8_splits(m: int, n: int, k: int, cfg: WgmmaW4Config, num_sms: int) -> int:
    """`splits_for` on 64-code chunks."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if cfg.programs_per_sm == 0 or tiles >= cfg.programs_per_sm * num_sms:
        return 1
    total = cdiv(k, W8_CHUNK)
    splits = max(1, min(total, cfg.programs_per_sm * num_sms // tiles))
    return cdiv(total, cdiv(total, splits))


def wgmma_w8_mm(x2d, qweight, scales, zeros, bias, n: int, config: Optional[WgmmaW4Config] = None,
                splits: Optional[int] = None) -> torch.Tensor:
    """out [M, N] = s * (x2d @ (u - z).T) (+ bias) for int8 codes with one scale (and zero point) per output
    channel: x @ W.T for the unrounded W = (u - z) * s, within one rounding per weight of x @ w_hat.T (the scale
    after the sums, as `w8_decode`). The caller checked `applies_w8` and validated the arguments."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    m, k = x2d.shape
    sms = sm_count(x2d.device)
    cfg = config or WGMMA_W8_CONFIGS[arch_key(x2d.device.type, x2d.device.index)]
    check_config(cfg)
    total = cdiv(k, W8_CHUNK)
    ways = w8_splits(m, n, k, cfg, sms) if splits is None else splits
    if ways < 1:
        raise ValueError(f"splits: expected >= 1, got {splits}")
    ways = cdiv(total, cdiv(total, min(ways, total)))  # whole chunks per split
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    dst = out if ways == 1 else torch.empty((ways, m, n), dtype=torch.float32, device=x2d.device)
    has_bias = bias is not None and ways == 1
    launch_kernel(_w8_wgmma_kernel, (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), ways),
        x_descriptor(x2d, cfg.block_m), qweight, scales, zeros if zeros is not None else scales,
        bias if has_bias else scales, dst, m, n, k, qweight.stride(0), dst.stride(-2), cdiv(total, ways),
        HAS_ZERO=zeros is not None, HAS_BIAS=has_bias, SPLIT=ways > 1, STAGES=cfg.stages, GROUP=cfg.group,
        num_warps=cfg.num_warps,
    )
    if ways > 1:
        splitk_reduce(dst, bias, out)
    return out
