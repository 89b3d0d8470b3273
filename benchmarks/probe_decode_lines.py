"""Probe (Gluon, sm90): which ways of reading the decode kernel's row-major packed words reach the read floor?

Follow-up of probe_decode_read_pattern.py (PROBE_LAYOUT=1), which found its `tl` read of gemv_mma's pattern (8 rows
x 64 bytes per warp load, one 128-code chunk per buffer, two buffers) 5-8% slower than whole 128-byte lines per row.
Here the packed int4 words [N, K / 8] of the five Llama-3 shapes (random int32, sums checked against torch) are read
in units of 32 words (two chunks, one 128-byte line) per row, 128 rows per program, split-K for P programs per SM:
* `lines` (default): two units in flight per program in registers, three lane mappings of the same [128, 32] tile:
  m0 = lane c loads words 4c..4c+3 then 16+4c.. (each instruction 8 rows x 64 contiguous bytes, gemv_mma's
  mapping, both halves of a line back to back), m1 = lane c loads words 8c..8c+7 (the first instruction touches all
  four sectors of each line), m2 = 4 rows x 128 contiguous bytes per instruction; `_ef`: the evict-first hint;
* `--ring`: the copy engine (TMA) into a shared-memory ring: [128, W] boxes (W = 16: one chunk, 64-byte rows, as the
  dropped TMA-fed decode variant; W = 32: 128-byte rows) in S slots, one CTA barrier per slot refill; with m0 w8 p2
  of the register read as the reference;
* `--cp-ring`: cp.async (16 bytes a thread, each thread reading back its own words) into a ring of S units of W
  words per row (Triton adds a CTA barrier before each refill and after each wait), with m0 w8 p2 as the reference;
and bench_read_floor's contiguous read (contig_p64). CUDA graphs, weights rotated past L2, two rounds each (us_0,
us_1). Run: PYTHONPATH=$PWD/src:$PWD/benchmarks python benchmarks/probe_decode_lines.py [--ring | --cp-ring]
Results: results/probe_decode_lines.json, probe_decode_ring.json, probe_decode_cp_ring.json."""
import json
import os
import sys

import torch
import triton
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_read_floor import read_sum  # noqa: E402

# the package's Gluon imports, with the renames between Triton releases folded (kernels/_gluon.py)
from quantfuse.kernels._gluon import TensorDescriptor, gl, gluon, mbarrier  # noqa: E402
from quantfuse.kernels._gluon import cta_barrier as _barrier  # noqa: E402
from quantfuse.kernels._gluon import tma_load as _tma_load  # noqa: E402
SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]


@gluon.constexpr_function
def _layout(mode, nw):
    if mode == 0:
        return gl.BlockedLayout([1, 4], [8, 4], [nw, 1], [1, 0])
    if mode == 1:
        return gl.BlockedLayout([1, 8], [8, 4], [nw, 1], [1, 0])
    return gl.BlockedLayout([1, 4], [4, 8], [nw, 1], [1, 0])


@gluon.jit
def _lines_kernel(w, out, N, KW, units_per_split, n_units, BLOCK_N: gl.constexpr, MODE: gl.constexpr,
                  EF: gl.constexpr, num_warps: gl.constexpr):
    L: gl.constexpr = _layout(MODE, num_warps)
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    u0 = pid_s * units_per_split
    n = gl.minimum(units_per_split, n_units - u0)
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    rj = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    ok = (rn < N)[:, None] & (rj >= 0)[None, :]
    ptrs = w + rn.to(gl.int64)[:, None] * KW + u0 * 32 + rj[None, :]
    policy: gl.constexpr = "evict_first" if EF else ""
    acc = gl.zeros([BLOCK_N, 32], gl.int32, L)
    a = gl.load(ptrs, mask=ok & (n > 0), eviction_policy=policy)
    b = gl.load(ptrs + 32, mask=ok & (n > 1), eviction_policy=policy)
    for t in range(0, n, 2):
        acc += a
        a = gl.load(ptrs + (t + 2) * 32, mask=ok & (t + 2 < n), eviction_policy=policy)
        acc += b
        b = gl.load(ptrs + (t + 3) * 32, mask=ok & (t + 3 < n), eviction_policy=policy)
    gl.store(out + pid_n * gl.num_programs(1) + pid_s, gl.sum(gl.sum(acc, 1), 0))


def _split_plan(n, n_units, block_n, pps, sms):
    """(row blocks, splits, units per split): split-K for about pps programs per SM, as the decode kernel does."""
    grid_n = triton.cdiv(n, block_n)
    splits = max(1, min(n_units, pps * sms // grid_n))
    ups = triton.cdiv(n_units, splits)
    return grid_n, triton.cdiv(n_units, ups), ups


def lines_read(words2d, out, block_n, pps, sms, warps, mode, ef):
    n, kw = words2d.shape
    n_units = kw // 32
    grid_n, splits, ups = _split_plan(n, n_units, block_n, pps, sms)
    _lines_kernel[(grid_n, splits)](words2d, out, n, kw, ups, n_units, BLOCK_N=block_n, MODE=mode, EF=ef,
                                    num_warps=warps)
    return grid_n * splits


def _run(name, what, checks, time_round):
    """Per shape: random words, each of `checks` (label, read(words, out) -> programs) summed right, then two
    rounds of `time_round(res, r, sets, out)` and the contiguous read; the result file `name`."""
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for k, n in SHAPES:
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        exp = int(w.to(torch.int64).sum()) % (1 << 32)
        for label, read in checks(sms):
            out.zero_()
            progs = read(w, out)
            got = int(out[:progs].to(torch.int64).sum()) % (1 << 32)
            assert got == exp, (k, n, label, got, exp)
        sets = [w] + [w.clone() for _ in range(common.rotation_count(w.numel() * 4) - 1)]
        res = {"K": k, "N": n}
        for r in range(2):
            time_round(res, r, [(q,) for q in sets], out, sms)
            res[f"contig_p64_{r}"] = common.graph_us(lambda b: read_sum(b, out, 64 * sms, 2048, 8, True),
                                                     [(q.view(-1),) for q in sets])
        rows.append(res)
        print(json.dumps({a: (round(v, 2) if isinstance(v, float) else v) for a, v in res.items()}), flush=True)
        del sets, w
        torch.cuda.empty_cache()
    write(rows, name, what)


def main():
    def checks(sms):
        return [(f"m{m}", lambda w, o, m=m: lines_read(w, o, 128, 4, sms, 8, m, False)) for m in (0, 1, 2)]

    def time_round(res, r, sets, out, sms):
        for warps in (4, 8):
            for pps in (2, 4):
                for mode in (0, 1, 2):
                    for ef in (False, True):
                        res[f"m{mode}_w{warps}_p{pps}{'_ef' if ef else ''}_{r}"] = common.graph_us(
                            lambda q, warps=warps, pps=pps, mode=mode, ef=ef: lines_read(q, out, 128, pps, sms,
                                                                                         warps, mode, ef), sets)

    _run("probe_decode_lines", "register reads: three lane mappings of whole-line units", checks, time_round)




@gluon.jit
def _ring_kernel(desc, out, units_per_split, n_units, S: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = desc.block_type.shape[0]
    W: gl.constexpr = desc.block_type.shape[1]
    L: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    u0 = pid_s * units_per_split
    n = gl.minimum(units_per_split, n_units - u0)
    smem = gl.allocate_shared_memory(gl.int32, [S, BN, W], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(S):
        mbarrier.expect(ready.index(i), desc.block_type.nbytes, pred=i < n)
        _tma_load(desc, [pid_n * BN, (u0 + i) * W], ready.index(i), smem.index(i), pred=i < n)
    acc = gl.zeros([BN, W], gl.int32, L)
    for t in range(0, n):
        slot = t % S
        mbarrier.wait(ready.index(slot), (t // S) & 1)
        acc += smem.index(slot).load(L)
        _barrier()
        fill = t + S < n
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes, pred=fill)
        _tma_load(desc, [pid_n * BN, (u0 + t + S) * W], ready.index(slot), smem.index(slot), pred=fill)
    gl.store(out + pid_n * gl.num_programs(1) + pid_s, gl.sum(gl.sum(acc, 1), 0))


def ring_read(words2d, out, block_n, w, stages, pps, sms, warps):
    n, kw = words2d.shape
    n_units = kw // w
    grid_n, splits, ups = _split_plan(n, n_units, block_n, pps, sms)
    lay = gl.NVMMASharedLayout.get_default_for([block_n, w], gl.int32)
    desc = TensorDescriptor(words2d, list(words2d.shape), list(words2d.stride()), [block_n, w], lay)
    _ring_kernel[(grid_n, splits)](desc, out, ups, n_units, S=stages, num_warps=warps)
    return grid_n * splits


def _ring_sweep(name, what, prefix, read, configs, programs, check_programs, fits):
    """A shared-memory ring reader `read(words, out, block_n, W, S, pps, sms, warps)` over its (W, S) configs at
    4 / 8 warps and the `programs` per SM where `fits(pps, W, S)`, with the register read m0 w8 p2 beside it."""
    def checks(sms):
        return [(f"W{wd} S{st}", lambda w, o, wd=wd, st=st: read(w, o, 128, wd, st, check_programs, sms, 4))
                for wd, st in configs]

    def time_round(res, r, sets, out, sms):
        for warps in (4, 8):
            for pps in programs:
                for wd, st in configs:
                    if fits(pps, wd, st):
                        res[f"{prefix}_W{wd}_S{st}_w{warps}_p{pps}_{r}"] = common.graph_us(
                            lambda q, wd=wd, st=st, warps=warps, pps=pps: read(q, out, 128, wd, st, pps, sms, warps),
                            sets)
        res[f"m0_w8_p2_{r}"] = common.graph_us(lambda q: lines_read(q, out, 128, 2, sms, 8, 0, False), sets)

    _run(name, what, checks, time_round)


def main_ring():
    # (box width W in words, slots S); four programs per SM only where a program's ring is at most 32 KB
    _ring_sweep("probe_decode_ring", "copy-engine ring reads, 64- vs 128-byte box rows", "ring", ring_read,
                [(16, 4), (16, 8), (32, 2), (32, 4)], (2, 4), 2, lambda pps, wd, st: pps == 2 or wd * st <= 64)


@gluon.jit
def _cp_ring_kernel(w, out, N, KW, units_per_split, n_units, BLOCK_N: gl.constexpr, W: gl.constexpr,
                   S: gl.constexpr, num_warps: gl.constexpr):
    # each thread copies (cp.async, 16 bytes) and later reads back only its own words, so waiting for its own
    # copy groups would be enough (Triton still adds CTA barriers around the wait); S - 1 units in flight without
    # registers
    L: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (W // 4), W // 4], [num_warps, 1], [1, 0])
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    u0 = pid_s * units_per_split
    n = gl.minimum(units_per_split, n_units - u0)
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    rj = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    ok = (rn < N)[:, None] & (rj >= 0)[None, :]
    ptrs = w + rn.to(gl.int64)[:, None] * KW + u0 * W + rj[None, :]
    smem = gl.allocate_shared_memory(gl.int32, [S, BLOCK_N, W], SL)
    for i in gl.static_range(S - 1):
        async_copy.async_copy_global_to_shared(smem.index(i), ptrs + i * W, mask=ok & (i < n))
        async_copy.commit_group()
    acc = gl.zeros([BLOCK_N, W], gl.int32, L)
    for t in range(0, n):
        nxt = t + S - 1
        async_copy.async_copy_global_to_shared(smem.index(nxt % S), ptrs + nxt * W, mask=ok & (nxt < n))
        async_copy.commit_group()
        async_copy.wait_group(S - 1)
        acc += smem.index(t % S).load(L)
    async_copy.wait_group(0)
    gl.store(out + pid_n * gl.num_programs(1) + pid_s, gl.sum(gl.sum(acc, 1), 0))


def cp_ring_read(words2d, out, block_n, w, stages, pps, sms, warps):
    n, kw = words2d.shape
    n_units = kw // w
    grid_n, splits, ups = _split_plan(n, n_units, block_n, pps, sms)
    _cp_ring_kernel[(grid_n, splits)](words2d, out, n, kw, ups, n_units, BLOCK_N=block_n, W=w, S=stages,
                                      num_warps=warps)
    return grid_n * splits


def main_cp_ring():
    # (unit width W in words, slots S); two programs per SM only where a program's ring is at most 64 KB
    _ring_sweep("probe_decode_cp_ring", "cp.async ring reads (each thread its own words)", "cp", cp_ring_read,
                [(16, 4), (16, 8), (32, 4), (32, 8)], (1, 2), 2, lambda pps, wd, st: pps == 1 or wd * st <= 128)


def flatten(rows):
    """One row per (shape, read) from the per-shape dicts: both rounds and the packed words' GB/s at the faster."""
    flat = []
    for res in rows:
        nbytes = res["K"] // 8 * res["N"] * 4
        for key in [k2 for k2 in res if k2.endswith("_0")]:
            label = key[:-2]
            us = [res[f"{label}_{r}"] for r in range(2)]
            flat.append({"K": res["K"], "N": res["N"], "read": label, "us_0": us[0], "us_1": us[1],
                         "GBs": nbytes / min(us) / 1e3})
    return flat


def write(rows, name, what, notes=""):
    common.write_result(name, f"W4A16 decode words, Gluon reads: {what}", flatten(rows),
                        notes=__doc__.split("Run:")[0].replace("\n", " ") + notes)


if __name__ == "__main__":
    if "--ring" in sys.argv:
        main_ring()
    elif "--cp-ring" in sys.argv:
        main_cp_ring()
    else:
        main()
