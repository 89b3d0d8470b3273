"""Launch configurations as data, one table per GPU architecture.

Memory-bound kernels here are not autotuned: their best tile is a function of the row length, chosen
from these tables so a new shape never waits for a tuning sweep. Values were picked on an H100 (sm90);
other architectures fall back to the default table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ._common import next_pow2, pdl_supported


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_k: int
    num_warps: int
    single_pass: bool = True


# elements one program keeps in flight, and the longest row a per-token program holds in registers
_QUANT_TABLE = {
    "sm90": {"elements": 8192, "max_single_pass_k": 16384, "loop_block_k": 4096, "group_block_k": 1024},
    "default": {"elements": 4096, "max_single_pass_k": 8192, "loop_block_k": 2048, "group_block_k": 1024},
}


@lru_cache(maxsize=None)
def arch_key(device_type: str, index) -> str:
    if device_type != "cuda":
        return "default"
    major, _ = torch.cuda.get_device_capability(index)
    return "sm90" if major >= 9 else "default"


def _warps(elements: int) -> int:
    if elements <= 1024:
        return 2
    if elements <= 4096:
        return 4
    if elements <= 8192:
        return 8
    return 16


def quantize_tile(device: torch.device, kind: str, k: int, group: int = 1) -> Tile:
    """Tile for the quantize/dequantize kernels. kind: per_token | per_group | per_tensor | elementwise.
    k is the row length; for per_group, block_k is a multiple of `group`."""
    table = _QUANT_TABLE[arch_key(device.type, device.index)]
    budget = table["elements"]
    if kind == "per_token":
        block_k = next_pow2(k)
        if block_k <= table["max_single_pass_k"]:
            block_m = max(1, budget // block_k)
            return Tile(block_m, block_k, _warps(block_m * block_k), True)
        block_k = table["loop_block_k"]
        return Tile(1, block_k, _warps(block_k), False)
    if kind == "per_group":
        block_k = max(group, min(next_pow2(k), table["group_block_k"]))
        block_m = max(1, budget // block_k)
        return Tile(block_m, block_k, _warps(block_m * block_k))
    block_k = min(next_pow2(k), 1024)
    block_m = max(1, budget // block_k)
    return Tile(block_m, block_k, _warps(block_m * block_k))


@lru_cache(maxsize=None)
def _sm_count(device_type: str, index) -> int:
    if device_type != "cuda":
        return 4
    device = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 for CPU tensors under the interpreter); cached."""
    return _sm_count(device.type, device.index)


@lru_cache(maxsize=None)
def _smem_limit(device_type: str, index) -> int:
    if device_type != "cuda" or not torch.cuda.is_available():
        return 1 << 30  # the interpreter (and host-only dispatch tests) have no shared memory limit
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or (1 << 30))


def smem_limit(device: torch.device) -> int:
    """Shared memory one program may use on `device` (opt-in maximum: 232448 bytes on the H100); cached."""
    return _smem_limit(device.type, device.index)


def max_partials(device: torch.device) -> int:
    """Programs of a grid-stride reduction: two per SM, so the partials fit one 1024-wide block."""
    return min(1024, 2 * sm_count(device))


# Architectures where the split-K reduce kernels (scaled_mm's and weight_only's) are launched early, behind the
# split-K kernel that signals them (H100 A/Bs: tune_scaled_mm_reduce_pdl.json, tune_weight_only_reduce_pdl.json).
SPLIT_K_REDUCE_PDL = {"sm90"}


def split_k_reduce_pdl(device: torch.device) -> bool:
    """Launch a split-K reduce kernel with programmatic dependent launch: on the architectures of
    SPLIT_K_REDUCE_PDL, where Triton has it (never under the interpreter)."""
    return arch_key(device.type, device.index) in SPLIT_K_REDUCE_PDL and pdl_supported()


# Weight widths, per architecture, whose weight-only decode kernels (M <= DECODE_PDL_MAX_M: the tl GEMV and mma
# tiles, gemv_tma, gemv_mma) are launched with programmatic dependent launch: each waits for the previous kernel in
# the stream before its first memory access and then lets the next one launch, so its launch and prologue overlap
# the previous kernel's tail. H100 same-run A/B (tune_weight_only_decode_pdl.json, back-to-back calls of one op in
# a CUDA graph): int4 M = 1 2-6% faster on 4096x6144 .. 8192x10240 (10.84 -> 10.16 us at 4096x6144), M = 16 up to
# 4%; int8 -0.8% .. +1.0%, so int8 stays off. In the Llama-3-8B layer (neighbours are torch kernels) no change.
DECODE_PDL = {"sm90": (4,)}
DECODE_PDL_MAX_M = 16


def decode_pdl(device: torch.device, m: int, bits: int) -> bool:
    """Launch a weight-only product of M rows and `bits`-bit weights with programmatic dependent launch
    (DECODE_PDL), where Triton has it (never under the interpreter)."""
    return (m <= DECODE_PDL_MAX_M and bits in DECODE_PDL.get(arch_key(device.type, device.index), ())
            and pdl_supported())
