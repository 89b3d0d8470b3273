"""`quantfuse check`: run every op's kernel against the reference on this machine and print a table.

On a GPU the Triton kernels run natively. Without one, the check re-runs itself with TRITON_INTERPRET=1
so the same kernels execute under Triton's interpreter on CPU tensors (slower, small shapes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


@dataclass
class CheckResult:
    op: str
    case: str
    ok: bool
    detail: str
    ms: float


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).int() if q.dtype == torch.float8_e4m3fn else q.int()


def _exact(got, want) -> str:
    """'' if every tensor pair is bit-equal, else a description of the first difference."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:
            continue
        if g.dtype in (torch.int8, torch.float8_e4m3fn):
            diff = (_codes(g) - _codes(w)).abs()
            if diff.any():
                return f"output {i}: {int((diff > 0).sum())} codes differ (max {int(diff.max())})"
        elif not torch.equal(g, w):
            return f"output {i}: max |diff| {float((g.float() - w.float()).abs().max()):.3g}"
    return ""


def _quantize_cases(device: str, big: bool) -> List[tuple]:
    import quantfuse as qf
    from quantfuse import reference as ref

    m, k = (4096, 4096) if big else (33, 1025)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16) * 3
    xg = x[:, : (k // 128) * 128]
    i8, f8 = torch.int8, torch.float8_e4m3fn
    cases = []
    for name, dt in (("int8", i8), ("fp8", f8)):
        cases += [
            ("quantize_per_tensor", f"dynamic {name} {m}x{k}",
             lambda dt=dt: (qf.quantize_per_tensor(x, dt), ref.quantize_per_tensor(x, dt))),
            ("quantize_per_token", f"{name} {m}x{k}",
             lambda dt=dt: (qf.quantize_per_token(x, dt), ref.quantize_per_token(x, dt))),
            (
                "quantize_per_group",
                f"{name} g128 transposed {m}x{xg.shape[1]}",
                lambda dt=dt: (
                    qf.quantize_per_group(xg, dt, 128, transposed_scales=True),
                    ref.quantize_per_group(xg, dt, 128, transposed_scales=True),
                ),
            ),
        ]
    cases.append(
        ("quantize_per_token", f"int8 asymmetric {m}x{k}",
         lambda: (qf.quantize_per_token(x, i8, symmetric=False), ref.quantize_per_token(x, i8, symmetric=False)))
    )
    q, s, z = ref.quantize_per_token(x, i8, symmetric=False)
    cases.append(
        ("dequantize", f"int8 asymmetric -> bf16 {m}x{k}",
         lambda: ((qf.dequantize(q, s, z, out_dtype=torch.bfloat16),),
                  (ref.dequantize(q, s, z, out_dtype=torch.bfloat16),)))
    )
    return cases


# Further op families register their checks here: name -> fn(device, big) -> [(op, case, thunk)].
CHECKS: List[Callable[[str, bool], List[tuple]]] = [_quantize_cases]


def _run(device: str) -> List[CheckResult]:
    from quantfuse import ops

    big = device == "cuda"
    results = []
    with ops.backend("triton"):
        for make in CHECKS:
            for op, case, thunk in make(device, big):
                t0 = time.perf_counter()
                try:
                    got, want = thunk()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    detail = _exact(got, want)
                    ok = detail == ""
                except Exception as exc:  # report, do not stop the table
                    ok, detail = False, f"{type(exc).__name__}: {exc}"[:120]
                results.append(CheckResult(op, case, ok, detail or "bit-exact", (time.perf_counter() - t0) * 1e3))
    return results


def _print(results: List[CheckResult], device: str, mode: str) -> None:
    w_op = max(len(r.op) for r in results)
    w_case = max(len(r.case) for r in results)
    print(f"quantfuse check on {device} ({mode})")
    print(f"{'op'.ljust(w_op)}  {'case'.ljust(w_case)}  result  detail")
    for r in results:
        print(f"{r.op.ljust(w_op)}  {r.case.ljust(w_case)}  {'PASS' if r.ok else 'FAIL'}    {r.detail}")
    passed = sum(r.ok for r in results)
    print(f"{passed} passed, {len(results) - passed} failed")


def run_check(device: str = "auto") -> int:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("quantfuse check: --device cuda asked for, but no CUDA device is visible", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET at import: run the check in a child process that sets it first.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "quantfuse.check", "--device", "cpu"], env=env)
    mode = "Triton kernels, native" if device == "cuda" else "Triton kernels under the interpreter"
    results = _run(device)
    _print(results, device, mode)
    return 0 if all(r.ok for r in results) else 1


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m quantfuse.check")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return run_check(parser.parse_args(argv).device)


if __name__ == "__main__":
    sys.exit(main())
