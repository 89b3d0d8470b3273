"""Assertions and helpers shared by the tests."""

import os
import subprocess
import sys

import torch

# Offline sm90 builds run in a fresh process without the interpreter: the Triton interpreter can leave
# triton.language patched after a test ran `tl` code in this process (after tests/test_encoder.py a Gluon build
# that missed Triton's disk cache failed with "'block_argument' object has no attribute 'dtype'" in tl.cdiv).
_FRESH_BUILD = """
import importlib, sys
module = importlib.import_module(sys.argv[1])
kernel = eval(sys.argv[2], vars(module))
with open(sys.argv[3], "wb") as f:
    f.write(kernel.asm["cubin"])
"""


def build_cubin_in_fresh_process(module: str, expression: str, path: str) -> None:
    """Evaluate `expression` (a compiled kernel) in `module`'s namespace in a new Python process with
    TRITON_INTERPRET=0 and write the kernel's cubin to `path`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _FRESH_BUILD, module, expression, path], cwd=root, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"sm90 build of {module}: {expression} failed:\n{done.stderr[-3000:]}"


def gluon_sm90_build(fn, args, consts, divisible=lambda name, typ: False, **options):
    """The Gluon kernel `fn` compiled for sm90 by this Triton (Triton internals: GluonASTSource, mangle_type,
    GPUTarget). args: argument name -> a type string ("*bf16") or a value typed as the launcher would (tensor,
    descriptor); every other non-constexpr argument is an i32. consts: the constexprs; one the kernel declares with
    a default and `consts` leaves out takes that default (left out of the signature it would silently become a
    runtime i32, compiling both sides of every branch on it). divisible(name, type): the arguments specialized as
    multiples of 16, as the launcher sees them at aligned shapes. options: compile options (num_warps, maxnreg)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return _sm90_build(GluonASTSource, fn, args, consts, divisible, options)


def tl_sm90_build(fn, args, consts, divisible=lambda name, typ: False, **options):
    """`gluon_sm90_build` for a @triton.jit (`tl`) kernel (Triton internals: ASTSource); options: num_warps,
    num_stages."""
    from triton.compiler import ASTSource

    return _sm90_build(ASTSource, fn, args, consts, divisible, options)


def _sm90_build(source, fn, args, consts, divisible, options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    consts = dict(consts)
    for p in fn.params:
        if p.is_constexpr and p.name not in consts:
            assert p.has_default, f"{fn.__name__}: constexpr {p.name} needs a value"
            consts[p.name] = p.default
    names = fn.arg_names
    sig = {}
    for a in names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in args:
            sig[a] = args[a] if isinstance(args[a], str) else mangle_type(args[a])
        else:
            sig[a] = "i32"
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if sig[a] != "constexpr" and divisible(a, sig[a])}
    src = source(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loads_behind_barriers(sass: str) -> list:
    """The global loads (LDG) of an sm90 SASS listing that wait behind a CTA barrier (BAR.SYNC) which follows an
    earlier load of the same stretch of code between tensor-core, copy-engine or store instructions (an epilogue):
    in a `tl` kernel each vector loaded for the accumulator's layout crosses shared memory between two barriers,
    so a load written after another one's use is issued only once that exchange is done, and their latencies add
    up."""
    import re

    late, seen = [], []
    for line in sass.splitlines():
        if re.search(r"\b(IGMMA|HGMMA|QGMMA|STG|UTMASTG|UTMALDG)\.|\bEXIT\b", line):
            seen = []
        elif re.search(r"\bLDG\.E\b", line):
            if "BAR" in seen:
                late.append(line.strip())
            seen.append("LDG")
        elif "BAR.SYNC" in line and seen:
            seen.append("BAR")
    return late


def sm90_sass(tmp_path, module: str, expression: str):
    """(SASS, resource usage) of `expression` (a compiled kernel in `module`'s namespace) built for sm90 in a fresh
    process and disassembled by the cuobjdump bundled with Triton; the calling test is skipped where the wheel has
    none."""
    import pytest
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("this Triton wheel bundles no cuobjdump")
    path = str(tmp_path / "kernel.cubin")
    build_cubin_in_fresh_process(module, expression, path)
    return (subprocess.check_output([cuobjdump, "-sass", path], text=True),
            subprocess.check_output([cuobjdump, "--dump-resource-usage", path], text=True))


def codes(q: torch.Tensor) -> torch.Tensor:
    """Integer view of int8 / fp8 codes, for exact comparisons (fp8 NaN != NaN otherwise). fp8 -0 (0x80)
    reads as +0: the same value, and a product rounding to zero may carry either sign (hardware and
    reference differ there for y = silu(gate) * up underflowing)."""
    if q.dtype != torch.float8_e4m3fn:
        return q.to(torch.int32)
    c = q.view(torch.uint8).to(torch.int32)
    return torch.where(c == 0x80, torch.zeros_like(c), c)


def assert_codes_equal(actual: torch.Tensor, expected: torch.Tensor, tie_rate: float = 0.0) -> None:
    """Exact equality of quantized codes; with tie_rate > 0, a mismatch rate below it is allowed and no
    mismatch may exceed one code step (SPEC section 0, rounding ties)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    a, e = codes(actual), codes(expected)
    diff = (a - e).abs()
    if tie_rate == 0.0:
        bad = int((diff != 0).sum())
        assert bad == 0, f"{bad} of {diff.numel()} codes differ; first at {torch.nonzero(diff)[:5].tolist()}"
        return
    assert int(diff.max()) <= 1, f"a code differs by {int(diff.max())} steps"
    rate = float((diff != 0).float().mean())
    assert rate < tie_rate, f"mismatch rate {rate} >= {tie_rate}"


class KernelSpy:
    """Wraps a Triton kernel: records the keyword arguments (constexprs), the positional arguments ("args")
    and the grid of every launch, then launches it. Install with
    monkeypatch.setattr(module, "_kernel", KernelSpy(module._kernel))."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(dict(kwargs, grid=grid, args=args))
            return self.fn[grid](*args, **kwargs)

        return launch
