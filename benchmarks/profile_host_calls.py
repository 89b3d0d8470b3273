"""Host microseconds per eager call of the public ops against torch's own (a dev tool).

Each op runs 5 batches of 50 calls without synchronizing; the best batch is its enqueue cost (the GPU keeps
the queue short at these Llama-sized operands). Arguments: op names to cProfile afterwards. To compare two
source trees, run it alternately with PYTHONPATH=<tree>/src (results/host_calls_ab.txt).
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import quantfuse as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
M, K, N = (2048, 4096, 4096) if DEV == "cuda" else (16, 256, 256)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def build_ops():
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    wq8 = torch.randint(-127, 127, (N, K), device=DEV, dtype=torch.int8)
    wf8 = torch.randn(N, K, device=DEV).to(torch.float8_e4m3fn)
    sw = torch.rand(N, 1, device=DEV) + 0.5
    q8, s8, _ = qf.quantize_per_token(x, torch.int8)
    qf8, sf8, _ = qf.quantize_per_token(x, torch.float8_e4m3fn)
    gate_up = torch.randn(M, 2 * 3584, device=DEV, dtype=torch.bfloat16)
    qw = qf.quantize_weight(w.float(), bits=4, group_size=128)
    qw8 = qf.quantize_weight(w.float(), bits=8, group_size=-1)
    x1 = x[:1].clone()
    qg, sg, _ = qf.quantize_per_group(x, torch.float8_e4m3fn, group_size=128)
    sb = torch.rand(K // 128, N // 128, device=DEV) + 0.5
    return {
        "F.linear": lambda: F.linear(x, w),
        "torch._scaled_mm fp8": lambda: torch._scaled_mm(qf8, wf8.t(), scale_a=sf8.reshape(-1, 1),
                                                         scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16),
        "torch._int_mm": lambda: torch._int_mm(q8, wq8.t()),
        "quantize_per_token int8": lambda: qf.quantize_per_token(x, torch.int8),
        "scaled_mm int8": lambda: qf.scaled_mm(q8, wq8.t(), s8, sw, torch.bfloat16),
        "scaled_mm int8 M=1": lambda: qf.scaled_mm(q8[:1], wq8.t(), s8[:1], sw, torch.bfloat16),
        "scaled_mm fp8": lambda: qf.scaled_mm(qf8, wf8.t(), sf8, sw, torch.bfloat16),
        "silu_and_mul_quant int8": lambda: qf.silu_and_mul_quant(gate_up, torch.int8),
        "weight_only_mm M=1": lambda: qf.weight_only_mm(x1, qw),
        "weight_only_mm M=512": lambda: qf.weight_only_mm(x[:512], qw),
        "weight_only_mm M=2048": lambda: qf.weight_only_mm(x, qw),
        "weight_only_mm int8 M=1": lambda: qf.weight_only_mm(x1, qw8),
        "scaled_mm_blockwise fp8": lambda: qf.scaled_mm_blockwise(qg, wf8.t(), sg, sb, torch.bfloat16),
    }


def host_us(fn, calls=50, batches=5):
    for _ in range(5):
        fn()
    times = []
    for _ in range(batches):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    _sync()
    return min(times), sorted(times)[batches // 2]


def main(profile_names):
    ops = build_ops()
    for name, fn in ops.items():
        best, median = host_us(fn)
        print(f"{name:28s} host {best:8.1f} us/call (best of 5 batches), median {median:8.1f}", flush=True)
    for name in profile_names:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            ops[name]()
        prof.disable()
        _sync()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(30)
        print("=====", name)
        print(text.getvalue())


if __name__ == "__main__":
    main(sys.argv[1:])
