"""Probe: is the W4A16 M = 1 decode (kernels/gemv_mma.py) bound by its access pattern or by itself?

Times in one run on the device, CUDA graphs, weights rotated past L2 (common.graph_us), two rounds each, on the five
Llama-3 shapes (W4A16 g128 symmetric, float32 scales):
* `ours`: weight_only_mm at M = 1;
* `pattern ...`: a read-only kernel with the decode kernel's access pattern: a program reads BLOCK_N rows of the
  packed words over a K range (split-K as the decode kernel's programs-per-SM rule), each warp load 8 rows x 64 bytes
  (16-byte loads), two chunks in flight; `_s`: also each chunk's float32 group scales;
* `contig ...`: bench_read_floor's contiguous read of the packed words (16-byte loads, .cg).
Modes (environment):
* default: the first study's grid (results/tune_gemv_mma_pattern_read.json);
* PROBE_LAYOUT=1: row-major words against row-grouped layouts (`_r<R>`: the same words addressed as if stored
  [N / R, chunks, R, 16], every chunk of R rows one contiguous block; `_ef`: the evict-first hint), scales read
  (results/tune_gemv_mma_layout_read.json);
* PROBE_LAYOUT=1 PROBE_WORDS=1: words only, `words<W>`: W int32 of a row per chunk (16 = 64 bytes, the kernel's
  chunk; 32 / 64 = whole 128-byte lines) row-major or row-grouped by 8 (results/tune_gemv_mma_layout_read_words.json);
  with PROBE_L2_FETCH=B the context's maximum L2 fetch granularity is set to B bytes first (cuCtxSetLimit) and the
  result name gets `_l2fetch<B>`.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_decode_read_pattern.py (--dry: the interpreter, a small
buffer, the pattern kernel's sums checked for three layouts).
Result: results/tune_gemv_mma_pattern_read.json (and the mode's file)."""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_read_floor import read_sum  # noqa: E402
from bench_weight_only import clone_qw, qw_bytes  # noqa: E402

import quantfuse as qf  # noqa: E402


@triton.jit
def _pattern_kernel(w, s, out, N, KW, chunks_per_split, n_chunks, BLOCK_N: tl.constexpr, SCALES: tl.constexpr,
                    WORDS: tl.constexpr, ROWS: tl.constexpr, EF: tl.constexpr):
    # ROWS = 0: the packed words row-major [N, KW] (the shipped layout); ROWS = R > 0: the same words as if stored
    # [N / R, n_chunks, R, WORDS], every chunk of R rows one contiguous block (a bijection of the buffer, so the
    # bytes read and their sum are the same; only the addresses differ)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    c0 = pid_s * chunks_per_split
    n = tl.minimum(chunks_per_split, n_chunks - c0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, WORDS)
    ok_n = rn < N
    if ROWS == 0:
        row_base = rn.to(tl.int64) * KW
        step = WORDS
    else:
        row_base = (rn // ROWS).to(tl.int64) * (n_chunks * ROWS * WORDS) + (rn % ROWS) * WORDS
        step = ROWS * WORDS
    ptrs = w + row_base[:, None] + c0 * step + rj[None, :]
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    kk = rj[None, :] * 0
    k1 = rn * 0
    sacc = tl.zeros([BLOCK_N], tl.float32)
    policy: tl.constexpr = "evict_first" if EF else ""
    a = tl.load(ptrs, mask=ok_n[:, None] & (kk + n > 0), eviction_policy=policy)
    b = tl.load(ptrs + step, mask=ok_n[:, None] & (kk + n > 1), eviction_policy=policy)
    for t in range(0, n, 2):
        acc += a
        if SCALES:
            sacc += tl.load(s + (c0 + t) * N + rn, mask=ok_n, eviction_policy=policy)
        a = tl.load(ptrs + (t + 2) * step, mask=ok_n[:, None] & (kk + t + 2 < n), eviction_policy=policy)
        acc += b
        if SCALES:
            sacc += tl.load(s + (c0 + t + 1) * N + rn, mask=ok_n & (k1 + t + 1 < n), eviction_policy=policy)
        b = tl.load(ptrs + (t + 3) * step, mask=ok_n[:, None] & (kk + t + 3 < n), eviction_policy=policy)
    tl.store(out + pid_n * tl.num_programs(1) + pid_s, tl.sum(tl.sum(acc, 1), 0) + tl.sum(sacc, 0).to(tl.int32))


def pattern_read(qw, out, block_n, pps, sms, warps, scales, rows=0, ef=False, words=16):
    """The pattern kernel over qw's packed words (and float32 scales if `scales`), `words` int32 per row and chunk
    (16: the decode kernel's 128 codes); see _pattern_kernel for rows."""
    n, kw = qw.qweight.shape
    if kw % words or (rows and n % rows):
        raise SystemExit(f"pattern read: {n} rows of {kw} words split into whole {words}-word chunks of {rows or 1}"
                         " rows only")
    n_chunks = kw // words
    grid_n = triton.cdiv(n, block_n)
    splits = max(1, min(n_chunks, pps * sms // grid_n))
    cps = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, cps)
    _pattern_kernel[(grid_n, splits)](qw.qweight, qw.scales, out, n, kw, cps, n_chunks, BLOCK_N=block_n,
                                      SCALES=scales, WORDS=words, ROWS=rows, EF=ef, num_warps=warps)


LAYOUT = os.environ.get("PROBE_LAYOUT", "") == "1"
WORDS_STUDY = os.environ.get("PROBE_WORDS", "") == "1"


def candidates():
    """(label, pattern_read kwargs): the first study's grid, or with PROBE_LAYOUT=1 row-major against row-grouped
    layouts (r<R>: chunks of R rows contiguous) with and without the evict-first hint, scales always read."""
    if not LAYOUT:
        for bn in (64, 128):
            for pps in (2, 4, 8):
                for sc in (False, True):
                    yield f"pattern_b{bn}_p{pps}{'_s' if sc else ''}", dict(block_n=bn, pps=pps, warps=4, scales=sc)
        return
    if WORDS_STUDY:
        # words only (no scales): row-major with 128 / 256 bytes of a row per chunk, against 64 bytes row-major
        # and row-grouped by 8
        for warps in (4, 8):
            for pps in (2, 4):
                for words, rows in ((16, 0), (16, 8), (32, 0), (64, 0), (32, 8)):
                    yield (f"pattern_b128_w{warps}_p{pps}_words{words}_r{rows}",
                           dict(block_n=128, pps=pps, warps=warps, scales=False, rows=rows, words=words))
        return
    for warps in (4, 8):
        for pps in (2, 4):
            for rows in (0, 8, 16, 128):
                for ef in (False, True):
                    yield (f"pattern_b128_w{warps}_p{pps}_s_r{rows}{'_ef' if ef else ''}",
                           dict(block_n=128, pps=pps, warps=warps, scales=True, rows=rows, ef=ef))


def set_l2_fetch_granularity(nbytes: int) -> int:
    """CU_LIMIT_MAX_L2_FETCH_GRANULARITY of the current context (a hint to the driver) set to `nbytes`; returns the
    value the driver reports after."""
    import ctypes

    torch.zeros(1, device="cuda")  # the primary context exists and is current
    cu = ctypes.CDLL("libcuda.so.1")
    limit = ctypes.c_size_t(0)
    if cu.cuCtxSetLimit(5, ctypes.c_size_t(nbytes)) or cu.cuCtxGetLimit(ctypes.byref(limit), 5):
        raise SystemExit("cuCtxSetLimit / cuCtxGetLimit(CU_LIMIT_MAX_L2_FETCH_GRANULARITY) failed")
    return limit.value


def main():
    dry = "--dry" in sys.argv
    dev = "cpu" if dry else "cuda"
    l2_fetch = int(os.environ.get("PROBE_L2_FETCH", "0"))
    if l2_fetch and not dry:
        print("L2 fetch granularity now", set_l2_fetch_granularity(l2_fetch), flush=True)
    sms = 132 if dry else torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    shapes = [(256, 512)] if dry else [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
    for k, n in shapes:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=4, group_size=128, symmetric=True,
                                scale_dtype=torch.float32)
        out = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
        if dry:
            for rows_, ef in ((0, False), (8, True), (128, False)):
                out.zero_()
                pattern_read(qw, out, 64 if rows_ <= 64 else 128, 4, sms, 4, False, rows_, ef)
                exp = int(qw.qweight.to(torch.int64).sum())
                got = int(out.to(torch.int64).sum())
                if (exp - got) % (1 << 32):
                    raise SystemExit(f"pattern read (rows {rows_}) sum {got} != {exp} (mod 2^32)")
            print("pattern read sums ok")
            return
        nbytes = qw_bytes(qw)
        sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        res = {"K": k, "N": n, "bytes": nbytes}
        for r in range(2):
            res[f"ours_us_{r}"] = common.graph_us(lambda q: qf.weight_only_mm(x, q), [(q,) for q in sets])
            for label, kw in candidates():
                res[f"{label}_{r}"] = common.graph_us(
                    lambda q, kw=kw: pattern_read(q, out, sms=sms, **kw), [(q,) for q in sets])
            words = [q.qweight.view(-1) for q in sets]
            for pps in (4, 16, 64):
                res[f"contig_p{pps}_{r}"] = common.graph_us(
                    lambda b, pps=pps: read_sum(b, out, pps * sms, 2048, 8, True), [(b,) for b in words])
        print(json.dumps({k2: (round(v, 2) if isinstance(v, float) else v) for k2, v in res.items()}), flush=True)
        rows.append(res)
        del sets, qw
        torch.cuda.empty_cache()
    flat = []
    for res in rows:
        for key in [k2 for k2 in res if k2.endswith("_0")]:
            label = key[:-2]
            us = [res[f"{label}_{r}"] for r in range(2)]
            flat.append({"K": res["K"], "N": res["N"], "read": label, "us_0": us[0], "us_1": us[1],
                         "GBs": res["bytes"] / min(us) / 1e3})
    name = ("tune_gemv_mma_layout_read" + ("_words" if WORDS_STUDY else "")
            if LAYOUT else "tune_gemv_mma_pattern_read") + (f"_l2fetch{l2_fetch}" if l2_fetch else "")
    common.write_result(name, "W4A16 M=1 decode vs reads of its own access pattern", flat,
                        notes=__doc__.split("Run:")[0].replace("\n", " "))


if __name__ == "__main__":
    main()
