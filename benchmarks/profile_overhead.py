"""Host (CPU) cost of one op call, the number that bounds eager-mode speed (a dev tool): microseconds
per call at M=1 with the GPU idle, and a cProfile of the slowest Python frames."""

import cProfile
import pstats
import time

import torch

import quantfuse as qf
from quantfuse import ops


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-127, 127, (4096, 4096), dtype=torch.int8, device="cuda")
    sw = torch.rand(4096, 1, device="cuda")
    q, s, _ = qf.quantize_per_token(x, torch.int8)
    qw = ops.quantize_weight(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), bits=4, group_size=128)
    lin = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    cases = {
        "F.linear (bf16)": lambda: lin(x),
        "quantize_per_token": lambda: qf.quantize_per_token(x, torch.int8),
        "scaled_mm": lambda: qf.scaled_mm(q, w.t(), s, sw, torch.bfloat16),
        "weight_only_mm": lambda: ops.weight_only_mm(x, qw),
    }
    for name, fn in cases.items():
        print(f"{name:24s} {per_call_us(fn):8.1f} us/call (host)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        qf.quantize_per_token(x, torch.int8)
        qf.scaled_mm(q, w.t(), s, sw, torch.bfloat16)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    pstats.Stats(pr).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
