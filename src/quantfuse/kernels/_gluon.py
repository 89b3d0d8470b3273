"""Gluon (Triton's explicit-layout dialect) for the sm90 kernels, imported once, with the renames between
Triton releases folded: absent or failing to import, GLUON_AVAILABLE is False and those kernels are simply off
(their `tl` twins run)."""

from __future__ import annotations

from functools import lru_cache

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.6, gl.barrier in later releases
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # a TMA tile load: tma.async_copy_global_to_shared in Triton 3.6, tma.async_load later
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_AVAILABLE = True
except Exception:  # noqa: BLE001 - any import-time failure means "no Gluon"
    GLUON_AVAILABLE = False

# The warp-specialized kernels' register split (setmaxnreg): a 4-warp loader partition and two 4-warp consumer
# warpgroups under maxnreg MAXNREG (12 warps x 168 fit the 64K register file); each consumer gets
# CONSUMER_REGS per thread for its accumulators and epilogue, the loader what is left (40).
WS_CONSUMER_REGS = 232
WS_MAXNREG = 168

__all__ = ["GLUON_AVAILABLE", "sm90_exactly", "WS_CONSUMER_REGS", "WS_MAXNREG"]
if GLUON_AVAILABLE:
    __all__ += ["gluon", "gl", "mbarrier", "mma_v2", "tma", "warpgroup_mma", "warpgroup_mma_init", "warpgroup_mma_wait",
                "TensorDescriptor", "cta_barrier", "fence_async_shared", "tma_load", "tile_coords", "signal_dependents",
                "ring_load", "fill_tiles", "grid_dependency_sync", "operand_descriptor", "unswizzled_layout",
                "store_layout"]

    _GL_DTYPES = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.float16: gl.float16,
                  torch.bfloat16: gl.bfloat16}

    @lru_cache(maxsize=None)
    def _default_layout(block: tuple, dtype: torch.dtype):
        return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])

    @lru_cache(maxsize=None)
    def unswizzled_layout(element_bitwidth: int, rank: int):
        """The NVMMA shared layout without swizzle (boxes read back with plain shared loads), made once: an eager
        launch builds its descriptors every call and a layout costs microseconds of host time."""
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bitwidth, rank=rank)

    def operand_descriptor(t: torch.Tensor, block):
        """A tensor descriptor over `t` in `block` boxes with the default NVMMA shared layout of its dtype (what a
        wgmma operand or a copy-engine output tile reads or writes)."""
        block = tuple(block)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _default_layout(block, t.dtype))

    @gluon.constexpr_function
    def store_layout(block_n, bits, num_warps):
        """A blocked layout of [rows, block_n] tiles in which each thread stores 16 contiguous bytes (whole rows of
        up to 32 threads): the layout an epilogue converts a wgmma accumulator to before its global stores, since
        the accumulator's own layout (pairs of adjacent columns per thread) makes 4-byte stores."""
        vec = 128 // bits  # 16 bytes per thread along N
        cols = min(block_n // vec, 32)
        return gl.BlockedLayout([1, vec], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.jit
    def tile_coords(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Grouped order (GROUP_M row tiles walk one column band of the weight, kept in L2): _common.tile_coords
        for Gluon, which cannot call a `tl` function."""
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile % width) % size_m, (tile % width) // size_m

    @gluon.jit
    def ring_load(a_desc, b_desc, a_smem, b_smem, ready, empty, c, a_row, b_row, k, STAGES: gl.constexpr,
                  EXTRA_BYTES: gl.constexpr):
        """A warp-specialized loader's K step c into slot c % STAGES of its ready / empty mbarrier ring: wait
        until the consumers freed the slot, expect the A and B boxes plus EXTRA_BYTES that the caller copies
        into the same slot after this, and copy A [a_row, k] and B [b_row, k] (zero fill past the edges).
        Returns the slot."""
        slot = c % STAGES
        # slots start free: waiting on the opposite parity of a fresh barrier returns at once
        mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes + EXTRA_BYTES)
        tma_load(a_desc, [a_row, k], ready.index(slot), a_smem.index(slot))
        tma_load(b_desc, [b_row, k], ready.index(slot), b_smem.index(slot))
        return slot

    @gluon.jit
    def fill_tiles(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr):
        """A persistent warp-specialized GEMM's loader: every K step of every tile of this program (grouped order),
        in order, into the ready / empty slot ring (ring_load; zero fill past M, N and K)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        c = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            for ks in range(k_steps):
                ring_load(a_desc, b_desc, a_smem, b_smem, ready, empty, c, pid_m * BLOCK_M, pid_n * BLOCK_N,
                          ks * BLOCK_K, STAGES, 0)
                c += 1

    @gluon.jit
    def signal_dependents():
        """Programmatic dependent launch: let the next kernel in the stream, launched with launch_pdl, be
        scheduled now (it waits for this grid's results itself); _common.grid_dependency_sync's second half,
        for Gluon, which cannot call a `tl` function."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def grid_dependency_sync(PDL: gl.constexpr):
        """_common.grid_dependency_sync for Gluon: with PDL, wait until the previous kernel in the stream has
        finished and its writes are visible (griddepcontrol.wait), then let the next kernel launch; call it before
        the kernel's first global load or store. Without PDL nothing is emitted."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            signal_dependents()


@lru_cache(maxsize=None)
def sm90_exactly(device_type: str, index) -> bool:
    """Compute capability 9.0 exactly: wgmma and these TMA kernels are sm90a builds (configs.arch_key calls every
    major >= 9 "sm90"). Cached per device: the launchers ask on every call."""
    return device_type == "cuda" and torch.cuda.get_device_capability(index) == (9, 0)
