"""Sweep the fused SiLU-and-mul + quantization launch table (SILU_QUANT_CONFIGS in
quantfuse/kernels/silu_quant.py) on the GPU: tile size (elements per program), outputs per warp, and for
per-token quantization the row path (one row in registers, split over programs, or one program walking
its row twice with the second read from L2). A dev tool, not a test.

Each candidate patches the sm90 table entry, runs silu_and_mul_quant under CUDA graphs with inputs
rotated past L2 (common.time_ms), and is compared with the copy bandwidth measured in the same run
(bytes: x read once, q written once, float32 scales) and with the shipped entry. Writes tune_silu_quant.json.
Stops at TUNE_BUDGET_S seconds (default 240) and still writes what it measured.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_silu_quant.py   (--dry-run: list candidates)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BUDGET_S = float(os.environ.get("TUNE_BUDGET_S", "240"))
SHAPES = [("fp8_token", 4096, 14336), ("fp8_g128", 4096, 14336), ("fp8_g128", 16384, 14336), ("fp8_token", 256, 14336),
          ("fp8_g128", 4096, 5120), ("fp8_g128", 256, 14336), ("int8_g128", 4096, 14336)]
GROUP_CANDIDATES = [dict(elements=e, elements_per_warp=w) for e, w in itertools.product((2048, 4096, 8192),
                                                                                        (256, 512, 1024))]
TOKEN_CANDIDATES = ([dict(token_path="single", elements_per_warp=w) for w in (512, 1024)]
                    + [dict(token_path="split", chunk=c, elements=e) for c, e in itertools.product((1024, 2048, 4096),
                                                                                                   (2048, 4096, 8192))]
                    + [dict(token_path="loop", loop_block=b, elements_per_warp=w, loop_rows=r)
                       for b, w, r in itertools.product((1024, 2048, 4096), (256, 512), (1, 2))
                       if r * b <= 4096])


def candidates():
    out = []
    for mode, t, h in SHAPES:
        for cand in (TOKEN_CANDIDATES if mode.endswith("token") else GROUP_CANDIDATES):
            out.append((mode, t, h, cand))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    cands = candidates()
    print(f"{len(cands)} candidates over {len(SHAPES)} shapes, budget {BUDGET_S:.0f} s")
    if args.dry_run:
        for c in cands:
            print(c)
        return

    from common import copy_bandwidth_gbs, rotation_count, time_ms, write_result

    import quantfuse as qf
    from quantfuse.kernels import silu_quant as ks

    fp8, int8 = torch.float8_e4m3fn, torch.int8
    table = ks.SILU_QUANT_CONFIGS["sm90"]
    shipped = dict(table)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    t0 = time.perf_counter()
    rows = []
    inputs_cache = {}
    for mode, t, h, cand in [(m, t, h, None) for m, t, h in SHAPES] + cands:
        if time.perf_counter() - t0 > BUDGET_S:
            print("budget reached", flush=True)
            break
        dtype = fp8 if mode.startswith("fp8") else int8
        group = None if mode.endswith("token") else 128
        nbytes = t * 2 * h * 2 + t * h + 4 * t * (h // group if group else 1)
        if (t, h) not in inputs_cache:
            inputs_cache.clear()
            inputs_cache[(t, h)] = [(torch.randn(t, 2 * h, device="cuda", dtype=torch.bfloat16) * 3,)
                                    for _ in range(rotation_count(nbytes))]
        sets = inputs_cache[(t, h)]
        table.clear()
        table.update(shipped)
        path = None
        if cand is not None:
            cand = dict(cand)
            path = cand.pop("token_path", None)
            table.update(cand)

        def run(x):
            if path is not None:
                return ks.silu_and_mul_quant(x, dtype, None, None, None, False, token_path=path)
            return qf.silu_and_mul_quant(x, dtype, group_size=group)

        try:
            ms = time_ms(run, sets, graph=True, warmup=10, rep=40)
        except Exception as err:  # noqa: BLE001
            print(f"{mode} T={t} H={h} {cand} failed: {type(err).__name__}: {err}"[:200], flush=True)
            continue
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(mode=mode, T=t, H=h, cand="shipped" if cand is None else str(cand),
                         token_path=path, us=round(ms * 1e3, 2), frac_copy=round(gbs / copy_gbs, 3)))
        print(rows[-1], f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    table.clear()
    table.update(shipped)
    for mode, t, h in SHAPES:
        mine = [r for r in rows if (r["mode"], r["T"], r["H"]) == (mode, t, h)]
        if mine:
            best = min(mine, key=lambda r: r["us"])
            ship = next((r for r in mine if r["cand"] == "shipped"), None)
            print(f"best {mode} T={t} H={h}: {best['cand']} {best['us']} us ({best['frac_copy']} of copy); "
                  f"shipped {ship['us'] if ship else '?'} us")
    write_result("tune_silu_quant", "SiLU-and-mul + quantization launch-table sweep (dev)", rows,
                 extra={"copy_bandwidth_gbs": round(copy_gbs, 1)})


if __name__ == "__main__":
    main()
