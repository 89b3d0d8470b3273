"""`launch_kernel` (kernels/_common.py): compiled-kernel launches that skip Triton's per-call binding must run
exactly the binary the JIT would pick, for every specialization Triton makes (pointer alignment, integers
equal to one or divisible by 16, constexprs, launch options), inside CUDA graphs too."""

import pytest
import torch
import triton
import triton.language as tl

from quantfuse.kernels import _common
from quantfuse.kernels._common import launch_kernel

pytestmark = pytest.mark.gpu


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, TWICE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    v = alpha * x.to(tl.float32) + y.to(tl.float32)
    if TWICE:
        v = v * 2.0
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _run(x, y, n, stride, alpha, block=128, twice=False, num_warps=4):
    out = torch.empty(n, dtype=y.dtype, device=y.device)
    launch_kernel(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, stride, alpha, BLOCK=block, TWICE=twice,
                  num_warps=num_warps)
    return out


def _want(x, y, n, stride, alpha, twice=False):
    v = alpha * x[: (n - 1) * stride + 1 : stride].float() + y[:n].float()
    return (v * 2 if twice else v).to(y.dtype)


def test_hits_are_the_jit_kernels_for_every_specialization():
    cache = _common._LAUNCH_CACHES.pop(_axpy_kernel, None)
    base = torch.randn(70000, device="cuda")
    y16 = torch.randn(70000, device="cuda", dtype=torch.float16)
    cases = [
        (base, y16, 4096, 1, 0.5, False),           # aligned, n % 16 == 0, stride == 1
        (base[1:], y16[1:], 4095, 1, -1.5, False),  # unaligned pointers, n odd
        (base, y16, 1, 1, 2.0, False),              # n == 1 (specialized to a constant)
        (base, y16, 1000, 3, 0.25, True),           # stride 3, the other constexpr
        (base, y16, 32, 16, 1.0, False),            # stride divisible by 16
        (base.half(), y16, 999, 2, 3.0, False),     # another pointer dtype
    ]
    for _ in range(3):  # first round compiles (JIT), the next two are cache hits
        for x, y, n, stride, alpha, twice in cases:
            got = _run(x, y, n, stride, alpha, twice=twice)
            torch.testing.assert_close(got, _want(x, y, n, stride, alpha, twice), rtol=1e-3, atol=1e-3)
    entries = _common._LAUNCH_CACHES[_axpy_kernel].entries
    assert len(entries) == len(cases)
    # each entry's binary is the one the JIT itself returns for those arguments
    for (x, y, n, stride, alpha, twice), (key, (kernel, _)) in zip(cases, entries.items()):
        out = torch.empty(n, dtype=y.dtype, device="cuda")
        jit = _axpy_kernel[(1,)](x, y, out, n, stride, alpha, BLOCK=128, TWICE=twice, num_warps=4)
        assert jit is kernel
    if cache is not None:
        _common._LAUNCH_CACHES[_axpy_kernel] = cache


def test_launch_options_key_separately():
    x, y = torch.randn(5000, device="cuda"), torch.randn(5000, device="cuda")
    for warps in (1, 4, 8, 4, 1):
        torch.testing.assert_close(_run(x, y, 5000, 1, 0.5, num_warps=warps), _want(x, y, 5000, 1, 0.5))
    kernels = {k[1]: v[0] for k, v in _common._LAUNCH_CACHES[_axpy_kernel].entries.items()}
    warps = {kern.metadata.num_warps for kern in kernels.values()}
    assert {1, 4, 8} <= warps


def test_graph_capture_and_replay_through_hits():
    x, y = torch.randn(3000, device="cuda"), torch.randn(3000, device="cuda")
    _run(x, y, 3000, 1, 1.0)  # compiled, cached
    out = torch.empty(3000, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch_kernel(_axpy_kernel, (triton.cdiv(3000, 128),), x, y, out, 3000, 1, 1.0, BLOCK=128, TWICE=False,
                      num_warps=4)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _want(x, y, 3000, 1, 1.0))


def test_a_launch_hook_takes_the_jit_path():
    from triton import knobs

    x, y = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    _run(x, y, 256, 1, 1.0)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton >= 3.5: a chain of hooks
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        _run(x, y, 256, 1, 1.0)
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1
    assert not _common._HOOKS_SET()


def _gluon_launches():
    """(label, call) for launchers that hand Gluon tensor descriptors to their kernels, where this GPU runs them."""
    import quantfuse as qf
    from quantfuse.kernels import gemv_tma, weight_only, weight_only_ws

    calls = []
    x1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    q8 = qf.quantize_weight(torch.randn(4096, 4096, device="cuda"), bits=8, group_size=-1)
    if gemv_tma.applies(x1, q8.qweight, q8.scales, 8, -1, 4096):
        calls.append(("gemv_tma int8 M=1", lambda: weight_only.gemv_tma_mm(x1, q8.qweight, q8.scales, None, None, 8,
                                                                            -1, 4096)))
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    q4 = qf.quantize_weight(torch.randn(4096, 4096, device="cuda"), bits=4, group_size=128)
    if weight_only_ws.applies(x, q4.qweight, q4.scales, 4, 128, None):
        calls.append(("weight_only_ws int4 M=1024", lambda: weight_only_ws.ws_w4_mm(x, q4.qweight, q4.scales, None,
                                                                                     None, 128, 4096)))
    assert calls, "no Gluon descriptor launcher applies on this GPU"
    return calls


def test_gluon_descriptor_launches_hit_the_cache(monkeypatch):
    # Gluon's TensorDescriptor is keyed too (dtype, block, layout): the second call of an op whose kernel takes
    # descriptors launches the compiled kernel directly (no JIT binding), with the same output, in graphs too
    for label, call in _gluon_launches():
        first = call()
        misses = []
        real_miss = _common._LaunchCache.miss
        counting = lambda self, *a: misses.append(self.fn) or real_miss(self, *a)  # noqa: E731
        monkeypatch.setattr(_common._LaunchCache, "miss", counting)
        again = call()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = call()
        g.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(_common._LaunchCache, "miss", real_miss)
        assert not misses, f"{label}: JIT path taken for {misses}"
        assert torch.equal(again, first) and torch.equal(captured, first), label
