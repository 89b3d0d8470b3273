"""Sweep launch variants of the weight-only GEMM (kernels/weight_only.py) on the GPU and suggest the
`_DISPATCH["sm90"]` tile table (a dev tool, like tune_scaled_mm.py; not part of the suite).

W4A16, group 128, symmetric, bf16 activations, on (K, N) in SHAPES at M in MS. Per (M, K, N) it times
(common.time_ms, graph=True, weights and activations rotated past L2 via common.rotation_count):
bf16 F.linear on the dequantized weight, tinygemm (torch.ops.aten._weight_int4pack_mm, prepared as in
bench_weight_only.py), the shipped dispatch (quantfuse.weight_only_mm), and candidate tiles forced through
`fused_mm(tile=...)`:
- kernel "mma" (tensor cores): block_n {16, 32, 64, 128} x chunks {1, 2, 4} x num_warps {2, 4, 8} (plus 1 for
  block_n <= 32, where more warps only replicate the dequantization) x num_stages {2, 3, 4} x programs_per_sm
  {1, 2, 4, 8}, convert "inplace" and "shift"; block_m = the next power of two >= M, at least 16;
- kernel "gemv" (M <= 4 only, block_m = M): block_n {32, 64, 128, 256} x chunks {1, 2, 4} x scale
  {"before", "auto"} x warps {2, 4, 8} x stages {2, 3, 4}.
Pruning, to stay under 8 minutes on an H100 (TUNE_BUDGET_S, default 450, stops early and writes what it has):
  stage 1: every (kernel, block_n, chunks) at a default warps / stages / programs_per_sm, convert "inplace";
  stage 2: the two best of stage 1 (per shape) x warps x stages;
  stage 3: the best of stage 2 x programs_per_sm, and with convert "shift".
Before each stage the new kernels are compiled in parallel by worker processes (the Triton disk cache is
shared), so the timed process only loads them. A candidate that fails (compile error, out of resources) is
printed and skipped.
Rows: kind (bf16 / tinygemm / shipped / mma / gemv), M, K, N, cfg, us, weight_GBs (packed weight + scales
bytes / time), frac_copy_bw (/ copy bandwidth measured once here), speedup_vs_bf16, speedup_vs_tinygemm.
Prints the best candidate per (M, K, N) and a suggested `_DISPATCH["sm90"]["tiles"]` (per M, the candidate
with the best geometric-mean speedup over the shipped dispatch across shapes).

Run on the device:  PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_weight_only.py
                    ... --candidates benchmarks/tune_candidates/weight_only_krule.json  (only the tiles of a
                    JSON list, at TUNE_MS; TUNE_BITS=8 TUNE_GROUP=-1 sweeps W8A16 per channel instead)
Without a GPU:      PYTHONPATH=$PWD/src python benchmarks/tune_weight_only.py --dry-run   (lists candidates)
                    ... --census  (compiles the stage-1 candidates for sm90 with Triton's bundled ptxas, no GPU
                    needed, and prints registers / spills / shared memory / SASS instructions per weight of the
                    K loop; slow, CPU only)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(4096, 6144), (4096, 14336), (14336, 4096), (8192, 10240), (28672, 8192)]
MS = [int(v) for v in os.environ.get("TUNE_MS", "1,4,16,32,64").split(",")]
# the swept scheme: W4A16 group 128 by default; TUNE_BITS=8 TUNE_GROUP=-1 for W8A16 per channel
BITS = int(os.environ.get("TUNE_BITS", "4"))
GROUP = int(os.environ.get("TUNE_GROUP", "128"))
BLOCK_NS = (16, 32, 64, 128)
GEMV_BLOCK_NS = (32, 64, 128, 256)
CHUNKS = (1, 2, 4)
WARPS = (1, 2, 4, 8)
STAGES = (2, 3, 4)
PPSM = (1, 2, 4, 8)
BUDGET_S = float(os.environ.get("TUNE_BUDGET_S", "450"))
# scales dtype of the swept weights: "bfloat16" (the activation dtype) lets convert "packed" run
SCALE_DTYPE = os.environ.get("TUNE_SCALE_DTYPE", "float32")
# TUNE_TINYGEMM=0 skips the tinygemm peer (prefill-sized sweeps, where it is far behind and slow to time)
WARMUP_MS, REP_MS = 5, 20
# "cpu" only for --cpu-smoke (the interpreter; checks this script's logic, times nothing real); an environment
# variable so that the spawned compile workers see it too
DEVICE = os.environ.get("TUNE_DEVICE", "cuda")


# ---------------------------------------------------------------------------------------------------
# candidates (pure Python: --dry-run needs no GPU)
# ---------------------------------------------------------------------------------------------------
def mma_block_m(m: int) -> int:
    return min(64, max(16, 1 << max(0, (m - 1).bit_length())))


def default_ppsm(m: int) -> int:
    return 4 if m <= 16 else (2 if m <= 32 else 1)


def warps_for(kernel: str, block_n: int):
    if kernel == "mma":
        return {16: (1, 2, 4), 32: (1, 2, 4), 64: (2, 4, 8), 128: (4, 8), 256: (4, 8)}[block_n]
    return (1, 2, 4) if block_n == 16 else (2, 4, 8)


def cand(kernel, m, block_n, chunks, num_warps, num_stages, ppsm, convert="inplace", block_m=None):
    if block_m is None:
        block_m = mma_block_m(m) if kernel == "mma" else m
    return dict(kernel=kernel, block_m=block_m, block_n=block_n, chunks=chunks,
                convert=convert, num_warps=num_warps, num_stages=num_stages, programs_per_sm=ppsm)


def key(c: dict) -> str:
    return (f"{c['kernel']} m{c['block_m']} n{c['block_n']} c{c['chunks']} {c['convert']} w{c['num_warps']} "
            f"s{c['num_stages']} p{c['programs_per_sm']}"
            + (f" {c['scale']}" if c.get("scale", "before") != "before" else "") + (" wide" if c.get("wide") else ""))


def stage1(m: int):
    out = []
    if m >= 128:
        # prefill-like M: one block_m that covers M dequantizes each weight tile once; wider tiles need 8 warps
        for bm, bn, ch in itertools.product((64, 128), (64, 128, 256), (1, 2)):
            w = 8 if bm * bn >= 128 * 128 else 4
            out.append(cand("mma", m, bn, ch, w, 3, 1, block_m=bm))
        return out
    for bn, ch in itertools.product(BLOCK_NS, CHUNKS):
        if m >= 64 and bn < 64:
            continue  # the M = 64 sweep of the last table: block_n 16 / 32 never came close
        w = {16: 1, 32: 2, 64: 4, 128: 4}[bn]
        out.append(cand("mma", m, bn, ch, w, 3, default_ppsm(m)))
    if m <= 4:
        for bn, ch in itertools.product(GEMV_BLOCK_NS, CHUNKS):
            out.append(cand("gemv", m, bn, ch, 2 if bn == 16 else 4, 3, default_ppsm(m)))
            # the scale after the sums (exact u - z, no per-weight multiply or rounding)
            out.append(dict(cand("gemv", m, bn, ch, 2 if bn == 16 else 4, 3, default_ppsm(m)), scale="auto"))
    return out


def stage2(best: dict):
    """warps x stages around one (kernel, block_n, chunks)."""
    return [dict(best, num_warps=w, num_stages=s)
            for w, s in itertools.product(warps_for(best["kernel"], best["block_n"]), STAGES)]


def stage3(best: dict):
    out = [dict(best, programs_per_sm=p) for p in PPSM]
    out.append(dict(best, convert="shift"))
    return out


def dedupe(cands, seen=None):
    seen = set() if seen is None else seen
    out = []
    for c in cands:
        k = key(c)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def dry_run():
    total = 0
    for m in MS:
        s1 = stage1(m)
        s2 = dedupe([c for b in s1[:2] for c in stage2(b)], {key(c) for c in s1})
        s3 = dedupe(stage3(s1[0]), {key(c) for c in s1 + s2})
        per_shape = len(s1) + len(s2) + len(s3)
        total += per_shape * len(SHAPES)
        print(f"M={m}: stage 1 {len(s1)} candidates, stage 2 ~{len(s2)} (2 best x warps x stages), stage 3 "
              f"~{len(s3)} (programs_per_sm, shift): ~{per_shape} per shape")
        for c in s1:
            print("   ", key(c))
        print("    stage 2 e.g.:", ", ".join(key(c) for c in s2[:4]), "...")
        print("    stage 3 e.g.:", ", ".join(key(c) for c in s3))
    print(f"about {total} candidate timings over {len(SHAPES)} shapes x {len(MS)} M, plus 3 baselines per "
          f"(M, shape); budget TUNE_BUDGET_S={BUDGET_S:.0f} s")


# ---------------------------------------------------------------------------------------------------
# --census: compile for sm90 without a GPU (Triton's bundled ptxas / cuobjdump)
# ---------------------------------------------------------------------------------------------------
def census(ms):
    import torch
    import triton

    import sass_weight_only as sw
    from common import WEIGHT_ONLY_DIVISIBLE, compile_sm90, cubin_resources
    from quantfuse.kernels import weight_only as kw

    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*fp32", "bias_ptr": "*bf16",
             "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    seen = set()
    for m in ms:
        for c in stage1(m):
            k = key(c)
            if k in seen:
                continue
            seen.add(k)
            fn = kw._wo_gemv_kernel if c["kernel"] == "gemv" else kw._wo_mm_kernel
            mma = fn is kw._wo_mm_kernel
            scale = kw._scale_code(c, 2, mma)  # W4A16 g128 on K = 256 .. : several groups
            consts = dict(BITS=4, GROUP_FIELDS=8, HAS_ZERO=False, HAS_BIAS=False, SPLIT=True, BLOCK_M=c["block_m"],
                          BLOCK_N=c["block_n"], CHUNKS=c["chunks"], SCALE=scale, FUSED_REDUCE=True, INTERPRET=False,
                          CONVERT=kw._convert_code(c, torch.bfloat16, torch.float32, 4, mma, scale != 0))
            if not mma:
                consts["BLOCK_M_P2"] = triton.next_power_of_2(c["block_m"])
            t0 = time.time()
            try:
                ck = compile_sm90(fn, consts, types, c["num_warps"], c["num_stages"],
                                  divisible=WEIGHT_ONLY_DIVISIBLE)
                summ = sw.summarize(sw.cuobjdump(ck.asm["cubin"]))
            except Exception as e:  # noqa: BLE001
                print(f"{k:45s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            loop = summ.get("main_loop", {})
            weights_per_thread = c["block_n"] * 128 * c["chunks"] / (32 * c["num_warps"])
            n = loop.get("instructions", 0)
            res = cubin_resources(ck.asm["cubin"])
            print(f"{k:45s} regs {res.get('REG', '?'):>3} local {res.get('LOCAL', '?'):>4} smem {ck.metadata.shared:6d}  "
                  f"K-loop {n:5d} instr = {n / weights_per_thread:5.2f} per weight per thread  "
                  f"({time.time() - t0:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------------------------
# GPU sweep
# ---------------------------------------------------------------------------------------------------
_W = {}  # worker state


def _make_qw(k, n, seed):
    import torch

    import quantfuse as qf

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=g)
    return qf.quantize_weight(w, bits=BITS, group_size=GROUP, symmetric=True, scale_dtype=getattr(torch, SCALE_DTYPE))


def _worker_init():
    import torch

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    _W["qw"] = {}


def _worker_qw(k, n):
    """Random packed codes and scales of the right shapes and layout (what the kernel sees), built without
    quantizing a float weight: a dozen workers doing that at once on the biggest shape could run out of
    GPU memory."""
    import torch

    from quantfuse.weights import QuantizedWeight

    words = -(-k // (16 * (32 // BITS))) * 16  # whole 16-word chunks, as pack_codes pads K
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, words), device=DEVICE, dtype=torch.int32)
    groups = 1 if GROUP == -1 else -(-k // GROUP)
    scales = (torch.rand(groups, n, device=DEVICE) * 0.01).to(getattr(torch, SCALE_DTYPE))
    return QuantizedWeight(qweight, scales, None, BITS, GROUP, (n, k), None)


def _worker_compile(m, k, n, cfg):
    """Compile (and run once) one candidate in a worker; the Triton disk cache then serves the timed process.
    Returns None, or the error (None too for a GPU out-of-memory in the worker: the timed process retries)."""
    import torch

    from quantfuse.kernels import weight_only as kw

    try:
        if (k, n) not in _W["qw"]:
            _W["qw"][(k, n)] = _worker_qw(k, n)
        qw = _W["qw"][(k, n)]
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, None, BITS, GROUP, n, tile=cfg)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return None
    except torch.cuda.OutOfMemoryError:
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Sweep:
    def __init__(self, workers: int):
        import torch

        import common
        import bench_weight_only as bwo

        self.torch, self.common, self.bwo = torch, common, bwo
        self.start = time.time()
        self.rows = []
        self.failed = {}  # (m, k, n, key) -> error
        self.base_cache = {}
        self.pool = None
        if workers > 0:
            try:
                import multiprocessing as mp

                self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                                initializer=_worker_init)
            except Exception as e:  # noqa: BLE001
                print("no compile workers:", e, flush=True)
        self.bw = common.copy_bandwidth_gbs() if DEVICE == "cuda" else 1.0
        print(f"{common.env_info()}  copy {self.bw:.0f} GB/s  workers {workers}", flush=True)

    def elapsed(self):
        return time.time() - self.start

    def over_budget(self):
        return self.elapsed() > BUDGET_S

    def precompile(self, jobs):
        """jobs: [(m, k, n, cfg)]; compile them in the workers (errors recorded, those candidates skipped).
        Phase 1 compiles each (candidate, M) once (first shape), phase 2 runs the other shapes (mostly cache
        hits; a different specialization, e.g. split or not, compiles there)."""
        if self.pool is None or not jobs:
            return
        t0 = time.time()
        first, rest, seen = [], [], set()
        for j in jobs:
            ident = (j[0], key(j[3]))
            (rest if ident in seen else first).append(j)
            seen.add(ident)
        for phase in (first, rest):
            futs = {self.pool.submit(_worker_compile, *j): j for j in phase}
            done, not_done = wait(futs, timeout=max(10.0, BUDGET_S - self.elapsed()))
            for f in done:
                try:
                    err = f.result()
                except Exception as e:  # noqa: BLE001  (a worker died: the timed process tries it itself)
                    print("compile worker failed:", type(e).__name__, e, flush=True)
                    continue
                if err:
                    m, k, n, cfg = futs[f]
                    self.failed[(m, k, n, key(cfg))] = err
                    print(f"    M={m} K={k} N={n} {key(cfg)}: FAILED {err}", flush=True)
            for f in not_done:
                f.cancel()
        print(f"[{self.elapsed():6.1f}s] compiled {len(first)} kernels / ran {len(jobs)} launches in "
              f"{time.time() - t0:.1f} s ({sum(1 for j in jobs if (j[0], j[1], j[2], key(j[3])) in self.failed)} "
              f"failed)", flush=True)

    # --- per shape ------------------------------------------------------------------------------
    def setup_shape(self, k, n):
        torch, common, bwo = self.torch, self.common, self.bwo
        qw = _make_qw(k, n, 0)
        self.wbytes = bwo.qw_bytes(qw)
        self.qw_sets = [qw] + [bwo.clone_qw(qw) for _ in range(common.rotation_count(self.wbytes) - 1)]
        w_hat = qw.dequantize(torch.bfloat16)
        self.lin_sets = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        self.tg_sets = None
        try:
            if BITS != 4:
                raise ValueError("tinygemm takes 4-bit weights only")
            if os.environ.get("TUNE_TINYGEMM", "1") == "0":
                raise ValueError("skipped (TUNE_TINYGEMM=0)")
            wp, sz = bwo.tinygemm_pack(qw)
            tg_bytes = wp.numel() * wp.element_size() + sz.numel() * sz.element_size()
            self.tg_sets = [(wp, sz)] + [(wp.clone(), sz.clone()) for _ in range(common.rotation_count(tg_bytes) - 1)]
        except Exception as e:  # noqa: BLE001
            print("tinygemm unavailable:", type(e).__name__, str(e).splitlines()[0][:200], flush=True)

    def drop_shape(self):
        self.qw_sets = self.lin_sets = self.tg_sets = None
        if DEVICE == "cuda":
            self.torch.cuda.empty_cache()

    def time_us(self, fn, sets):
        if DEVICE == "cpu":  # --cpu-smoke: one call, wall clock
            t0 = time.perf_counter()
            fn(*sets[0])
            return (time.perf_counter() - t0) * 1e6
        return self.common.time_ms(fn, sets, graph=True, warmup=WARMUP_MS, rep=REP_MS) * 1e3

    def baselines(self, m, k, n):
        """Input sets for (m, k, n); times bf16 F.linear, tinygemm and the shipped dispatch the first time."""
        torch, bwo = self.torch, self.bwo
        nsets = max(len(self.qw_sets), len(self.lin_sets), len(self.tg_sets or []))
        self.xs = [torch.randn(m, k, device=DEVICE).to(torch.bfloat16) for _ in range(nsets)]
        if (m, k, n) in self.base_cache:
            self.base = self.base_cache[(m, k, n)]
            return
        base = {}
        base["bf16"] = self.time_us(bwo.bf16_linear, [(self.xs[i], w) for i, w in enumerate(self.lin_sets)])
        base["tinygemm"] = None
        if self.tg_sets is not None:
            try:
                base["tinygemm"] = self.time_us(bwo.tinygemm, [(self.xs[i], wp, sz) for i, (wp, sz) in enumerate(self.tg_sets)])
            except Exception as e:  # noqa: BLE001
                print("tinygemm failed:", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
        base["shipped"] = self.time_us(bwo.ours, [(self.xs[i], q) for i, q in enumerate(self.qw_sets)])
        self.base = self.base_cache[(m, k, n)] = base
        for kind in ("bf16", "tinygemm", "shipped"):
            if base[kind] is not None:
                self.add_row(kind, m, k, n, "-" if kind != "shipped" else "dispatch", base[kind])

    def add_row(self, kind, m, k, n, cfg, us):
        gbs = self.wbytes / (us * 1e-6) / 1e9
        row = dict(kind=kind, M=m, K=k, N=n, cfg=cfg, us=us, weight_GBs=gbs, frac_copy_bw=gbs / self.bw,
                   speedup_vs_bf16=self.base["bf16"] / us,
                   speedup_vs_tinygemm=(self.base["tinygemm"] / us) if self.base.get("tinygemm") else "n/a")
        self.rows.append(row)
        return row

    def candidate(self, m, k, n, cfg):
        """Time one candidate; returns us or None (failed / skipped)."""
        kw = self._kw()
        ck = key(cfg)
        if (m, k, n, ck) in self.failed:
            return None

        def fn(x, qw):
            return kw.fused_mm(x, qw.qweight, qw.scales, qw.zeros, None, BITS, GROUP, n, tile=cfg)

        try:
            us = self.time_us(fn, [(self.xs[i], q) for i, q in enumerate(self.qw_sets)])
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.failed[(m, k, n, ck)] = err
            print(f"    {ck}: FAILED {err}", flush=True)
            if DEVICE == "cuda":
                self.torch.cuda.synchronize()
            return None
        row = self.add_row(cfg["kernel"], m, k, n, ck, us)
        row["tile"] = json.dumps(cfg, sort_keys=True)
        return us

    @staticmethod
    def _kw():
        from quantfuse.kernels import weight_only as kw

        return kw

    def run_stage(self, label, per_key_cands):
        """per_key_cands: {(m, k, n): [cfg]}; precompile all, then time shape by shape."""
        jobs = [(m, k, n, c) for (m, k, n), cs in per_key_cands.items() for c in cs]
        self.precompile(jobs)
        results = {}
        for (k, n) in SHAPES:
            keys = [(m, kk, nn) for (m, kk, nn) in per_key_cands if (kk, nn) == (k, n)]
            if not keys or self.over_budget():
                continue
            self.setup_shape(k, n)
            for (m, _, _) in sorted(keys):
                if self.over_budget():
                    print(f"budget {BUDGET_S:.0f} s reached: stopping", flush=True)
                    break
                self.baselines(m, k, n)
                timed = []
                for c in per_key_cands[(m, k, n)]:
                    if self.over_budget():
                        break
                    us = self.candidate(m, k, n, c)
                    if us is not None:
                        timed.append((us, c))
                timed.sort(key=lambda t: t[0])
                results[(m, k, n)] = timed
                best = timed[0] if timed else None
                b = self.base
                print(f"[{self.elapsed():6.1f}s] {label} M={m} K={k} N={n}: bf16 {b['bf16']:.1f} us, tinygemm "
                      f"{b['tinygemm'] if b['tinygemm'] is None else round(b['tinygemm'], 1)} us, shipped "
                      f"{b['shipped']:.1f} us; {len(timed)}/{len(per_key_cands[(m, k, n)])} ok; best "
                      + (f"{key(best[1])} {best[0]:.1f} us ({b['bf16'] / best[0]:.2f}x bf16, "
                         f"{self.wbytes / (best[0] * 1e-6) / 1e9 / self.bw:.2f} of copy bw)" if best else "-"),
                      flush=True)
            self.drop_shape()
        return results

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def suggest(rows):
    """Per M, the candidate with the best geometric-mean speedup over the shipped dispatch across shapes
    (among those timed on the most shapes)."""
    shipped = {(r["M"], r["K"], r["N"]): r["us"] for r in rows if r["kind"] == "shipped"}
    table = []
    for m in MS:
        by_cfg = {}
        for r in rows:
            if r["M"] == m and r["kind"] in ("mma", "gemv") and (m, r["K"], r["N"]) in shipped:
                by_cfg.setdefault(r["tile"], []).append(shipped[(m, r["K"], r["N"])] / r["us"])
        if not by_cfg:
            continue
        most = max(len(v) for v in by_cfg.values())
        score = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in by_cfg.items() if len(v) == most}
        best = max(score, key=score.get)
        table.append((m, json.loads(best), score[best], most))
    return table


def from_table(m: int):
    """--from-table: the shipped sm90 tile for M with the scale applied before (inplace: the previous
    kernel) and after the dot (packed / inplace), the after-packed one at half / double its programs_per_sm,
    more stages and (M <= 32) block_n 256, plus (M >= 64) the M = 64 runners-up of an earlier sweep."""
    import torch
    from quantfuse.kernels import weight_only as kw

    base = kw.pick_from(kw._DISPATCH["sm90"]["tiles"], m, BITS, getattr(torch, SCALE_DTYPE).itemsize)
    base = {k: v for k, v in base.items() if k not in ("max_m", "bits", "scale_bytes")}
    p = base["programs_per_sm"]
    after = dict(base, convert="packed", scale="after")
    out = [dict(base, convert="inplace", scale="before"), dict(base, convert="packed", scale="before"),
           dict(after, convert="inplace"), after]
    out += [dict(after, programs_per_sm=pp) for pp in sorted({max(1, p // 2), 2 * p} - {p})]
    out += [dict(after, num_stages=st) for st in (base["num_stages"] + 1, base["num_stages"] + 2)]
    if m <= 32:
        out += [dict(after, block_n=256, num_warps=w) for w in (4, 8)]
    if m >= 64 and base["block_m"] <= 64:
        out += [dict(after, block_n=64, num_warps=4, num_stages=3, programs_per_sm=pp) for pp in (1, 2, 4)]
    return dedupe(out)


def from_list(m: int, tiles):
    """--candidates FILE: the tiles of a JSON list (block_m defaults to the M's mma block, or M for gemv)."""
    out = []
    for t in tiles:
        t = dict(t)
        t.setdefault("block_m", mma_block_m(m) if t.get("kernel", "mma") == "mma" else m)
        if t.get("kernel") == "gemv" and m > 4:
            continue
        out.append(t)
    return dedupe(out)


def sweep(workers: int, table_only: bool = False, tiles=None):
    sw = Sweep(workers)
    try:
        if tiles is not None:
            table_only = True
        s1 = {(m, k, n): (from_list(m, tiles) if tiles is not None else from_table(m) if table_only else stage1(m))
              for m in MS for (k, n) in SHAPES}
        r1 = sw.run_stage("stage 1", s1)
        if table_only:
            r1 = {}
        s2 = {}
        for km, timed in r1.items():
            seen = {key(c) for _, c in timed}
            s2[km] = dedupe([c for _, b in timed[:2] for c in stage2(b)], seen)
        r2 = sw.run_stage("stage 2", {k: v for k, v in s2.items() if v}) if not sw.over_budget() else {}
        s3 = {}
        for km in r1:
            timed = sorted(r1.get(km, []) + r2.get(km, []), key=lambda t: t[0])
            if timed:
                seen = {key(c) for _, c in timed}
                s3[km] = dedupe(stage3(timed[0][1]), seen)
        if not sw.over_budget() and s3:
            sw.run_stage("stage 3", {k: v for k, v in s3.items() if v})
    finally:
        sw.close()
    rows = sw.rows
    # best per (M, K, N)
    print("\nbest candidate per (M, K, N):")
    for m in MS:
        for (k, n) in SHAPES:
            cands = [r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n) and r["kind"] in ("mma", "gemv")]
            base = {r["kind"]: r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n) and r["kind"] in ("bf16", "tinygemm", "shipped")}
            if not cands:
                continue
            b = min(cands, key=lambda r: r["us"])
            tg = b["speedup_vs_tinygemm"]
            tg = "n/a" if isinstance(tg, str) else f"{tg:.2f}x"
            shipped = f"{base['shipped']['us']:.1f} us" if "shipped" in base else "-"
            print(f"  M={m:3d} K={k:5d} N={n:5d}: {b['cfg']:45s} {b['us']:7.1f} us  {b['speedup_vs_bf16']:.2f}x bf16  "
                  f"{tg} tinygemm  {b['frac_copy_bw']:.2f} of copy bw  (shipped {shipped})")
    table = suggest(rows)
    print('\nsuggested _DISPATCH["sm90"]["tiles"] (per M: best geometric-mean speedup over the shipped dispatch; '
          "max_m = the M it was measured at, so the rows between are interpolated: check before shipping):")
    print("        \"tiles\": [")
    for m, cfg, score, cover in table:
        cfg = {k: cfg[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "programs_per_sm", "chunks",
                                   "kernel", "convert", "scale") if k in cfg}
        print(f"            dict(max_m={m}, " + ", ".join(f"{k}={v!r}" for k, v in cfg.items())
              + f"),  # {score:.2f}x shipped over {cover} shapes")
    print("            # ... keep the catch-all (max_m=1 << 62) entry of the shipped table\n        ],")
    columns = ["kind", "M", "K", "N", "cfg", "us", "weight_GBs", "frac_copy_bw", "speedup_vs_bf16", "speedup_vs_tinygemm"]
    failed = [f"M={m} K={k} N={n} {c}: {e}" for (m, k, n, c), e in sw.failed.items()]
    notes = (f"W{BITS}A16 g{GROUP} sym bf16; CUDA graphs, inputs rotated past L2; copy bandwidth {sw.bw:.0f} GB/s; "
             f"do_bench warmup {WARMUP_MS} ms rep {REP_MS} ms; {len(rows)} rows, {len(failed)} failed candidates; "
             f"total {sw.elapsed():.0f} s (budget {BUDGET_S:.0f} s)")
    path = sw.common.write_result(
        "tune_weight_only", "Weight-only GEMM tile / variant sweep (dev)",
        [{c: r.get(c) for c in columns} for r in rows], columns=columns, notes=notes,
        extra={"suggested_sm90_tiles": [dict(max_m=m, **cfg, geomean_speedup_vs_shipped=s, shapes=cv)
                                        for m, cfg, s, cv in table],
               "failed": failed[:200]})
    print(notes)
    print("wrote", path)


def main():
    global DEVICE, SHAPES, MS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="list the candidates; needs no GPU")
    ap.add_argument("--census", action="store_true", help="compile stage-1 candidates for sm90 offline (no GPU)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developer check of this script's logic on CPU (interpreter, tiny shapes, no timings)")
    ap.add_argument("--from-table", action="store_true",
                    help="time only the shipped tiles' convert / programs_per_sm variants (see from_table)")
    ap.add_argument("--candidates", metavar="FILE",
                    help="time only the tiles of this JSON list (keys of a _DISPATCH tile; block_m optional)")
    ap.add_argument("--workers", type=int, default=min(12, max(0, (os.cpu_count() or 1) - 2)),
                    help="compile worker processes (0: compile in the timed process)")
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
        return
    if args.census:
        census(MS)
        return
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"], os.environ["TUNE_DEVICE"] = "1", "cpu"
        # its timings are meaningless: never over the committed results
        os.environ.setdefault("OUT", tempfile.mkdtemp(prefix="tune_weight_only_smoke_"))
        DEVICE, SHAPES, MS = "cpu", [(256, 48), (384, 40)], [1, 4, 32]
        sweep(min(args.workers, 2))
        return
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run or --census without one)")
        return
    tiles = None
    if args.candidates:
        with open(args.candidates) as f:
            tiles = json.load(f)
    sweep(args.workers, args.from_table, tiles)


if __name__ == "__main__":
    main()
