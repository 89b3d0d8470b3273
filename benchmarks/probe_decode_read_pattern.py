"""Probe: is the W4A16 M = 1 decode (kernels/gemv_mma.py) bound by its access pattern or by itself?

Times in one run on the device, CUDA graphs, weights rotated past L2 (common.graph_us), two rounds each, on the five
Llama-3 shapes (W4A16 g128 symmetric, float32 scales):
* `ours`: weight_only_mm at M = 1;
* `pattern ...`: a read-only kernel with the decode kernel's access pattern: a program reads BLOCK_N rows of the
  packed words over a K range (split-K as the decode kernel's programs-per-SM rule), each warp load 8 rows x 64 bytes
  (16-byte loads), two chunks in flight; `_s`: also each chunk's float32 group scales;
* `contig ...`: bench_read_floor's contiguous read of the packed words (16-byte loads, .cg).
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/probe_decode_read_pattern.py (--dry: the interpreter, a small
buffer, the pattern kernel's sum checked).
Result: results/tune_gemv_mma_pattern_read.json."""
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
                    WORDS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    c0 = pid_s * chunks_per_split
    n = tl.minimum(chunks_per_split, n_chunks - c0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, WORDS)
    ok_n = rn < N
    ptrs = w + rn[:, None].to(tl.int64) * KW + c0 * WORDS + rj[None, :]
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    kk = rj[None, :] * 0
    k1 = rn * 0
    sacc = tl.zeros([BLOCK_N], tl.float32)
    a = tl.load(ptrs, mask=ok_n[:, None] & (kk + n > 0))
    b = tl.load(ptrs + WORDS, mask=ok_n[:, None] & (kk + n > 1))
    for t in range(0, n, 2):
        acc += a
        if SCALES:
            sacc += tl.load(s + (c0 + t) * N + rn, mask=ok_n)
        a = tl.load(ptrs + (t + 2) * WORDS, mask=ok_n[:, None] & (kk + t + 2 < n))
        acc += b
        if SCALES:
            sacc += tl.load(s + (c0 + t + 1) * N + rn, mask=ok_n & (k1 + t + 1 < n))
        b = tl.load(ptrs + (t + 3) * WORDS, mask=ok_n[:, None] & (kk + t + 3 < n))
    tl.store(out + pid_n * tl.num_programs(1) + pid_s, tl.sum(tl.sum(acc, 1), 0) + tl.sum(sacc, 0).to(tl.int32))


def pattern_read(qw, out, block_n, pps, sms, warps, scales):
    n, kw = qw.qweight.shape
    n_chunks = kw // 16
    grid_n = triton.cdiv(n, block_n)
    splits = max(1, min(n_chunks, pps * sms // grid_n))
    cps = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, cps)
    _pattern_kernel[(grid_n, splits)](qw.qweight, qw.scales, out, n, kw, cps, n_chunks, BLOCK_N=block_n,
                                      SCALES=scales, WORDS=16, num_warps=warps)


def main():
    dry = "--dry" in sys.argv
    dev = "cpu" if dry else "cuda"
    sms = 132 if dry else torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    shapes = [(256, 512)] if dry else [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
    for k, n in shapes:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=4, group_size=128, symmetric=True,
                                scale_dtype=torch.float32)
        out = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
        if dry:
            pattern_read(qw, out, 64, 4, sms, 4, False)
            exp = int(qw.qweight.to(torch.int64).sum())
            got = int(out.to(torch.int64).sum())
            if (exp - got) % (1 << 32):
                raise SystemExit(f"pattern read sum {got} != {exp} (mod 2^32)")
            print("pattern read sum ok")
            return
        nbytes = qw_bytes(qw)
        sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        res = {"K": k, "N": n, "bytes": nbytes}
        for r in range(2):
            res[f"ours_us_{r}"] = common.graph_us(lambda q: qf.weight_only_mm(x, q), [(q,) for q in sets])
            for bn in (64, 128):
                for pps in (2, 4, 8):
                    for sc in (False, True):
                        key = f"pattern_b{bn}_p{pps}{'_s' if sc else ''}_{r}"
                        res[key] = common.graph_us(
                            lambda q, bn=bn, pps=pps, sc=sc: pattern_read(q, out, bn, pps, sms, 4, sc),
                            [(q,) for q in sets])
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
    common.write_result("tune_gemv_mma_pattern_read", "W4A16 M=1 decode vs reads of its own access pattern", flat,
                        notes=__doc__.split("Run:")[0].replace("\n", " "))


if __name__ == "__main__":
    main()
