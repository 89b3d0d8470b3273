"""A/B of the warp-specialized W4A16 prefill kernel (kernels/weight_only_ws.py) against the paths it competes with,
on the GPU (a dev tool, like tune_weight_only.py; not part of the suite).

W4A16 group 128 symmetric, bf16 activations, the five Llama-3 (K, N) at M in WS_MS (default 1024, 1536, 2048,
4096), float32 scales and bfloat16 scales (the packed conversion). Per row, in alternated rounds (WS_ROUNDS, default
2; the minimum of each), CUDA graphs, weights rotated past L2 (common.rotation_count):
- ws_us: ws_w4_mm with the tail plan weight_only_mm would give it (`weight_only_ws.tail_plan`);
- wgmma_us: weight_only_wgmma.wgmma_w4_mm with its own plan (config, split-K, tail split);
- dequant_cublas_us: dequantize once + F.linear;
- ours_us: quantfuse.weight_only_mm (the shipped dispatch; `path` names it);
- bf16_us: F.linear on the dequantized weight.
Writes results/tune_weight_only_ws.json (OUT overrides the folder).

Run on the device:  PYTHONPATH=$PWD/src:$PWD python benchmarks/tune_weight_only_ws.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402
from quantfuse.kernels import weight_only_wgmma as ww  # noqa: E402
from quantfuse.kernels import weight_only_ws as wws  # noqa: E402
from quantfuse.weights import QuantizedWeight  # noqa: E402

BF16 = torch.bfloat16
LLAMA_KN = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
MS = [int(v) for v in os.environ.get("WS_MS", "1024,1536,2048,4096").split(",")]
ROUNDS = int(os.environ.get("WS_ROUNDS", "2"))
COLUMNS = ["scales", "K", "N", "M", "path", "ours_us", "ws_us", "wgmma_us", "dequant_cublas_us", "bf16_us",
           "ws_vs_bf16", "wgmma_vs_bf16", "ours_vs_bf16", "ws_vs_wgmma", "ws_tail"]


def _clone(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.qweight.clone(), qw.scales.clone(), None, qw.bits, qw.group_size, qw.shape, None)


def _path(m, n, k, scale16, sms) -> str:
    if wws.prefer(m, n, k, "sm90", sms):
        return "ws"
    if ww.prefer(m, n, k, "sm90", scale16):
        return "wgmma"
    return "dequant+cublas" if m >= kw._table(torch.device("cuda"))["cublas_min_m"] else "fused"


def main() -> None:
    dev = torch.device("cuda")
    sms = kw._num_sms(dev)
    rows = []
    for sdt in (torch.float32, BF16):
        for k, n in LLAMA_KN:
            qw = qf.quantize_weight(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=128, scale_dtype=sdt)
            wbytes = qw.qweight.numel() * 4 + qw.scales.numel() * qw.scales.element_size()
            qws = [qw] + [_clone(qw) for _ in range(common.rotation_count(wbytes) - 1)]
            w_hat = qw.dequantize(BF16)
            lins = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
            for m in MS:
                x = torch.randn(m, k, device=dev, dtype=BF16)
                tail = wws.tail_plan(m, n, k, "sm90", sms)
                fns = {
                    "ws_us": (lambda x, q: wws.ws_w4_mm(x, q.qweight, q.scales, q.zeros, None, 128, n, tail=tail),
                              [(x, q) for q in qws]),
                    "wgmma_us": (lambda x, q: ww.wgmma_w4_mm(x, q.qweight, q.scales, q.zeros, None, 128, n),
                                 [(x, q) for q in qws]),
                    "dequant_cublas_us": (lambda x, q: F.linear(x, kw.dequantize(q.qweight, q.scales, q.zeros, 4,
                                                                                  128, k, BF16)),
                                          [(x, q) for q in qws]),
                    "ours_us": (lambda x, q: qf.weight_only_mm(x, q), [(x, q) for q in qws]),
                    "bf16_us": (lambda x, w: F.linear(x, w), [(x, w) for w in lins]),
                }
                times = {name: [] for name in fns}
                for r in range(ROUNDS):
                    for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                        fn, sets = fns[name]
                        times[name].append(common.time_ms(fn, sets, graph=True, warmup=10, rep=40) * 1e3)
                row = dict(scales=str(sdt).replace("torch.", ""), K=k, N=n, M=m,
                           path=_path(m, n, k, sdt == BF16, sms), ws_tail="none" if tail is None else
                           f"{tail[1].main_tiles_n}+{tail[1].splits}way")
                row.update({name: min(v) for name, v in times.items()})
                row["ws_vs_bf16"] = row["bf16_us"] / row["ws_us"]
                row["wgmma_vs_bf16"] = row["bf16_us"] / row["wgmma_us"]
                row["ours_vs_bf16"] = row["bf16_us"] / row["ours_us"]
                row["ws_vs_wgmma"] = row["wgmma_us"] / row["ws_us"]
                common.print_row(row)
                rows.append(row)
            del qws, lins, w_hat
            torch.cuda.empty_cache()
    notes = (f"W4A16 g128 sym, bf16 x; CUDA graphs, weights rotated past L2; each time the minimum of {ROUNDS} "
             f"alternated rounds. path: what quantfuse.weight_only_mm runs (ours_us).")
    common.finish("tune_weight_only_ws", "Weight-only INT4 prefill: warp-specialized kernel vs wgmma kernel, "
                  "dequantize + cuBLAS and bf16", rows, COLUMNS, notes)


if __name__ == "__main__":
    main()
