"""Scaled matmul with fused epilogues (SPEC section 2): INT8 and FP8 GEMMs and block-scaled FP8.

Math (acc = a_q @ b_q; int32 and exact for int8, float32 for fp8):
    out[i, j] = (scale_a[i] * scale_b[j]) * float(acc[i, j] - corr[i, j]) + bias[j]
    corr = 0                      (ScaledEpilogue, ScaledEpilogueBias)
         = azp_adj[j]             (ScaledEpilogueAzp: azp_adj = z_a * colsum(b_q), per-tensor z_a)
         = azp[i] * azp_adj[j]    (ScaledEpilogueAzpPerToken: azp_adj = colsum(b_q))
  corr is subtracted in int32 (exact, before any float conversion); one rounding to out dtype at the end.
Blockwise FP8 (1x128 activation groups, 128x128 weight blocks):
    out[i, j] = sum_kb (scale_a[i, kb] * scale_b[kb, j // 128]) * dot(a[i, kb-block], b[kb-block, j]) + bias[j]
  How the per-step scales are applied is MMConfig.variant (BLOCKWISE_VARIANTS: two float32 tiles, a rescaled
  single accumulator, one weight scale per tile); the shipped sm90 table uses variant 2, measured fastest.
  On sm90 at the M of blockwise_wgmma.takes_m (96..128 and from 192 rows), with describable operands, the Gluon
  kernel of blockwise_wgmma.py runs instead (asynchronous wgmma, each step's partial scaled while the next step's
  product runs): 1.25-1.5x this one.

Design:
- One tile kernel per family. Tiles are visited in grouped order (GROUP_M row-tiles share a column
  band of b) so the weight band stays in L2 while a moves through it.
- Pointer loads: rows/columns past M/N are wrapped (index % M) instead of masked, so the tile loads stay
  unmasked in M and N; only the K tail is masked, and only when K is not a multiple of the K step (EVEN_K).
- Small M (decode) is weight streaming: few output tiles cannot occupy the GPU, so K is split across
  programs (SPLIT_K). Each split writes its raw partial (int32 for int8, exact) to a workspace and a
  second kernel sums the splits and applies the epilogue. Deterministic, no atomics, no memset, so it
  is CUDA-graph safe.
- Tensor descriptors (sm90 table: large M, and M = 1 or N <= 16384 in decode): the copy engine moves the
  tiles, zero fill past M, N and K (`tma_applies`: K-contiguous a and b^T with 16-byte aligned rows; else the
  table's pointer-load candidates run); at large M a persistent grid of one or two programs per SM whose
  flattened tile loop issues the next tile's loads under this tile's epilogue (MMConfig.tma / persistent).
- sm90 (a WsConfig in the table; from 257 rows, fp8 where its tiles fill one round of the SMs, int8 at any fill:
  WS_MIN_ROUND_FILL; both at 116..128 and 231..256 rows: WS_MIN_ROW_FILL): the warp-specialized Gluon
  kernel of rowwise_wgmma.py (a copy-engine loader partition, two consumer warpgroups on 128x256 tiles, or ping-pong
  on 128x128 tiles: `_ws_pick`); the `tl` kernel stays its twin everywhere else and on the CPU.
- Row split (`row_split`, GPU; scaled_mm and scaled_mm_blockwise): an M a few rows past whole rounds of tiles
  (1040 = 1024 + 16 at 14336x4096) runs as two calls into one output, the whole rounds and a decode-sized rest,
  where the model (ROW_SPLIT) says the rest is shorter than the extra, part-filled round of tiles it replaces
  (1.1-1.4x there on the H100).
- Configs come from a table per architecture and M bucket (`CONFIGS`), never from a tuning sweep at
  first call. QUANTFUSE_AUTOTUNE=1 opts in to timing the bucket's candidates once per shape.
- Under the Triton interpreter, fp8 loads cannot take `other=`; the K tail is then zeroed after the load
  and the fp8 product is formed from float32 upcasts (exact: a product of two fp8 values fits float32).
  The interpreter's int8 tl.dot with an int32 accumulator is exact (checked in the tests against int64),
  so int8 needs no twin.
Launchers assume arguments were validated by `quantfuse.ops`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, cast_to, cdiv, describable, describable_transposed, descriptor, grid_dependency_sync,
                      launch_kernel, pdl_launch_options, persistent_grid, remember_plan, tile_coords, tma_variant)
from .configs import arch_key, sm_count, smem_limit, split_k_reduce_pdl

if TYPE_CHECKING:  # imported lazily at run time (blockwise_wgmma imports this module)
    from .blockwise_wgmma import WgmmaConfig


# ----------------------------------------------------------------------------------------------------
# Config table: per architecture, per M bucket (upper bound of M), a list of candidates; the first is
# the shipped choice, the rest are what QUANTFUSE_AUTOTUNE=1 tries.
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MMConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # split-K is chosen at launch from the SM count unless fixed here (0 = automatic)
    split_k: int = 0
    # blockwise kernel only (see BLOCKWISE_VARIANTS); scaled_mm accepts 0 only
    variant: int = 0
    # scaled_mm only: operands through tensor descriptors (TMA; where `tma_applies`), and programs per SM
    # of a persistent grid (0: one program per tile; split-K launches ignore it)
    tma: bool = False
    persistent: int = 0


@dataclass(frozen=True)
class WsConfig:
    """The warp-specialized Gluon kernel of rowwise_wgmma.py (sm90, describable operands): a persistent grid, a
    copy-engine loader and two consumer warpgroups on 128 x block_n tiles, `stages` shared-memory slots."""
    block_m: int = 128
    block_n: int = 256
    stages: int = 4
    group_m: int = 8
    tma: bool = True  # needs tensor descriptors (the table filter for non-describable operands)
    # ping-pong: each consumer warpgroup takes every other tile whole (128 x block_n as two 64-row
    # accumulators), so one's epilogue runs while the other's main loop keeps the tensor cores busy
    pingpong: bool = False


_BIG = 1 << 62

# A bucket is (max_m, configs), (max_m, max_n, configs) or (max_m, max_n, min_k, configs): the first bucket with
# M <= max_m (and N <= max_n, K >= min_k) gives the candidates, of which the first runs unless autotuning is
# opted into.
Bucket = Union[Tuple[int, List[MMConfig]], Tuple[int, int, List[MMConfig]], Tuple[int, int, int, List[MMConfig]]]
# (a candidate may also be a WsConfig: the Gluon kernel, skipped where it does not apply)

# Decode rows from benchmarks/tune_scaled_mm_decode.py on the H100 (fp8 and int8 alike, CUDA graphs, weights
# rotated past L2), pointer loads: at M = 1 a 64-wide tile, at M = 16 a 32-wide one (4096x6144: 13.6 us vs
# 16.9; 14336x4096: 28.9 vs 31.6), and 128-wide for N beyond 8192 (4096x28672: 50.4 us vs 55.5).
# Tensor-descriptor loads at M = 1 and for N up to 16384 (tune_scaled_mm_decode_tma2.json: the six Llama-3 shapes,
# fp8 and int8, same run; geometric mean over each bucket's shapes against the previous row): M = 1, N <= 8192
# 32-wide with TMA 0.92x the time (fp8 1x4096x6144 13.9 us vs 17.0); M = 1 and 16, N = 10240 64-wide with TMA
# 36.8 / 36.7 us vs 40.7 / 42.1 (the 128-wide tile stays for N = 28672: 49.2 vs 50.1 with TMA); M = 16, N <= 8192
# unchanged (TMA within 1%).
_SM90_SMALL_M: List[Bucket] = [
    (1, 8192, [MMConfig(16, 32, 256, 4, 4, tma=True), MMConfig(16, 64, 256, 4, 4), MMConfig(16, 32, 256, 4, 4)]),
    (1, 16384, [MMConfig(16, 64, 256, 4, 4, tma=True), MMConfig(16, 128, 256, 4, 4)]),
    (1, [MMConfig(16, 128, 256, 4, 4, tma=True), MMConfig(16, 128, 256, 4, 4), MMConfig(16, 64, 256, 4, 4)]),
    (16, 8192, [MMConfig(16, 32, 256, 4, 4), MMConfig(16, 64, 256, 4, 4), MMConfig(16, 128, 128, 4, 5)]),
    (16, 16384, [MMConfig(16, 64, 256, 4, 4, tma=True), MMConfig(16, 32, 256, 4, 4)]),
    (16, [MMConfig(16, 128, 256, 4, 4), MMConfig(16, 64, 256, 4, 4)]),
    (64, [MMConfig(64, 64, 256, 4, 4), MMConfig(64, 128, 128, 4, 4), MMConfig(32, 64, 256, 4, 4)]),
]

# Large M from benchmarks/tune_scaled_mm_prefill.py (H100, the six Llama-3 (K, N) at M = 1024 and 4096, CUDA
# graphs; results/tune_scaled_mm_prefill.json). Past SPLIT_K_MAX_M the launcher takes the first candidate
# whose last wave is about as full as the best one's (`_wave_pick`), so the order is the preference:
# - fp8: 128x256 (group 16) wherever its tiles fill the waves; 128x128 / 4 warps / 5 stages where 128x256
#   leaves the last wave part-empty (1024x4096x6144: 192 tiles on 132 SMs; 45.3 us vs 50.5, torch._scaled_mm
#   45.1; 1024x8192x10240: 136.0 vs 151.9, torch 143.9; tune_scaled_mm_prefill_followup.json).
# - int8: 128x128 / 4 warps / 3 stages on every shape (1024x4096x6144: 51.2 us vs 65.6 for 128x256;
#   4096x4096x4096 116.3 vs 132.1); 128x256 tied only at 4096x28672x8192 (1691 vs 1681 us).
# TMA + persistent (benchmarks/tune_scaled_mm_prefill.py TUNE_OUT_NAME=tune_scaled_mm_tma, same six shapes at
# M = 1024 and 4096, bf16 out, per-token x per-channel + bias, CUDA graphs): operands through tensor
# descriptors with a persistent grid beat the pointer-loaded tiles above on 11 of 12 int8 and 10 of 12 fp8
# shapes:
# - int8 128x128 / 4 warps / 3 stages, 2 programs per SM: 4096x4096x28672 776 us vs 861, 4096x8192x10240
#   515 vs 584, 4096x14336x4096 364 vs 398, 1024x4096x28672 190 vs 205 (4096x28672x8192 1621 vs 1666;
#   128x256 / 8 warps / 1 program 1470 there, but 379 vs 351 at M = 1024).
# - fp8 128x256 / 8 warps / group 16, 1 program per SM: 4096x4096x28672 734 vs 845, 4096x4096x6144 165 vs
#   184, 1024x4096x28672 190 vs 203; 128x128 / 5 stages, 2 programs per SM where 128x256 leaves the last
#   wave part-empty: 1024x8192x10240 131 vs 148, 1024x4096x6144 43.7 vs 46.1. At K = 28672 (N = 8192) the
#   first sweep had them behind (4096 rows: 1424 vs 1346 us), a second one with the order reversed
#   (tune_scaled_mm_tma_fp8_ab.json) ahead (1387 vs 1463; the same pointer tile timed twice in that run:
#   1463 and 1463, but 519 and 605 at 4096x8192x10240): within this machine's run-to-run spread.
_SM90_INT8_LARGE_M = [MMConfig(128, 128, 128, 4, 3, tma=True, persistent=2), MMConfig(128, 128, 128, 4, 3),
                      MMConfig(128, 256, 128, 8, 3)]
# int8 from 2048 rows with K >= 16384: 128x256 / 8 warps / 1 program per SM leads (tune_scaled_mm_tma.json,
# 4096x28672x8192: 1470 us vs 1621 for the 128x128 / 2-per-SM row; at 1024 rows it lost, 379 vs 351).
_SM90_INT8_LONG_K = [MMConfig(128, 256, 128, 8, 3, tma=True, persistent=1)] + _SM90_INT8_LARGE_M
# int8 from 1024 rows: the warp-specialized Gluon kernel (WsConfig; rowwise_wgmma.py). First taken from K = 14336
# (tune_scaled_mm_ws.json: 1.05-1.16x at K = 28672, 1.06-1.10x at K = 14336, 0.87-0.96x at K = 4096); since its
# epilogue stores 16-bit results through a layout of 16-byte stores (tune_scaled_mm_ws_store.json, one call, the
# six Llama-3 shapes at M = 1024 and 4096, bf16 out + bias, CUDA graphs) it is 1.01-1.22x its former self and
# 1.01-1.08x the tl tiles at K = 4096 and 8192 (4096x4096x4096 102.3 us vs 108.6, 1024x8192x10240 135.3 vs 143.3,
# 4096x4096x28672 725 vs 776), so it runs at every K; `_pick_config` took it where its 128x256 tiles fill one
# round of the SMs (since stop 62 that holds for fp8 only: WS_MIN_ROUND_FILL). fp8 through it read 0.85-1.08x the
# tl tiles in that one call (1024x4096x6144 0.85, 4096x4096x6144 1.08) and stayed on them until the A/B below.
_SM90_WS = WsConfig(128, 256, 4, 8)
# The ping-pong schedule of that kernel (WsConfig.pingpong: each consumer warpgroup takes every other 128x128 tile
# whole, so one's epilogue runs under the other's main loop), and fp8 through the Gluon kernels from 1024 rows as
# int8. H100 A/B, 5 rounds whose order rotates (results/tune_scaled_mm_ws_dispatch_rot.json: the six Llama-3 shapes
# at M = 1024 / 2048 / 4096 and 8192^3; ..._small_rot.json: the Llama-3.2-1B / 3B shapes; bf16 out + bias, CUDA
# graphs; kernels compared with each other, not with 'dispatch', which always followed the torch peer and read up
# to 9% off the same kernel timed elsewhere in the round: the clocks follow the previous kernel's power draw):
# - fp8, cooperative kernel against the tl tiles: within 3% either way wherever both fill their last round (4096x
#   28672x8192 1450 us vs 1414, 4096^3 110 vs 113), ahead where 128x256 tiles leave it part-empty only via
#   ping-pong. Earlier calls that read it 1.00-1.29x the tl tiles (tune_scaled_mm_ws_dispatch.json, ..._fp8.json)
#   timed the tl tiles first after torch._scaled_mm, each round.
# - ping-pong (5 stages) leads at K <= 4096 (fp8 4096^3 106.4 us vs 109.7 cooperative / 113.3 tl, 4096x4096x28672
#   762 vs 812 / 789; int8 4096x4096x28672 693 vs 745 / 759, 4096x2048x16384 199 vs 233 / 231) and where its finer
#   tiles fill the last round better (1024x4096x6144 fp8 40.8 vs 53.4 / 44.8, int8 38.9 vs 49.1 / 50.8;
#   1024x8192x10240 fp8 130.8 vs 158.5 / 143.7): `ws_units` models that, ping-pong runs where its busiest program
#   has at most PINGPONG_UNITS of the cooperative kernel's 128x128 tile-times. At longer K it trails by up to 13%
#   (fp8 4096x28672x8192 1603 vs 1450; it moves 1.7x the bytes into shared memory per product).
_SM90_WS_PINGPONG = WsConfig(128, 128, 5, 8, pingpong=True)
_SM90_WS_BOTH = [_SM90_WS, _SM90_WS_PINGPONG]  # `_ws_pick` chooses between them
_SM90_FP8_LARGE_M = [MMConfig(128, 256, 128, 8, 3, 16, tma=True, persistent=1),
                     MMConfig(128, 128, 128, 4, 5, tma=True, persistent=2),
                     MMConfig(128, 256, 128, 8, 3, 16), MMConfig(128, 128, 128, 4, 5), MMConfig(128, 256, 128, 8, 3)]
# 65..256 rows (batched decode): the tl tiles, split over K; the Gluon kernels (`_ws_pick`) where their 128-row tiles
# are at least WS_MIN_ROW_FILL full (116..128 and 231..256 rows). H100 A/B, 5 rotated rounds
# (results/tune_scaled_mm_ws_small_m.json, the six Llama-3 shapes at M = 128 / 192 / 256, fp8 and int8): at 256 rows
# the pick is 1.01-1.37x the tl tile (int8 4096x4096 15.3 us vs 21.0, 4096x28672 63.0 vs 81.6; fp8 4096x6144 17.9
# vs 18.0); at 128 rows 0.93-1.27x (14336x4096, long K on 32 tiles, is the loss: int8 42.2 vs 39.8, fp8 42.5 vs
# 39.4); at 192 rows, a half-empty second row of tiles, `_ws_pick`'s kernel reads 0.81-1.26x it, under 1 on 7 of
# 12: the tl tile's 64-row tiles stay.
_SM90_BATCH_M: Bucket = (256, [MMConfig(64, 128, 128, 4, 4), MMConfig(128, 128, 128, 8, 4),
                               MMConfig(64, 256, 128, 8, 3)] + _SM90_WS_BOTH)
WS_MIN_ROW_FILL = 0.9
# a candidate whose last wave is at least this fraction as full as the best candidate's counts as full
WAVE_TOLERANCE = 0.95
PINGPONG_UNITS = 0.9
PINGPONG_MAX_K = 4096
# Below one round of cooperative (128x256) tiles and from 257 rows (H100 A/B, 5 rotated rounds:
# results/tune_scaled_mm_ws_mid_m.json, the six Llama-3 shapes at M = 384 / 512 / 768;
# tune_scaled_mm_ws_dispatch_small_rot.json at 1024 rows), as a fraction of a round of the SMs from which the Gluon
# kernels run instead of the tl tiles, per table:
# - int8: from any fill. The tl int8 tile (128x128, 3 stages) trails there: 384x4096x4096 22.6 us vs 15.6 ping-pong,
#   512x14336x4096 72.6 vs 45.6, 1024x8192x2048 41.4 vs 26.0, 768x28672x8192 312 vs 252; `_ws_pick` chooses
#   within 3.5% of the faster Gluon kernel on all 18 mid-M shapes (worst 384x4096x6144: ping-pong 27.2 us,
#   cooperative 26.3) and is at most 2.8% behind the tl tile where that leads (1024x2048x3072 15.7 vs 15.3).
# - fp8: from a full round (as from 1024 rows), also from 257 rows: there `_ws_pick`'s kernel reads 0.985-1.08x the
#   tl tiles, over 1.01 on 7 of 8 shapes (768x4096x28672 1.08, 768x4096x6144 1.08, 512x4096x28672 1.05; 512x28672x8192
#   0.985). Below a round it reads 0.92-1.03x them (1024x2048x2048 0.92, 384x4096x6144 0.93): the tl tiles by the wave
#   rule. The cooperative kernel no longer enters the wave rule where its last round ties with the tl tiles': the tl
#   tile led in 7 of those 9 measured cases, by up to 3% (1024x2048x3072 15.9 us vs 16.3, 768x4096x4096 25.7 vs 26.4;
#   1024x8192x3072 48.2 vs 47.8).
WS_MIN_ROUND_FILL = {"sm90": WAVE_TOLERANCE, "sm90_int8": 0.0}
CONFIGS: Dict[str, List[Bucket]] = {
    "sm90": _SM90_SMALL_M + [
        _SM90_BATCH_M,
        (_BIG, _SM90_WS_BOTH + _SM90_FP8_LARGE_M),
    ],
    # int8 operands: the same small-M rows, their own large-M tile (consulted when the table has this key)
    "sm90_int8": _SM90_SMALL_M + [
        _SM90_BATCH_M,
        (2047, _SM90_WS_BOTH + _SM90_INT8_LARGE_M),
        (_BIG, _BIG, 16384, _SM90_WS_BOTH + _SM90_INT8_LONG_K),
        (_BIG, _SM90_WS_BOTH + _SM90_INT8_LARGE_M),
    ],
    "default": [
        (16, [MMConfig(16, 64, 128, 4, 3)]),
        (64, [MMConfig(64, 64, 128, 4, 3)]),
        (_BIG, [MMConfig(128, 128, 64, 8, 3), MMConfig(64, 128, 64, 4, 3)]),
    ],
}

# Blockwise FP8: BLOCK_K divides the 128-wide scale group so each K step has one activation scale per
# row (and one weight-block scale per column). Large-M entries from the tile x variant sweep on the H100
# (benchmarks/tune_scaled_mm.py): variant 2 (one weight scale per tile, BLOCK_N <= 128) with 128x64 or
# 64x128 tiles, 6-10% over variant 0 (M=1024 K=8192 N=10240: 672 vs 608 TFLOPS; 4096^3: 688 vs 644).
BLOCKWISE_CONFIGS: Dict[str, List[Bucket]] = {
    "sm90": [
        (16, [MMConfig(16, 64, 128, 4, 4, variant=2), MMConfig(16, 128, 128, 4, 4, variant=2)]),
        (64, [MMConfig(64, 64, 128, 4, 4, variant=2), MMConfig(64, 128, 128, 4, 4, variant=2)]),
        (256, [MMConfig(64, 128, 128, 4, 4, variant=2), MMConfig(128, 64, 128, 8, 4, variant=2)]),
        (2048, [MMConfig(128, 64, 128, 8, 4, variant=2), MMConfig(64, 128, 128, 4, 3, variant=2)]),
        (_BIG, [MMConfig(64, 128, 128, 4, 3, variant=2), MMConfig(128, 64, 128, 8, 4, variant=2)]),
    ],
    "default": [
        (16, [MMConfig(16, 64, 128, 4, 3)]),
        (_BIG, [MMConfig(64, 128, 128, 4, 3)]),
    ],
}

# How the blockwise kernel applies the per-step scales s_t[m, n] = sa[m, t] * sb[t, n // 128]
# (MMConfig.variant, a bit set: 1 = rescaled accumulator, 2 = one weight scale per tile, 4 = promote the
# tensor-core sum every step; 0 is the original kernel, 2 what the sm90 table ships; 1 and 3 are refused on the
# GPU, see _GPU_INACCURATE_VARIANTS):
#   0 "two_tiles": partial = dot(a, b) into a fresh float32 tile, acc += (sa[:, None] * sb[None, :]) * partial.
#   1 "rescaled": one float32 tile. acc holds acc_true / (ua[:, None] * ub[None, :]) with per-row and per-column
#     running units ua, ub (the step's scales, or the previous units where a scale is zero); each step first
#     rescales acc *= (ua_old / ua)[:, None] * (ub_old / ub)[None, :] (correctly rounded divisions of vectors,
#     no tile of divisions) and then accumulates acc = dot(a, b, acc), so the dot's contribution carries
#     exactly the step's scale; at the end acc_true = (ua[:, None] * ub[None, :]) * acc.
#     - Zero scale: keeps the previous units (ratio 1, never 0 or inf). Exact when that activation group /
#       weight block is all zero, the only way a quantizer emits scale 0 (ours never does: SCALE_FLOOR). Zero
#       scale over nonzero codes adds that step at the previous units where the reference adds 0: a
#       documented deviation of variants 1/3/5/7 (variant 0/2 follow the reference).
#     - Non-finite scales propagate: the output is non-finite wherever the reference's is, in the same
#       rows/columns only (the ratios are per row and per column).
#     - Range: acc is the running true sum in units of the current scale: |acc| <= steps * 2^25 * r, r the
#       largest (earlier scale / current scale), row ratio times column ratio (each a division of two
#       scales, then one product: sa * sb is never formed, so its underflow does not matter). For any codes
#       acc stays finite while steps * r < 2^103 (r < 2^95 at K = 32768); beyond, the true value is not a
#       float32. A scale rising by r divides the earlier sum by r: only what drops below float32's smallest
#       normal, 2^-126 units of the new scale, can be lost, far below any nonzero fp8 product (>= 2^-18).
#       The tests run ratios up to 2^100 (2^60 in a row times 2^40 in a column).
#     - Rounding: about three float32 roundings per scale change (division, ratio product, multiply of acc),
#       none while scales repeat (BLOCK_K < 128 or equal scales); the CPU tests hold the same 1e-6 mean
#       relative error as variant 0.
#     - GPU caveat: Hopper's fp8 wgmma keeps ~14 mantissa bits while it accumulates (DeepSeek-V3), and
#       Triton's sm90 default lets it accumulate over the whole K (as the rowwise kernel does); in variant 0
#       every partial starts at zero, so only 128 products are summed that way. Bit 4 (variants 5/7) asks
#       Triton to promote into float32 every BLOCK_K (tl.dot max_num_imprecise_acc=BLOCK_K), which brings
#       back a compiler-managed partial tile. Measure the error (benchmarks/tune_scaled_mm.py records it).
#   2 "tile_scale_b": as 0, but when BLOCK_N divides 128 all of a tile's columns lie in one weight block
#     (the tile starts at a multiple of BLOCK_N; wrapped columns past N are never stored), so sb is one scalar
#     per step folded into the row vector: acc += (sa * sb)[:, None] * partial (one FMA per element).
#   3 = 1 + 2: the rescale is one row vector per step (acc *= ((ua_old / ua) * (ub_old / ub))[:, None]).
#   5 = 1 + 4, 7 = 3 + 4.
# The launcher drops bit 2 where BLOCK_N does not divide 128 (3 -> 1, 2 -> 0, 7 -> 5): see blockwise_modes.
BLOCKWISE_VARIANTS = {
    0: "two_tiles", 1: "rescaled", 2: "tile_scale_b", 3: "rescaled+tile_scale_b",
    5: "rescaled+promote", 7: "rescaled+tile_scale_b+promote",
}
BLOCKWISE_SCALE_BLOCK = 128

# Split-K is for weight streaming at decode-like M only.
SPLIT_K_MAX_M = 256

# Row split (`row_split`): an M just past a whole number of rounds of tiles (e.g. 1040 rows, where 1024 fill the
# H100's programs once) pays for one more, part-filled round. There the launcher runs the rows that fill whole
# rounds as one call and the few rows left (at most SPLIT_K_MAX_M: a decode-sized call that streams the weight
# once, split over K) as a second call into the same output, when the model says the second call is shorter
# than `max_tail_fraction` of that extra round: a round of programs_per_sm tiles per SM modelled as
# 2 * rows * N * K / ops_per_s, the extra round (few tiles, one per SM) as a round / programs_per_sm, the tail as
# the longer of streaming the weight (N * K * element_size / bytes_per_s) and its products (2 * rows * N * K at the
# family's decode rate, tail_ops_per_s) plus fixed_s. H100, bf16 out (results/tune_scaled_mm_row_split.json):
# rowwise int8 / fp8 with 128x128 tiles two per SM, whole rounds of 1024 x 4096 x 14336 83 us, 1040 rows 158 us, a
# 16-row call 28 us, at 4096 x 4096 32 / 48 / 15 us (left whole); blockwise (one 128x128 program per SM, rounds of
# 512 rows) at 14336 x 4096: 109 / 162 us, rests of 16 / 76 / 256 rows 30 / 50 / 73 us (the last left whole).
# The rowwise decode rate was 1.3e15 until int8 ran the Gluon kernel at K = 4096 / 8192: that rate split 1024 x
# 10240 x 8192 into 768 + 256 rows, 165 us against 135 us for the one call (the 256-row call ~75 us, about 6.4e14 of
# products a second: scaled_mm.json and tune_scaled_mm_ws_store.json, stop 56); tails of a few rows stream the
# weight and do not reach the rate. 6e14 still split 2048 rows into 1920 + 128 at 4096 x 6144 and 8192 x 10240, 1.17-
# 1.30x the time of the one Gluon call, fp8 and int8 (tune_scaled_mm_ws_dispatch_rot.json: 2048x4096x6144 fp8 103.9
# us vs 81.6, int8 93.4 vs 78.4; the 128-row call was not timed alone). At 2.5e14 that tail models as 26 + 8 us,
# over 0.9 of the 25 us extra round, so those shapes run whole; 16-row tails (1040 rows) still split.
# The tail rates were measured on tl tails; since stop 62 tails of 116..128 and 231..256 rows (blockwise: 96..128,
# 192..256) run the Gluon kernels (e.g. 4224 x 14336 x 4096 splits off 128 rows, whose ping-pong call read 0.94x the
# tl tile in tune_scaled_mm_ws_small_m.json), not re-measured as tails.
ROW_SPLIT: Dict[str, Dict[str, object]] = {
    "sm90": dict(ops_per_s=1.3e15, bytes_per_s=2.5e12, fixed_s=8e-6, max_tail_fraction=0.9,
                 tail_ops_per_s={"rowwise": 2.5e14, "blockwise": 3e14}),
}


def row_split(m: int, n: int, k: int, element_size: int, cfg, sms: int, arch: str, family: str = "rowwise") -> int:
    """Rows of the first call of a row-split launch (see ROW_SPLIT), or 0 to run the M rows as one call. cfg: the
    config the whole call would run (its tile and programs per SM set a round); family: "rowwise" (scaled_mm) or
    "blockwise" (scaled_mm_blockwise), whose decode-sized calls differ in speed."""
    rule = ROW_SPLIT.get(arch)
    if rule is None or m <= SPLIT_K_MAX_M:
        return 0
    # the Gluon kernels: one program per SM (ping-pong: its two consumers' tiles make a round)
    per_sm = max(1, cfg.persistent) if isinstance(cfg, MMConfig) else (2 if getattr(cfg, "pingpong", False) else 1)
    round_rows = (sms * per_sm // cdiv(n, cfg.block_n)) * cfg.block_m  # rows whose tiles fill one round
    if round_rows == 0 or m < round_rows:
        return 0
    main = m // round_rows * round_rows
    tail = m - main
    if tail == 0 or tail > SPLIT_K_MAX_M:
        return 0
    extra_round_s = 2.0 * round_rows * n * k / rule["ops_per_s"] / per_sm
    tail_s = max(n * k * element_size / rule["bytes_per_s"],
                 2.0 * tail * n * k / rule["tail_ops_per_s"][family]) + rule["fixed_s"]
    return main if tail_s < rule["max_tail_fraction"] * extra_round_s else 0

# Under the interpreter every program is a Python loop: small tiles keep the CPU tests fast.
_INTERPRET_CONFIG = MMConfig(16, 32, 32, 4, 1, group_m=2)


def _bucket(table: List[Bucket], m: int, n: int, k: int = 0) -> List[MMConfig]:
    for entry in table:
        max_m, max_n, min_k, configs = ((entry[0], _BIG, 0, entry[1]) if len(entry) == 2 else
                                        (entry[0], entry[1], 0, entry[2]) if len(entry) == 3 else entry)
        if m <= max_m and n <= max_n and k >= min_k:
            return configs
    return table[-1][-1]


def choose_split_k(m: int, n: int, k: int, cfg: MMConfig, device: torch.device) -> int:
    """Split K until about two programs per SM are in flight, keeping at least 4 K steps per split so the
    software pipeline still overlaps loads with math. Only the small-M buckets get here with few tiles."""
    if cfg.split_k:
        return cfg.split_k
    if m > SPLIT_K_MAX_M:
        # past decode sizes a near-full wave of tiles beats the partial-sum round trip through memory
        # (splitting 1024x4096x4096 three ways halved its throughput on the H100)
        return 1
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    k_steps = cdiv(k, cfg.block_k)
    target = 2 * sm_count(device)
    if tiles >= target // 2 or k_steps < 8:
        return 1
    split = min(cdiv(target, tiles), k_steps // 4, 16)
    return max(1, split)


# ----------------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_upcast_interp(x):
    """Exact fp8-e4m3fn -> float32 under the interpreter, whose own cast reads the NaN codes 0x7f / 0xff
    as +-480 (e4m3 without NaN); every other code it converts exactly."""
    bits = x.to(tl.uint8, bitcast=True)
    nan = tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F) == 0x7F, nan, x.to(tl.float32))


@triton.jit
def _tile_operands(pid, a_ptr, b_ptr, M, N, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows/columns, wrapped operand indices, K start and first operand pointers.
    Wrapped indices: out-of-range rows/columns re-read valid memory and are never stored (no contiguity
    hints on them: at the wrap they are not contiguous)."""
    pid_m, pid_n = tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ram = (rm % M).to(tl.int64)
    rbn = (rn % N).to(tl.int64)
    k_start = tl.program_id(1) * K_PER_SPLIT
    rk = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + ram[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rbn[None, :] * stride_bn
    return rm, rn, ram, rbn, k_start, a_ptrs, b_ptrs


@triton.jit
def _load_operand(ptrs, k_ok, EVEN_K: tl.constexpr, IS_FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Load an int8/fp8 tile; masked-off K lanes read as 0. Under the interpreter fp8 comes back as its
    float32 upcast (the interpreter cannot cast `other=0` to fp8), which the dot consumes exactly."""
    if EVEN_K:
        x = tl.load(ptrs)
        if IS_FP8 and INTERPRET:
            x = _fp8_upcast_interp(x)
    elif IS_FP8 and INTERPRET:
        x = tl.where(k_ok, _fp8_upcast_interp(tl.load(ptrs, mask=k_ok)), 0.0)
    elif IS_FP8:
        # `other=0` cannot be cast to fp8 by the compiler: zero the masked lanes through the bits
        bits = tl.load(ptrs, mask=k_ok).to(tl.int8, bitcast=True)
        x = tl.where(k_ok, bits, tl.zeros_like(bits)).to(tl.float8e4nv, bitcast=True)
    else:
        x = tl.load(ptrs, mask=k_ok, other=0)
    return x


@triton.jit
def _mma(a, b, acc, IS_FP8: tl.constexpr, INTERPRET: tl.constexpr):
    # one return per constexpr branch: the code generator does not prune statements after a return
    if IS_FP8:
        if INTERPRET:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _epilogue(
    acc, rm, rn, M, N,
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr,
    AZP_MODE: tl.constexpr, APPLY_SCALES: tl.constexpr,
):
    """acc (int32 or float32) -> float32 result before the final rounding (see module docstring)."""
    m_ok = rm < M
    n_ok = rn < N
    # every vector load is issued before the first use: each one reaches the accumulator's layout through a
    # shared-memory exchange with CTA barriers, and a load written after such a use waits behind it (the loads'
    # latencies came one after another, once per tile)
    if AZP_MODE != 0:
        adj = tl.load(azp_adj_ptr + rn, mask=n_ok, other=0)
    if AZP_MODE == 2:
        zp = tl.load(azp_ptr + rm, mask=m_ok, other=0)
    if APPLY_SCALES:
        if SCALE_A_PER_ROW:
            sa = tl.load(scale_a_ptr + rm, mask=m_ok, other=0.0)
        else:
            sa = tl.load(scale_a_ptr)
        if SCALE_B_PER_COL:
            sb = tl.load(scale_b_ptr + rn, mask=n_ok, other=0.0)
        else:
            sb = tl.load(scale_b_ptr)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0)
    if AZP_MODE == 1:
        acc = acc - adj[None, :]
    elif AZP_MODE == 2:
        acc = acc - zp[:, None] * adj[None, :]
    out = acc.to(tl.float32)
    if APPLY_SCALES:
        if SCALE_A_PER_ROW:
            sa = sa[:, None]
        if SCALE_B_PER_COL:
            sb = sb[None, :]
        out = (sa * sb) * out
    if HAS_BIAS:
        out = out + bias.to(tl.float32)[None, :]
    return out


@triton.jit
def _mm_tile(
    pid, a_src, b_src, out_ptr, ws_ptr,
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om,
    IS_FP8: tl.constexpr, SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP_MODE: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One output tile (split `tl.program_id(1)` of its K range). TMA: a_src is a descriptor over a [M, K]
    (blocks [BLOCK_M, BLOCK_K]) and b_src one over b^T [N, K] (blocks [BLOCK_N, BLOCK_K]); the copy engine
    zero-fills past M, N and K (no wrapped rows, no K masks)."""
    pid_k = tl.program_id(1)
    if IS_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if TMA:
        pid_m, pid_n = tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            a = a_src.load([pid_m * BLOCK_M, k0])
            b = b_src.load([pid_n * BLOCK_N, k0]).T
            if IS_FP8 and INTERPRET:
                a = _fp8_upcast_interp(a)
                b = _fp8_upcast_interp(b)
            acc = _mma(a, b, acc, IS_FP8, INTERPRET)
    else:
        rm, rn, ram, rbn, k_start, a_ptrs, b_ptrs = _tile_operands(
            pid, a_src, b_src, M, N, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = _load_operand(a_ptrs, (kk < k_end)[None, :], EVEN_K, IS_FP8, INTERPRET)
            b = _load_operand(b_ptrs, (kk < k_end)[:, None], EVEN_K, IS_FP8, INTERPRET)
            acc = _mma(a, b, acc, IS_FP8, INTERPRET)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        out = _epilogue(
            acc, rm, rn, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
            SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, True,
        )
        o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, cast_to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        ws = ws_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(ws, acc, mask=mask)


@triton.jit
def _scaled_mm_kernel(
    a_src, b_src, out_ptr, ws_ptr,
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om,
    IS_FP8: tl.constexpr, SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP_MODE: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, PERSISTENT: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """A program per output tile (and K split), or (PERSISTENT, no split) a few programs per SM striding
    over the tiles in one flattened loop, the next tile's loads issued under this tile's epilogue.
    PDL (split-K): signal at once that the reduce kernel, launched early, may take the SMs this grid frees."""
    grid_dependency_sync(PDL)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _mm_tile(tile, a_src, b_src, out_ptr, ws_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
                     M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn, stride_om,
                     IS_FP8, SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, SPLIT_K, EVEN_K,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, INTERPRET)
    else:
        _mm_tile(tl.program_id(0), a_src, b_src, out_ptr, ws_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr,
                 azp_ptr, M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn, stride_om,
                 IS_FP8, SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, SPLIT_K, EVEN_K,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, INTERPRET)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, out_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    M, N, stride_om,
    SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr,
    AZP_MODE: tl.constexpr, APPLY_SCALES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Sum the SPLIT_K partials (int32 sums stay exact) and apply the epilogue once. PDL: launched early behind
    the split-K kernel; waits for its partials before the first load."""
    grid_dependency_sync(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    ptrs = ws_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.load(ptrs, mask=mask, other=0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0)
    out = _epilogue(
        acc, rm, rn, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
        SCALE_A_PER_ROW, SCALE_B_PER_COL, HAS_BIAS, AZP_MODE, APPLY_SCALES,
    )
    o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, cast_to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _blockwise_kernel(
    a_ptr, b_ptr, out_ptr, ws_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, SCALE_MODE: tl.constexpr, SB_PER_TILE: tl.constexpr, PROMOTE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """SCALE_MODE 0: two float32 tiles (acc and the step's partial); 1: one rescaled accumulator.
    SB_PER_TILE: one weight-block scale per step for the whole tile (BLOCK_N divides SCALE_BLOCK).
    PROMOTE (SCALE_MODE 1): the tensor-core sum is promoted into float32 every BLOCK_K.
    See BLOCKWISE_VARIANTS for the math and the numerical guarantees."""
    pid_k = tl.program_id(1)
    rm, rn, ram, rbn, k_start, a_ptrs, b_ptrs = _tile_operands(
        tl.program_id(0), a_ptr, b_ptr, M, N, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    sa_ptrs = scale_a_ptr + ram * stride_sam
    if SB_PER_TILE:
        # the tile's first column is a multiple of BLOCK_N, which divides SCALE_BLOCK: one weight block
        _, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        sb_ptrs = scale_b_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_sbn
    else:
        # one weight-block scale per column (BLOCK_N may span several 128-wide weight blocks)
        sb_ptrs = scale_b_ptr + (rbn // SCALE_BLOCK) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_MODE == 1:
        # running units: acc_true = (ua[:, None] * ub[None, :]) * acc; any nonzero start works (acc = 0)
        ua = tl.full((BLOCK_M,), 1.0, tl.float32)
        if SB_PER_TILE:
            ub = 1.0  # loop-carried as a float32 scalar
        else:
            ub = tl.full((BLOCK_N,), 1.0, tl.float32)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = _load_operand(a_ptrs, (kk < k_end)[None, :], EVEN_K, True, INTERPRET)
        b = _load_operand(b_ptrs, (kk < k_end)[:, None], EVEN_K, True, INTERPRET)
        kb = k0 // SCALE_BLOCK
        sa = tl.load(sa_ptrs + kb * stride_sak)
        sb = tl.load(sb_ptrs + kb * stride_sbk)
        if SCALE_MODE == 0:
            partial = _mma(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), True, INTERPRET)
            if SB_PER_TILE:
                acc += (sa * sb)[:, None] * partial
            else:
                acc += (sa[:, None] * sb[None, :]) * partial
        else:
            # a zero scale keeps the units (its step adds nothing when its codes are zero); NaN/inf pass
            na = tl.where(sa != 0.0, sa, ua)
            nb = tl.where(sb != 0.0, sb, ub)
            ra = tl.math.div_rn(ua, na)
            rb = tl.math.div_rn(ub, nb)
            if SB_PER_TILE:
                acc = acc * (ra * rb)[:, None]
            else:
                acc = acc * (ra[:, None] * rb[None, :])
            if PROMOTE and not INTERPRET:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = _mma(a, b, acc, True, INTERPRET)
            ua = na
            ub = nb
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALE_MODE == 1:
        # the same rounding as the reference's (sa * sb) * part when K is one group
        if SB_PER_TILE:
            acc = (ua * ub)[:, None] * acc
        else:
            acc = (ua[:, None] * ub[None, :]) * acc

    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        out = acc
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, cast_to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        ws = ws_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(ws, acc, mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------
_tuned: Dict[tuple, MMConfig] = {}
# Launch plans (config, split, grid, ...) by shape key: choosing them costs more host time than the launch
# itself (the bucket walk, wave efficiencies and split-K rule in Python); a steady-state call looks its
# shape up. Not used with QUANTFUSE_AUTOTUNE=1 (which keeps its own `_tuned`) or an explicit config.
_PLANS: Dict[tuple, tuple] = {}


def _autotune_enabled() -> bool:
    return os.environ.get("QUANTFUSE_AUTOTUNE", "0") == "1"


def wave_efficiency(m: int, n: int, cfg: MMConfig, sms: int) -> float:
    """Output tiles / (waves * SMs): 1.0 when the last wave of one-tile-per-SM programs is full."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return tiles / (cdiv(tiles, sms) * sms)


def _wave_pick(candidates: List[MMConfig], m: int, n: int, sms: int) -> MMConfig:
    """The first candidate whose wave efficiency is within WAVE_TOLERANCE of the best (large M, no split-K:
    there a part-empty last wave costs up to a whole tile's time; measured in tune_scaled_mm_prefill.json)."""
    eff = [wave_efficiency(m, n, c, sms) for c in candidates]
    best = max(eff)
    return next(c for c, e in zip(candidates, eff) if e >= WAVE_TOLERANCE * best)


def ws_units(m: int, n: int, cfg: WsConfig, sms: int) -> int:
    """The persistent Gluon kernel's time in 128x128 tile-times: the busiest program's tiles (one program per SM),
    block_n / 128 units each (ping-pong's two consumers take turns on the tensor cores: one unit per tile)."""
    return cdiv(cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), sms) * (cfg.block_n // 128)


def _ws_pick(candidates: List[WsConfig], m: int, n: int, k: int, sms: int) -> WsConfig:
    """The first candidate (the cooperative Gluon kernel), or the ping-pong one: up to K = PINGPONG_MAX_K, or
    wherever its busiest program has at most PINGPONG_UNITS of the work (ws_units)."""
    first = candidates[0]
    pingpong = next((c for c in candidates if c.pingpong), None)
    if pingpong is not None and (k <= PINGPONG_MAX_K or
                                 ws_units(m, n, pingpong, sms) <= PINGPONG_UNITS * ws_units(m, n, first, sms)):
        return pingpong
    return first


def tile_smem_bytes(cfg: MMConfig, out_size: int, in_size: int = 1) -> int:
    """Shared memory a tl tile asks for: its num_stages operand slots, plus the output tile that the store's layout
    conversion stages (out_size bytes per element). Exact for the 128x256 fp8 tile on the H100 up to its barriers:
    278528 + 24 bytes with float32 output (out of 232448), which is why a float32 output excludes it."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * in_size + cfg.block_m * cfg.block_n * out_size


# the tl tile left where no listed one fits the shared memory (any output dtype)
_FALLBACK_TILE = MMConfig(128, 128, 64, 8, 3)


def _table_key(table, device: torch.device, flavor: Optional[str]) -> str:
    arch = arch_key(device.type, device.index)
    return f"{arch}_{flavor}" if flavor and f"{arch}_{flavor}" in table else arch


def _pick_config(table, m: int, n: int, k: int, device: torch.device, key: tuple, run,
                 flavor: Optional[str] = None, tma_ok: bool = True, ws_ok: bool = False,
                 out_size: int = 2) -> MMConfig:
    """The bucket's first candidate (past SPLIT_K_MAX_M the Gluon kernel by `_ws_pick` from WS_MIN_ROUND_FILL of a
    round of its tiles, else the first with full waves; up to it the Gluon kernel where its rows fill WS_MIN_ROW_FILL
    of its tiles; with autotuning the fastest). Without describable operands (tma_ok False) the TMA candidates are
    skipped: their pointer-load fallback is a tile nobody measured for that shape; WsConfig candidates only where
    the Gluon kernel applies (ws_ok). tl tiles whose shared memory (`tile_smem_bytes` with out_size-byte outputs;
    4 where split-K partials may be stored) exceeds the device's are skipped (_FALLBACK_TILE if none is left)."""
    if device.type != "cuda":
        return _INTERPRET_CONFIG
    table_key = _table_key(table, device, flavor)
    candidates = _bucket(table[table_key], m, n, k)
    if not ws_ok:
        candidates = [c for c in candidates if not isinstance(c, WsConfig)]
    if not tma_ok:
        candidates = [c for c in candidates if not c.tma] or candidates
    limit, stored = smem_limit(device), max(out_size, 4) if m <= SPLIT_K_MAX_M else out_size
    fitting = [c for c in candidates if isinstance(c, WsConfig) or tile_smem_bytes(c, stored) <= limit]
    if not any(not isinstance(c, WsConfig) for c in fitting):
        fitting.append(_FALLBACK_TILE)
    candidates = fitting
    if not _autotune_enabled() or len(candidates) == 1:
        ws = [c for c in candidates if isinstance(c, WsConfig)]
        tl = [c for c in candidates if not isinstance(c, WsConfig)]
        if m > SPLIT_K_MAX_M:
            # the persistent Gluon kernel's measured wins include part-full last rounds (1024x8192x10240: 320
            # tiles on 132 SMs, 1.06x); below WS_MIN_ROUND_FILL of a round of its tiles, the tl tiles
            sms = sm_count(device)
            fill = WS_MIN_ROUND_FILL.get(table_key, WAVE_TOLERANCE)
            if ws and cdiv(m, ws[0].block_m) * cdiv(n, ws[0].block_n) >= fill * sms:
                return _ws_pick(ws, m, n, k, sms)
            return _wave_pick(tl, m, n, sms)
        if ws and m >= WS_MIN_ROW_FILL * cdiv(m, ws[0].block_m) * ws[0].block_m:
            return _ws_pick(ws, m, n, k, sm_count(device))
        return tl[0]
    if key not in _tuned:
        # opt-in: time each candidate once for this exact shape (not inside graph capture)
        best, best_ms = candidates[0], float("inf")
        for cfg in candidates:
            try:
                ms = triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=20, return_mode="median")
            except Exception:  # a candidate that does not fit (shared memory) is skipped
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        _tuned[key] = best
    return _tuned[key]


def _k_partition(k: int, cfg: MMConfig, split: int) -> Tuple[int, bool]:
    k_steps = cdiv(k, cfg.block_k)
    k_per_split = cdiv(k_steps, split) * cfg.block_k
    even_k = k % cfg.block_k == 0
    return k_per_split, even_k


def _effective_split(k: int, cfg: MMConfig, split: int) -> int:
    # after rounding K_PER_SPLIT up to whole steps, trailing splits may be empty: drop them
    k_per_split, _ = _k_partition(k, cfg, split)
    return max(1, cdiv(k, k_per_split))


def tma_applies(a2d: torch.Tensor, b: torch.Tensor) -> bool:
    """Tensor descriptors over a [M, K] and b^T [N, K]: both K-contiguous with 16-byte aligned rows."""
    return describable(a2d) and describable_transposed(b)


def scaled_mm(
    a2d: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    azp_adj: Optional[torch.Tensor],
    azp: Optional[torch.Tensor],
    config: Optional[MMConfig] = None,
    out: Optional[torch.Tensor] = None,
    split_rows: Optional[int] = None,
) -> torch.Tensor:
    """out [M, N] for a2d [M, K] (unit last stride, any row stride) and b [K, N] (any strides).

    scale_a numel 1 or M, scale_b numel 1 or N (float32), bias [N], azp_adj [N] int32, azp numel M int32.
    out: an [M, N] tensor of out_dtype with unit column stride to write into (a row split's halves). split_rows:
    run rows [0, split_rows) and [split_rows, M) as two calls (0: one call; None: `row_split` decides on the
    GPU, one call elsewhere)."""
    m, k = a2d.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a2d.device)
    is_fp8 = a2d.dtype == torch.float8_e4m3fn
    # the kernel indexes the scales as flat vectors: any contiguous shape of numel 1, M or N serves as is
    scale_a = scale_a if scale_a.is_contiguous() else scale_a.contiguous()
    scale_b = scale_b if scale_b.is_contiguous() else scale_b.contiguous()
    if azp_adj is None:
        azp_mode = 0
    elif azp is None:
        azp_mode = 1
    else:
        azp_mode = 2
        azp = azp if azp.is_contiguous() else azp.contiguous()
    dummy = scale_a
    tma_ok = tma_applies(a2d, b)

    def ws_ok() -> bool:
        # asked when a plan is made or a WsConfig given, not on the cached-plan path (the plan key holds what
        # decides it: dtype, device, describability)
        from .rowwise_wgmma import applies

        return tma_ok and applies(a2d, b)

    def geometry(cfg: MMConfig) -> tuple:
        if isinstance(cfg, WsConfig):
            return (cfg, )
        if cfg.variant:
            raise ValueError(f"config.variant: scaled_mm has no variants (blockwise only), got {cfg.variant}")
        split = _effective_split(k, cfg, choose_split_k(m, n, k, cfg, a2d.device))
        k_per_split, even_k = _k_partition(k, cfg, split)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        use_tma, persistent = tma_variant(cfg.tma, cfg.persistent if split == 1 else 0, tma_ok)
        grid = (persistent_grid(tiles, persistent, sm_count(a2d.device)), split)
        return cfg, split, k_per_split, even_k, use_tma, persistent, grid

    def launch(cfg: MMConfig, plan: Optional[tuple] = None) -> torch.Tensor:
        if isinstance(cfg, WsConfig):
            if plan is None and not ws_ok():
                raise ValueError("config: a WsConfig needs sm90, Gluon and describable int8 / fp8 e4m3 operands "
                                 "(a [M, K] and b^T [N, K] K-contiguous with 16-byte aligned rows)")
            from .rowwise_wgmma import scaled_mm_ws  # imported here: it imports this module

            return scaled_mm_ws(a2d, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, cfg, out=out)
        cfg, split, k_per_split, even_k, use_tma, persistent, grid = plan or geometry(cfg)
        ws = dummy
        # the reduce kernel launched early: the split-K kernel signals it at its start
        pdl = split > 1 and split_k_reduce_pdl(a2d.device)
        if split > 1:
            ws = torch.empty((split, m, n), dtype=torch.float32 if is_fp8 else torch.int32, device=a2d.device)
        common = dict(
            SCALE_A_PER_ROW=scale_a.numel() > 1, SCALE_B_PER_COL=scale_b.numel() > 1,
            HAS_BIAS=bias is not None, AZP_MODE=azp_mode, INTERPRET=INTERPRET,
        )
        a_src, b_src = a2d, b
        if use_tma:
            a_src = descriptor(a2d, (cfg.block_m, cfg.block_k))
            b_src = descriptor(b.t(), (cfg.block_n, cfg.block_k))
        launch_kernel(_scaled_mm_kernel, grid,
            a_src, b_src, out, ws, scale_a, scale_b,
            bias if bias is not None else dummy,
            azp_adj if azp_adj is not None else dummy,
            azp if azp is not None else dummy,
            m, n, k, k_per_split,
            a2d.stride(0), a2d.stride(1), b.stride(0), b.stride(1), out.stride(0),
            IS_FP8=is_fp8, SPLIT_K=split, EVEN_K=even_k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            TMA=use_tma, PERSISTENT=bool(persistent), PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )
        if split > 1:
            _launch_reduce(ws, out, scale_a, scale_b, bias, azp_adj, azp, dummy, split, True, common, pdl)
        return out

    if split_rows and not 0 < split_rows < m:
        raise ValueError(f"split_rows: expected 0 or 0 < split_rows < M={m}, got {split_rows}")
    if config is None:
        key = ("mm", a2d.dtype, m, n, k, b.stride(0) == 1, tma_ok, azp_mode, bias is not None, out_dtype)
        if a2d.is_cuda and not _autotune_enabled():
            plan_key = key + (a2d.device.index,)
            plan = _PLANS.get(plan_key)
            if plan is None:  # (geometry of the whole call, rows of a row split's first call or 0)
                cfg = _pick_config(CONFIGS, m, n, k, a2d.device, key, launch, None if is_fp8 else "int8", tma_ok,
                                   ws_ok(), out.element_size())
                plan = (geometry(cfg), row_split(m, n, k, a2d.element_size(), cfg, sm_count(a2d.device),
                                                 arch_key(a2d.device.type, a2d.device.index)))
                remember_plan(_PLANS, plan_key, plan)
            whole, rows = plan
            if split_rows is None:
                split_rows = rows
            if not split_rows:
                return launch(whole[0], whole)
    if split_rows:
        return _rows_as_two_calls(a2d, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, config, out,
                                  split_rows)
    if config is None:
        config = _pick_config(CONFIGS, m, n, k, a2d.device, key, launch, None if is_fp8 else "int8", tma_ok,
                              ws_ok(), out.element_size())
    return launch(config)


def _rows_as_two_calls(a2d, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, config, out, rows):
    """`scaled_mm` of rows [0, rows) and [rows, M) as two calls writing their rows of `out` (row_split): every
    output row is computed from its own row of a, its scale and zero point only, so the halves are the rows of
    the whole (int8 bit for bit; fp8 up to the accumulation order of the tail's tile)."""
    m = a2d.shape[0]

    def part(t, r0, r1):  # a per-row vector's rows (numel M), or the per-tensor value as it is
        return t if t is None or t.numel() != m or m == 1 else t.reshape(-1)[r0:r1]

    for r0, r1 in ((0, rows), (rows, m)):
        scaled_mm(a2d[r0:r1], b, part(scale_a, r0, r1), scale_b, out_dtype, bias, azp_adj, part(azp, r0, r1),
                  config, out=out[r0:r1], split_rows=0)
    return out


def _launch_reduce(ws, out, scale_a, scale_b, bias, azp_adj, azp, dummy, split, apply_scales, common, pdl=False):
    m, n = out.shape
    block_m, block_n = (16, 32) if INTERPRET else (16, 256)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    launch_kernel(_split_k_reduce_kernel, grid,
        ws, out, scale_a, scale_b,
        bias if bias is not None else dummy,
        azp_adj if azp_adj is not None else dummy,
        azp if azp is not None else dummy,
        m, n, out.stride(0),
        APPLY_SCALES=apply_scales, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, num_warps=4, **common,
        **pdl_launch_options(pdl),
    )


_VARIANT_BITS = {0: (0, False, False), 1: (1, False, False), 2: (0, True, False), 3: (1, True, False),
                 5: (1, False, True), 7: (1, True, True)}


# Measured on the H100 (tests/kernels/test_scaled_mm_blockwise_variants.py, K=4096): worst 128-column block
# mean relative error 1.07e-3 to 1.40e-3 for these, against < 1e-3 for 0, 2, 5 and 7; refused on the GPU
# (the interpreter accumulates in float32 and runs them for the CPU tests of the rescaling algebra).
_GPU_INACCURATE_VARIANTS = (1, 3)


def blockwise_modes(cfg: MMConfig) -> Tuple[int, bool, bool]:
    """(SCALE_MODE, SB_PER_TILE, PROMOTE) that the blockwise kernel runs for `cfg` (see BLOCKWISE_VARIANTS):
    the one-weight-scale-per-tile bit only where BLOCK_N divides the 128-wide weight block, else dropped."""
    if cfg.variant not in _VARIANT_BITS:
        raise ValueError(f"config.variant: expected one of {sorted(_VARIANT_BITS)} for blockwise, got {cfg.variant}")
    if BLOCKWISE_SCALE_BLOCK % cfg.block_k:
        # one activation scale and one row of weight-block scales per K step
        raise ValueError(f"config.block_k: must divide {BLOCKWISE_SCALE_BLOCK} for blockwise, got {cfg.block_k}")
    scale_mode, per_tile, promote = _VARIANT_BITS[cfg.variant]
    return scale_mode, per_tile and BLOCKWISE_SCALE_BLOCK % cfg.block_n == 0, promote


def effective_blockwise_variant(cfg: MMConfig) -> int:
    """The variant that really runs for `cfg` (bit 2 dropped where BLOCK_N does not divide 128)."""
    scale_mode, per_tile, promote = blockwise_modes(cfg)
    return scale_mode | (2 if per_tile else 0) | (4 if promote else 0)


def scaled_mm_blockwise(
    a2d: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    config: Optional[Union[MMConfig, "WgmmaConfig"]] = None,
    out: Optional[torch.Tensor] = None,
    split_rows: Optional[int] = None,
) -> torch.Tensor:
    """Block-scaled fp8: scale_a [M, ceil(K/128)] (any strides), scale_b [ceil(K/128), ceil(N/128)].
    out / split_rows as in `scaled_mm` (row_split decides on the GPU where split_rows is None).
    On sm90 with describable operands and the M of blockwise_wgmma.takes_m the Gluon kernel runs
    (blockwise_wgmma: asynchronous wgmma with lagged promotion; `config` may be a WgmmaConfig for it),
    elsewhere this module's `tl` kernel (`config` an MMConfig)."""
    from . import blockwise_wgmma as bw

    m, k = a2d.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a2d.device)
    if split_rows and not 0 < split_rows < m:
        raise ValueError(f"split_rows: expected 0 or 0 < split_rows < M={m}, got {split_rows}")
    gluon = isinstance(config, bw.WgmmaConfig) or (config is None and bw.applies(a2d, b))
    if split_rows is None and config is None and a2d.is_cuda and not _autotune_enabled():
        key = ("blockwise_rows", m, n, k, gluon, a2d.device.index)
        split_rows = _PLANS.get(key)
        if split_rows is None:
            cfg = (bw.pick_config(m, n, a2d.device) if gluon else
                   _pick_config(BLOCKWISE_CONFIGS, m, n, k, a2d.device, key, None, out_size=out.element_size()))
            split_rows = row_split(m, n, k, 1, cfg, sm_count(a2d.device), arch_key(a2d.device.type, a2d.device.index),
                                   "blockwise")
            remember_plan(_PLANS, key, split_rows)
    if split_rows:
        for r0, r1 in ((0, split_rows), (split_rows, m)):  # rows are independent (see _rows_as_two_calls)
            scaled_mm_blockwise(a2d[r0:r1], b, scale_a[r0:r1], scale_b, out_dtype, bias, config, out=out[r0:r1],
                                split_rows=0)
        return out
    if gluon:
        if not bw.applies(a2d, b, any_m=True):
            raise ValueError("config: a WgmmaConfig needs sm90, Gluon and describable fp8 e4m3 operands")
        return bw.scaled_mm_blockwise_wgmma(a2d, b, scale_a, scale_b, out_dtype, bias, config, out=out)
    dummy = out

    def launch(cfg: MMConfig) -> torch.Tensor:
        scale_mode, sb_per_tile, promote = blockwise_modes(cfg)
        split = _effective_split(k, cfg, choose_split_k(m, n, k, cfg, a2d.device))
        k_per_split, even_k = _k_partition(k, cfg, split)
        ws = dummy
        if split > 1:
            ws = torch.empty((split, m, n), dtype=torch.float32, device=a2d.device)
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), split)
        launch_kernel(_blockwise_kernel, grid,
            a2d, b, out, ws, scale_a, scale_b, bias if bias is not None else dummy,
            m, n, k, k_per_split,
            a2d.stride(0), a2d.stride(1), b.stride(0), b.stride(1), out.stride(0),
            scale_a.stride(0), scale_a.stride(1), scale_b.stride(0), scale_b.stride(1),
            HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            SCALE_BLOCK=BLOCKWISE_SCALE_BLOCK, SCALE_MODE=scale_mode, SB_PER_TILE=sb_per_tile,
            PROMOTE=promote, INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if split > 1:
            common = dict(SCALE_A_PER_ROW=False, SCALE_B_PER_COL=False, HAS_BIAS=bias is not None,
                          AZP_MODE=0, INTERPRET=INTERPRET)
            _launch_reduce(ws, out, dummy, dummy, bias, None, None, dummy, split, False, common)
        return out

    if config is None:
        key = ("blockwise", m, n, k, b.stride(0) == 1, bias is not None, out_dtype)
        config = _pick_config(BLOCKWISE_CONFIGS, m, n, k, a2d.device, key, launch, out_size=out.element_size())
    if a2d.device.type == "cuda" and config.variant in _GPU_INACCURATE_VARIANTS:
        raise ValueError(
            f"config.variant: {config.variant} lets the tensor cores accumulate the whole K at their reduced "
            f"internal precision and misses the 1e-3 error bound on the GPU (measured 1.1e-3 to 1.4e-3 on an "
            f"H100); use 0, 2, 5 or 7")
    return launch(config)


def azp_adjustment(b: torch.Tensor, azp: Optional[torch.Tensor]) -> torch.Tensor:
    """colsum(b_q) as int32, times the per-tensor zero point when given (offline, torch is enough)."""
    colsum = b.to(torch.int32).sum(dim=0, dtype=torch.int32)
    if azp is not None:
        colsum = colsum * azp.reshape(()).to(torch.int32)
    return colsum
