"""W8A16 decode (M = 2..32, one scale per output channel): the packed int8 codes read as a byte matrix straight into
a `tl.dot` operand, the per-channel scale applied to the sums.

Math (SPEC section 4): out[m, n] = s[n] * sum_k x[m, k] * (u[n, k] - z[n]) (+ bias[n]), float32 accumulation, one
rounding. That is x @ W.T with the unrounded W = (u - z) * s, within one rounding per weight of x @ w_hat.T: the
allowance `quantfuse.weight_only_mm` states (the M = 1 GEMVs use it too).

Layout: in the packed layout (`weight_only` module doc) byte i of the little-endian int32 word j of a 64-code chunk
is field i, k = 16 i + j; so a row of the [N, K_pad / 4] int32 words viewed as [N, K_pad] bytes holds, inside each
chunk, k = 16 (p mod 4) + p / 4 at byte p. The dot's K order is free (it sums over it): the weight tile
[BLOCK_K, BLOCK_N] is loaded as the bytes lie, and x [BLOCK_M, BLOCK_K] is read in k order and permuted in
registers into the bytes' order (a reshape / permute of [BLOCK_M, BLOCK_K / 64, 4, 16]).

Why: the int8 tiles of `weight_only._wo_mm_kernel` load int32 words, extract each field by a shift and a mask and
scale every weight before the dot. Here each step's [BLOCK_K, BLOCK_N] bytes come through Triton's multi-stage
load pipeline as one operand (the recipe of `scaled_mm`'s fp8 decode tiles, which stream the same number of
weight bytes 1.1-1.3x faster than that tile on the H100), each byte becomes the exact u - z with the 2^23 trick
(one PRMT puts the byte under 0x4B0000: the float 2^23 + u; one FADD subtracts 2^23 + z, exact; half an F2FP
rounds the pair to x's dtype, exact for |u - z| <= 255), and the scale multiplies the sums once per output. The
kernel is issue-bound at one warp per scheduler (ncu at 14336x4096, M = 16: 2.14 cycles per issued instruction,
DRAM at 67% of peak), so instructions per weight are its budget: the PRMT replaced plain tl's zero-extension and
OR (a PRMT and a LOP3 per weight), 1.01-1.13x, bit-identical (results/tune_weight_only_w8_decode_prmt.json); with
float16 x two bytes per PRMT become the float16 pair (1024 + u, 1024 + u') and one HSUB2 of (1024 + z) pairs leaves
u - z: one instruction per weight, 1.01-1.10x more, bit-identical (results/tune_weight_only_w8_decode_f16.json).
One program per SM: a program's tile is 128 weight rows (columns of the output) by the 16 rows of x, and split-K
over whole steps brings the programs to the SM count; float32 partials are reduced by `weight_only.splitk_reduce`
with the bias and the one rounding, launched early behind this kernel where `configs.split_k_reduce_pdl` says
(1.03-1.07x at 4096x6144 and 4096x4096, 1.01-1.02x at 14336x4096, M = 2..32: results/tune_w8_decode_reduce_pdl.json).
M = 17..32 takes a 32-row block of x with 128-byte steps, 3 stages and two programs per SM (the 32 x 256-byte tile
holds 190 registers, one program per SM, and ran slower). M past block_m runs more program rows; the M blocks of a
weight tile are launched next to each other so that they can share it through L2, but two 32-row blocks still lost
to the int8 tl tiles at M = 48 / 64 (below).

H100 (torch 2.11, Triton 3.6; CUDA graphs, weights rotated past L2, min of 3 alternated rounds in one call,
results/tune_weight_only_w8_decode.json, W8A16 per channel, bf16 x) against the int8 tile it replaced
(`weight_only.fused_mm`): float32 scales, M = 2 / 4 / 8 / 16, 1.09-1.17x on all six shapes (28672x8192 at M = 16:
92.3 us vs 108, 1.84x bf16; 8192x10240 40.0 vs 45.2, 1.80x; 14336x4096 29.6 vs 33.7); bfloat16 scales at M = 16
1.34-1.56x (that tile reads 16-bit scales per weight). M = 17..32 (results/tune_weight_only_w8_decode_wide.json,
five Llama-3 shapes, float32 scales, M = 17 / 24 / 32, min of 2 rounds, the tl tile it replaced in the same run):
the 32-row config 1.19-1.34x on four shapes (4096x28672 M = 32 53.7 us vs 72.2, 1.69x bf16; 28672x8192 101.6 vs
136.2, 1.71x; 8192x10240 43.2 vs 52.3, 1.68x; 14336x4096 32.6 vs 38.7, 1.52x) and 1.00-1.02x at 4096x6144 (1.32x
bf16). At M = 48 / 64 the tl tiles stay (the best config here 0.64-0.95x them), and at M = 96 / 128 (0.53-0.74x); a
64- or 128-row block makes Triton use wgmma with the converted weight stored to shared memory, and spills (0.16-0.65x
the tl tiles in results/tune_weight_only_w8_decode_wide_first.json). At M = 1 the Gluon GEMV (`gemv_tma`) stays:
this kernel's recipe (before the PRMT) ran 0.79-1.02x it there (results/tune_weight_only_w8_bytes*.json and
benchmarks/probe_w8_bytes.py hold the candidates: 64 / 128 / 256 columns, 128 / 256 / 512 bytes per step, 3-6
stages, 1-4 programs per SM, x gathered in the bytes' order instead of permuted, the weight as the left operand;
results/tune_weight_only_w8_decode_configs.json the neighbours of the shipped config after it).

Scope (`applies`): int8 codes with one scale (and zero point) per output channel (group_size -1, or one group
covering K), float16 / bfloat16 x with a contiguous last dimension, any M >= 1 (correct at any M, fast in the
dispatch band), packed words with contiguous rows. `weight_only_mm` runs it where `prefer` says
(W8_DECODE_DISPATCH). The kernel is plain `tl` code, so the Triton interpreter runs it too (its dot in float32)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, cap_splits, cast_to, cdiv, grid_dependency_sync, launch_kernel
from .configs import sm_count, split_k_reduce_pdl

CHUNK_BYTES = 64  # codes of one 16-word chunk (the permutation's period)


@dataclass(frozen=True)
class W8DecodeConfig:
    """block_n weight rows (output columns) per program; block_k codes (bytes) per K step, a multiple of 64;
    num_stages of the load pipeline; programs_per_sm sets the split-K target (column blocks x M blocks x splits ~
    programs_per_sm x SMs); block_m rows of x per program (M past it takes more program rows, each streaming the
    weight again); min_steps_per_split: the automatic split count leaves each split at least this many K steps
    (`_common.cap_splits`)."""
    block_n: int = 128
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 1
    block_m: int = 16
    min_steps_per_split: int = 1


# Per architecture, the configs by increasing block_m (`pick_config`: the first that covers M; H100: the module doc's
# measurements; for M <= 16, in results/tune_weight_only_w8_bytes_sweeps.json 3 stages were 2-3% faster at K = 4096
# and 2-3% slower at K = 8192 / 28672, the last split's program reducing the partials within 3%; for M = 17..32 the
# best of eight configs on all five shapes in results/tune_weight_only_w8_decode_wide.json, 4 stages 1-7% behind),
# and the M band where weight_only_mm prefers this kernel. "default" (other GPUs, the interpreter tests): a small
# tile, not tuned.
W8_DECODE_CONFIGS: Dict[str, Tuple[W8DecodeConfig, ...]] = {
    # two steps per split at least (H100, results/probe_small_splits.json: 2048x2048 at M = 32, 16 one-step splits
    # 9.4 us, 8 splits 7.9)
    "sm90": (W8DecodeConfig(min_steps_per_split=2),
             W8DecodeConfig(128, 128, 4, 3, 2, block_m=32, min_steps_per_split=2)),
    "default": (W8DecodeConfig(32, 64, 4, 2, 2),),
}
W8_DECODE_DISPATCH: Dict[str, Dict[str, int]] = {"sm90": dict(min_m=2, max_m=32)}


def check_config(cfg: W8DecodeConfig) -> None:
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not pow2(cfg.block_n) or cfg.block_n < 16:
        raise ValueError(f"config block_n: expected a power of two >= 16, got {cfg}")
    if not pow2(cfg.block_k) or cfg.block_k < CHUNK_BYTES:
        raise ValueError(f"config block_k: expected a power of two >= {CHUNK_BYTES} (whole chunks), got {cfg}")
    if not pow2(cfg.block_m) or not 16 <= cfg.block_m <= 128:
        raise ValueError(f"config block_m: expected a power of two in 16..128, got {cfg}")
    if cfg.num_warps not in (1, 2, 4, 8) or cfg.num_stages < 1 or cfg.programs_per_sm < 1:
        raise ValueError(f"config: expected num_warps in (1, 2, 4, 8), num_stages >= 1, programs_per_sm >= 1, "
                         f"got {cfg}")


def pick_config(arch: str, m: int = 1) -> W8DecodeConfig:
    """The arch's config for M rows: the first (by increasing block_m) whose block_m covers M, else the last."""
    configs = W8_DECODE_CONFIGS.get(arch, W8_DECODE_CONFIGS["default"])
    return next((cfg for cfg in configs if m <= cfg.block_m), configs[-1])


def prefer(m: int, arch: str) -> bool:
    """Whether weight_only_mm runs this kernel for M rows on `arch` (configs.arch_key), where `applies`."""
    rule = W8_DECODE_DISPATCH.get(arch)
    return rule is not None and rule["min_m"] <= m <= rule["max_m"]


def applies(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> bool:
    """Whether the product can run here (module doc); the caller validated the arguments."""
    return (bits == 8 and scales.shape[0] == 1 and x2d.shape[0] >= 1
            and x2d.dtype in (torch.float16, torch.bfloat16) and x2d.stride(1) == 1
            and qweight.dtype == torch.int32 and qweight.stride(1) == 1)


# Four bytes of one register to four float32 2^23 + u: PRMT copies byte i under the bytes 0x4B 0x00 0x00 (selector
# nibbles, low byte first: i, 4, 4, 7 of {0x4B000000, word}), one instruction per weight; in plain tl the
# zero-extension and the OR cost a PRMT and a LOP3 per weight (ptxas, sm90).
_BYTES_TO_MAGIC = tl.constexpr(" ".join(f"prmt.b32 ${i}, $4, 0x4B000000, {0x7440 + i:#06x};" for i in range(4)))


@triton.jit
def _magic_bytes(w, INTERPRET: tl.constexpr):
    """The float32 2^23 + u of each byte u of the int8 tile w (its bits unsigned), exact."""
    if INTERPRET:  # the interpreter cannot run PTX: the same bits in plain tl
        return ((w.to(tl.int32) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        return tl.inline_asm_elementwise(_BYTES_TO_MAGIC, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True,
                                         pack=4)


# float16 x: two weights per PRMT + HSUB2. PRMT lays bytes 0 / 1 (2 / 3) of the word under 0x64 in two 16-bit lanes
# (selector nibbles 0, 4, 1, 4 of {0x64646464, word}): the float16 pair (1024 + u, 1024 + u'), exact for u < 1024;
# subtracting the pair (1024 + z) leaves the exact u - z. One instruction per weight instead of PRMT + FADD + half
# an F2FP through float32 (bfloat16's 8 significant bits cannot hold 128 + u for u >= 128, so it keeps that path).
_BYTES_MINUS_ZERO_F16 = tl.constexpr("prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342; "
                                     "sub.f16x2 $0, $0, $3; sub.f16x2 $1, $1, $4;")


@triton.jit
def _codes_minus_zero(w, zero_plus_magic, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The exact u - z of each byte u of the int8 tile w ([BLOCK_K, BLOCK_N], bits unsigned) in DTYPE; z per column
    as zero_plus_magic = 2^23 + z ([BLOCK_N], float32)."""
    if DTYPE == tl.float16 and not INTERPRET:
        z_pair = (zero_plus_magic - 8387584.0).to(tl.float16)  # 1024 + z (exact: < 2048)
        z_pair = tl.broadcast_to(z_pair[None, :], w.shape)
        return tl.inline_asm_elementwise(_BYTES_MINUS_ZERO_F16, "=r,=r,r,r,r", [w, z_pair], dtype=tl.float16,
                                         is_pure=True, pack=4)
    else:
        return (_magic_bytes(w, INTERPRET) - zero_plus_magic[None, :]).to(DTYPE)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter's dot mishandles 16-bit operands; float32 of the same values is exact
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _w8_decode_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr,
                      M, N, K, K_PAD, k_per_split, stride_xm, stride_wn, stride_om,
                      HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, INTERPRET: tl.constexpr,
                      PDL: tl.constexpr = False):
    """out [M, N] (or split pid's float32 partial [M, N] with SPLIT) = s * (x @ (u - z)^T) over the split's bytes
    [pid * k_per_split, + k_per_split) of K_PAD; w_ptr: the codes as bytes [N, K_PAD]. EVEN: K == K_PAD and every
    step whole (no masks). Rows past M and columns past N read rows m mod M / n mod N (valid memory), never stored.
    PDL (split-K): let the reduce kernel, launched early behind this one, be scheduled at once."""
    grid_dependency_sync(PDL)
    # the M blocks of one weight tile are neighbours in launch order (axis 0), so they run together and can share the
    # tile through L2
    pid_s = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rn = (offs_n % N).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rm = (offs_m % M).to(tl.int64)
    p_begin = pid_s * k_per_split
    p_end = tl.minimum(p_begin + k_per_split, K_PAD)
    pk = tl.arange(0, BLOCK_K)
    if HAS_ZERO:
        z = tl.load(z_ptr + rn).to(tl.float32)
    else:
        z = tl.full([BLOCK_N], 128.0, tl.float32)  # symmetric codes are biased by 2^(bits - 1)
    zero_plus_magic = z + 8388608.0
    w_ptrs = w_ptr + rn[None, :] * stride_wn + (p_begin + pk)[:, None]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (p_begin + pk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p in range(p_begin, p_end, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(p + pk < p_end)[:, None], other=0)
            x = tl.load(x_ptrs, mask=((p + pk < K) & (p + pk < p_end))[None, :], other=0.0)
        wv = _codes_minus_zero(w, zero_plus_magic, x_ptr.dtype.element_ty, INTERPRET)
        # x from k order (chunk, field, word) into the bytes' order (chunk, word, field)
        xb = tl.reshape(tl.permute(tl.reshape(x, [BLOCK_M, BLOCK_K // 64, 4, 16]), (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])
        acc = _dot(xb, wv, acc, INTERPRET)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + rn).to(tl.float32)[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + rows64 * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows64 * stride_om + offs_n[None, :], cast_to(acc, out_ptr.dtype.element_ty, INTERPRET),
                 mask=mask)


def split_plan(n: int, k_pad: int, cfg: W8DecodeConfig, num_sms: int, splits: Optional[int] = None, m: int = 1):
    """(K steps, splits, steps per split) of a launch over [N, K_pad] codes and M rows: splits forced, or
    programs_per_sm x SMs over the column blocks x M blocks (floored), each split a whole number of steps (the last
    possibly fewer)."""
    steps = cdiv(k_pad, cfg.block_k)
    if splits is None:
        blocks = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
        splits = cap_splits(cfg.programs_per_sm * num_sms // blocks, steps, cfg.min_steps_per_split)
    elif splits < 1:
        raise ValueError(f"splits: expected >= 1, got {splits}")
    per = cdiv(steps, min(splits, steps))
    return steps, cdiv(steps, per), per


def w8_decode_mm(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], n: int, config: Optional[W8DecodeConfig] = None,
                 splits: Optional[int] = None, num_sms: Optional[int] = None, arch: str = "sm90") -> torch.Tensor:
    """out [M, N] = s * (x2d @ (u - z).T) (+ bias) in x2d's dtype; the caller checked `applies` and validated the
    arguments. config: default `pick_config(arch)`; splits: force the number of K splits (whole steps each)."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    if config is not None:  # the shipped configs are checked by the tests, not on every decode call
        check_config(config)
    m, k = x2d.shape
    cfg = config or pick_config(arch, m)
    # the kernel reads one scale row: grouped scales would be read as per-channel ones, so they are refused here even
    # though `applies` keeps the dispatch away from them
    if m < 1:
        raise ValueError(f"x2d: expected at least one row, got shape {tuple(x2d.shape)}")
    if scales.shape[0] != 1 or (zeros is not None and zeros.shape[0] != 1):
        raise ValueError(f"scales: expected one row (per-channel scales and zero points), got shape "
                         f"{tuple(scales.shape)}")
    w8 = qweight.view(torch.int8)  # [N, K_pad]: the words' bytes, little-endian
    k_pad = w8.shape[1]
    grid_n = cdiv(n, cfg.block_n)
    _, splits, steps_per_split = split_plan(n, k_pad, cfg, num_sms or sm_count(x2d.device), splits, m)
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    split = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x2d.device) if split else out
    pdl = split and split_k_reduce_pdl(x2d.device)  # the reduce kernel launched early, signalled by this one
    launch_kernel(_w8_decode_kernel, (cdiv(m, cfg.block_m), grid_n, splits),
                  x2d, w8, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
                  part, m, n, k, k_pad, steps_per_split * cfg.block_k, x2d.stride(0), w8.stride(0), out.stride(0),
                  HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN=k == k_pad and k_pad % cfg.block_k == 0,
                  INTERPRET=INTERPRET, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        splitk_reduce(part, bias, out, pdl=pdl)
    return out
