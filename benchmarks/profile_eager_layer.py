"""Why eager prefill is slower than the graphed layer (a dev tool, not part of the suite).

For the Llama-3-8B-shaped layer of bench_model_layer.py at PROFILE_TOKENS tokens (default 2048), per scheme:
host microseconds per layer call with the GPU left running (the launch cost a plain PyTorch caller pays),
the eager and graphed GPU medians, and from torch.profiler the CUDA runtime calls that can stall the host
(synchronizations, copies, allocations) with their counts and host time, and a cProfile of ten calls
(PROFILE_CPROFILE=0 skips it). A sync in the per-call path shows
up as eager time ~ graphed time + host time."""

from __future__ import annotations

import copy
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model_layer import SCHEMES, build_layer, calibration_batches, layer_fn  # noqa: E402
from common import time_ms  # noqa: E402

import quantfuse as qf  # noqa: E402

WATCH = ("Synchronize", "Memcpy", "Malloc", "Free", "Memset", "EventQuery", "StreamWait", "LaunchKernel",
         "cuLaunch", "aten::item", "aten::_local_scalar_dense", "aten::copy_", "aten::to")


def host_us(fn, inputs, n=20):
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(*inputs[i % len(inputs)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    tokens = int(os.environ.get("PROFILE_TOKENS", "2048"))
    names = os.environ.get("PROFILE_SCHEMES", "int8_dynamic,fp8_dynamic,int4_weight_only").split(",")
    base, rope = build_layer()
    layers = {"bf16": base}
    for name in names:
        q = copy.deepcopy(base)
        config = SCHEMES[name]()
        qf.quantize_(q, config, calibration_data=calibration_batches(rope) if config.needs_calibration else None,
                     progress=False)
        layers[name] = q
    inputs = [(torch.randn(1, tokens, base.self_attn.q_proj.in_features, device="cuda", dtype=torch.bfloat16),
               torch.arange(tokens, device="cuda").unsqueeze(0)) for _ in range(2)]
    for name, layer in layers.items():
        fn = layer_fn(layer, rope)
        with torch.no_grad():
            h = host_us(fn, inputs)
            eager = time_ms(fn, inputs) * 1e3
            graphed = time_ms(fn, inputs, graph=True) * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(*inputs[0])
                torch.cuda.synchronize()
        print(f"=== {name}: host {h:.0f} us/call, eager GPU {eager:.0f} us, graphed {graphed:.0f} us", flush=True)
        for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total):
            if any(w in ev.key for w in WATCH):
                print(f"  {ev.key[:60]:60s} count {ev.count // 3:5d}/call  host {ev.self_cpu_time_total / 3:9.0f} us/call")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        if name != "bf16" and os.environ.get("PROFILE_CPROFILE", "1") == "1":
            pr = cProfile.Profile()
            with torch.no_grad():
                pr.enable()
                for _ in range(10):
                    fn(*inputs[0])
                pr.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(pr)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats("quantfuse", 30)


if __name__ == "__main__":
    main()
