"""Triton kernels of the INT8 transformer encoder (SPEC section 6; the FasterTransformer v3.0 fusion plan
rebuilt for Hopper with plain K-contiguous layouts instead of COL32 / COL4_4R2_8C tile orders).

Symbols: activations are quantized per tensor, `x ~ s_x * x_q`; weights per output channel,
`W[n, :] ~ s_w[n] * W_q[n, :]`; every int8 product accumulates exactly in int32 (`acc`).

* `int8_gemm` -- `acc = A_q @ W_q^T` with one of three epilogues, all in float32 from
  `v = acc * (s_a * s_w[n]) + bias[n]`:
  - `"residual"`: `y = v + residual` (fp16 residual, or int8 residual times its scale), stored fp16
    (it feeds `layernorm_quant`; the LayerNorm needs whole rows, which one GEMM tile does not hold);
  - `"requant"`: `q = sat(rne(act(v) / s_out))` with act = identity or erf-GELU (erf by Abramowitz & Stegun
    7.1.26 where the table says `fast_gelu`: |GELU error| <= 7e-7 on [-12, 12] with an exact reciprocal and
    exponential (interpreter), as small as float32's own rounding there, and within the GPU test's 1e-6 with
    the approximate MUFU ones; `fast_gelu` 2 with the reciprocal requantization: the same erfc in
    `relu(p) - |p| erfc(|z|) / 2`, p = v / s_out, the scale factors folded into its constants), stored int8;
  - `"qkv"`: the fused Q|K|V projection: `q = sat(rne(v / s_out[n]))` (s_out = s_q, s_k or s_v by
    column), stored head-split: Q and K as `[2, heads, T, head_dim]`, V transposed as
    `[heads, head_dim, T_v]` so that P.V reads V K-major (the only int8 operand order wgmma takes).
  The table picks per tile and epilogue how operands arrive (pointer loads, or tensor descriptors: the
  Hopper copy engine, zero fill past the edges) and whether the grid is persistent (a few programs per SM
  striding over tiles in one flattened loop, the next tile's loads issued under this tile's epilogue). Where
  few tiles would leave most SMs idle (small token counts, long K), the table splits K over several programs per
  tile: each stores its int32 partial, and the tile's last program to finish sums them (exact: the same bits as
  one program) and runs the epilogue.
* `int8_attention` -- one program per (query block, head, sequence) over packed variable-length
  sequences (`cu_seqlens`), key mask optional. Pass 1 finds the row max m and the normaliser l of
  `s = (Q_q . K_q^T) * s_q * s_k / sqrt(d)` over unmasked keys; pass 2 recomputes s, forms the final
  probabilities `p = exp(s - m) / l`, quantizes them `p_q = sat(rne(p / s_p))` on chip and accumulates
  `P_q . V_q` in int32; the epilogue dequantizes `ctx = acc * s_p * s_v`, merges heads and requantizes
  `sat(rne(ctx / s_ctx))` into `[T, hidden]`. Probabilities never leave the chip. Two passes because the
  requantization needs the final (normalised) probabilities, which an online softmax only knows at the end.
  Where the batch's longest sequence fits one key block (`attention_one_pass`, up to 128 keys on sm90), a
  single pass holds whole score rows: m and l are plain reductions and each score is computed and
  exponentiated once (l is then a direct sum, not an online one: at most one code apart at rounding ties).
  A row with no unmasked key gets p = 0 everywhere (ctx = 0), never NaN.
* `layernorm_quant` -- `o = (y - mean) / sqrt(var + eps) * gamma + beta` per row of fp16 `y`, stored
  fp16 (mode 1) and/or int8 `sat(rne(o16 / s_out))` where o16 is o rounded to fp16 when the fp16 copy is
  written (so the int8 copy is exactly the quantization of the fp16 activation), else o.

Quantization divisions: the probabilities inside the attention loop and, by default on sm90
(`reciprocal_requant`, `layernorm_reciprocal`), the GEMM requantization epilogues and the LayerNorm multiply
by the float32 reciprocal of the scale instead of dividing (a difference from the reference's true division
only at rounding ties, one code at most); a per-element true division (`div_rn`) measured twice the
LayerNorm's time on the H100, so even that memory-bound kernel was bound by it. The attention's output keeps
the true division (a length-1 sequence, p = 1, ctx / s_ctx = v * s_v / s_ctx, can make many outputs exact ties:
with the reciprocal, up to 5.5% of the codes in the H100 attention tests came out one off, past their 0.1%
allowance), computed as `_common.div_rn_by`: the correctly rounded reciprocal once per program and a Markstein
correction per output (three FMA-pipe instructions, bit for bit div.rn), instead of div.rn's reciprocal, range
check and branch per output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, cdiv, describable, descriptor, div_rn_by, div_rn_by_applies, exp2_approx,
                      grid_dependency_sync, launch_kernel, next_pow2, pdl_launch_options, pdl_supported,
                      persistent_grid, rcp_approx, tile_coords, tile_counters, tma_variant, to_int8_rne,
                      to_int8_sat, to_int8_sat_nonneg)
from . import encoder_wgmma
from .configs import arch_key, sm_count

# ----------------------------------------------------------------------------------------------------
# Launch configurations (data, per architecture). GEMM tiles are tried largest first; the first whose
# grid fills `min_waves` waves of the GPU's SMs is used, else the last (smallest) one.
# ----------------------------------------------------------------------------------------------------
ENCODER_CONFIGS = {
    "sm90": {
        # (block_m, block_n, block_k, num_warps, num_stages, min_waves, variants); variants: per epilogue
        # (tma, persistent[, tma_epilogue[, warp_specialized]]) -- A and W loaded through tensor descriptors (the
        # copy engine: no per-thread addresses, zero fill past the edges), programs per SM of a persistent grid
        # whose flattened tile loop issues the next tile's loads under this tile's epilogue (0: a program per tile),
        # the output tile stored (the residual loaded) through descriptors, and the Gluon kernel of
        # encoder_wgmma.py instead of this file's; an epilogue not named runs (False, 0).
        # From benchmarks/tune_encoder.py on the H100 (BERT-base GEMMs at 1024, 4096 and 16384 tokens, CUDA
        # graphs; tune_encoder_gemm_tiles.json): 128x128x128 with 4 warps and 3
        # stages once the grid fills one wave (fc2 at 4096 tokens 25.5 us vs 31.2 for 128x64, o 14.5 vs 15.2,
        # qkv at 1024 11.9 vs 12.8; fc1 at 16384 185 us vs 234 for the earlier 8-warp, 4-stage first choice),
        # else 128x64, else 64x64 (o and fc2 at 1024 tokens: 7.0 and 13.2 us, the best of the sweep). 128x256
        # tiles are out: compiled for sm90 (Triton's ptxas, offline) their epilogues spill.
        # Variants of the 128x128x128 tile (tune_encoder_tma.json, tune_encoder_qkv_persistent.json, CUDA
        # graphs): QKV with TMA and 2 programs per SM 22.0 us vs 26.4 at 4096 tokens, 67.6 vs 85.0 at 16384
        # (TMA alone 23.4 / 73.8); FC1 + GELU 30.8 vs 34.4 and 111.1 vs 130.4; one program per SM loses
        # everywhere (FC1 53.3 / 197.2: its epilogue then idles the tensor cores); the residual epilogues (O,
        # FC2) gain nothing (O 15.2 vs 14.6 at 4096 tokens, FC2 83.5 vs 83.5 at 16384). Epilogue through
        # descriptors (tune_encoder_tma_epilogue.json, one run, 2048 / 4096 / 16384 tokens): O 11.3 / 13.8 /
        # 36.0 us vs 11.4 / 14.5 / 38.5, FC2 21.4 / 24.6 / 79.1 vs 21.5 / 25.5 / 82.6, FC1 (TMA, 2 per SM)
        # 21.4 / 31.5 / 112.7 vs 21.9 / 32.0 / 116.2; with the persistent grid the residual ones lose (FC2
        # 37.2 us at 4096 tokens). A ninth element selects the warp-specialized Gluon kernel (encoder_wgmma.py);
        # no tile here does: same run (tune_encoder_ws_gluon.json, 4096 tokens) qkv 36.0 us vs 22.5, fc1 41.1 vs
        # 31.4, o 16.5 vs 13.8, fc2 28.9 vs 24.7 (it wins fc2 only at 2048 and 16384 tokens: 18.3 vs 21.4, 75.6
        # vs 78.4).
        "gemm": [
            (128, 128, 128, 4, 3, 1.0,
             {"qkv": (True, 2), "requant": (True, 2, True), "residual": (False, 0, True)}),
            (128, 64, 128, 4, 4, 1.0, {}),
            (64, 64, 128, 4, 4, 0.0, {}),
        ],
        # The QKV GEMM uses the same list: once its head-split stores were vector stores, the same sweep put
        # 128x128x128 / 4 warps / 3 stages first for it too (16384 tokens: 89.7 us vs 111.2 for 128x64).
        # Two passes (longer sequences), from benchmarks/tune_encoder.py TUNE_ALIGNED=0,1 at 32x384 and 16x512
        # (CUDA graphs; tune_encoder_attention_aligned.json): with 16-aligned sequence starts (the padded path)
        # 64x64 / 4 warps / 3 stages, 76.5 and 64.9 us (V^T in asynchronous 16-byte copies; SDPA fp16 46.4 and
        # 39.3); still first after the lean score path, 69.4 and 59.4 us (tune_encoder_attention_lean.json).
        # Packed sequences at any offset walk their keys from the start rounded down to 16 (`align_down`)
        # and take the aligned config too (graphed packed encoder at 32x384 half-length, bench_encoder: 2839 us
        # vs 3119 with byte loads of V^T). "attention" is for V^T rows not padded to 16 columns, loaded a byte
        # at a time: 128x64 / 8 warps, 104.0 and 87.6 us (the earlier 64x32 / 4 warps: 105.8 and 91.2).
        "attention": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
        "attention_aligned": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        # one pass (whole score rows on chip) up to these key counts: (max_seqlen, tile), the first that covers
        # the batch's longest sequence
        # (benchmarks/tune_encoder.py TUNE_ATTN=one_pass, CUDA graphs: 128x128 tokens 54.3 us vs 68.4 for the
        # two-pass config, 32x128 18.9 vs 22.6; at 384 and 512 keys every one-pass tile spills and loses, best
        # 153.9 vs 111.7 and 104.9 vs 97.5). With aligned starts (tune_encoder_attention_one_pass_aligned.json)
        # the same tile stays first or within 7%: 128x128 41.7 us (SDPA fp16 42.1), 32x128 15.8 (bm 32: 15.6);
        # after the lean score path 37.7 and 14.9 us, still first (tune_encoder_attention_lean.json).
        "attention_one_pass": [
            (128, {"block_m": 64, "num_warps": 4, "num_stages": 1}),
        ],
        # the same for packed sequences of varying lengths (starts not 16-aligned): every sequence's last query
        # block is partly empty, so smaller blocks waste less (benchmarks/tune_encoder.py TUNE_VARLEN, CUDA
        # graphs, results/tune_encoder_varlen.json; lengths uniform in [32, 96]: 32 sequences 11.8 us vs 13.6
        # for block_m 64, 128 sequences 29.5 vs 32.4, best of 8 tiles both; lengths in [96, 288] keep the
        # aligned two-pass config, 44.0 us, within 3% of the sweep's best, 64x32 at 42.8)
        "attention_one_pass_packed": [
            (128, {"block_m": 32, "num_warps": 4, "num_stages": 1}),
        ],
        # LayerNorm: rows per program = budget // next_pow2(N), warps = rows * next_pow2(N) // elements per
        # warp; the reciprocal requantization halves its time (benchmarks/tune_encoder.py, N = 768, mode 1's
        # fp16 + int8 outputs at 16384 rows: 4 rows, 2 warps, reciprocal 30.3 us vs 55.7 us for 4 warps and
        # true division; the per-element division, not memory, bounded it)
        "layernorm_rows_budget": 4096,
        "layernorm_elements_per_warp": 2048,
        "layernorm_reciprocal": True,
        # requantizing epilogues multiply by 1 / s_out (one division per column) instead of dividing every
        # element; results differ from a true division only at rounding ties (the tests allow one code
        # there). Offline sm90 compile: the QKV epilogue kernel shrinks from 2960 to 2168 instructions at
        # 128x128x128 (benchmarks/tune_encoder.py times both).
        "reciprocal_requant": True,
        # FC1's GELU through the branch-free A&S 7.1.26 erfc (see _gelu) instead of libdevice's erff: the whole
        # encoder 6-7% faster from 4096 tokens up (bench_encoder.py's mode1_graph_libdevice_gelu_us column).
        # 2: that GELU and the reciprocal requantization in one form (_gelu_requant_fast; offline sm90 SASS of
        # the 128x128 FC1 tile 3928 -> 3568 instructions); same-run A/B on the H100, alternated, CUDA graphs
        # (tune_encoder_gelu_requant.json): FC1 29.9 / 29.9 us vs 31.9 / 32.2 at 4096 tokens, 107.5 / 107.2 vs
        # 117.8 / 115.4 at 16384; codes off the reference at 4103 x 3072: 23 vs 21 of 12.6M, one code each
        "fast_gelu": 2,
        # programmatic dependent launch (each kernel launches while the previous one drains and waits for it
        # before its first memory access, `grid_dependency_sync`) up to this many tokens. bench_encoder's
        # same-run ablation (mode 2, CUDA graphs, PDL on every kernel vs none): 1x128 418 us vs 481, but 8x128
        # 712 vs 650, 16384 tokens 4760 vs 4620, 32x384 4579 vs 4410 (4096: 1380 both): early-launched
        # programs waiting on SMs the previous kernel still holds skew where one-wave grids land
        "pdl_max_tokens": 256,
        # past pdl_max_tokens, the LayerNorms behind the residual GEMMs and the attention behind the QKV GEMM
        # (_pdl's consumer rules), up to 4096 tokens. bench_encoder's same-run ablations (CUDA graphs, mode 2):
        # LayerNorm PDL at every size vs none: 1024 tokens 622.9 us vs 650.3, 4096 1343.9 vs 1370.3, but 16384
        # 4620.7 vs 4589.3; with it up to 4096 and attention PDL at every size, attention PDL vs none: 1024 614.4
        # vs 627.5, 4096 1336.7 vs 1348.5, but 32x384 4339.1 vs 4268.1. Packed half-length batches of 32x128
        # (~2048 tokens) lost about 1% to either (1122.3 vs 1107.3 without LayerNorm PDL, vs 1112.5 without
        # attention PDL), 8x128 ones gained 1-3%.
        "pdl_layernorm_max_tokens": 4096,
        "pdl_attention_max_tokens": 4096,
        # the tiles' descriptor epilogues (variant element 3) only from this many tokens: same-run graphed A/B on
        # the H100 (tune_encoder_split_tiles.json, 4 reps at 2048 / 4096 tokens): at 2048 tokens (where only FC1
        # runs the 128x128 tile) mode 2 987.9 us with it vs 965.9 without, mode 1 1010.1 vs 982.9; at 4096 1319.8
        # vs 1329.7 and 1352.8 vs 1351.9; at 16384 4440-4455 vs 4541-4569, 32x384 4221-4268 vs 4303-4334
        "tma_epilogue_min_tokens": 4096,
        # K splits per GEMM tile (max_tokens, max_splits, min_k_steps, max_programs; `_pick_split_k`): up to
        # max_splits programs per tile, each with at least min_k_steps K steps, the tile's last one summing the int32
        # partials, while the grid stays within max_programs. benchmarks/tune_encoder.py TUNE_SPLITS on the H100
        # (CUDA graphs; tune_encoder_split_k_small.json): FC2 (K = 3072) alone on the 64x64 tile at 64 / 128 / 256
        # tokens 7.7 / 8.2 / 9.5 us with 4 / 4 / 2 splits vs 10.4 / 10.7 / 10.8 whole (fp16 F.linear 9.3 / 8.8 /
        # 9.7); the K = 768 GEMMs (6 steps) lose with any split (O at 64 tokens 5.4 us whole, 6.2 with 2).
        # In the graphed encoder (PDL up to 256 tokens: the next kernel's programs take SMs early) a wide split grid
        # costs more than alone: same-run A/B, 5 rounds (tune_encoder_split_k_encoder.json), mode 1 / mode 2
        # BERT-base at 1x64 1.073 / 1.048x with 4 splits, 1x128 1.069 / 0.982x with 4 and 1.050 / 1.037x with 2,
        # 2x128 1.009 / 0.988x with 2: so at most 48 programs (4 splits at 64 tokens, 2 at 128, none from 256; this
        # rule in the same run: 1.075 / 1.048, 1.049 / 1.034, 1.003 / 1.000). From 1024 tokens splits lose at every
        # count (tune_encoder_split_k.json: the partials' traffic outweighs the wave balance they buy)
        "gemm_split_k": (1024, 4, 4, 48),
        # a CUDA-graph-captured forward of at least this many tokens runs its batch as two halves on two streams (two
        # parallel graph branches, whose kernels overlap in a torch.profiler trace of the replay). H100 sweep
        # (results/tune_encoder_streams.json; mode 2 padded, mode 1 packed half-length, CUDA graphs, 2 / 4 halves vs one
        # batch, two timings of one): 9216 tokens and up gain 2-8% (24x384 2922 -> 2786 us, 32x384 3983 -> 3670, 96x128
        # 3430 -> 3337, 128x128 4279 -> 4171, 32x512 5236 -> 4970, packed 64x384 3815 -> 3569), 8192 and below lose up
        # to 10% (32x128 1271 -> 1400, 16x512 2827 -> 2954) or break even (packed 128x128 ~8150 tokens 2518 -> 2521);
        # four parts lose almost everywhere. bench_encoder in one run (encoder.json, stop 43): mode 2 32x384 3711.4 us
        # vs 3979.7 on one stream, 128x128 4128.9 vs 4337.2
        "stream_split_min_tokens": 9216,
    },
    "default": {
        "gemm": [
            (64, 64, 64, 4, 3, 1.0, {}),
            (32, 32, 32, 4, 2, 0.0, {}),
        ],
        "attention": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
        "attention_aligned": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
        "attention_one_pass": [(128, {"block_m": 32, "num_warps": 4, "num_stages": 1})],
        "attention_one_pass_packed": [(128, {"block_m": 32, "num_warps": 4, "num_stages": 1})],
        "layernorm_rows_budget": 2048,
        "layernorm_elements_per_warp": 1024,
        "layernorm_reciprocal": False,
        "reciprocal_requant": False,
        "fast_gelu": True,
        "pdl_max_tokens": 0,
        "stream_split_min_tokens": 0,
    },
}

_EPILOGUES = {"residual": 0, "requant": 1, "qkv": 2}


def _table(device: torch.device) -> dict:
    return ENCODER_CONFIGS[arch_key(device.type, device.index)]


def _pdl(device: torch.device, tokens: int, consumer: str = "") -> bool:
    """Launch an encoder kernel with programmatic dependent launch: from 1 up to the table's `pdl_max_tokens`
    tokens, where Triton has it (never under the interpreter); for `consumer` ("layernorm": the LayerNorm
    behind a residual GEMM, "attention": the attention behind the QKV GEMM) also up to the table's
    `pdl_{consumer}_max_tokens`. A GEMM whose consumer that says yes for signals its dependents at its start, so
    the consumer's programs take SMs as the GEMM's last tiles drain and wait there for its results (a launch
    latency saved per pair)."""
    table = _table(device)
    limit = max(table["pdl_max_tokens"], table.get(f"pdl_{consumer}_max_tokens", 0) if consumer else 0)
    return 0 < tokens <= limit and pdl_supported()


def stream_split_min_tokens(device: torch.device) -> int:
    """Token count from which a CUDA-graph-captured encoder forward splits its batch over two streams (the
    table's `stream_split_min_tokens`; 0: never)."""
    return int(_table(device).get("stream_split_min_tokens", 0))


# ----------------------------------------------------------------------------------------------------
# int8 GEMM with fused epilogues
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _requant(v, scale, RECIPROCAL: tl.constexpr):
    """v / scale, rounded to float32: a true division, or v times the float32 reciprocal of the scale
    (computed once per scale, not per element)."""
    if RECIPROCAL:
        v = v * (1.0 / scale)
    else:
        v = tl.math.div_rn(v, scale + tl.zeros_like(v))
    return v


@triton.jit
def _gelu(v, FAST: tl.constexpr, INTERPRET: tl.constexpr):
    """erf-GELU 0.5 * v * (1 + erf(v / sqrt(2))). FAST: 1 + erf(z) from Abramowitz & Stegun 7.1.26,
    erfc(|z|) ~ t * poly5(t) * exp(-z^2) with t = 1 / (1 + p|z|) (|error| <= 1.5e-7), taken as is for z < 0
    (no cancellation in 1 + erf) and as 2 - erfc for z >= 0: branch-free, where libdevice's erff branches per
    element on |z| (258 branches in the sm90 PTX of a 128x128 tile), so warps holding BERT's mixed
    magnitudes run both sides. Same-run A/B on the H100 (encoder mode 1, CUDA graphs): 6264 vs 6724 us at
    16384 tokens; on full-range codes (|v| ~ 30, one side only) the two are within 4%."""
    if FAST:
        z = v * 0.7071067811865476
        az = tl.abs(z)
        t = rcp_approx(1.0 + 0.3275911 * az, INTERPRET)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erfc = poly * exp2_approx(-(az * az) * 1.4426950408889634, INTERPRET)
        return 0.5 * v * tl.where(z < 0.0, erfc, 2.0 - erfc)
    else:
        return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))


# y = v * sqrt(log2(e) / 2): z = v / sqrt(2) and exp(-z^2) = exp2(-y^2)
_GELU_Y = tl.constexpr(0.8493218002880191)
# A&S 7.1.26's p = 0.3275911 for |y| instead of |z| (p / sqrt(log2 e))
_GELU_P = tl.constexpr(0.2727374808792225)


@triton.jit
def _gelu_requant_fast(y, p, INTERPRET: tl.constexpr):
    """GELU(v) / s_out from y = v * _GELU_Y and p = v / s_out, as relu(p) - |p| * erfc(|z|) / 2 (equal to
    p * (1 + erf(z)) / 2 for either sign of v; no cancellation: the product is 0 .. 0.17 |p|), erfc by
    Abramowitz & Stegun 7.1.26 as in _gelu(FAST) with the scale factors folded into its constants (its five
    coefficients halved). Against _gelu then the reciprocal requantization (offline sm90 SASS of the 128x128
    FC1 tile): no separate z, 0.5 v, requantizing multiply or select per element; the float roundings differ,
    so a code can differ where a value lies within rounding of a code boundary (one code)."""
    t = rcp_approx(1.0 + _GELU_P * tl.abs(y), INTERPRET)
    half_erfc = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    half_erfc = half_erfc * exp2_approx(-(y * y), INTERPRET)
    return tl.fma(-tl.abs(p), half_erfc, tl.maximum(p, 0.0))


@triton.jit
def _tile_acc(a_src, w_src, pid_m, pid_n, M, N, K, stride_am, stride_wn, k_lo, k_hi,
              TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """acc = A_q[tile rows, k_lo:k_hi] @ W_q[tile columns, k_lo:k_hi]^T in int32 (k_lo a multiple of BLOCK_K;
    k_hi = K, or a multiple of BLOCK_K below it). TMA: a_src / w_src are tensor descriptors
    (blocks [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K]; the copy engine zero-fills past M, N and K, so no
    masks and no per-thread addresses); else pointers, with out-of-range rows / columns wrapped onto valid
    ones, index % M / % N (no masks in the main loop; the stores are masked)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if TMA:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = a_src.load([pid_m * BLOCK_M, k0])
            w = w_src.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # past the edge, row M + i loads row i (a distinct line per row): wrapping every such row onto row 0 sent
        # a partial tile's loads to one L2 line, and the GEMM took up to 1.7x as long whenever M % BLOCK_M != 0
        # (H100, BERT-base FC2 with the 128x64 tile: 24.6 us at 2208 rows vs 15.3 at 2304)
        rm_load = rm % M
        rn_load = rn % N
        a_ptrs = a_src + rm_load[:, None].to(tl.int64) * stride_am + (k_lo + rk)[None, :]
        # W is [N, K] row-major: the [BLOCK_K, BLOCK_N] tile is K-contiguous (K-major B operand).
        w_ptrs = w_src + rn_load[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0)
                w = tl.load(w_ptrs, mask=rk[:, None] < K - k0, other=0)
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tile_epilogue(
    acc, pid_m, pid_n, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
    M, N, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
    EPILOGUE: tl.constexpr, RES_MODE: tl.constexpr, GELU: tl.constexpr, HEAD_DIM: tl.constexpr,
    COLUMN_OUT_SCALE: tl.constexpr, COLUMN_RES_SCALE: tl.constexpr, RECIPROCAL: tl.constexpr,
    ALIGNED_QKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST_GELU: tl.constexpr,
    BRANCH_FREE: tl.constexpr, TMA_EPI: tl.constexpr, INTERPRET: tl.constexpr,
):
    """TMA_EPI ("residual" and "requant"): out_ptr (and res_ptr) are tensor descriptors of [BLOCK_M, BLOCK_N]
    boxes; the tile leaves through shared memory and the copy engine (clipped at M and N) and the residual
    arrives the same way (zero fill), where the accumulator's register layout otherwise makes one store
    (and one residual load) per element and thread: 128 one-byte STG per thread for an int8 tile in the
    sm90 build."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    mask = m_ok[:, None] & n_ok[None, :]
    # every load of the epilogue is issued before the first use of any: each vector reaches the accumulator's
    # layout through a shared-memory exchange fenced by CTA barriers, and a load written after such a use waits
    # behind it (the latencies then come one after another, per tile)
    w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0)
    if EPILOGUE == 1:
        if COLUMN_OUT_SCALE:
            out_scale = tl.load(out_scale_ptr + rn, mask=n_ok, other=1.0)[None, :]
        else:
            out_scale = tl.load(out_scale_ptr)
    elif EPILOGUE == 2:
        out_scale = tl.load(out_scale_ptr + rn, mask=n_ok, other=1.0)
    if EPILOGUE == 0 and RES_MODE != 0:
        if RES_MODE == 2 and COLUMN_RES_SCALE:
            res_scale_vec = tl.load(res_scale_vec_ptr + rn, mask=n_ok, other=0.0)
        # after the vectors: a descriptor load waits for its tile where it is written
        if TMA_EPI:
            r = res_ptr.load([pid_m * BLOCK_M, pid_n * BLOCK_N])
        else:
            r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=mask, other=0)
    # explicit FMAs where a product meets a sum: left to the compiler, the contraction of `acc * s + bias +
    # r * s_r` differed between this epilogue's split-K and whole-tile copies (H100: 2 of 98304 fp16 outputs one
    # ulp apart), and the padded and packed encoder paths, which may split differently, must agree bit for bit
    v = tl.fma(acc.to(tl.float32), (a_scale * w_scale)[None, :], bias[None, :])

    if EPILOGUE == 0:
        if RES_MODE != 0:
            if RES_MODE == 1:
                v = v + r.to(tl.float32)
            elif COLUMN_RES_SCALE:
                v = tl.fma(r.to(tl.float32), res_scale_vec[None, :], v)
            else:
                v = tl.fma(r.to(tl.float32), res_scale, v)
        if TMA_EPI:
            out_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], v.to(tl.float16))
        else:
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], v.to(tl.float16), mask=mask)
    elif EPILOGUE == 1:
        if GELU and FAST_GELU == 2 and RECIPROCAL:
            # the dequantization scales fold into y = v * _GELU_Y (so exp(-z^2) = exp2(-y^2)) and the
            # requantization into p = v / s_out = y * (1 / (s_out * _GELU_Y)): _gelu_requant_fast's form
            y = tl.fma(acc.to(tl.float32), (a_scale * w_scale * _GELU_Y)[None, :], (bias * _GELU_Y)[None, :])
            q = to_int8_sat(_gelu_requant_fast(y, y * (1.0 / (out_scale * _GELU_Y)), INTERPRET))
        else:
            if GELU:
                v = _gelu(v, FAST_GELU, INTERPRET)
            q = to_int8_sat(_requant(v, out_scale, RECIPROCAL))
        if TMA_EPI:
            out_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], q)
        else:
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], q, mask=mask)
    else:
        q = to_int8_sat(_requant(v, out_scale[None, :], RECIPROCAL))
        # V^T rows run along the tokens: masked at M they become byte stores wherever M % 16 != 0 (packed
        # batches; 25.5 us vs 15.5 at 2143 vs 2144 tokens on the H100). vt_rows is M rounded up to 16 where
        # V^T's rows have room: the rows past M are padding whose keys the attention gives p = 0.
        vt_mask = (rm < vt_rows)[:, None] & n_ok[None, :]
        if ALIGNED_QKV:
            # The tile lies inside one of Q | K | V (HIDDEN % BLOCK_N == 0) and its columns run through
            # whole runs of SUB = min(BLOCK_N, HEAD_DIM) within one head: built from the scalar tile start
            # plus j // SUB and j % SUB, the addresses show the compiler SUB contiguous bytes (Q, K) or
            # BLOCK_M contiguous bytes (V^T), so the stores are vector stores instead of one byte per lane.
            SUB: tl.constexpr = BLOCK_N if BLOCK_N < HEAD_DIM else HEAD_DIM
            col0 = pid_n * BLOCK_N
            which = col0 // HIDDEN
            j = tl.arange(0, BLOCK_N)
            colw = (col0 - which * HIDDEN) + (j // SUB) * SUB
            head = colw // HEAD_DIM
            d = colw - head * HEAD_DIM + j % SUB
            # Q, K: [2, heads, M, HEAD_DIM]; V^T: [heads, HEAD_DIM, stride_vt]
            if BRANCH_FREE:
                # both stores, one masked off: a branch on `which` inside the persistent tile loop keeps the
                # compiler from flattening it
                qk_off = ((tl.minimum(which, 1) * (HIDDEN // HEAD_DIM) + head).to(tl.int64) * M)[None, :] \
                    * HEAD_DIM + rm[:, None] * HEAD_DIM + d[None, :]
                which_j = (j * 0 + which)[None, :]  # a tensor: the interpreter takes no scalar in a mask
                tl.store(out_ptr + qk_off, q, mask=mask & (which_j < 2))
                vt_off = (head * HEAD_DIM + d).to(tl.int64)[None, :] * stride_vt + rm[:, None]
                tl.store(vt_ptr + vt_off, q, mask=vt_mask & (which_j == 2))
            elif which < 2:
                qk_off = ((which * (HIDDEN // HEAD_DIM) + head).to(tl.int64) * M)[None, :] * HEAD_DIM \
                    + rm[:, None] * HEAD_DIM + d[None, :]
                tl.store(out_ptr + qk_off, q, mask=mask)
            else:
                vt_off = (head * HEAD_DIM + d).to(tl.int64)[None, :] * stride_vt + rm[:, None]
                tl.store(vt_ptr + vt_off, q, mask=vt_mask)
        else:
            which = rn // HIDDEN
            within = rn - which * HIDDEN
            head = within // HEAD_DIM
            d = within - head * HEAD_DIM
            # Q, K: [2, heads, M, HEAD_DIM]
            qk_off = (which * HIDDEN).to(tl.int64)[None, :] * M + (head * HEAD_DIM).to(tl.int64)[None, :] * M \
                + rm[:, None] * HEAD_DIM + d[None, :]
            tl.store(out_ptr + qk_off, q, mask=mask & (which < 2)[None, :])
            # V^T: [heads, HEAD_DIM, stride_vt]
            vt_off = (head * HEAD_DIM + d).to(tl.int64)[None, :] * stride_vt + rm[:, None]
            tl.store(vt_ptr + vt_off, q, mask=vt_mask & (which == 2)[None, :])


@triton.jit
def _split_k_total(acc, tile, split, num_tiles, part_ptr, count_ptr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """(last, total): this program's int32 partial of `tile` stored as split `split` of part_ptr
    ([SPLIT_K, num_tiles, BLOCK_M * BLOCK_N]); the program of the tile that arrives last (an acq_rel counter per
    tile in count_ptr, reset by that program for the next launch) gets last = True and the exact int32 sum of
    every split, its own read back too (the same bits as one program over the whole K)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_part = part_ptr + tile.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs
    tl.store(tile_part + split.to(tl.int64) * num_tiles * (BLOCK_M * BLOCK_N), acc)
    # barrier (this program's own stores visible to all its threads), then release: the whole partial is
    # visible before the count moves (fences are cumulative); acquire: the last program sees the other partials
    # (read past L1, not coherent across SMs)
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = done == SPLIT_K - 1
    if last:
        # every split's load without a branch between them: issued together, one latency instead of SPLIT_K - 1
        acc = tl.load(tile_part, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(tile_part + s * num_tiles.to(tl.int64) * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last, acc


@triton.jit
def _gemm_tile(
    tile, split, num_tiles, a_src, w_src, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr, part_ptr,
    count_ptr, M, N, K, stride_am, stride_wn, stride_rm, stride_om, stride_vt, vt_rows,
    a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
    EPILOGUE: tl.constexpr, RES_MODE: tl.constexpr, GELU: tl.constexpr, HEAD_DIM: tl.constexpr,
    COLUMN_OUT_SCALE: tl.constexpr, COLUMN_RES_SCALE: tl.constexpr, RECIPROCAL: tl.constexpr,
    ALIGNED_QKV: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FAST_GELU: tl.constexpr, TMA: tl.constexpr,
    BRANCH_FREE: tl.constexpr, TMA_EPI: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Output tile `tile` (grouped order): its int32 product and its epilogue; with SPLIT_K > 1, split `split`
    of its K steps, and the epilogue in whichever of the tile's programs finishes last."""
    pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if SPLIT_K == 1:
        acc = _tile_acc(a_src, w_src, pid_m, pid_n, M, N, K, stride_am, stride_wn, 0, K, TMA, EVEN_K,
                        BLOCK_M, BLOCK_N, BLOCK_K)
        _tile_epilogue(acc, pid_m, pid_n, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
                       M, N, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
                       EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, RECIPROCAL,
                       ALIGNED_QKV, BLOCK_M, BLOCK_N, FAST_GELU, BRANCH_FREE, TMA_EPI, INTERPRET)
    else:
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = split * k_per
        acc = _tile_acc(a_src, w_src, pid_m, pid_n, M, N, K, stride_am, stride_wn, k_lo, tl.minimum(K, k_lo + k_per),
                        TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
        last, acc = _split_k_total(acc, tile, split, num_tiles, part_ptr, count_ptr, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            _tile_epilogue(acc, pid_m, pid_n, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
                           M, N, stride_rm, stride_om, stride_vt, vt_rows, a_scale, res_scale, res_scale_vec_ptr,
                           HIDDEN, EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE,
                           RECIPROCAL, ALIGNED_QKV, BLOCK_M, BLOCK_N, FAST_GELU, BRANCH_FREE, TMA_EPI, INTERPRET)


@triton.jit
def _int8_gemm_kernel(
    a_src, w_src, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr, part_ptr, count_ptr,
    M, N, K, stride_am, stride_wn, stride_rm, stride_om, stride_vt, vt_rows,
    a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
    EPILOGUE: tl.constexpr, RES_MODE: tl.constexpr, GELU: tl.constexpr, HEAD_DIM: tl.constexpr,
    COLUMN_OUT_SCALE: tl.constexpr, COLUMN_RES_SCALE: tl.constexpr, RECIPROCAL: tl.constexpr,
    ALIGNED_QKV: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FAST_GELU: tl.constexpr, TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    TMA_EPI: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One output tile per program, or (PERSISTENT) a grid of a few programs per SM striding over the tiles
    in one flattened loop, so the compiler can issue the next tile's loads under this tile's epilogue, or
    (SPLIT_K > 1, not persistent) SPLIT_K programs per tile, program s * tiles + t taking split s of tile t's K
    steps (part_ptr, count_ptr: _split_k_total's partials and arrival counters)."""
    grid_dependency_sync(PDL)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _gemm_tile(tile, 0, num_tiles, a_src, w_src, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
                       part_ptr, count_ptr, M, N, K, stride_am, stride_wn, stride_rm, stride_om, stride_vt, vt_rows,
                       a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
                       EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, RECIPROCAL,
                       ALIGNED_QKV, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FAST_GELU, TMA, True, TMA_EPI, 1,
                       INTERPRET)
    else:
        tile = tl.program_id(0)
        split = 0
        if SPLIT_K > 1:
            split = tile // num_tiles
            tile = tile - split * num_tiles
        _gemm_tile(tile, split, num_tiles, a_src, w_src, bias_ptr, w_scale_ptr, out_scale_ptr, res_ptr, out_ptr, vt_ptr,
                   part_ptr, count_ptr, M, N, K, stride_am, stride_wn, stride_rm, stride_om, stride_vt, vt_rows,
                   a_scale, res_scale, res_scale_vec_ptr, HIDDEN,
                   EPILOGUE, RES_MODE, GELU, HEAD_DIM, COLUMN_OUT_SCALE, COLUMN_RES_SCALE, RECIPROCAL,
                   ALIGNED_QKV, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FAST_GELU, TMA, False, TMA_EPI, SPLIT_K,
                   INTERPRET)


def _pick_gemm_tile(device: torch.device, m: int, n: int, k: int, epilogue: str):
    """(block_m, block_n, block_k, num_warps, num_stages, tma, persistent, tma_epilogue, warp_specialized) from
    the table: always nine elements; tma_epilogue only from the table's tma_epilogue_min_tokens."""
    table = _table(device)
    tiles = table["gemm"]
    sms = sm_count(device)
    k_p2 = max(16, next_pow2(k))
    chosen = next((t for t in tiles if t[2] <= k_p2 and cdiv(m, t[0]) * cdiv(n, t[1]) >= t[5] * sms),
                  tiles[-1])
    bm, bn, bk, warps, stages, _, variants = chosen
    variant = tuple(variants.get(epilogue, ()))
    if len(variant) >= 3 and m < table.get("tma_epilogue_min_tokens", 0):
        variant = variant[:2] + (False,) + variant[3:]
    return (bm, bn, min(bk, k_p2), warps, stages) + variant + (False, 0, False, False)[len(variant):]


def _pick_split_k(device: torch.device, m: int, tiles: int, k_steps: int) -> int:
    """Programs per output tile from the table's `gemm_split_k` (max_tokens, max_splits, min_k_steps,
    max_programs): up to max_tokens rows, at most max_splits, each split with at least min_k_steps K steps, the
    grid within max_programs and one wave of SMs; 1 past max_tokens or on a table without the rule."""
    rule = _table(device).get("gemm_split_k")
    if not rule:
        return 1
    max_tokens, max_splits, min_k_steps, max_programs = rule
    if m > max_tokens:
        return 1
    return max(1, min(max_splits, min(max_programs, sm_count(device)) // tiles, k_steps // min_k_steps))


def int8_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: float,
    w_scale: torch.Tensor,
    bias: torch.Tensor,
    epilogue: str,
    *,
    out_scale: torch.Tensor | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    residual_scale: float | torch.Tensor = 1.0,
    heads: int = 1,
    head_dim: int = 1,
    vt_stride: int | None = None,
    config: tuple | None = None,
    reciprocal: bool | None = None,
    fast_gelu: bool | int | None = None,
    split_k: int | None = None,
):
    """Launch `acc = a @ w.T` (int8 [M, K] x int8 [N, K]) with the named epilogue (module docstring).

    config (block_m, block_n, block_k, num_warps, num_stages[, tma, persistent[, tma_epilogue
    [, warp_specialized]]]), reciprocal and fast_gelu override the table (for benchmarks/tune_encoder.py). tma:
    load A and W through tensor descriptors (the Hopper copy engine) where the operands are `describable`;
    persistent: programs per SM of a persistent grid (0: one program per tile); tma_epilogue: the "residual" and
    "requant" epilogues store (and load the residual) through tensor descriptors where those tensors are
    describable; warp_specialized: the Gluon kernel of `encoder_wgmma` (a copy-engine loader and two consumer
    warpgroups in ping-pong; block_m 128, num_warps ignored) where `encoder_wgmma.applies`, else this one.
    split_k: programs per output tile, each over an equal share of the K steps, the tile's last one summing the
    int32 partials (exact: the same result as one program) and running the epilogue; None: the table's
    `gemm_split_k` rule (`_pick_split_k`). Not with a persistent grid or the Gluon kernel.

    out_scale: float32 [1] (per tensor) or [N] (per output column: "qkv", and "requant" when the consumer
    of the int8 output folds a per-channel smoothing factor into its weight). residual_scale: a float, or
    float32 [N] for an int8 residual quantized with per-column scales.

    Returns fp16 [M, N] ("residual"), int8 [M, N] ("requant"), or (qk int8 [2, heads, M, head_dim],
    vt int8 [heads, head_dim, vt_stride]) ("qkv")."""
    if epilogue not in _EPILOGUES:
        raise ValueError(f"epilogue: expected one of {tuple(_EPILOGUES)}, got {epilogue!r}")
    for name, t in (("a", a), ("w", w)):
        if t.dtype != torch.int8 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: expected a 2-D int8 tensor with unit column stride, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a, w: expected the same K, got a {tuple(a.shape)} and w {tuple(w.shape)}")
    if epilogue != "residual" and out_scale is None:
        raise ValueError(f"out_scale: the {epilogue!r} epilogue requantizes and needs out_scale")
    n = w.shape[0]
    if out_scale is not None and (out_scale.dtype != torch.float32 or out_scale.numel() not in (1, n)
                                  or not out_scale.is_contiguous()):
        raise ValueError(f"out_scale: expected a contiguous float32 tensor of 1 or N={n} elements, got "
                         f"{out_scale.dtype} {tuple(out_scale.shape)}")
    if epilogue == "qkv" and out_scale.numel() != n:
        raise ValueError(f"out_scale: the 'qkv' epilogue expects one scale per column ({n}), got {out_scale.numel()}")
    column_res = isinstance(residual_scale, torch.Tensor)
    if column_res and (residual_scale.dtype != torch.float32 or residual_scale.numel() != n
                       or not residual_scale.is_contiguous()):
        raise ValueError(f"residual_scale: expected a float or a contiguous float32 tensor of N={n} elements, "
                         f"got {residual_scale.dtype} {tuple(residual_scale.shape)}")
    if epilogue == "qkv" and w.shape[0] != 3 * heads * head_dim:
        raise ValueError(f"w: the 'qkv' epilogue expects {3 * heads * head_dim} = 3 * heads * head_dim rows, "
                         f"got {w.shape[0]}")
    m, k = a.shape
    if epilogue == "qkv" and vt_stride is not None and vt_stride < m:
        raise ValueError(f"vt_stride: V^T rows must hold all M={m} tokens, got vt_stride={vt_stride}")
    dev = a.device
    tile = tuple(config) if config is not None else _pick_gemm_tile(dev, m, n, k, epilogue)
    if len(tile) not in (5, 7, 8, 9):
        raise ValueError(f"config: expected (block_m, block_n, block_k, num_warps, num_stages[, tma, persistent"
                         f"[, tma_epilogue[, warp_specialized]]]), got {config!r}")
    bm, bn, bk, warps, stages = tile[:5]
    use_tma, persistent = tma_variant(*(tile[5:7] if len(tile) >= 7 else (False, 0)), describable(a, w))
    if reciprocal is None:
        reciprocal = _table(dev)["reciprocal_requant"]
    if fast_gelu is None:
        fast_gelu = _table(dev)["fast_gelu"]
    code = _EPILOGUES[epilogue]
    hidden = n // 3 if code == 2 else n
    vt = a  # placeholder pointer when unused
    vt_rows = m
    if code == 0:
        out = torch.empty((m, n), dtype=torch.float16, device=dev)
    elif code == 1:
        out = torch.empty((m, n), dtype=torch.int8, device=dev)
    else:
        out = torch.empty((2, heads, m, head_dim), dtype=torch.int8, device=dev)
        vt_stride = vt_stride or m
        vt = torch.empty((heads, head_dim, vt_stride), dtype=torch.int8, device=dev)
        m16 = cdiv(m, 16) * 16
        if vt_stride >= m16:
            vt_rows = m16
    res_mode = 0
    res = a
    if residual is not None:
        res = residual
        res_mode = 1 if residual.dtype == torch.float16 else 2
    column_out_scale = out_scale is not None and out_scale.numel() > 1 and code == 1
    aligned_qkv = code == 2 and hidden % bn == 0 and (bn % head_dim == 0 or head_dim % bn == 0)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k: expected None or an int >= 1, got {split_k!r}")
    # the Gluon kernel's wgmma tiles: one 128-row warpgroup tile, N in 16..256, K steps of 32-deep instructions
    if (len(tile) == 9 and tile[8] and bm == 128 and bn % 16 == 0 and bn <= 256 and bk % 32 == 0
            and encoder_wgmma.applies(a, w, code, bool(reciprocal), gelu, bool(fast_gelu), aligned_qkv)):
        if split_k is not None and split_k > 1:
            raise ValueError(f"split_k: the warp-specialized Gluon kernel does not split K; got split_k={split_k} "
                             f"with config {tile}")
        encoder_wgmma.launch(
            a, w, out, res, vt, bias, w_scale, out_scale if out_scale is not None else w_scale,
            residual_scale if column_res else w_scale, m=m, n=n, k=k,
            stride_rm=res.stride(0) if res.dim() == 2 else 0, stride_om=out.stride(0) if code != 2 else 0,
            stride_vt=vt_stride or 0, vt_rows=vt_rows, a_scale=a_scale,
            res_scale=1.0 if column_res else float(residual_scale), hidden=hidden, code=code, res_mode=res_mode,
            gelu=gelu, head_dim=head_dim, column_out_scale=column_out_scale, column_res_scale=column_res,
            block_m=bm, block_n=bn, block_k=bk, stages=stages, programs_per_sm=max(1, int(tile[6])),
            tma_out=bool(tile[7]), sms=sm_count(dev))
        return (out, vt) if code == 2 else out
    tiles = cdiv(m, bm) * cdiv(n, bn)
    k_steps = cdiv(k, bk)
    if split_k is None:
        splits = 1 if persistent else _pick_split_k(dev, m, tiles, k_steps)
    else:
        if split_k > 1 and persistent:
            raise ValueError("split_k: a split tile runs one program per (tile, split), not a persistent grid; "
                             f"got split_k={split_k} with persistent={persistent}")
        splits = split_k
    splits = cdiv(k_steps, cdiv(k_steps, min(splits, k_steps)))  # no empty split
    counters = tile_counters(dev, tiles) if splits > 1 else None
    if counters is None:
        splits = 1
        counters = part = w_scale  # placeholder pointers
    else:
        part = torch.empty((splits, tiles, bm * bn), dtype=torch.int32, device=dev)
    grid = (persistent_grid(tiles, int(persistent), sm_count(dev)) * splits,)
    pdl = _pdl(dev, m)
    # the grid dependency instructions (wait, then signal dependents): with PDL, and in a GEMM whose consumer is
    # launched early (a kernel launched without PDL passes the wait at once)
    gdc = _pdl(dev, m, {0: "layernorm", 2: "attention"}.get(code, ""))
    a_src, w_src = (descriptor(a, (bm, bk)), descriptor(w, (bn, bk))) if use_tma else (a, w)
    tma_epi = (len(tile) >= 8 and bool(tile[7]) and code != 2 and describable(out)
               and (res_mode == 0 or describable(res)))
    out_dst = descriptor(out, (bm, bn)) if tma_epi else out
    res_src = descriptor(res, (bm, bn)) if tma_epi and res_mode else res
    launch_kernel(_int8_gemm_kernel, grid,
        a_src, w_src, bias, w_scale, out_scale if out_scale is not None else w_scale, res_src, out_dst, vt, part,
        counters, m, n, k, a.stride(0), w.stride(0), res.stride(0) if res.dim() == 2 else 0,
        out.stride(0) if code != 2 else 0, vt_stride or 0, vt_rows,
        float(a_scale), 1.0 if column_res else float(residual_scale), residual_scale if column_res else w_scale,
        hidden,
        EPILOGUE=code, RES_MODE=res_mode, GELU=gelu, HEAD_DIM=head_dim,
        COLUMN_OUT_SCALE=column_out_scale, COLUMN_RES_SCALE=column_res, RECIPROCAL=bool(reciprocal),
        ALIGNED_QKV=aligned_qkv,
        EVEN_K=(k % bk == 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FAST_GELU=int(fast_gelu) if gelu else 0, TMA=use_tma,
        PERSISTENT=bool(persistent), TMA_EPI=tma_epi, SPLIT_K=splits, PDL=gdc, INTERPRET=INTERPRET, num_warps=warps,
        num_stages=stages,
        **pdl_launch_options(pdl),
    )
    if code == 2:
        return out, vt
    return out


# ----------------------------------------------------------------------------------------------------
# int8 attention: QK^T -> masked softmax (fp32) -> int8 P -> P.V -> dequant + head merge + requant
# ----------------------------------------------------------------------------------------------------
# A masked key's raw score gets the bits of -2^100 added in place of the conversion's magic number: it becomes a
# float in [-1.5 * 2^100, -0.75 * 2^100], below every real raw score (|Q_q . K_q^T| <= 2^22), with no select
# per score; times any score scale above 1e-27 its exponential is 0.
# The key words (`attention_key_words`) hold one of these two int32 values per key.
KEY_ATTENDS_WORD = 0x4B400000  # float32 1.5 * 2^23, the conversion's magic number
KEY_MASKED_WORD = -243269632   # 0xF1800000, float32 -2^100
_KEY_ATTENDS_BITS = tl.constexpr(KEY_ATTENDS_WORD)
_MASKED_KEY_BITS = tl.constexpr(KEY_MASKED_WORD)
_MASKED_ROW_BELOW = tl.constexpr(-1e27)      # a row max this low means the row has no unmasked key


@triton.jit
def _raw_scores(q, k_base, key_words_ptr, kstart, n0, lead, klen,
                HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, LEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Raw scores f = Q_q . K_q^T of the query block against key columns n0 .. n0 + BLOCK_N - 1 counted from
    `kstart` as exact float32 integers, masked columns (outside [lead, klen), or masked out) far below every
    real score; with the key columns. An int32 x with |x| <= 2^22 becomes float32 exactly without a conversion
    instruction (I2FP issues on sm90's quarter-rate pipe, shared with the exponential): 1.5 * 2^23 + x has x in
    its mantissa, so adding the magic number's bits and subtracting it as a float is exact. The mask is per
    column, so it rides in that integer add (a per-column magic number) instead of a select per score; the
    scale is applied later, fused with the max subtraction (one FFMA per score). Offline sm90 SASS of the
    two-pass 64x64 tile (4 warps, 32 scores per thread and key block): 292 instructions per pass-1 iteration
    and 339 per pass-2 iteration, from 352 and 431 with a select, a multiply and a subtraction per score (the
    integer add even folds into the MMA: its accumulator starts at the magic numbers).

    With a key mask (HAS_MASK) the per-column magic numbers are loaded as they are: `attention_key_words` made
    them once per forward, so no compare and select per column and key block (with the byte mask they cost the
    padded 32x384 forward's 64x64 tile 48 instructions per pass-1 iteration and 58 per pass-2 iteration).
    LEAD: columns before `lead` (the previous sequence's keys under align-down) are masked too."""
    d = tl.arange(0, HEAD_DIM)
    cols = n0 + tl.arange(0, BLOCK_N)
    in_k = cols < klen
    k = tl.load(k_base + (kstart + cols)[:, None] * HEAD_DIM + d[None, :], mask=in_k[:, None], other=0)
    acc = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    if HAS_MASK:
        magic = tl.load(key_words_ptr + kstart + cols, mask=in_k, other=_MASKED_KEY_BITS)
    else:
        magic = tl.where(in_k, _KEY_ATTENDS_BITS, _MASKED_KEY_BITS)
    if LEAD:
        magic = tl.where(cols >= lead, magic, _MASKED_KEY_BITS)
    if HEAD_DIM <= 256:
        # |Q_q . K_q^T| <= HEAD_DIM * 2^14 <= 2^22: the magic-number conversion is exact
        f = (acc + magic[None, :]).to(tl.float32, bitcast=True) - 12582912.0
    else:
        f = tl.where((magic == _KEY_ATTENDS_BITS)[None, :], acc.to(tl.float32), -1.2676506002282294e30)
    return f, cols


@triton.jit
def _scaled_row_max(m_raw, scale):
    """The row max times the score scale, or +inf for a row whose max is a masked key's (no unmasked key yet):
    that row's exponentials are then 0, never overflowing (masked raw scores differ by up to 2^99)."""
    return tl.where(m_raw > _MASKED_ROW_BELOW, m_raw * scale, float("inf"))


@triton.jit
def _p_factor(l, inv_p_scale):
    """1 / l and 1 / s_p folded into one factor per row; rows without any unmasked key (l = 0) get 0."""
    return tl.where(l > 0.0, inv_p_scale / tl.where(l > 0.0, l, 1.0), 0.0)


@triton.jit
def _p_codes(v, P_CLAMP: tl.constexpr):
    """int8 codes of probabilities over their scale, v = p / s_p >= 0. Without P_CLAMP (the launcher's promise
    that 1 / s_p <= 127 (1 + 2^-10)) no clamp: p <= 1 up to the approximations' few ulp, so v < 127.5 and the
    magic-number rounding alone gives at most 127 (one FMNMX per score fewer, 32 of the 64x64 tile's 340 pass-2
    instructions per key block). The one-pass path's normalising multiply then fuses with the rounding add (one
    FFMA, one rounding instead of two), so its codes can move by one at near-ties."""
    if P_CLAMP:
        return to_int8_sat_nonneg(v)
    else:
        return to_int8_rne(v)


@triton.jit
def _int8_attention_kernel(
    qk_ptr, vt_ptr, out_ptr, cu_seqlens_ptr, key_words_ptr,
    T, k_plane, stride_vt, stride_om,
    score_scale_log2, inv_p_scale, ctx_scale, out_scale,
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, ONE_PASS: tl.constexpr, ALIGNED: tl.constexpr,
    ALIGN_DOWN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    INTERPRET: tl.constexpr, FMA_DIV: tl.constexpr = True, P_CLAMP: tl.constexpr = True,
):
    """ONE_PASS (BLOCK_N >= the longest sequence): the block's whole score rows at once, so the row max and
    the normaliser are exact reductions and each score is computed and exponentiated once; otherwise two
    passes over key blocks (online max / normaliser, then recomputed scores).

    Keys are walked from `kstart`: the sequence start (ALIGNED, or neither flag) or (ALIGN_DOWN) the start
    rounded down to a multiple of 16, the `lead` = start % 16 keys before it (the previous sequence's) masked
    out, and V^T read up to a multiple of 16 columns (V^T rows are padded to 16 columns; the extra keys have
    p = 0). With either flag V^T's key runs and their masks are 16-byte aligned, so its tiles load as 16-byte
    asynchronous copies pipelined with the MMAs instead of one synchronous byte load per key (offline sm90
    SASS: LDGSTS.128 instead of LDG.U8 + STS.U8); with neither (V^T rows not padded to 16) byte loads."""
    grid_dependency_sync(PDL)
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    if ALIGNED:
        # every sequence starts and ends on a multiple of 16 tokens
        start = tl.multiple_of(start, 16)
        length = tl.multiple_of(length, 16)
    lead = 0
    kstart = start
    klen = length
    vlen = length
    if ALIGN_DOWN:
        lead = start % 16
        kstart = tl.multiple_of(start - lead, 16)
        klen = lead + length
        vlen = tl.multiple_of((klen + 15) // 16 * 16, 16)
    if pid_m * BLOCK_M < length:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        row_ok = rows < length
        head_off = head.to(tl.int64) * T * HEAD_DIM
        q = tl.load(qk_ptr + head_off + (start + rows)[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0)
        k_base = qk_ptr + k_plane + head_off
        vt_base = vt_ptr + head.to(tl.int64) * HEAD_DIM * stride_vt

        # Scores stay raw (exact integers in float32) up to the exponential: exp(s - m) with s = f * c is
        # exp2(f * c2 - m_f * c2), c2 = c * log2(e), one FFMA per score; the row max m_f is taken on raw scores.
        if ONE_PASS:
            if ALIGNED:
                # V^T's 16-byte loads issued before the scores, so their latency hides under Q.K^T and the
                # softmax (H100, CUDA graphs, the table's 64-row tile, same run as the kernel before:
                # results/tune_encoder_attention_hoist.json: 32x128 tokens 14.3 vs 14.8 us, 128x128 35.7 vs
                # 37.2, 1x128 7.0 vs 7.4, 8x128 8.3 vs 8.2; a scratch variant holding the packed path's byte
                # loads that long lost 1.3-1.8 us, so they stay after the softmax)
                vt = tl.load(vt_base + d[:, None] * stride_vt + (kstart + tl.arange(0, BLOCK_N))[None, :],
                             mask=(tl.arange(0, BLOCK_N) < vlen)[None, :], other=0)
            f, cols = _raw_scores(q, k_base, key_words_ptr, kstart, 0, lead, klen, HEAD_DIM, HAS_MASK, ALIGN_DOWN,
                                  BLOCK_N)
            m_scaled = _scaled_row_max(tl.max(f, 1), score_scale_log2)
            e = exp2_approx(tl.fma(f, score_scale_log2, -m_scaled[:, None]), INTERPRET)
            p_q = _p_codes(e * _p_factor(tl.sum(e, 1), inv_p_scale)[:, None], P_CLAMP)
            if not ALIGNED:
                vt = tl.load(vt_base + d[:, None] * stride_vt + (kstart + cols)[None, :],
                             mask=(cols < vlen)[None, :], other=0)
            acc = tl.dot(p_q, tl.trans(vt), out_dtype=tl.int32)
        else:
            # Pass 1: row max (raw) and normaliser (base 2: score_scale_log2 folds in log2(e)).
            m_raw = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            for n0 in range(0, klen, BLOCK_N):
                f, cols = _raw_scores(q, k_base, key_words_ptr, kstart, n0, lead, klen, HEAD_DIM, HAS_MASK,
                                      ALIGN_DOWN, BLOCK_N)
                m_new = tl.maximum(m_raw, tl.max(f, 1))
                m_scaled = _scaled_row_max(m_new, score_scale_log2)
                # the old sum is 0 while a row has seen no unmasked key (m_raw * c is then -inf or -2^100 c)
                l_i = l_i * exp2_approx(m_raw * score_scale_log2 - m_scaled, INTERPRET) \
                    + tl.sum(exp2_approx(tl.fma(f, score_scale_log2, -m_scaled[:, None]), INTERPRET), 1)
                m_raw = m_new

            # Pass 2: final probabilities p = exp2(f * c2 - m_f * c2 + log2(1 / (l s_p))), the normalisation in
            # the same FFMA (rows without an unmasked key: a bias of +inf, so p = 0), quantized on chip, times V.
            p_factor = _p_factor(l_i, inv_p_scale)
            log2_factor = tl.log2(tl.where(p_factor > 0.0, p_factor, 1.0))
            p_bias = tl.where(p_factor > 0.0, _scaled_row_max(m_raw, score_scale_log2) - log2_factor, float("inf"))
            acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.int32)
            for n0 in range(0, klen, BLOCK_N):
                f, cols = _raw_scores(q, k_base, key_words_ptr, kstart, n0, lead, klen, HEAD_DIM, HAS_MASK,
                                      ALIGN_DOWN, BLOCK_N)
                p_q = _p_codes(exp2_approx(tl.fma(f, score_scale_log2, -p_bias[:, None]), INTERPRET), P_CLAMP)
                vt = tl.load(vt_base + d[:, None] * stride_vt + (kstart + cols)[None, :],
                             mask=(cols < vlen)[None, :], other=0)
                acc = tl.dot(p_q, tl.trans(vt), acc, out_dtype=tl.int32)

        ctx = acc.to(tl.float32) * ctx_scale
        if FMA_DIV:
            o = to_int8_sat(div_rn_by(ctx, out_scale, tl.math.div_rn(1.0, out_scale)))
        else:
            o = to_int8_sat(tl.math.div_rn(ctx, out_scale + tl.zeros_like(ctx)))
        tl.store(out_ptr + (start + rows)[:, None].to(tl.int64) * stride_om + head * HEAD_DIM + d[None, :], o,
                 mask=row_ok[:, None])


# one-pass score rows wider than this no longer fit the registers of any tile (they spill from 512 on sm90)
ONE_PASS_MAX_KEYS = 512
# shared memory the attention's K / V^T pipeline stages may take together (the query block and the compiler's
# scratch need the rest)
ATTENTION_STAGE_BYTES = 160 * 1024


def _attention_config(device: torch.device, max_seqlen: int, aligned_starts: bool, aligned_vt: bool) -> dict:
    """The one-pass tile for the first `attention_one_pass` entry (`attention_one_pass_packed` where sequences
    do not start on multiples of 16) whose key count covers max_seqlen, else the two-pass config for
    16-aligned V^T key runs (aligned starts, or starts rounded down: `int8_attention`) or for byte-wise V^T
    loads."""
    table = _table(device)
    for max_keys, cfg in table["attention_one_pass" if aligned_starts else "attention_one_pass_packed"]:
        if max_seqlen <= max_keys:
            return dict(cfg, one_pass=True)
    return table["attention_aligned" if aligned_vt else "attention"]


def attention_key_words(key_mask: torch.Tensor) -> torch.Tensor:
    """int8 / bool key mask [T] (nonzero = attend) -> the int32 words `int8_attention` adds to each key's raw
    scores: the magic number of the scores' float conversion where the key attends, the bits of -2^100 where it
    is masked. The encoder makes them once per forward; the attention of every layer loads them as they are.
    An int32 tensor is taken to be key words already and returned as it is (int32 is never a mask here)."""
    if key_mask.dtype == torch.int32:
        return key_mask
    if key_mask.dtype not in (torch.int8, torch.bool):
        raise TypeError(f"key_mask: expected int8 or bool (nonzero = attend), got {key_mask.dtype}")
    # int32 from the start, no host tensors (CUDA-graph capturable); a bool mask is not compared again
    words = torch.full_like(key_mask, KEY_MASKED_WORD, dtype=torch.int32)
    return words.masked_fill_(key_mask if key_mask.dtype == torch.bool else key_mask != 0, KEY_ATTENDS_WORD)


def int8_attention(
    qk: torch.Tensor,
    vt: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    key_mask: torch.Tensor | None,
    q_scale: float,
    k_scale: float,
    v_scale: float,
    p_scale: float,
    out_scale: float,
    config: dict | None = None,
    aligned_starts: bool = False,
) -> torch.Tensor:
    """Attention over packed sequences. qk [2, heads, T, d] int8, vt [heads, d, T_v] int8,
    cu_seqlens int32 [B + 1], key_mask int8 / bool [T] (nonzero = attend), its `attention_key_words` (int32:
    always read as key words, never as a 0 / 1 mask), or None. Returns int8 [T, heads * d].
    config (block_m, block_n, num_warps, num_stages, and optionally one_pass: the whole key range in one block,
    block_n then being the next power of two of max_seqlen, at least 32) overrides the table
    (benchmarks/tune_encoder.py).
    aligned_starts: the caller guarantees every cu_seqlens entry is a multiple of 16 (the padded path's
    uniform batches of a length divisible by 16). Otherwise, where V^T's rows are padded to a multiple of 16
    columns (vt.stride(1) % 16 == 0, as the QKV GEMM writes them) and (one pass) the key block has room for
    15 more keys, each sequence's keys are walked from its start rounded down to a multiple of 16, the keys
    before the start masked (align down). Both load V^T as aligned 16-byte copies; a config with
    "align_down": False forces byte loads."""
    _, heads, t, head_dim = qk.shape
    padded_vt = vt.stride(1) % 16 == 0
    aligned = bool(aligned_starts) and padded_vt
    cfg = dict(config or _attention_config(qk.device, max_seqlen, aligned, aligned or padded_vt))
    one_pass = bool(cfg.get("one_pass", False))
    if one_pass and max_seqlen > ONE_PASS_MAX_KEYS:
        raise ValueError(f"config: one_pass holds at most {ONE_PASS_MAX_KEYS} keys per row, max_seqlen is "
                         f"{max_seqlen}")
    bm = cfg["block_m"]
    # P.V's K is the key block: int8 tensor-core products need K >= 32 (16 gave wrong results on the H100)
    bn = max(32, next_pow2(max(max_seqlen, 1))) if one_pass else cfg["block_n"]
    align_down = (not aligned and padded_vt and cfg.get("align_down", True)
                  and (not one_pass or max_seqlen + 15 <= bn))
    # each pipeline stage holds a K block and a V^T block: wide heads get fewer stages (head_dim 512 on the
    # 64-key table tile asked for 256 KB of shared memory at 3 stages, past the H100's 227 KB)
    stages = max(1, min(cfg["num_stages"], ATTENTION_STAGE_BYTES // (2 * bn * head_dim)))
    out = torch.empty((t, heads * head_dim), dtype=torch.int8, device=qk.device)
    batch = cu_seqlens.numel() - 1
    grid = (cdiv(max(max_seqlen, 1), bm), heads, batch)
    score_scale_log2 = q_scale * k_scale / math.sqrt(head_dim) * math.log2(math.e)
    pdl = _pdl(qk.device, t, "attention")
    key_words = cu_seqlens if key_mask is None else attention_key_words(key_mask)
    inv_p_scale = 1.0 / p_scale
    launch_kernel(_int8_attention_kernel, grid,
        qk, vt, out, cu_seqlens, key_words,
        t, heads * t * head_dim, vt.stride(1), out.stride(0),
        score_scale_log2, inv_p_scale, p_scale * v_scale, out_scale,
        HEAD_DIM=head_dim, HAS_MASK=key_mask is not None, ONE_PASS=one_pass,
        ALIGNED=aligned, ALIGN_DOWN=align_down,
        BLOCK_M=bm, BLOCK_N=bn, PDL=pdl, INTERPRET=INTERPRET, FMA_DIV=div_rn_by_applies(out_scale),
        P_CLAMP=inv_p_scale > 127.0 * (1 + 2 ** -10),
        num_warps=cfg["num_warps"], num_stages=stages, **pdl_launch_options(pdl),
    )
    return out


# ----------------------------------------------------------------------------------------------------
# LayerNorm (+ requant)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _gathered_row(table_ptr, index_ptr, rows, row_ok, cols, mask, N, num_rows):
    """fp16 rows table[index[rows]] as float32; an index outside [0, num_rows) reads nothing and gives a NaN
    row (the LayerNorm then makes the token's whole hidden state NaN: loud, where torch's gather would
    assert on the device)."""
    idx = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    ok = (idx >= 0) & (idx < num_rows)
    v = tl.load(table_ptr + tl.where(ok, idx, 0)[:, None] * N + cols[None, :], mask=mask & ok[:, None], other=0.0)
    return tl.where(ok[:, None], v.to(tl.float32), float("nan"))


@triton.jit
def _layernorm_quant_kernel(
    y_ptr, gamma_ptr, beta_ptr, out16_ptr, out8_ptr,
    M, N, stride_y, out_scale, out_scale_vec_ptr, eps,
    ids_ptr, types_ptr, positions_ptr, type_emb_ptr, pos_emb_ptr, n_word, n_type, n_pos, gather_ptr, n_src,
    scatter_ptr, n_scatter, n_dest,
    EMBED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, WRITE_FP16: tl.constexpr,
    WRITE_INT8: tl.constexpr,
    DEQUANT_FP16: tl.constexpr, COLUMN_SCALE: tl.constexpr,
    RECIPROCAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """EMBED: y is the fp16 rounding of word[ids] + pos[positions] + type[types] summed in float32 (y_ptr the
    word table), the embedding sum gathered here instead of in three torch gathers, adds and casts. GATHER: row
    r takes token gather[r] of the n_src given (ids, types and positions indexed through it: the packed path's
    tokens picked out of the padded batch here, not by three more gathers); an index outside [0, n_src) gives
    a NaN row. SCATTER: the fp16 row r (r < n_scatter) goes to row scatter[r] of the n_dest-row output (the
    packed path's tokens put back into the padded batch by the last LayerNorm, not by an index_put after it);
    rows r >= n_scatter and destinations outside [0, n_dest) are not written."""
    grid_dependency_sync(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    # gamma and beta are loaded with the row: written after the mean and variance (reductions across warps, CTA
    # barriers) they were issued only after both, one more memory latency per program
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0)
    beta = tl.load(beta_ptr + cols, mask=col_ok, other=0.0)
    if SCATTER:
        dest = tl.load(scatter_ptr + rows, mask=rows < n_scatter, other=-1).to(tl.int64)
    if EMBED:
        src = rows
        if GATHER:
            src = tl.load(gather_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            src_ok = (src >= 0) & (src < n_src)
            src = tl.where(src_ok, src, 0)
        y = _gathered_row(y_ptr, ids_ptr, src, row_ok, cols, mask, N, n_word) \
            + _gathered_row(pos_emb_ptr, positions_ptr, src, row_ok, cols, mask, N, n_pos)
        y = y + _gathered_row(type_emb_ptr, types_ptr, src, row_ok, cols, mask, N, n_type)
        if GATHER:
            y = tl.where(src_ok[:, None], y, float("nan"))
        y = tl.where(mask, y.to(tl.float16).to(tl.float32), 0.0)
    else:
        y = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(y, 1) / N
    centered = tl.where(mask, y - mean[:, None], 0.0)
    var = tl.sum(centered * centered, 1) / N
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    o = centered * rstd[:, None] * gamma[None, :] + beta[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    offs16 = offs
    mask16 = mask
    if SCATTER:
        dest_ok = (dest >= 0) & (dest < n_dest)
        offs16 = tl.where(dest_ok, dest, 0)[:, None] * N + cols[None, :]
        mask16 = mask & dest_ok[:, None]
    if WRITE_FP16:
        o16 = o.to(tl.float16)
        tl.store(out16_ptr + offs16, o16, mask=mask16)
        o = o16.to(tl.float32)
    if WRITE_INT8:
        if COLUMN_SCALE:
            # loaded here, not with gamma and beta: held across the reductions it took the sm90 build from 128
            # to 168 registers (6 programs per SM instead of 8: 0.89x at 4096 tokens); ptxas issues it early anyway
            col_scale = tl.load(out_scale_vec_ptr + cols, mask=col_ok, other=1.0)
            q = to_int8_sat(_requant(o, col_scale[None, :], RECIPROCAL))
        else:
            q = to_int8_sat(_requant(o, out_scale, RECIPROCAL))
        tl.store(out8_ptr + offs, q, mask=mask)
        if DEQUANT_FP16:
            tl.store(out16_ptr + offs16, (q.to(tl.float32) * out_scale).to(tl.float16), mask=mask16)


def layernorm_quant(y: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
                    out_scale: float | torch.Tensor | None, write_fp16: bool, config: tuple | None = None,
                    embed: tuple | None = None, dequant_fp16: bool = False, out_fp16: torch.Tensor | None = None,
                    scatter: torch.Tensor | None = None):
    """Row LayerNorm of fp16 y [M, N]; returns (fp16 or None, int8 or None). out_scale: a float (per
    tensor), float32 [N] (per column: a smoothing factor folded into the consumer's weight), or None.
    config (rows per program, num_warps, reciprocal) overrides the table (for benchmarks/tune_encoder.py).
    embed = (input_ids, token_type_ids, positions, type_table, pos_table[, gather]), int32/int64 [M] each and
    fp16 [*, N] tables: y is then the fp16 word table and the rows normalised are fp16(word[ids] + pos[positions]
    + type[types]) (float32 sums), gathered in the kernel; a token whose index is out of its table's range gets a
    NaN row. With gather (int32/int64 [M]) the three index tensors hold S >= 1 tokens and row r is token
    gather[r] (an index outside [0, S) gives a NaN row). dequant_fp16 (per-tensor out_scale, write_fp16 False):
    the fp16 output is fp16(q * s_out), the int8 result dequantized (mode 2's encoder output) instead of the
    LayerNorm itself. out_fp16: a contiguous fp16 [M, N] tensor the fp16 output is written into (and returned)
    instead of a new one (the encoder's split forward: each chunk's rows of the one output). scatter (int32/int64
    [T], T <= M, with out_fp16 a contiguous fp16 [R, N]): fp16 row r < T goes to row scatter[r] of out_fp16 (the
    packed forward's last LayerNorm restoring the padded layout); rows r >= T and destinations outside [0, R) are
    not written (the int8 output keeps the M input rows)."""
    if dequant_fp16 and (write_fp16 or out_scale is None or isinstance(out_scale, torch.Tensor)):
        raise ValueError("dequant_fp16: needs a per-tensor float out_scale and write_fp16=False")
    if out_fp16 is not None and not (write_fp16 or dequant_fp16):
        raise ValueError("out_fp16: given, but neither write_fp16 nor dequant_fp16 asks for an fp16 output")
    # without embed the kernel's embedding arguments are placeholders (gamma; EMBED is off)
    ids = types = positions = type_emb = pos_emb = gamma
    gather = None
    if embed is not None:
        if len(embed) not in (5, 6):
            raise ValueError(f"embed: expected (input_ids, token_type_ids, positions, type_table, pos_table[, "
                             f"gather]), got {len(embed)} items")
        ids, types, positions, type_emb, pos_emb = embed[:5]
        gather = embed[5] if len(embed) == 6 else None
        m, n = (ids.numel() if gather is None else gather.numel()), y.shape[1]
        src = ids.numel()
        if gather is not None and (gather.dim() != 1 or gather.dtype not in (torch.int32, torch.int64)
                                   or not gather.is_contiguous() or gather.device != ids.device):
            raise ValueError(f"gather: expected a contiguous int32/int64 [M] tensor on {ids.device}, got "
                             f"{gather.dtype} {tuple(gather.shape)} on {gather.device}")
        for name, t in (("y", y), ("type_table", type_emb), ("pos_table", pos_emb)):
            if t.dtype != torch.float16 or t.dim() != 2 or t.shape[1] != n or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous fp16 [*, {n}] embedding table, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        for name, t in (("input_ids", ids), ("token_type_ids", types), ("positions", positions)):
            if t.dim() != 1 or t.numel() != src or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous int32/int64 [{src}] tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
    else:
        m, n = y.shape
    column = isinstance(out_scale, torch.Tensor)
    if column and (out_scale.dtype != torch.float32 or out_scale.numel() != n or not out_scale.is_contiguous()):
        raise ValueError(f"out_scale: expected a float or a contiguous float32 tensor of N={n} elements, got "
                         f"{out_scale.dtype} {tuple(out_scale.shape)}")
    block_n = next_pow2(n)
    table = _table(y.device)
    rows = max(1, min(16, table["layernorm_rows_budget"] // block_n))
    if scatter is not None:
        if out_fp16 is None:
            raise ValueError("scatter: needs out_fp16 (the [R, N] tensor its rows are written into)")
        if (scatter.dim() != 1 or scatter.dtype not in (torch.int32, torch.int64) or not scatter.is_contiguous()
                or scatter.device != y.device or scatter.numel() > m):
            raise ValueError(f"scatter: expected a contiguous int32/int64 [T] tensor on {y.device} with T <= {m}, "
                             f"got {scatter.dtype} {tuple(scatter.shape)} on {scatter.device}")
    # a scattered output has any number of rows R (the padded batch's); else exactly the M rows
    if out_fp16 is not None and (out_fp16.dtype != torch.float16 or out_fp16.dim() != 2 or out_fp16.shape[1] != n
                                 or (scatter is None and out_fp16.shape[0] != m)
                                 or not out_fp16.is_contiguous() or out_fp16.device != y.device):
        want = "R" if scatter is not None else m
        raise ValueError(f"out_fp16: expected a contiguous fp16 [{want}, {n}] tensor on {y.device}, got "
                         f"{out_fp16.dtype} {tuple(out_fp16.shape)} on {out_fp16.device}")
    out16 = out_fp16
    if out16 is None and (write_fp16 or dequant_fp16):
        out16 = torch.empty((m, n), dtype=torch.float16, device=y.device)
    out8 = torch.empty((m, n), dtype=torch.int8, device=y.device) if out_scale is not None else None
    warps = max(1, min(8, rows * block_n // table["layernorm_elements_per_warp"]))
    reciprocal = table["layernorm_reciprocal"]
    if config is not None:
        rows, warps, reciprocal = config
    pdl = _pdl(y.device, m, "" if embed is not None else "layernorm")
    launch_kernel(_layernorm_quant_kernel, (cdiv(m, rows),),
        y, gamma, beta, out16 if out16 is not None else y, out8 if out8 is not None else y,
        m, n, y.stride(0), 1.0 if column or out_scale is None else float(out_scale),
        out_scale if column else gamma, float(eps), ids, types, positions, type_emb, pos_emb,
        y.shape[0], type_emb.shape[0], pos_emb.shape[0], ids if gather is None else gather, ids.numel(),
        gamma if scatter is None else scatter, 0 if scatter is None else scatter.numel(),
        0 if scatter is None else out_fp16.shape[0],
        EMBED=embed is not None, GATHER=gather is not None, SCATTER=scatter is not None, WRITE_FP16=write_fp16,
        WRITE_INT8=out_scale is not None,
        DEQUANT_FP16=bool(dequant_fp16), COLUMN_SCALE=column,
        RECIPROCAL=bool(reciprocal), ROWS=rows, BLOCK_N=block_n, PDL=pdl, INTERPRET=INTERPRET,
        num_warps=warps, **pdl_launch_options(pdl),
    )
    return out16, out8
