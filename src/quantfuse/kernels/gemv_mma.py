"""Weight-only INT4 decode on the tensor cores for Hopper (sm90) in Gluon: the packed weight dequantized in
registers straight into the mma.sync operand, for M = 1..16.

Math (SPEC section 4): out[m, n] = sum_k x[m, k] * (u[n, k] - z[g(k), n]) * s[g(k), n] (+ bias[n]), each 128-code
chunk's float32 product of the exact integers u - z with x scaled by its group's scale (the GEMVs' "scale after":
x @ W.T for the unrounded W = (u - z) * s, within one rounding per weight of x @ w_hat.T).

Why: the CUDA-core GEMVs (`weight_only._wo_gemv_kernel`, `gemv_tma`) spend ~3.9 instructions per int4 weight
(unpack, convert, FFMA) and are issue-bound at 0.5-0.6 of copy bandwidth on the H100. Here the product is the
transposed out^T [N, M] = W [N, K] @ x^T [K, M] on mma.sync m16n8k16 with the weight as the A operand, and
the conversion is two weights per instruction: per 32-bit register pair `((w >> 4p) & 0x000F000F) | MAGIC2`
(one shift + one LOP3) is (MAGIC + u, MAGIC + u') in x's 16-bit dtype (MAGIC = 1024 in float16, 128 in
bfloat16, exact for 4-bit codes) and one packed HADD2 subtracts MAGIC + z exactly. About 1.4 instructions
per weight plus one HMMA per 64 weights per thread; M up to 8 rides in the n = 8 of the instruction for free.

No data movement between loading and the MMA: K's order inside a chunk is free (the product sums over it), so
the kernel's logical order k' is the one in which the packed words *are* the A fragment. In the packed layout
(`weight_only` module doc) field f of word j of a chunk holds k = 16 f + j. With a 16-bit A operand of
k_width 8, lane (r, c) of a warp holds, per chunk and row r / r + 8, k' = 32 blk + 8 c + e for blk = 0..3,
e = 0..7; register pair p of word j = 4 c + blk (fields p and p + 4: the low and high halves after the
shift) is (k' = 32 blk + 8 c + 2 p, + 1). So a thread loads the 4 consecutive words 4c .. 4c + 3 of a row
(one 16-byte load) and expands them in place (join / reshape / permute: register renaming, asserted
trivial at build time); x, the B operand, is read in the same permuted order (4 consecutive k per 8-byte
load: k = 16 f + 4 c + blk for blk = 0..3).

Pipelining: two register buffers (words, x, scale, zero point of one chunk each), the K loop unrolled by two so
they never move: a buffer is refilled as soon as its chunk is converted, so the other chunk's loads are in flight
during every conversion. H100 measurements: weight_only.GEMV_MMA_MIN_WEIGHTS, results/tune_gemv_mma.json.

x through shared memory (`MmaDecodeConfig.x_group`; the M = 9..16 pick from 8M codes): at two n-tiles of the
instruction a chunk's x is 32 registers per thread, and double-buffering it left no room for early refill. There
the copy engine brings each chunk's x as two [MP, 64] boxes (128-byte swizzle: the eight rows of x that a warp's
lanes read at once fall in different banks) into a ring of 2 x x_group slots with an mbarrier each; a product
waits on its slot and reads its x from shared memory right before the mma, and after every x_group chunks a CTA
barrier (every warp is done with them) precedes the refill of their slots with the chunks two groups on. Rows past
M and codes past K arrive as zeros. x whose row stride a descriptor cannot take runs the register buffers.

Split-K: as `gemv_tma` (float32 partials [splits, M, N]; the last program of a row block adds them in split
order with the bias, or `weight_only._splitk_reduce_kernel` without a counter slot).

Scope (`applies`): sm90 exactly, 1 <= M <= 16, float16 / bfloat16 x, int4 codes, groups of a multiple of 128
(whole chunks) or per channel. Everything else, and the Triton interpreter, runs the `tl` kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ._common import INTERPRET, cap_splits, cdiv, describable, launch_kernel, pdl_launch_options
from ._gluon import GLUON_AVAILABLE, sm90_exactly
from .configs import arch_key, decode_pdl, split_k_reduce_pdl

if GLUON_AVAILABLE:
    from ._gluon import cta_barrier as _cta_barrier
    from ._gluon import gl, gluon, grid_dependency_sync, mbarrier, mma_v2, operand_descriptor, signal_dependents
    from ._gluon import tma_load as _tma_load

CHUNK = 128  # int4 codes per chunk of 16 words
WORDS_PER_CHUNK = 16
MAX_M = 16
# the automatic split count leaves each split at least this many chunks (H100, results/probe_small_splits.json:
# 2048x2048 at M = 16, 16 one-chunk splits 7.3 us, 8 splits 5.9)
MIN_CHUNKS_PER_SPLIT = 2


def _convert_ptx(magic2: int, sub: str, mul: Optional[str] = None) -> str:
    """Four register pairs (MAGIC + u, MAGIC + u') of one int4 word ($4), minus the pair $5 (MAGIC + z twice);
    with `mul` (weight_only_wgmma) also times the pair $6 (s twice). Fields p and p + 4 of the word in pair p."""
    lines = []
    for p in range(4):
        src = "$4" if p == 0 else f"t{p}"
        if p:
            lines.append(f"shr.u32 t{p}, $4, {4 * p};")
        lines.append(f"lop3.b32 t{p}, {src}, 0x000F000F, {magic2:#010x}, 0xea;")
    if mul is None:
        lines += [f"{sub} ${p}, t{p}, $5;" for p in range(4)]
    else:
        lines += [f"{sub} t{p}, t{p}, $5;" for p in range(4)]
        lines += [f"{mul} ${p}, t{p}, $6;" for p in range(4)]
    return "{ .reg .b32 t0, t1, t2, t3; " + " ".join(lines) + " }"


if GLUON_AVAILABLE:  # the kernel's copies (a @jit function reads constexpr globals only)
    _CHUNK = gl.constexpr(CHUNK)
    _WORDS = gl.constexpr(WORDS_PER_CHUNK)
    _CONVERT_F16 = gl.constexpr(_convert_ptx(0x64006400, "sub.f16x2"))
    _CONVERT_BF16 = gl.constexpr(_convert_ptx(0x43004300, "sub.bf16x2"))
    _CONVERT_F16_SCALED = gl.constexpr(_convert_ptx(0x64006400, "sub.f16x2", "mul.rn.f16x2"))
    _CONVERT_BF16_SCALED = gl.constexpr(_convert_ptx(0x43004300, "sub.bf16x2", "mul.rn.bf16x2"))


@dataclass(frozen=True)
class MmaDecodeConfig:
    """block_n rows per program (16 x num_warps x row tiles per warp: a warp's x fragment serves its tiles);
    programs_per_sm sets the split-K target (row blocks x splits ~ programs_per_sm x SMs); fused_reduce: the
    last split of a row block adds the partials (with a counter slot), else `weight_only.splitk_reduce` does;
    early_refill: each register buffer's next chunk is loaded before its chunk is converted (three buffers' worth
    of registers, two chunks in flight under each conversion); x_group (0: off; picked at M = 9..16 only): x comes
    from a shared-memory ring of 2 x x_group chunks that the copy engine fills, x_group chunks at a time behind one
    CTA barrier, read right before each product instead of held in a register buffer per chunk in flight;
    evict_first: the codes and group scales loaded with the evict-first L2 hint (`pick_config` sets it by M and
    weight size: EVICT_FIRST_BELOW)."""
    block_n: int
    num_warps: int
    programs_per_sm: int
    fused_reduce: bool = True
    early_refill: bool = False
    x_group: int = 0
    evict_first: bool = False


# Per architecture, (largest M, candidates) by increasing M: the first candidate of M's bucket runs, the rest
# are what benchmarks/tune_gemv_mma.py sweeps. M = 9..16 (two n-tiles of the instruction: ~195 registers, 2
# programs per SM in ncu, results/ncu_gemv_mma.txt): with the fused reduction the last program of a row block
# reads [splits, M, 128] float32 partials alone, in the mma layout; the same config with the reduce kernel
# takes 0.58-1.0x its time (H100, results/tune_gemv_mma_m16.json, eight shapes 4096x1024..28672x8192, M = 9 /
# 12 / 16, CUDA graphs), and 128 rows x 4 warps x 2 programs per SM is within 1% of the best candidate on each.
# A TMA-fed variant (words through a shared-memory ring, 124 registers at M = 16) measured 0.7-1.0x these picks
# at M = 1..16 and was not kept (results/tune_gemv_mma_tma*.json). x loaded right before each chunk's product instead
# of double-buffered (fewer registers: MP = 32 builds without spills, and early refill fits at M = 9..16) lost to
# the tl wide tile at M = 24 / 32 (0.70-0.86x) and to these picks at M = 12 / 16 (0.90-1.02x):
# results/tune_gemv_mma_m32.json, _xlate_m16.json; not kept.
# M = 1..8: early refill, 128 rows x 8 warps x 2 programs per SM (127 registers: two programs fill the register
# file). Same H100 run (results/tune_gemv_mma_early_refill.json, 7 shapes 4096x4096..28672x8192, M = 1 / 4 / 8,
# CUDA graphs): geometric mean 1.069x the earlier pick (128 rows x 4 warps x 4 programs per SM, whose loop has one
# chunk in flight under each conversion), 0.98-1.21x per case; M = 1 4096x28672 29.3 us vs 30.4, 14336x4096
# 16.7 vs 18.2, 8192x10240 22.7 vs 24.2. Why: a read-only kernel with this kernel's access pattern (8 rows x 64
# bytes per warp load, float32 scales) streamed 4096x28672's bytes in 27.4 us against 30.6 for the kernel
# (results/tune_gemv_mma_pattern_read.json): the loads waited on the conversion.
# Loading both halves of each row's 128-byte line back to back (chunks t + 2 and t + 3 at the top of each pair, a
# fourth chunk of registers) measured 0.957-1.028x this pick, although a plain read of the words runs 5-8% faster
# with both halves in one buffer than one chunk per buffer (results/tune_gemv_mma_paired.json, probe_decode_lines.json,
# tune_gemv_mma_layout_read_words.json): the kernel's time is not in how its loads meet the lines; not kept. Nor was
# prefetch.global.L2 of each row's chunk 2 / 4 / 8 ahead (more of the weight in flight without registers): 0.80-0.99x
# this pick on eight shapes at M = 1 / 8 / 16 (results/tune_gemv_mma_prefetch.json).
# x through the shared-memory ring at M <= 8 (where x takes half the registers it takes at 9..16): the best of five
# ring configs ran 0.86-1.00x this pick per case on eight shapes (results/tune_gemv_mma_x_ring.json, M = 1 / 4 / 8),
# so none is a candidate.
_INT4_ONE_TILE = [MmaDecodeConfig(128, 8, 2, early_refill=True), MmaDecodeConfig(128, 4, 4),
                  MmaDecodeConfig(64, 4, 4, early_refill=True), MmaDecodeConfig(128, 4, 3, early_refill=True),
                  MmaDecodeConfig(64, 4, 8), MmaDecodeConfig(128, 8, 4)]
# M = 9..16 with x through the shared-memory ring: 128 rows x 4 warps, early refill (which the two 32-register x
# buffers per chunk crowded out: 198 registers with the ring, no spills), rings of two groups of two chunks. H100
# (results/tune_gemv_mma_x_ring.json, W4A16 g128, float32 scales, CUDA graphs, one call; M = 9 / 12 / 16 against
# the register pick below, `X_RING_MIN_WEIGHTS`): 1.06-1.31x on the five Llama-3 shapes (4096x28672 M = 16 32.6 us
# vs 42.8, 2.75x bf16; 28672x8192 60.5 vs 69.8, 2.82x), 1.00-1.07x from 8M codes on small ones (4096x4096,
# 2048x8192, 8192x2048, 3072x3072), 0.94-0.99x below (2048x2048, 2048x3072). Groups of 4 / 6 / 8 chunks ran at
# 0.92-0.99x / 0.72-0.93x / 0.71-0.88x the speed of groups of 2 (the start requests two whole groups).
_INT4_TWO_TILES = [MmaDecodeConfig(128, 4, 2, False, True, x_group=2), MmaDecodeConfig(128, 4, 2, False),
                   MmaDecodeConfig(128, 4, 3, False), MmaDecodeConfig(128, 4, 4, False),
                   MmaDecodeConfig(256, 4, 1, False), MmaDecodeConfig(128, 4, 2),
                   MmaDecodeConfig(128, 4, 2, False, True, x_group=4),
                   MmaDecodeConfig(64, 4, 4, False, True, x_group=4)]
MMA_DECODE_CONFIGS: Dict[str, List[Tuple[int, List[MmaDecodeConfig]]]] = {
    "sm90": [(8, _INT4_ONE_TILE), (MAX_M, _INT4_TWO_TILES)]}
# Weights (N x K codes) below this take the bucket's first register-x candidate instead of an x-ring pick.
X_RING_MIN_WEIGHTS: Dict[str, int] = {"sm90": 8 << 20}
# Per architecture, (largest M, weights below which) the pick loads the codes and group scales with the evict-first
# L2 hint (MmaDecodeConfig.evict_first: each is read once). H100 A/B, the same config with and without the hint in
# alternated rounds, CUDA graphs, W4A16 g128 float32 scales (results/tune_evict_first.json, tune_evict_first_m.json;
# 14 Llama-3 / 3.2 shapes): M = 9..16 0.981-1.032x (speed with / without), geometric mean 1.007, every Llama-3-8B /
# 70B shape ahead (4096x28672 M = 16 32.2 us vs 32.9, 14336x4096 19.5 vs 20.1); M = 1..8 below 16M codes
# 1.010-1.044x (2048x2048, 2048x3072, 3072x3072, 3072x5120); from 16M codes 0.967-1.035x by shape, no size rule
# separating them (2048x16384, 3072x16384 and 28672x8192 behind, 4096x28672 and 14336x4096 ahead): off there.
EVICT_FIRST_BELOW: Dict[str, List[Tuple[int, int]]] = {"sm90": [(8, 16 << 20), (MAX_M, 1 << 62)]}


def all_configs(arch: str) -> List[MmaDecodeConfig]:
    """Every candidate of every M bucket, once each (what the tests run)."""
    out: List[MmaDecodeConfig] = []
    for _, cfgs in MMA_DECODE_CONFIGS[arch]:
        out += [c for c in cfgs if c not in out]
    return out


def check_config(cfg: MmaDecodeConfig) -> None:
    rows = 16 * cfg.num_warps
    if cfg.num_warps not in (1, 2, 4, 8) or cfg.block_n % rows or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"config: block_n must be a power of two multiple of 16 x num_warps (1, 2, 4 or 8), "
                         f"got {cfg}")
    if cfg.programs_per_sm < 1:
        raise ValueError(f"config programs_per_sm: expected >= 1, got {cfg.programs_per_sm}")
    if cfg.x_group < 0 or cfg.x_group % 2:
        # the K loop takes chunks two at a time, so a refill falls after a whole pair
        raise ValueError(f"config x_group: expected 0 (off) or an even number of chunks, got {cfg.x_group}")


def candidates(m: int, device: torch.device, arch: Optional[str] = None) -> List[MmaDecodeConfig]:
    """The candidates of M's bucket (1 <= M <= MAX_M), the shipped pick first."""
    return next(cfgs for max_m, cfgs in MMA_DECODE_CONFIGS[arch or arch_key(device.type, device.index)] if m <= max_m)


def pick_config(m: int, device: torch.device, weights: int = 1 << 62, arch: Optional[str] = None) -> MmaDecodeConfig:
    """M's pick for a weight of `weights` (N x K) codes: the bucket's first candidate, or its first without the x
    ring below X_RING_MIN_WEIGHTS; with the evict-first hint below EVICT_FIRST_BELOW."""
    arch = arch or arch_key(device.type, device.index)
    cfgs = candidates(m, device, arch)
    cfg = next(c for c in cfgs if not c.x_group) if weights < X_RING_MIN_WEIGHTS.get(arch, 0) else cfgs[0]
    below = next((w for max_m, w in EVICT_FIRST_BELOW.get(arch, []) if m <= max_m), 0)
    return dataclasses.replace(cfg, evict_first=True) if weights < below else cfg


def auto_config(x2d: torch.Tensor, n: int) -> MmaDecodeConfig:
    """The launcher's pick for x2d @ W.T with N = n outputs: `pick_config` for the weight's size, the register pick
    where the copy engine cannot read x2d's rows (the x ring needs a tensor descriptor)."""
    m, k = x2d.shape
    cfg = pick_config(m, x2d.device, n * k)
    if cfg.x_group and not describable(x2d):
        return dataclasses.replace(pick_config(m, x2d.device, 0), evict_first=cfg.evict_first)
    return cfg


def whole_chunk_groups(scales: torch.Tensor, group_size: int) -> bool:
    """Per channel, or groups of a power-of-two number of whole 128-code chunks (a chunk never straddles groups)."""
    chunks_per_group = group_size // CHUNK
    return scales.shape[0] == 1 or (group_size % CHUNK == 0 and chunks_per_group & (chunks_per_group - 1) == 0)


def applies(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
            k: int) -> bool:
    """Whether the product runs here (module doc); the caller validated the arguments."""
    if not GLUON_AVAILABLE or INTERPRET or not x2d.is_cuda or not 1 <= x2d.shape[0] <= MAX_M:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or bits != 4:
        return False
    if not sm90_exactly(x2d.device.type, x2d.device.index):
        return False
    return (whole_chunk_groups(scales, group_size)
            and x2d.stride(1) == 1 and qweight.dtype == torch.int32 and qweight.stride(1) == 1
            and qweight.shape[1] % WORDS_PER_CHUNK == 0)


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _stream_hint(evict_first):
        return "evict_first" if evict_first else ""

    @gluon.constexpr_function
    def _mma_layout(num_warps):
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _regs_vector_first(bases, dim):
        # registers that step along the memory-contiguous dim first: the loads become 16 / 8-byte vectors (a
        # renaming of registers only, so the conversion into the operand layout stays trivial)
        return [b for b in bases if b[dim] != 0 and sum(b) == b[dim]] + \
               [b for b in bases if not (b[dim] != 0 and sum(b) == b[dim])]

    @gluon.constexpr_function
    def _word_layout(a_ll):
        """[BLOCK_N, 16 words] of a chunk from the A operand's bases over (n, k'): e (k' bits 1, 2, 4) is inside
        a word; c (k' 8, 16) and blk (k' 32, 64) pick word j = 4 c + blk."""
        def conv(bases):
            return [[dn, 4 * ((dk >> 3) & 3) + (dk >> 5)] for dn, dk in bases if dk not in (1, 2, 4)]
        return gl.DistributedLinearLayout(_regs_vector_first(conv(a_ll.reg_bases), 1), conv(a_ll.lane_bases),
                                          conv(a_ll.warp_bases), [], [a_ll.shape[0], WORDS_PER_CHUNK])

    @gluon.constexpr_function
    def _x_layout(b_ll):
        """x as [8 fields f, 16 words j, MP] from the B operand's bases over (k', m): k' = 32 blk + 8 c + 2 p + h
        reads k = 16 f + j with f = p + 4 h, j = 4 c + blk."""
        def conv(bases):
            out = []
            for dk, dm in bases:
                f = ((dk >> 1) & 3) + 4 * (dk & 1)
                j = 4 * ((dk >> 3) & 3) + ((dk >> 5) & 3)
                out.append([f, j, dm])
            return out
        return gl.DistributedLinearLayout(_regs_vector_first(conv(b_ll.reg_bases), 1), conv(b_ll.lane_bases),
                                          conv(b_ll.warp_bases), [], [8, WORDS_PER_CHUNK, b_ll.shape[1]])

    @gluon.constexpr_function
    def _x_box_layout(x_ll):
        """One [MP, 64] x box of the shared-memory ring (k = 64 h + 16 f' + j, f = f' + 4 h) in the register
        layout that `_x_from_boxes` turns into x_l by register renaming: x_l's bases over (f, j, m) without f's
        bit 4, which is the join of the two boxes (a register basis of x_l: the two halves of a register pair)."""
        def conv(bases):
            return [[dm, 16 * (df & 3) + dj] for df, dj, dm in bases if not df & 4]
        assert [4, 0, 0] in x_ll.reg_bases, "f's bit 4 must be a register basis of x's layout"
        return gl.DistributedLinearLayout(conv(x_ll.reg_bases), conv(x_ll.lane_bases), conv(x_ll.warp_bases), [],
                                          [x_ll.shape[2], 64])

    @gluon.jit
    def _x_from_boxes(x_smem, slot, xb_l: gl.constexpr, x_l: gl.constexpr):
        """Chunk's x [8 f, 16 j, MP] in x_l from its two [MP, 64] boxes in ring slot `slot`."""
        MP: gl.constexpr = xb_l.shape[0]
        lo = gl.permute(gl.reshape(x_smem.index(2 * slot).load(xb_l), [MP, 4, 16]), (1, 2, 0))
        hi = gl.permute(gl.reshape(x_smem.index(2 * slot + 1).load(xb_l), [MP, 4, 16]), (1, 2, 0))
        xv = gl.reshape(gl.permute(gl.join(lo, hi), (3, 0, 1, 2)), [8, _WORDS, MP])
        return gl.convert_layout(xv, x_l, assert_trivial=True)

    @gluon.jit
    def _x_refill(x_desc, x_smem, ready, first, n_steps, c_begin, GROUP_X: gl.constexpr):
        """Chunks first .. first + GROUP_X - 1 of this split (those before n_steps) into their ring slots (chunk t
        in slot t % (2 GROUP_X)), each as two [MP, 64] boxes; rows past M and codes past K come as zeros."""
        for i in gl.static_range(GROUP_X):
            t = first + i
            slot = t % (2 * GROUP_X)
            fill = t < n_steps
            k = (c_begin + t) * _CHUNK
            mbarrier.expect(ready.index(slot), 2 * x_desc.block_type.nbytes, pred=fill)
            _tma_load(x_desc, [0, k], ready.index(slot), x_smem.index(2 * slot), pred=fill)
            _tma_load(x_desc, [0, k + _CHUNK // 2], ready.index(slot), x_smem.index(2 * slot + 1), pred=fill)

    @gluon.jit
    def _halves(v, DT: gl.constexpr):
        return v.to(gl.int16).to(DT, bitcast=True), (v >> 16).to(gl.int16).to(DT, bitcast=True)

    @gluon.jit
    def half_pair(h):
        """A 16-bit value twice in one int32 register pair (the packed conversion's per-row operands)."""
        v = h.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return v | (v << 16)

    @gluon.jit
    def magic_zero_pair(z, DT: gl.constexpr):
        """(MAGIC + z, MAGIC + z) in DT (MAGIC 1024 in float16, 128 in bfloat16: the conversion's magic number)."""
        if DT == gl.float16:
            MAGIC: gl.constexpr = 1024
        else:
            MAGIC: gl.constexpr = 128
        return half_pair((z + MAGIC).to(DT))

    @gluon.jit
    def convert_word_pairs(words, zpair, spair, DT: gl.constexpr, SCALED: gl.constexpr):
        """Each int4 word's four register pairs p = ((w >> 4p) & 0x000F000F) | MAGIC2 (shift + one LOP3: ptxas
        splits the and / or of two immediates into two LOP3s, hence the PTX) minus the pair (MAGIC + z, MAGIC + z),
        one packed subtract; SCALED (weight_only_wgmma): times the pair (s, s), one packed multiply. Returns the
        halves in DT, low (field p) then high (field p + 4) for p = 0..3."""
        if SCALED:
            ASM: gl.constexpr = _CONVERT_F16_SCALED if DT == gl.float16 else _CONVERT_BF16_SCALED
            q0, q1, q2, q3 = gl.inline_asm_elementwise(ASM, "=&r,=&r,=&r,=&r,r,r,r", [words, zpair, spair],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                       is_pure=True, pack=1)
        else:
            ASM: gl.constexpr = _CONVERT_F16 if DT == gl.float16 else _CONVERT_BF16
            q0, q1, q2, q3 = gl.inline_asm_elementwise(ASM, "=&r,=&r,=&r,=&r,r,r", [words, zpair],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                       is_pure=True, pack=1)
        l0, h0 = _halves(q0, DT)
        l1, h1 = _halves(q1, DT)
        l2, h2 = _halves(q2, DT)
        l3, h3 = _halves(q3, DT)
        return l0, h0, l1, h1, l2, h2, l3, h3

    @gluon.jit
    def _expand(words, zpair, a_layout: gl.constexpr, DT: gl.constexpr):
        """[BLOCK_N, 16] words -> [BLOCK_N, 128] u - z in the A operand layout, k' order (module doc): the pairs of
        `convert_word_pairs`, regrouped by register renaming."""
        BLOCK_N: gl.constexpr = words.shape[0]
        l0, h0, l1, h1, l2, h2, l3, h3 = convert_word_pairs(words, zpair, zpair, DT, False)
        q = gl.join(gl.join(gl.join(l0, h0), gl.join(l1, h1)), gl.join(gl.join(l2, h2), gl.join(l3, h3)))
        q = gl.reshape(q, [BLOCK_N, 4, 4, 2, 2, 2])  # [n, c, blk, h, p0, p1]
        q = gl.permute(q, (0, 2, 1, 5, 4, 3))  # [n, blk, c, p1, p0, h]
        return gl.convert_layout(gl.reshape(q, [BLOCK_N, _CHUNK]), a_layout, assert_trivial=True)

    @gluon.jit
    def _x_operand(xv, b_layout: gl.constexpr):
        """x [8 f, 16 j, MP] -> the B operand [128 k', MP] (f = p + 4 h, j = 4 c + blk)."""
        MP: gl.constexpr = xv.shape[2]
        q = gl.reshape(xv, [2, 4, 4, 4, MP])  # [h, p, c, blk, m]
        q = gl.permute(q, (3, 2, 1, 0, 4))  # [blk, c, p, h, m]
        return gl.convert_layout(gl.reshape(q, [_CHUNK, MP]), b_layout, assert_trivial=True)

    @gluon.jit
    def _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s, rows_z, N, chunk, ok,
                    group_chunk_shift, HAS_ZERO: gl.constexpr, PER_CHANNEL: gl.constexpr, EVEN_K: gl.constexpr,
                    X_SMEM: gl.constexpr = False, EVICT_FIRST: gl.constexpr = False):
        # no fill values where nothing needs them (saves zeroing the registers first): rows past N and columns
        # past M are never stored, and the mma keeps rows and columns apart; codes past K are 0, but their
        # u - z is not, so x there must be 0
        # EVICT_FIRST: the codes and group scales are read once, by this program only; marked first out of L2
        words = gl.load(w_ptrs + chunk * _WORDS, mask=w_mask & ok, eviction_policy=_stream_hint(EVICT_FIRST))
        if X_SMEM:
            xv = 0  # x comes from the shared-memory ring (`_x_from_boxes`)
        elif EVEN_K:
            xv = gl.load(x_ptrs + chunk * _CHUNK, mask=x_mask_m & ok)
        else:
            xv = gl.load(x_ptrs + chunk * _CHUNK, mask=x_mask_m & ok & (x_k + chunk * _CHUNK < K), other=0.0)
        if PER_CHANNEL:
            g = 0  # one group: its zero point for every chunk, its scale after the K loop
            s = gl.zeros_like(rows_s, dtype=gl.float32)
        else:
            g = chunk >> group_chunk_shift
            s = gl.load(s_ptr + g * N + rows_s, mask=(rows_s < N) & ok, other=0.0,
                        eviction_policy=_stream_hint(EVICT_FIRST)).to(gl.float32)
        if HAS_ZERO:
            z = gl.load(z_ptr + g * N + rows_z, mask=(rows_z < N) & ok, other=0)
        else:
            z = gl.full_like(rows_z, 8)
        return words, xv, s, z

    @gluon.jit
    def _chunk_product(acc, w, xv, s, z, a_l: gl.constexpr, b_l: gl.constexpr, DT: gl.constexpr,
                       PER_CHANNEL: gl.constexpr, x_smem=None, ready=None, t=0, GROUP_X: gl.constexpr = 0,
                       xb_l: gl.constexpr = None, x_l: gl.constexpr = None):
        """acc + (u - z) x over one chunk, scaled by the chunk's group scale (per channel: after the K loop); with
        GROUP_X, x is chunk t of the shared-memory ring instead of xv."""
        a = _expand(w, magic_zero_pair(z, DT)[:, None], a_l, DT)
        if GROUP_X > 0:
            slot = t % (2 * GROUP_X)
            mbarrier.wait(ready.index(slot), (t // (2 * GROUP_X)) & 1)
            xv = _x_from_boxes(x_smem, slot, xb_l, x_l)
        b = _x_operand(xv, b_l)
        if PER_CHANNEL:
            return mma_v2(a, b, acc)
        else:
            return acc + mma_v2(a, b, gl.zeros_like(acc)) * s[:, None]

    @gluon.jit
    def _wo_mma_decode_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, x_desc,
        M, N, K, stride_xm, stride_wn, stride_om, chunks_per_split, splits, group_chunk_shift,
        HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, FUSED_REDUCE: gl.constexpr,
        PER_CHANNEL: gl.constexpr, EVEN_K: gl.constexpr, BLOCK_N: gl.constexpr, MP: gl.constexpr,
        num_warps: gl.constexpr, SIGNAL: gl.constexpr = False, PDL: gl.constexpr = False,
        EARLY_REFILL: gl.constexpr = False, GROUP_X: gl.constexpr = 0, EVICT_FIRST: gl.constexpr = False,
    ):
        # PDL: launched early (configs.decode_pdl); nothing is read before the wait, which also signals
        grid_dependency_sync(PDL)
        if SIGNAL and not PDL:  # the split-K reduce kernel behind this one is launched early (split_k_reduce_pdl)
            signal_dependents()
        mma: gl.constexpr = _mma_layout(num_warps)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        w_l: gl.constexpr = _word_layout(gl.to_linear_layout(a_l, [BLOCK_N, _CHUNK]))
        x_l: gl.constexpr = _x_layout(gl.to_linear_layout(b_l, [_CHUNK, MP]))
        DT: gl.constexpr = x_ptr.dtype.element_ty

        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        off_n = pid_n * BLOCK_N
        c_begin = pid_s * chunks_per_split
        n_steps = gl.minimum(chunks_per_split, gl.cdiv(K, _CHUNK) - c_begin)

        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        rj = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, w_l))
        w_ptrs = w_ptr + rn.to(gl.int64)[:, None] * stride_wn + rj[None, :]
        w_mask = (rn < N)[:, None] & (rj < _WORDS)[None, :]

        xl2: gl.constexpr = gl.SliceLayout(2, x_l)
        xf = gl.arange(0, 8, layout=gl.SliceLayout(1, xl2))
        xj = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, xl2))
        xm = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_l)))
        x_k = (16 * xf[:, None] + xj[None, :])[:, :, None]  # [8, 16, 1]: k inside a chunk
        x_ptrs = x_ptr + xm[None, None, :] * stride_xm + x_k
        x_mask_m = (xm < M)[None, None, :] & (x_k >= 0)

        rows_s = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        rows_z = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))

        X_SMEM: gl.constexpr = GROUP_X > 0
        xb_l: gl.constexpr = _x_box_layout(x_l) if X_SMEM else None
        if X_SMEM:  # the ring's first two groups of chunks are in flight before the first words are loaded
            x_smem = gl.allocate_shared_memory(DT, [4 * GROUP_X, MP, _CHUNK // 2], x_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [2 * GROUP_X, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2 * GROUP_X):
                mbarrier.init(ready.index(i), count=1)
            _x_refill(x_desc, x_smem, ready, 0, n_steps, c_begin, GROUP_X)
            _x_refill(x_desc, x_smem, ready, GROUP_X, n_steps, c_begin, GROUP_X)
        else:
            x_smem = None
            ready = None

        # two chunks in flight: each buffer is refilled as soon as its chunk is converted, while the other
        # buffer's chunk is converted (unrolled by two, so the buffers stay in their registers: no copies)
        wa, xa, sa, za = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s, rows_z, N,
                                     c_begin, n_steps > 0, group_chunk_shift, HAS_ZERO, PER_CHANNEL, EVEN_K, X_SMEM,
                                     EVICT_FIRST)
        wb, xb, sb, zb = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s, rows_z, N,
                                     c_begin + 1, n_steps > 1, group_chunk_shift, HAS_ZERO, PER_CHANNEL, EVEN_K,
                                     X_SMEM, EVICT_FIRST)
        acc = gl.zeros([BLOCK_N, MP], gl.float32, mma)
        for t in range(0, n_steps, 2):
            # EARLY_REFILL: a buffer's refill is issued before its chunk is converted (a third buffer's registers),
            # so two chunks stay in flight during every conversion instead of one
            if EARLY_REFILL:
                na, nxa, nsa, nza = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s,
                                                rows_z, N, c_begin + t + 2, t + 2 < n_steps, group_chunk_shift,
                                                HAS_ZERO, PER_CHANNEL, EVEN_K, X_SMEM, EVICT_FIRST)
            acc = _chunk_product(acc, wa, xa, sa, za, a_l, b_l, DT, PER_CHANNEL, x_smem, ready, t, GROUP_X, xb_l,
                                 x_l)
            if not EARLY_REFILL:
                na, nxa, nsa, nza = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s,
                                                rows_z, N, c_begin + t + 2, t + 2 < n_steps, group_chunk_shift,
                                                HAS_ZERO, PER_CHANNEL, EVEN_K, X_SMEM, EVICT_FIRST)
            wa, xa, sa, za = na, nxa, nsa, nza
            if EARLY_REFILL:
                nb, nxb, nsb, nzb = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s,
                                                rows_z, N, c_begin + t + 3, t + 3 < n_steps, group_chunk_shift,
                                                HAS_ZERO, PER_CHANNEL, EVEN_K, X_SMEM, EVICT_FIRST)
            if t + 1 < n_steps:
                acc = _chunk_product(acc, wb, xb, sb, zb, a_l, b_l, DT, PER_CHANNEL, x_smem, ready, t + 1, GROUP_X,
                                     xb_l, x_l)
            if not EARLY_REFILL:
                nb, nxb, nsb, nzb = _load_chunk(w_ptrs, w_mask, x_ptrs, x_mask_m, x_k, K, s_ptr, z_ptr, rows_s,
                                                rows_z, N, c_begin + t + 3, t + 3 < n_steps, group_chunk_shift,
                                                HAS_ZERO, PER_CHANNEL, EVEN_K, X_SMEM, EVICT_FIRST)
            wb, xb, sb, zb = nb, nxb, nsb, nzb
            if X_SMEM:
                if (t + 2) % GROUP_X == 0:  # a group of chunks done: every warp has read its slots, refill them
                    _cta_barrier()
                    _x_refill(x_desc, x_smem, ready, t + 2 + GROUP_X, n_steps, c_begin, GROUP_X)

        cols = gl.arange(0, MP, layout=gl.SliceLayout(0, mma))
        out_mask = (rows_s < N)[:, None] & (cols < M)[None, :]
        if PER_CHANNEL:
            acc = acc * gl.load(s_ptr + rows_s, mask=rows_s < N, other=0.0).to(gl.float32)[:, None]
        if SPLIT:
            part_offs = cols[None, :] * N + rows_s[:, None]
            gl.store(part_ptr + pid_s * M * N + part_offs, acc, mask=out_mask)
            if FUSED_REDUCE:
                _cta_barrier()  # every thread's partial is stored before the release below
                done = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if done == splits - 1:
                    total = gl.zeros([BLOCK_N, MP], gl.float32, mma)
                    for p in range(0, splits):
                        total += gl.load(part_ptr + p * M * N + part_offs, mask=out_mask, other=0.0,
                                         cache_modifier=".cg")
                    if HAS_BIAS:
                        total += gl.load(bias_ptr + rows_s, mask=rows_s < N, other=0.0).to(gl.float32)[:, None]
                    gl.store(out_ptr + cols[None, :] * stride_om + rows_s[:, None],
                             total.to(out_ptr.dtype.element_ty), mask=out_mask)
                    gl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + rows_s, mask=rows_s < N, other=0.0).to(gl.float32)[:, None]
            gl.store(out_ptr + cols[None, :] * stride_om + rows_s[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=out_mask)


def gemv_mma(x2d, qweight, scales, zeros, bias, group_size: int, n: int,
             config: Optional[MmaDecodeConfig] = None, splits: Optional[int] = None,
             counters: Optional[torch.Tensor] = None, num_sms: Optional[int] = None) -> torch.Tensor:
    """out [M, N] = x2d @ W.T (+ bias) for int4 codes; the caller checked `applies` and validated the arguments.
    counters: a zeroed int32 slot per row block for the fused split-K reduction (None, or a config without
    fused_reduce: a second kernel reduces)."""
    from .weight_only import splitk_reduce  # here, not at the top: weight_only imports this module

    cfg = config or auto_config(x2d, n)
    check_config(cfg)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count
    m, k = x2d.shape
    per_channel = scales.shape[0] == 1
    grid_n = cdiv(n, cfg.block_n)
    total_chunks = cdiv(k, CHUNK)
    if splits is None:
        splits = cap_splits(cfg.programs_per_sm * num_sms // grid_n, total_chunks, MIN_CHUNKS_PER_SPLIT)
    chunks_per_split = cdiv(total_chunks, splits)
    splits = cdiv(total_chunks, chunks_per_split)
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    split = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x2d.device) if split else out
    fused = split and cfg.fused_reduce and counters is not None and counters.numel() >= grid_n
    has_bias = bias is not None
    # groups of whole chunks, a power of two of them (validated); per channel: one group
    group_chunk_shift = 0 if per_channel else (group_size // CHUNK).bit_length() - 1
    pdl = split and not fused and split_k_reduce_pdl(x2d.device)
    early = decode_pdl(x2d.device, m, 4)
    mp = 8 if m <= 8 else 16
    # x through the shared-memory ring where the copy engine can read it (else the register buffers: a config
    # given with x_group then runs as it would without; `auto_config` picks the register pick there)
    group_x = cfg.x_group if cfg.x_group and describable(x2d) else 0
    x_desc = operand_descriptor(x2d, [mp, CHUNK // 2]) if group_x else None
    launch_kernel(_wo_mma_decode_kernel, (grid_n, splits),
        x2d, qweight, scales, zeros if zeros is not None else scales, bias if has_bias else scales, out, part,
        counters if fused else scales, x_desc, m, n, k, x2d.stride(0), qweight.stride(0), out.stride(0),
        chunks_per_split, splits, group_chunk_shift,
        HAS_ZERO=zeros is not None, HAS_BIAS=has_bias, SPLIT=split, FUSED_REDUCE=fused, PER_CHANNEL=per_channel,
        EVEN_K=k % CHUNK == 0, BLOCK_N=cfg.block_n, MP=mp, num_warps=cfg.num_warps, SIGNAL=pdl,
        PDL=early, EARLY_REFILL=bool(cfg.early_refill), GROUP_X=group_x, EVICT_FIRST=bool(cfg.evict_first),
        **pdl_launch_options(early),
    )
    if split and not fused:
        splitk_reduce(part.view(splits, -1, n), bias, out, pdl=pdl)
    return out
