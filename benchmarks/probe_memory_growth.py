"""Does GPU memory stay allocated across many op calls (a leak in a cache)? A dev probe: runs the fuzz cases of
tests/gpu/test_fuzz_gpu.py one after another in one process (PROBE_CASES per op, default 150) and prints
torch.cuda.memory_allocated() after each op's cases (gc + empty_cache), against the value before any."""

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.gpu import test_fuzz_gpu as fz  # noqa: E402


def allocated():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def main():
    cases = int(os.environ.get("PROBE_CASES", "150"))
    start = allocated()
    print(f"start: {start / 2**20:.1f} MiB allocated", flush=True)
    for name in ("test_fuzz_weight_only_mm", "test_fuzz_scaled_mm", "test_fuzz_scaled_mm_blockwise",
                 "test_fuzz_activation_quantization", "test_fuzz_silu_and_mul_quant"):
        fn = getattr(fz, name)
        failures = 0
        peak = 0
        torch.cuda.reset_peak_memory_stats()
        for seed in range(cases):
            try:
                fn(seed)
            except AssertionError as err:
                failures += 1
                print(f"  {name}[{seed}] assertion: {str(err)[:200]}", flush=True)
            now = torch.cuda.memory_allocated()
            peak = max(peak, now)
            if seed % 50 == 49:
                print(f"  {name} after {seed + 1}: {allocated() / 2**20:.1f} MiB allocated", flush=True)
        print(f"{name}: {cases} cases, {failures} assertion failures, allocated after "
              f"{allocated() / 2**20:.1f} MiB (start {start / 2**20:.1f}), between cases at most "
              f"{peak / 2**30:.2f} GiB, this op's max reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB",
              flush=True)


if __name__ == "__main__":
    main()
