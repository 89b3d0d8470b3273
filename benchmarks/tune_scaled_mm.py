"""Sweep candidate tiles and accumulation variants of the blockwise fp8 kernel on a few shapes, against the
rowwise fp8 kernel (a dev tool that feeds the CONFIGS / BLOCKWISE_CONFIGS tables in
quantfuse/kernels/scaled_mm.py; not part of the suite).

    python benchmarks/tune_scaled_mm.py --dry-run          # list the candidates (no GPU needed)
    python benchmarks/tune_scaled_mm.py --dry-run --compile-report   # + sm90 registers/spills (no GPU)
    TUNE_BUDGET_S=420 python benchmarks/tune_scaled_mm.py  # on the GPU; results in $OUT/tune_scaled_mm.json

Acceptance metric: `vs_best_rowwise` = best rowwise time / blockwise time on the same shape (target >= 0.85
at M >= 1024), counted only for candidates with `accurate` (rel_err < 1e-3, the spec's blockwise bound).
rel_err = mean|out_bf16 - bf16(ref)| / mean|ref|: for outputs spread over the rounding grid and errors
below one ulp, E|rnd(x + e) - rnd(x)| = |e|, so this estimates the float32 error of the kernel without compiling a
float32-output twin of every candidate.

Order: the rowwise references first, then candidates in three passes (see `sweep_pass`), variants
innermost, each candidate compiled once and timed on every shape, so running out of TUNE_BUDGET_S (default
420 s) drops whole candidates, never shapes. Configs over the shared-memory limit are listed, not compiled.
The result file is rewritten after every candidate, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

from quantfuse import reference as ref  # noqa: E402
from quantfuse.kernels import scaled_mm as kmm  # noqa: E402

FP8 = torch.float8_e4m3fn
# (M, K, N)
SHAPES = [(4096, 4096, 4096), (1024, 4096, 4096), (4096, 14336, 4096), (1024, 8192, 10240)]
ROWWISE = [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 64, 8, 4)]
TILES = [(64, 128), (128, 128), (128, 64), (128, 256), (64, 256)]
WARPS = (4, 8)
STAGES = (3, 4, 5)
REL_ERR_MAX = 1e-3
H100_SMEM = 232448  # opt-in shared memory per block on sm90 (227 KiB)
TARGET = 0.85
COLUMNS = ["kind", "M", "K", "N", "variant", "variant_name", "block_m", "block_n", "num_warps", "num_stages",
           "cfg", "ms", "tflops", "vs_best_rowwise", "rel_err", "accurate", "pass", "error"]


def smem_bytes(cfg):
    """Shared memory of one blockwise program: `stages` buffers of an fp8 a tile and b tile, plus barriers
    (at or just above the compiled kernels' metadata on sm90)."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k + 1024


def sweep_pass(cfg):
    """1: 3-4 stages with 8 warps, or 4 warps up to 64x128 tiles (last session's best: 64x128 w4, 128x64 w8);
    3: 4 warps on tiles of 128x128 and more (an offline sm90 compile spills them for every variant but the
    one-tile ones, and their compiles are the slowest); 2: the rest."""
    area = cfg.block_m * cfg.block_n
    if (cfg.num_warps == 8 or area <= 64 * 128) and cfg.num_stages in (3, 4):
        return 1
    return 3 if cfg.num_warps == 4 and area >= 128 * 128 else 2


def blockwise_candidates(variants, smem_limit):
    """(pass, MMConfig) in sweep order, and the configs left out for shared memory. A variant whose bit 2
    the launcher would drop (BLOCK_N = 256) is left out: it would run (and be timed as) another variant."""
    out, too_big = [], []
    for (bm, bn), warps, stages in itertools.product(TILES, WARPS, STAGES):
        for v in variants:
            cfg = kmm.MMConfig(bm, bn, 128, warps, stages, 8, variant=v)
            if kmm.effective_blockwise_variant(cfg) != v:
                continue
            if smem_bytes(cfg) > smem_limit:
                too_big.append(cfg)
            else:
                out.append((sweep_pass(cfg), cfg))
    out.sort(key=lambda pc: pc[0])  # stable: tile, warps, stages, variant order within a pass
    return out, too_big


def compile_report(cfg):
    """Compile the blockwise kernel for sm90 without a GPU (Triton's bundled ptxas) for the sweep's operands
    (b = w.t(), transposed activation scales, bf16 out) and read registers, spill stack and shared memory
    from the cubin, plus the wgmma wait depth in the loop (1: the MMA overlaps the next iteration, as in the
    rowwise kernel; 0: it is waited for every step). Uses Triton internals (ASTSource, GPUTarget)."""
    import re

    from common import compile_sm90, cubin_resources

    mode, per_tile, promote = kmm.blockwise_modes(cfg)
    const = dict(HAS_BIAS=False, SPLIT_K=1, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SCALE_BLOCK=kmm.BLOCKWISE_SCALE_BLOCK,
                 SCALE_MODE=mode, SB_PER_TILE=per_tile, PROMOTE=promote, INTERPRET=False,
                 # unit strides are specialized by the launcher
                 stride_ak=1, stride_bk=1, stride_sam=1, stride_sbn=1)
    ptrs = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "ws_ptr": "*fp32",
            "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "bias_ptr": "*bf16"}
    t = time.time()
    kernel = compile_sm90(kmm._blockwise_kernel, const, ptrs, cfg.num_warps, cfg.num_stages)
    seconds = time.time() - t
    waits = sorted({int(w) for w in re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", kernel.asm["ptx"])})
    res = cubin_resources(kernel.asm["cubin"])
    return dict(regs=res.get("REG"), spill_stack=res.get("STACK"), shared=kernel.metadata.shared,
                wgmma_waits=waits, compile_s=round(seconds, 2))


def short(cfg):
    return f"v{cfg.variant} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def make_shape(m, k, n):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + k * 13 + n)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 4).to(FP8)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 60).to(FP8)
    b = w.t()
    kb, nb = -(-k // 128), -(-n // 128)
    # block scales as the GPU tests use them (never zero), activation scales in the transposed layout
    sa = (torch.rand(kb, m, device="cuda", generator=gen) * 0.1 + 0.01).t()
    sb = torch.rand(kb, nb, device="cuda", generator=gen) * 1e-3 + 1e-4
    sar = torch.rand(m, 1, device="cuda", generator=gen) * 0.1 + 0.01
    sbr = torch.rand(n, device="cuda", generator=gen) * 1e-3 + 1e-4
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32)
    return dict(a=a, b=b, sa=sa, sb=sb, sar=sar, sbr=sbr, want=want, want_bf16=want.to(torch.bfloat16).float(),
                want_mean=float(want.abs().mean()))


def rel_err(out, data):
    return float((out.float() - data["want_bf16"]).abs().mean()) / data["want_mean"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the candidates and exit (no GPU needed)")
    parser.add_argument("--variants", default=",".join(str(v) for v in sorted(kmm.BLOCKWISE_VARIANTS)
                                                         if v not in kmm._GPU_INACCURATE_VARIANTS),
                        help="comma-separated MMConfig.variant values (see kmm.BLOCKWISE_VARIANTS)")
    parser.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    parser.add_argument("--compile-report", action="store_true",
                        help="with --dry-run: compile every candidate for sm90 (no GPU) and print registers, "
                             "spill stack, shared memory and wgmma wait depth")
    args = parser.parse_args()
    variants = [int(v) for v in args.variants.split(",")]
    for v in variants:
        if v not in kmm.BLOCKWISE_VARIANTS:
            parser.error(f"--variants: {v} is not one of {sorted(kmm.BLOCKWISE_VARIANTS)}")
    budget = float(os.environ.get("TUNE_BUDGET_S", "420"))
    smem_limit = H100_SMEM
    if not args.dry_run:
        smem_limit = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", H100_SMEM)
    candidates, too_big = blockwise_candidates(variants, smem_limit)

    if args.dry_run:
        print(f"{len(candidates)} blockwise candidates x {len(SHAPES)} shapes {SHAPES} (M, K, N), "
              f"+ {len(ROWWISE)} rowwise references per shape; budget TUNE_BUDGET_S={budget:.0f} s")
        for v in variants:
            count = sum(c.variant == v for _, c in candidates)
            print(f"  variant {v} ({kmm.BLOCKWISE_VARIANTS[v]}): {count} candidates")
        for p in (1, 2, 3):
            print(f"  pass {p}: {sum(q == p for q, _ in candidates)} candidates")
        print(f"  left out, shared memory > {smem_limit} B (H100): " + ", ".join(short(c) for c in too_big))
        for i, (sweep_pass, cfg) in enumerate(candidates):
            extra = ""
            if args.compile_report:
                try:
                    extra = " " + " ".join(f"{key}={value}" for key, value in compile_report(cfg).items())
                except Exception as exc:  # noqa: BLE001
                    extra = f" compile failed: {type(exc).__name__}: {str(exc)[:120]}"
            print(f"{i:4d} pass {sweep_pass} {short(cfg):32s} {kmm.BLOCKWISE_VARIANTS[cfg.variant]:30s} "
                  f"smem {smem_bytes(cfg)}{extra}", flush=True)
        return

    t0 = time.time()

    def elapsed():
        return time.time() - t0

    def log(msg):
        print(f"[{elapsed():6.1f}s] {msg}", flush=True)

    rows = []
    state = {"stopped_early": False, "done": 0}

    def save():
        notes = (f"{state['done']}/{len(candidates)} blockwise candidates run"
                 + (f"; stopped at the TUNE_BUDGET_S={budget:.0f} s budget" if state["stopped_early"] else "")
                 + (f"; stopped on a CUDA error after the last candidate: {state['fatal']}"
                    if state.get("fatal") else "")
                 + f"; variants {kmm.BLOCKWISE_VARIANTS}; rel_err = mean|out_bf16 - bf16(ref)| / mean|ref|")
        write_result("tune_scaled_mm", "Tile x variant sweep for scaled_mm_blockwise vs rowwise fp8 (dev)", rows,
                     columns=COLUMNS, notes=notes,
                     extra=dict(best=best_rows(rows), budget_s=budget, elapsed_s=elapsed(),
                                left_out_shared_memory=[str(c) for c in too_big]))

    data = {}
    best_row = {}
    for m, k, n in SHAPES:
        data[(m, k, n)] = d = make_shape(m, k, n)
        flops = 2 * m * n * k
        for c in ROWWISE:
            cfg = kmm.MMConfig(*c)
            try:
                ms = triton.testing.do_bench(
                    lambda: kmm.scaled_mm(d["a"], d["b"], d["sar"], d["sbr"], torch.bfloat16, None, None, None,
                                          config=cfg), rep=args.rep)
            except Exception as err:  # noqa: BLE001
                log(f"rowwise {cfg} failed {type(err).__name__}")
                continue
            best_row[(m, k, n)] = min(best_row.get((m, k, n), ms), ms)
            rows.append(dict(kind="rowwise", M=m, K=k, N=n, cfg=str(cfg), ms=ms, tflops=flops / ms / 1e9))
        log(f"rowwise M={m} K={k} N={n}: best {flops / best_row[(m, k, n)] / 1e9:.0f} TFLOPS"
            if (m, k, n) in best_row else f"rowwise M={m} K={k} N={n}: no result")
    save()

    for i, (sweep_pass, cfg) in enumerate(candidates):
        if elapsed() > budget:
            state["stopped_early"] = True
            log(f"budget of {budget:.0f} s spent: stopping before candidate {i}/{len(candidates)}")
            break
        line = []
        for m, k, n in SHAPES:
            d = data[(m, k, n)]
            base = dict(kind="blockwise", M=m, K=k, N=n, variant=cfg.variant,
                        variant_name=kmm.BLOCKWISE_VARIANTS[cfg.variant], block_m=cfg.block_m,
                        block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, cfg=str(cfg),
                        **{"pass": sweep_pass})

            def run():
                return kmm.scaled_mm_blockwise(d["a"], d["b"], d["sa"], d["sb"], torch.bfloat16, None, config=cfg)

            try:
                err = rel_err(run(), d)
                ms = triton.testing.do_bench(run, rep=args.rep)
            except Exception as exc:  # noqa: BLE001 (shared memory, registers: the same on every shape)
                text = str(exc).splitlines()[0][:200] if str(exc) else ""
                rows.append(dict(base, error=f"{type(exc).__name__}: {text}"))
                line.append(f"failed {type(exc).__name__}: {text[:80]}")
                if "CUDA error" in text or "illegal" in text.lower():
                    state["fatal"] = text  # the context is gone: every later launch would fail too
                break
            flops = 2 * m * n * k
            ratio = best_row[(m, k, n)] / ms if (m, k, n) in best_row else float("nan")
            rows.append(dict(base, ms=ms, tflops=flops / ms / 1e9, vs_best_rowwise=ratio, rel_err=err,
                             accurate=err < REL_ERR_MAX))
            line.append(f"{flops / ms / 1e9:5.0f}T x{ratio:.2f}" + ("" if err < REL_ERR_MAX else f" ERR {err:.1e}"))
        state["done"] = i + 1
        log(f"{i + 1}/{len(candidates)} {short(cfg):30s} " + " | ".join(line))
        save()
        if state.get("fatal"):
            log(f"stopping: CUDA context lost after {short(cfg)} ({state['fatal']})")
            break

    print()
    for r in best_rows(rows):
        print(r)
    save()
    log("done")


def best_rows(rows):
    """Per shape: the best accurate candidate overall and per variant, with its rowwise ratio."""
    out = []
    shapes = sorted({(r["M"], r["K"], r["N"]) for r in rows})
    for shape in shapes:
        ok = [r for r in rows if r["kind"] == "blockwise" and (r["M"], r["K"], r["N"]) == shape
              and r.get("accurate")]
        for v in [None] + sorted({r["variant"] for r in ok}):
            pick = [r for r in ok if v is None or r["variant"] == v]
            if pick:
                top = max(pick, key=lambda r: r["tflops"])
                out.append(dict(M=shape[0], K=shape[1], N=shape[2], variant="any" if v is None else v,
                                cfg=top["cfg"], tflops=round(top["tflops"], 1),
                                vs_best_rowwise=round(top["vs_best_rowwise"], 3), rel_err=top["rel_err"],
                                meets_target=top["vs_best_rowwise"] >= TARGET))
    return out


if __name__ == "__main__":
    main()
