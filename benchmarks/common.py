"""Benchmark plumbing shared by every bench_*.py: timing, L2 rotation, ceilings and the result files.

Timing: `triton.testing.do_bench` medians. Inputs rotate through enough copies to exceed L2 (50 MB on
H100) several times over, so a kernel never reads warm cache. With `graph=True` one CUDA graph replays
the whole rotation and the time is divided by the number of calls (launch overhead excluded, as in a
graph-captured serving engine).

Result files: `write_result(name, title, rows, ...)` writes `$OUT/<name>.json` on the device machine
(or `benchmarks/results/<name>.json` locally) with the device, versions and date; `report.py` turns all of
them into BENCHMARKS.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

L2_ROTATE_BYTES = 256 * 1024 * 1024  # rotate through at least this many bytes of inputs
# Idle before a timing (BENCH_SETTLE_S): the GPU's clocks follow the previous kernel's power draw for ~1 s while a
# timing lasts ~0.1 s, so back to back each timing inherits its predecessor's state (the same Gluon kernel read up
# to 9% slower right after torch._scaled_mm than after another of ours: results/tune_scaled_mm_ws_dispatch_rot.json)
SETTLE_S = float(os.environ.get("BENCH_SETTLE_S", "0.3"))


# Llama-3.2-1B and -3B linear shapes (K, N): q|k|v, o, gate|up, down of each
SMALL_MODEL_KN = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048),
                  (3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072)]


def shapes_from_env(default):
    """BENCH_KN: "small" (SMALL_MODEL_KN) or "K:N,K:N,..."; unset: `default`."""
    spec = os.environ.get("BENCH_KN", "")
    if not spec:
        return list(default)
    if spec == "small":
        return list(SMALL_MODEL_KN)
    return [tuple(int(v) for v in item.split(":")) for item in spec.split(",") if item]


def shapes_title(kn) -> str:
    """What a result title adds for the BENCH_KN shapes ("" without BENCH_KN)."""
    spec = os.environ.get("BENCH_KN", "")
    if not spec:
        return ""
    return ", Llama-3.2-1B / 3B shapes" if spec == "small" else f", shapes {list(kn)}"


def env_info() -> Dict[str, object]:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
    else:
        info["device"] = "cpu"
    return info


def rotation_count(bytes_per_call: int, minimum: int = 2, maximum: int = 64) -> int:
    """How many distinct input sets to cycle through so the working set exceeds L2 several times."""
    n = -(-L2_ROTATE_BYTES // max(1, bytes_per_call))
    return int(max(minimum, min(maximum, n)))


def time_ms(
    fn: Callable[..., object],
    input_sets: Sequence[Sequence[object]],
    graph: bool = False,
    warmup: int = 25,
    rep: int = 100,
) -> float:
    """Median milliseconds of one call fn(*inputs), cycling through input_sets."""
    import triton

    n = len(input_sets)
    if graph:
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for args in input_sets:  # warm up: compile and autotune outside the capture
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for args in input_sets:
                fn(*args)
        torch.cuda.synchronize()
        return triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / n

    state = {"i": 0}

    def step():
        args = input_sets[state["i"] % n]
        state["i"] += 1
        fn(*args)

    for _ in range(n):  # compile everything before timing
        step()
    return triton.testing.do_bench(step, warmup=warmup, rep=rep, return_mode="median")


def settle() -> None:
    """Idle SETTLE_S seconds (see SETTLE_S) so the next timing starts from the GPU's idle clocks."""
    import time

    time.sleep(SETTLE_S)


def graph_us(fn: Callable, arg_sets: Sequence, warmup: int = 10, rep: int = 50) -> float:
    """`time_ms` under a CUDA graph, in microseconds (the tuners' decode timings)."""
    return time_ms(fn, arg_sets, graph=True, warmup=warmup, rep=rep) * 1e3


def mean_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """mean |a - b| / mean |b| in float32 (b the reference)."""
    return float((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp_min(1e-30))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bf16_matmul_tflops(n: int = 8192) -> float:
    """Measured dense bf16 ceiling (torch.matmul on random data)."""
    import triton

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def results_dir() -> str:
    out = os.environ.get("OUT")
    path = out if out else os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(path, exist_ok=True)
    return path


def write_result(
    name: str,
    title: str,
    rows: List[Dict[str, object]],
    columns: Optional[List[str]] = None,
    notes: str = "",
    extra: Optional[Dict[str, object]] = None,
) -> str:
    """Write one benchmark's rows (list of flat dicts) with the environment; returns the path."""
    record = {
        "name": name,
        "title": title,
        "env": env_info(),
        "columns": columns or (list(rows[0].keys()) if rows else []),
        "rows": rows,
        "notes": notes,
    }
    if extra:
        record.update(extra)
    path = os.path.join(results_dir(), f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def finish(name: str, title: str, rows: List[Dict[str, object]], columns: List[str], notes: str,
           extra: Optional[Dict[str, object]] = None) -> str:
    """The end of a sweep: every row gets every column ("n/a" where it has none), the result file is written,
    the table, the notes and the path are printed; returns the path."""
    for r in rows:
        for c in columns:
            r.setdefault(c, "n/a")
    path = write_result(name, title, rows, columns=columns, notes=notes, extra=extra)
    print()
    print_table(rows, columns)
    print(notes)
    print("wrote", path)
    return path


def print_row(row: Dict[str, object]) -> None:
    """One sweep row as it is measured, floats to four places (progress output of the tuners)."""
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def print_table(rows: List[Dict[str, object]], columns: Optional[List[str]] = None) -> None:
    if not rows:
        return
    columns = columns or list(rows[0].keys())

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


# the weight-only kernels' arguments their launcher sees as multiples of 16 (pointers, sizes, strides)
WEIGHT_ONLY_DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr", "N",
                         "K", "num_groups", "group_size", "stride_xm", "stride_wn", "stride_om")


def compile_sm90(fn, constexprs: Dict[str, object], types: Dict[str, str], num_warps: int, num_stages: int,
                 divisible: Optional[Sequence[str]] = None):
    """Compile a @triton.jit kernel for sm90 without a GPU (Triton's bundled ptxas; tests/_util.tl_sm90_build, the
    one copy of the Triton internals this needs) and return the compiled kernel (.asm["ptx" | "cubin"], .metadata).

    constexprs: values by argument name (names the kernel lacks are ignored; a constexpr left out takes its default);
    types: Triton types of the other arguments ("*bf16", "fp32", ...), "i32" where not named; divisible: the
    arguments specialized as multiples of 16, as the launcher would see them (default: every pointer and i32
    argument)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # tests/ lives beside benchmarks/
        sys.path.insert(0, root)
    from tests._util import tl_sm90_build

    names = fn.arg_names
    consts = {a: v for a, v in constexprs.items() if a in names}
    args = {a: t for a, t in types.items() if a in names and a not in consts}
    wanted = None if divisible is None else set(divisible)
    return tl_sm90_build(fn, args, consts,
                         lambda name, typ: name in wanted if wanted is not None else typ == "i32" or typ.startswith("*"),
                         num_warps=num_warps, num_stages=num_stages)


def cubin_resources(cubin: bytes) -> Dict[str, int]:
    """REG (registers per thread), STACK, LOCAL (spills) and SHARED bytes of a compiled kernel's cubin, from
    Triton's bundled `cuobjdump --dump-resource-usage` ({} if it cannot run)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.check_output([tool, "--dump-resource-usage", f.name], text=True)
        except Exception:  # noqa: BLE001
            return {}
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text)}
