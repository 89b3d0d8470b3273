"""A/B of the evict-first L2 hint on the decode kernels' weight loads (issues 3 and 5: decode lines at M <= 16).

At M <= 16 every weight byte is read once; bench_read_floor.py (stop 58) found its pure-read kernels 2-3% faster
with `eviction_policy="evict_first"` on buffers of 13-117 MB. This script times, in one run on the device and
alternating the variants round by round, each decode kernel with and without the hint, same config otherwise:

W4A16 g128 (float32 scales, bf16 x) at M = 1 and 16: `weight_only.gemv_mma_mm` with the pick's MmaDecodeConfig
hint-free ("shipped" in the result files, which predate the hint's table rule) vs the same with evict_first=True.
The hinted output must equal the hint-free one bit for bit (the hint changes no arithmetic).

The first run (results/tune_evict_first.json) also timed FP8 and INT8 rowwise decode (`scaled_mm` at M = 1 / 16:
the shipped tile, that tile with pointer loads, and with the hint on them, through an EVICT_B flag in a scratch
version of kernels/scaled_mm.py): the hint moved nothing (0.997-1.005x the pointer tile), and the flag was not
kept (Triton 3.6's tensor-descriptor loads, the M = 1 pick, take no cache hint; nor do the cp.async copies of the
pipelined W8A16 decode kernel, so neither got one).
CUDA graphs over a rotation of weights past L2 (common.graph_us); ROUNDS (default 3) alternated rounds, the median
per variant. Env: TUNE_KN ("K:N,..."), TUNE_M ("1,16"), ROUNDS, TUNE_OUT_NAME.
Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_evict_first.py
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_weight_only import clone_qw, qw_bytes  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import gemv_mma as gm  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

BF16 = torch.bfloat16
LLAMA_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
COLUMNS = ["line", "K", "N", "M", "variant", "config", "us", "us_min", "us_max", "vs_first", "peer", "peer_us",
           "vs_peer", "frac_copy_bw"]


def _kn():
    spec = os.environ.get("TUNE_KN", "")
    return [tuple(int(v) for v in s.split(":")) for s in spec.split(",") if s] or LLAMA_KN


def _rounds(variants, sets, rounds):
    """{label: [us per round]}, the variants timed in alternation."""
    times = {label: [] for label, _ in variants}
    for _ in range(rounds):
        for label, fn in variants:
            times[label].append(common.graph_us(fn, sets))
    return times


def w4_rows(rows, kns, ms, rounds, bw):
    dev = torch.device("cuda")
    for k, n in kns:
        qw = qf.quantize_weight(torch.randn(n, k, device=dev), bits=4, group_size=128, scale_dtype=torch.float32)
        nbytes = qw_bytes(qw)
        sets = [(q,) for q in [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]]
        w_hat = qw.dequantize(BF16)
        w_sets = [(w,) for w in [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=BF16)
            shipped = dataclasses.replace(gm.auto_config(x, n), evict_first=False)
            cfgs = {"shipped": shipped, "evict_first": dataclasses.replace(shipped, evict_first=True)}
            variants = [(label, lambda q, cfg=cfg: kw.gemv_mma_mm(x, q.qweight, q.scales, q.zeros, None,
                                                                   q.group_size, n, config=cfg))
                        for label, cfg in cfgs.items()]
            assert torch.equal(variants[0][1](qw), variants[1][1](qw)), \
                f"W4A16 {k}x{n} M={m}: the evict-first output differs"
            times = _rounds(variants, sets, rounds)
            peer_us = common.graph_us(lambda w: F.linear(x, w), w_sets)
            first = statistics.median(times["shipped"])
            for label, cfg in cfgs.items():
                us = statistics.median(times[label])
                rows.append(dict(line="W4A16 g128", K=k, N=n, M=m, variant=label, config=str(cfg), us=us,
                                 us_min=min(times[label]), us_max=max(times[label]), vs_first=first / us,
                                 peer="bf16 F.linear", peer_us=peer_us, vs_peer=peer_us / us,
                                 frac_copy_bw=nbytes / (us * 1e-6) / 1e9 / bw))
                common.print_row(rows[-1])
        del sets, w_sets
        torch.cuda.empty_cache()


def main():
    torch.manual_seed(0)
    start = time.time()
    bw = common.copy_bandwidth_gbs()
    kns = _kn()
    ms = [int(v) for v in os.environ.get("TUNE_M", "1,16").split(",") if v]
    rounds = int(os.environ.get("ROUNDS", "3"))
    rows = []
    w4_rows(rows, kns, ms, rounds, bw)
    notes = (f"copy bandwidth {bw:.0f} GB/s in this run; CUDA graphs, weights rotated past L2; us = median of {rounds} "
             f"alternated rounds (us_min / us_max their range); vs_first = the first variant's us / this one's. "
             f"Outputs with and without the hint equal bit for bit (asserted). total {time.time() - start:.0f} s")
    common.finish(os.environ.get("TUNE_OUT_NAME", "tune_evict_first"),
                  "Decode kernels: evict-first L2 hint on the weight loads vs none (A/B, same run)", rows, COLUMNS,
                  notes)


if __name__ == "__main__":
    main()
