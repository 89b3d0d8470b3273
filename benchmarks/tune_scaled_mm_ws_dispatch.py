"""Same-run A/B of the rowwise scaled_mm kernels at prefill sizes (M >= 1024), fp8 and int8: the shipped dispatch
against the warp-specialized Gluon kernels of rowwise_wgmma.py, cooperative (WsConfig(128, 256, 4, G): two consumer
warpgroups split each 128x256 tile) and ping-pong (WsConfig(128, 128, S, 8, pingpong=True): each consumer takes every
other 128x128 tile whole, one's epilogue under the other's main loop), with the torch peer timed in the same rounds
(fp8: torch._scaled_mm rowwise + bias, use_fast_accum=True; int8: torch._int_mm + the two-kernel epilogue).

Why: tune_scaled_mm_ws_store.json (3 rounds, for the store change only) read the cooperative kernel 1.01-1.08x the
tl tiles for fp8 at 4096 rows with K <= 8192 and 0.85-1.0x elsewhere, and issue 3's fp8 line (>= 0.95x
torch._scaled_mm at M >= 1024) missed on four K = 4096 shapes, where the epilogue is the largest share of a tile.

Per (dtype, M, K, N): TUNE_ROUNDS (default 5) alternated rounds of every contender, each round starting one
contender later (the order rotates: see the loop), medians and each round's ratio to the dispatch kept; every
candidate's output is compared with the dispatch's (max |diff| / max |dispatch|).
Per-token x per-channel scales + bf16 bias, bf16 out, CUDA graphs, inputs rotated past L2. Writes
tune_scaled_mm_ws_dispatch.json (TUNE_OUT_NAME overrides). TUNE_MS, TUNE_KN, TUNE_DTYPES, TUNE_GROUPS,
TUNE_PP_STAGES, TUNE_PP_GROUPS (ping-pong group_m; 8 alone is named 'pp sS', others 'pp sS gG') and TUNE_EXTRA=0
(drops 8192^3) narrow it.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_scaled_mm_ws_dispatch.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
if os.environ.get("TUNE_KN"):  # e.g. "4096:6144,8192:10240"
    KN = [tuple(int(v) for v in kn.split(":")) for kn in os.environ["TUNE_KN"].split(",")]
MS = tuple(int(v) for v in os.environ.get("TUNE_MS", "1024,2048,4096").split(","))
ROUNDS = int(os.environ.get("TUNE_ROUNDS", "5"))
GROUPS = tuple(int(v) for v in os.environ.get("TUNE_GROUPS", "8").split(","))
PP_STAGES = tuple(int(v) for v in os.environ.get("TUNE_PP_STAGES", "4,5,6").split(","))
PP_GROUPS = tuple(int(v) for v in os.environ.get("TUNE_PP_GROUPS", "8").split(","))
PP_NAMES = [(st, g, f"pp s{st}" + ("" if g == 8 else f" g{g}")) for st in PP_STAGES for g in PP_GROUPS]
DTYPES = tuple(os.environ.get("TUNE_DTYPES", "fp8,int8").split(","))
EXTRA = [(8192, 8192, 8192)] if os.environ.get("TUNE_EXTRA", "1") == "1" else []


def main():
    from bench_scaled_mm import make_sets, torch_int_mm_unfused, torch_scaled_mm_rowwise_fast
    from common import finish, time_ms

    from quantfuse.kernels import scaled_mm as kmm

    torch.manual_seed(0)
    t0 = time.perf_counter()
    rows = []
    shapes = [(m, k, n) for m in MS for k, n in KN] + EXTRA
    for dtype in DTYPES:
        qdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.int8
        for m, k, n in shapes:
            sets = make_sets(m, k, n, qdtype)

            def ours(cfg):
                return lambda a, b, sa, sb, bias: kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None,
                                                                config=cfg)

            flavor = None if dtype == "fp8" else "int8"
            tl_cfg = kmm._pick_config(kmm.CONFIGS, m, n, k, sets[0][0].device, None, None, flavor, True, False)
            contenders = {"dispatch": ours(None), "tl": ours(tl_cfg)}
            for g in GROUPS:
                contenders[f"ws g{g}"] = ours(kmm.WsConfig(128, 256, 4, g))
            for st, g, name in PP_NAMES:
                contenders[name] = ours(kmm.WsConfig(128, 128, st, g, pingpong=True))
            contenders["peer"] = torch_scaled_mm_rowwise_fast if dtype == "fp8" else torch_int_mm_unfused

            ref = contenders["dispatch"](*sets[0]).float()
            row = dict(dtype=dtype, M=m, K=k, N=n)
            for name in list(contenders):
                if name in ("dispatch", "peer"):
                    continue
                try:
                    got = contenders[name](*sets[0]).float()
                    torch.cuda.synchronize()
                except Exception as err:  # noqa: BLE001 -- e.g. out of shared memory
                    print(f"{dtype} {m}x{k}x{n} {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                    del contenders[name]
                    continue
                row[f"{name}_maxdiff"] = (got - ref).abs().max().item() / ref.abs().max().item()
            times = {name: [] for name in contenders}
            names = list(contenders)
            for r in range(ROUNDS):
                # each round starts one contender later: a timing follows the previous one's power draw (the clocks
                # settle over ~1 s, a timing lasts ~50 ms: the same kernel read up to 8% slower right after
                # torch._scaled_mm), so every contender takes every place in the order once in len(names) rounds
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(time_ms(contenders[name], sets, graph=True, warmup=10, rep=40) * 1e3)
            for name in contenders:
                row[f"{name}_us"] = round(statistics.median(times[name]), 2)
            for name in contenders:
                if name != "peer":
                    row[f"{name}_vs_peer"] = round(row["peer_us"] / row[f"{name}_us"], 4)
                if name not in ("dispatch", "peer"):
                    per_round = [d / w for d, w in zip(times["dispatch"], times[name])]
                    row[f"{name}_over_dispatch"] = round(row["dispatch_us"] / row[f"{name}_us"], 4)
                    row[f"{name}_rounds"] = " ".join(f"{r:.3f}" for r in per_round)
            rows.append(row)
            print({key: v for key, v in row.items() if not key.endswith("rounds")},
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            sets.clear()
            torch.cuda.empty_cache()

    names = ["tl"] + [f"ws g{g}" for g in GROUPS] + [name for _, _, name in PP_NAMES]
    columns = ["dtype", "M", "K", "N", "dispatch_us"] + [f"{c}_us" for c in names] + ["peer_us", "dispatch_vs_peer"]
    columns += [f"{c}_vs_peer" for c in names] + [f"{c}_over_dispatch" for c in names]
    columns += [f"{c}_rounds" for c in names] + [f"{c}_maxdiff" for c in names]
    finish(os.environ.get("TUNE_OUT_NAME", "tune_scaled_mm_ws_dispatch"),
           "rowwise scaled_mm at prefill sizes: dispatch vs the Gluon ws kernels (cooperative, ping-pong) (dev)",
           rows, columns,
           f"H100 A/B, {ROUNDS} alternated rounds per shape (dispatch, tl, ws candidates, the peer; each round starts "
           "one contender later), medians. 'dispatch' = "
           "qf.scaled_mm as shipped, 'tl' = the tile the table picks without the Gluon kernels, "
           "'ws gG' = WsConfig(128, 256, 4, G) (cooperative: two consumers split each 128x256 tile), 'pp sS' = "
           "WsConfig(128, 128, S, 8, pingpong=True) (each consumer takes every other 128x128 tile whole). Peer: fp8 "
           "torch._scaled_mm (use_fast_accum=True), int8 torch._int_mm + the two-kernel epilogue. *_over_dispatch > 1: "
           "faster than shipped; *_vs_peer > 1: faster than torch; *_maxdiff: max |x - dispatch| / max |dispatch|. "
           "Per-token x per-channel scales + bf16 bias, bf16 out, CUDA graphs, inputs rotated past L2.")


if __name__ == "__main__":
    main()
