#!/usr/bin/env python3
"""GPU-only-path probe for quantfuse: every case runs a public op on CUDA tensors (the Triton / Gluon kernels) and
compares it with the same op on CPU copies of the same inputs (quantfuse's PyTorch reference), with the
tolerances that SPEC.md / README.md / tests/gpu/*.py state.

Run (H100, torch 2.11, triton 3.6):
    cd <repo> && PYTHONPATH=src python3 benchmarks/probe_gpu_edges.py            # all cases, ~4 min budget
    OUT=/some/dir ...                                                   # also writes $OUT/gpu_probe.json
    ... --only 'wo/'                                                    # regex filter on case names
    ... --budget 400                                                    # seconds before remaining cases are SKIPPED
CPU dry run (interpreter, a handful of small cases, checks the probe's own logic):
    cd <repo> && PYTHONPATH=src TRITON_INTERPRET=1 .venv/bin/python benchmarks/probe_gpu_edges.py --cpu-dry-run
CPU self-test of every case's construction and checks (reference on both sides; slow on a busy machine):
    ... --cpu-selftest

Statuses: PASS, FAIL (bound violated: the worst error / bound ratio is printed), WARN (weight_only_mm only: the stated
bound holds but the error exceeds the probe's own statistical rounding scale, see check_wo), ERROR (unexpected
exception), XERR (an expected ValueError / TypeError for invalid input), SKIP (budget exhausted), FATAL (a sticky
CUDA error: illegal address etc.; the run stops there and names the case).

Tolerances (copied from the repo):
- quantize_* codes: equal except one code at rounding ties, mismatch rate < 1e-4 (SPEC section 0); scales and zero
  points bit for bit (true division on both sides).
- silu_and_mul_quant: codes as above but rate < 1e-3 against the CPU reference (CPU expf vs CUDA libdevice expf: the
  CPU tests' allowance), and rate < 1e-4 against the reference run on the GPU tensors (tests/gpu); scales rtol 1e-5.
- dequantize / QuantizedWeight.dequantize: bit for bit.
- scaled_mm: tests/gpu/test_scaled_mm_gpu.assert_within_bound:
      |out - ref| <= REL |ref| + 2^-20 (|ref - bias| + |bias|) [+ 2^-25 fp16] [+ 2^-10 s_a s_b (|a| @ |b|) fp8]
  REL = 2^-8 bf16, 2^-11 fp16, 2^-22 fp32; zero-point epilogues with unit scales and fp32 out: bit for bit.
- scaled_mm_blockwise: fp32 out mean|err| / mean|ref| < 1e-3 (tests), the 16-bit out within one rounding of the
  fp32 out (tests), plus two localized checks of this probe: per-row and per-column mean relative error < 1e-2, and
  elementwise |err| <= 2^-8 |ref| + 2^-9 (|a| s_a) @ (|b| s_b) + 2^-20 |bias| ("elementwise(heuristic)").
- weight_only_mm: tests/gpu/test_weight_only_gpu.assert_gemm_within_bound:
      |y - x @ w_hat.T - bias| <= REL (|x| @ |w_hat|.T + |bias|) + ABS, REL = 2^-7 + 2^-14 bf16, 2^-10 + 2^-17 fp16,
  ABS = 2^-24 fp16; and against the CPU op's own (rounded) output with one more output rounding allowed.
- NaN / Inf / zero rows: the other rows bit for bit equal to a run without the special row (and within the bound);
  an all-zero row gives exactly the bias.

Run of stop 60 (H100, torch 2.11, Triton 3.6, the source of commit e8a1ff3): 230 PASS, 10 XERR, nothing else, 182 s;
the log is results/probe_gpu_edges.txt. Written by a review helper; kept as a dev tool (not part of the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import re
import sys
import threading
import time
import traceback
import zlib



def group_region_masks(m, width, row, col, group):
    """(element mask [m, width], group-scale mask [m, width / group]) with False on the group of `row` holding
    column `col`: the region a NaN / Inf there may poison."""
    g = col // group
    emask = torch.ones(m, width, dtype=torch.bool)
    emask[row, g * group:(g + 1) * group] = False
    smask = torch.ones(m, width // group, dtype=torch.bool)
    smask[row, g] = False
    return emask, smask

def _parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, a handful of small cases")
    p.add_argument("--cpu-selftest", action="store_true",
                   help="every case on CPU with the reference on both sides (checks the probe's logic only)")
    p.add_argument("--budget", type=float, default=225.0, help="seconds; cases not started by then are SKIPPED")
    p.add_argument("--case-timeout", type=float, default=150.0, help="seconds one case may run (hang watchdog)")
    p.add_argument("--only", default=None, help="regex: run only the cases whose name matches")
    p.add_argument("--list", action="store_true", help="list the case names and exit")
    return p.parse_args()


ARGS = _parse_args()
DRY = ARGS.cpu_dry_run
SELFTEST = ARGS.cpu_selftest
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

faulthandler.enable()

import torch  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse import reference as qref  # noqa: E402
from quantfuse._validation import rows_view  # noqa: E402
from quantfuse.weights import QuantizedWeight  # noqa: E402

CPU_MODE = DRY or SELFTEST
DEV = "cpu" if CPU_MODE else "cuda"
if not CPU_MODE and not torch.cuda.is_available():
    print("gpu_probe: no CUDA device (use --cpu-dry-run on a CPU machine)", file=sys.stderr)
    sys.exit(2)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
INT8, FP8 = torch.int8, torch.float8_e4m3fn
SHORT = {BF16: "bf16", F16: "fp16", F32: "fp32", INT8: "i8", FP8: "fp8"}
torch.backends.cuda.matmul.allow_tf32 = False


# ------------------------------------------------------------------------------------------------------------------
# plumbing
# ------------------------------------------------------------------------------------------------------------------
class Fail(Exception):
    def __init__(self, msg, ratio=None):
        super().__init__(msg)
        self.ratio = ratio


class Expected(Exception):
    pass


class Warn(Exception):
    """The stated bound holds, but a probe-specific sharper check does not (see check_wo)."""
    def __init__(self, msg, ratio=None):
        super().__init__(msg)
        self.ratio = ratio


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def dev_ctx():
    """The 'GPU' side: CUDA tensors run the kernels; in the dry run CPU tensors through the interpreter."""
    if DRY:
        return qf.backend("triton")
    if SELFTEST:
        return qf.backend("reference")
    return contextlib.nullcontext()


def ref_ctx():
    return qf.backend("reference")


def cpu(t):
    if t is None:
        return None
    return t.detach().to("cpu").clone() if t.device.type == "cpu" else t.detach().to("cpu")


def esize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def seed_of(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def rand_float(shape, dtype, scale=1.0):
    return (torch.randn(shape, device=DEV) * scale).to(dtype)


def rand_q(shape, dtype):
    if dtype == INT8:
        return torch.randint(-128, 128, shape, dtype=INT8, device=DEV)
    return (torch.randn(shape, device=DEV) * 60).to(FP8)


def make_rows(m, k, dtype, layout, maker):
    """An [m, k] (or [..., k]) tensor of `dtype` with the given memory layout; maker(shape) makes a fresh tensor of
    dtype on DEV. Layouts: contig, pad16 (row stride a 16-byte multiple), padodd (odd row stride), off16 (base
    16 bytes into a padded row), offodd (base one element in), expand (stride-0 rows), overlap (rows 16 bytes apart,
    overlapping), 3d (leading dims that collapse), 3dperm (leading dims that do not collapse: copied)."""
    e = esize(dtype)
    if layout == "contig":
        return maker((m, k))
    if layout == "pad16":
        return maker((m, k + 16 // e))[:, :k]
    if layout == "padodd":
        return maker((m, k + 1))[:, :k]
    if layout == "off16":
        o = 16 // e
        return maker((m, k + 3 * o))[:, o:o + k]
    if layout == "offodd":
        return maker((m, k + 8))[:, 1:1 + k]
    if layout == "expand":
        return maker((1, k)).expand(m, k)
    if layout == "overlap":
        step = 16 // e
        base = maker((1, (m - 1) * step + k)).reshape(-1)
        return base.as_strided((m, k), (step, 1))
    if layout in ("3d", "3dperm"):
        a = 3 if m % 3 == 0 else (2 if m % 2 == 0 else 1)
        if layout == "3d":
            return maker((a, m // a, k + 16 // e))[..., :k]
        return maker((m // a, a, k)).transpose(0, 1)
    raise ValueError(layout)


def flat(t, k):
    return t.reshape(-1, k)


def codes(q):
    """tests/_util.codes: integer view of int8 / fp8 codes (fp8 -0 read as +0)."""
    if q.dtype != FP8:
        return q.to(torch.int32)
    c = q.view(torch.uint8).to(torch.int32)
    return torch.where(c == 0x80, torch.zeros_like(c), c)


def check_codes(got, want, tie_rate, mask=None, what="q"):
    """Codes equal except one step at rounding ties, mismatch rate < tie_rate (SPEC section 0)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Fail(f"{what}: shape/dtype {tuple(got.shape)} {got.dtype} vs reference {tuple(want.shape)} {want.dtype}")
    g, w = codes(cpu(got)), codes(cpu(want))
    d = (g - w).abs()
    if mask is not None:
        d = d[mask]
    if d.numel() == 0:
        return f"{what}: nothing compared"
    mx = int(d.max())
    rate = float((d != 0).float().mean())
    if mx > 1 or (rate > 0 and rate >= tie_rate):
        first = torch.nonzero((g - w).abs() != 0)[:3].tolist()
        raise Fail(f"{what}: max code diff {mx}, mismatch rate {rate:.2e} (allowed <=1 step, rate < {tie_rate:g}); "
                   f"first at {first}", ratio=max(mx, rate / tie_rate))
    return f"{what} mism {rate:.1e}"


def check_exact(got, want, mask=None, what="scale"):
    """Bit for bit (NaN equal to NaN)."""
    g, w = cpu(got), cpu(want)
    if g.shape != w.shape or g.dtype != w.dtype:
        raise Fail(f"{what}: shape/dtype {tuple(g.shape)} {g.dtype} vs reference {tuple(w.shape)} {w.dtype}")
    if mask is not None:
        g, w = g[mask], w[mask]
    if g.is_floating_point():
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    else:
        same = g == w
    bad = int((~same).sum())
    if bad:
        i = torch.nonzero(~same)[:3].flatten().tolist()
        raise Fail(f"{what}: {bad} of {same.numel()} differ (first flat idx {i}: got {g[~same][:3].tolist()} "
                   f"want {w[~same][:3].tolist()})", ratio=float("inf"))
    return f"{what} exact"


def check_close(got, want, rtol, mask=None, what="scale"):
    g, w = cpu(got).float(), cpu(want).float()
    if g.shape != w.shape:
        raise Fail(f"{what}: shape {tuple(g.shape)} vs reference {tuple(w.shape)}")
    if mask is not None:
        g, w = g[mask], w[mask]
    r = _ratio(g, w, rtol * w.abs())
    if r > 1:
        raise Fail(f"{what}: relative error {r * rtol:.3g} > rtol {rtol:g}", ratio=r)
    return f"{what} rel {r * rtol:.1e}"


def _ratio(got, want, bound):
    """max |got - want| / bound with NaN == NaN and equal infinities counting as exact; NaN elsewhere is inf."""
    if got.numel() == 0:
        return 0.0
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    err = torch.where(same, torch.zeros_like(got), (got - want).abs())
    r = err / bound.clamp_min(1e-30)
    r = torch.where(torch.isnan(r), torch.full_like(r, float("inf")), r)
    return float(r.max())


def rows_mask(m, exclude):
    keep = torch.ones(m, dtype=torch.bool)
    for r in exclude:
        keep[r] = False
    return keep


# ------------------------------------------------------------------------------------------------------------------
# path labels (informational: which kernel the dispatch should pick; never affects a verdict)
# ------------------------------------------------------------------------------------------------------------------
def wo_path(x, qw):
    if CPU_MODE:
        return "interp" if DRY else "ref"
    try:
        from quantfuse.kernels import gemv_mma as gm
        from quantfuse.kernels import gemv_tma as gt
        from quantfuse.kernels import w8_decode as w8
        from quantfuse.kernels import weight_only as kw
        from quantfuse.kernels import weight_only_wgmma as ww
        from quantfuse.kernels import weight_only_ws as wws
        from quantfuse.kernels.configs import arch_key

        x2d = rows_view(x)
        if qw.perm is not None:
            x2d = x2d.index_select(1, qw.perm)
        m, k = x2d.shape
        n = qw.shape[0]
        bits, gs, s, z, w = qw.bits, qw.group_size, qw.scales, qw.zeros, qw.qweight
        arch = arch_key(x2d.device.type, x2d.device.index)
        table = kw._DISPATCH[arch]
        s16 = s.dtype == x2d.dtype
        sms = kw._num_sms(x2d.device)
        if kw.prefer_dequant_cublas_small(m, n, k, table):
            return "cublas-small"
        if wws.prefer(m, n, k, arch, sms) and wws.applies(x2d, w, s, bits, gs, z):
            return "ws" + ("+tail" if wws.tail_plan(m, n, k, arch, sms) else "")
        if ww.prefer(m, n, k, arch, s16) and ww.applies(x2d, w, s, bits, gs):
            _, sp, tail = ww.plan(m, n, k, arch, sms)
            return f"wgmma(sp{sp}{'+tail' if tail else ''})"
        small = ww.small_m_config(m, n, k, arch, sms, s16)
        if small is not None and ww.applies(x2d, w, s, bits, gs):
            return "wgmma-small"
        if ww.prefer_w8(m, arch) and ww.applies_w8(x2d, w, s, bits):
            return "w8-wgmma"
        if m >= table["cublas_min_m"]:
            return "cublas"
        if gm.applies(x2d, w, s, bits, gs, k) and kw.prefer_gemv_mma(m, n, k):
            return "gemv_mma" + ("-xring" if gm.auto_config(x2d, n).x_group else "")
        if w8.prefer(m, arch) and w8.applies(x2d, w, s, bits):
            return "w8_decode"
        if m == 1 and gt.applies(x2d, w, s, bits, gs, k) and kw.prefer_gemv_tma(
                bits, n, k, kw.pick_tile(1, x2d.device, bits), sms):
            return "gemv_tma"
        t = kw.pick_tile(m, x2d.device, bits, s.element_size())
        return f"tl-{t.get('kernel', 'mma')}{t['block_m']}x{t['block_n']}{'w' if t.get('wide') else ''}"
    except Exception as e:  # a label only
        return f"?{type(e).__name__}"


def smm_path(a, b):
    if CPU_MODE:
        return "interp" if DRY else "ref"
    try:
        from quantfuse.kernels import rowwise_wgmma as rw
        from quantfuse.kernels import scaled_mm as kmm

        a2d = rows_view(a)
        return f"tma={int(kmm.tma_applies(a2d, b))},ws_ok={int(rw.applies(a2d, b))}"
    except Exception as e:
        return f"?{type(e).__name__}"


def bw_path(a, b):
    if CPU_MODE:
        return "interp" if DRY else "ref"
    try:
        from quantfuse.kernels import blockwise_wgmma as bw

        return "gluon" if bw.applies(rows_view(a), b) else "tl"
    except Exception as e:
        return f"?{type(e).__name__}"


# ------------------------------------------------------------------------------------------------------------------
# case builders
# ------------------------------------------------------------------------------------------------------------------
TIE = 1e-4


def row_of(x, r):
    """A writable view of row r of the flattened [M, K] rows of x (any leading dims, no copy)."""
    idx = []
    for d in reversed(x.shape[:-1]):
        idx.append(r % d)
        r //= d
    return x[tuple(reversed(idx))]


def _special_rows(x, special, r, c=0):
    """Put a special value into flattened row r of x (in place; x must not alias rows): nan / inf / -inf (one
    element), zero / const / nearconst (the whole row)."""
    row = row_of(x, r)
    if special == "nan":
        row[c] = float("nan")
    elif special == "inf":
        row[c] = float("inf")
    elif special == "ninf":
        row[c] = float("-inf")
    elif special == "zero":
        row.zero_()
    elif special == "const":
        row.fill_(3.0)
    elif special == "nearconst":
        row.copy_(3.0 + torch.arange(row.shape[0], device=row.device).float().mul(1e-6))


def case_quant(kind, m, k, in_dt, qdt, layout="contig", special=None, group=128, transposed=False, ub=None,
               symmetric=True, static=None, azp=None):
    """quantize_per_token / per_group / per_tensor on the device vs the CPU reference."""
    scale_in = 3.0 if special != "tiny" else 1e-39
    x = make_rows(m, k, in_dt, layout, lambda s: rand_float(s, in_dt, scale_in))
    r = m // 2
    if special in ("nan", "inf", "zero", "const", "nearconst"):
        _special_rows(x, special, r, c=min(k - 1, 5))
    ub_t = None if ub is None else torch.tensor([ub], dtype=F32, device=DEV)
    args = {}
    if kind == "token":
        fn = lambda t, u: qf.quantize_per_token(t, qdt, scale_ub=u, symmetric=symmetric)  # noqa: E731
    elif kind == "group":
        fn = lambda t, u: qf.quantize_per_group(t, qdt, group_size=group, scale_ub=u,  # noqa: E731
                                                transposed_scales=transposed)
    else:
        if static is not None:
            args["scale"] = torch.tensor([static], dtype=F32, device=DEV)
            if azp is not None:
                args["azp"] = torch.tensor([azp], dtype=torch.int32, device=DEV)
        fn = lambda t, u: qf.quantize_per_tensor(t, qdt, **args)  # noqa: E731
    with dev_ctx():
        q, s, z = fn(x, ub_t)
    sync()
    xc = cpu(x)
    with ref_ctx():
        if kind == "tensor":
            rargs = {k_: cpu(v) for k_, v in args.items()}
            qr, sr, zr = qf.quantize_per_tensor(xc, qdt, **rargs)
        else:
            qr, sr, zr = fn(xc, cpu(ub_t))
    notes = []
    if q.shape != x.shape:
        raise Fail(f"q shape {tuple(q.shape)} != x shape {tuple(x.shape)}")
    if kind == "tensor" and static is not None:
        if s is not args["scale"] or (azp is not None and z is not args["azp"]):
            raise Fail("static per-tensor: the op did not return the given scale / azp tensors")
    mm = x.numel() // k
    emask = None
    smask = None
    if special in ("nan", "inf") and kind != "tensor":
        if kind == "token":
            keep = rows_mask(mm, [r])
            emask = keep[:, None].expand(mm, k)
            smask = keep[:, None]
        else:
            emask, smask = group_region_masks(mm, k, r, min(k - 1, 5), group)
    if special in ("nan", "inf") and kind == "tensor" and static is None:
        # the whole tensor is the region: only no crash / right shapes are required
        return "nan/inf per tensor: shapes ok"
    notes.append(check_codes(flat(q, k), flat(qr, k), TIE, emask))
    notes.append(check_exact(s, sr, smask, "scale"))
    if (z is None) != (zr is None):
        raise Fail(f"azp presence differs: {z is None} vs reference {zr is None}")
    if z is not None and not (kind == "tensor"):
        notes.append(check_exact(z, zr, smask, "azp"))
    if kind == "group" and transposed:
        if not s.t().is_contiguous():
            raise Fail(f"transposed scales: expected a view of a contiguous [K/g, M], strides {s.stride()}")
    return ", ".join(notes)


def case_dequant(m, k, qdt, mode, out_dt, layout="contig", group=128):
    """dequantize on the device vs the CPU reference, bit for bit."""
    q = make_rows(m, k, qdt, layout, lambda s: rand_q(s, qdt))
    azp = None
    gs = None
    if mode == "tensor":
        scale = torch.rand(1, device=DEV) + 0.01
    elif mode == "token":
        scale = torch.rand(m, 1, device=DEV) + 0.01
        if qdt == INT8:
            azp = torch.randint(-300, 300, (m, 1), dtype=torch.int32, device=DEV)
    elif mode == "token_azp_tensor":
        scale = torch.rand(m, 1, device=DEV) + 0.01
        azp = torch.tensor([17], dtype=torch.int32, device=DEV)
    else:  # group, scale as a transposed view
        gs = group
        scale = (torch.rand(k // group, m, device=DEV) + 0.01).t()
    with dev_ctx():
        y = qf.dequantize(q, scale, azp, gs, out_dt)
    sync()
    with ref_ctx():
        yr = qf.dequantize(cpu(q), cpu(scale), cpu(azp), gs, out_dt)
    return check_exact(y, yr, None, "x_hat")


def case_silu(m, h, in_dt, qdt, mode, transposed=False, layout="contig", ub=None, special=None):
    """silu_and_mul_quant on the device vs the CPU reference (and vs the reference on the device tensors)."""
    scale_in = 3.0 if special != "tiny" else 1e-20
    x = make_rows(m, 2 * h, in_dt, layout, lambda s: rand_float(s, in_dt, scale_in))
    r = m // 2
    if special in ("nan", "inf", "ninf", "zero"):
        _special_rows(x, special, r, c=min(h - 1, 3))
    ub_t = None if ub is None else torch.tensor([ub], dtype=F32, device=DEV)
    kw = {}
    group = None
    if mode == "token":
        kw = dict(scale_ub=ub_t)
    elif mode == "static":
        kw = dict(scale=torch.tensor([0.05], dtype=F32, device=DEV))
    else:
        group = int(mode[1:])
        kw = dict(group_size=group, scale_ub=ub_t, transposed_scales=transposed)
    with dev_ctx():
        q, s = qf.silu_and_mul_quant(x, qdt, **kw)
    sync()
    kwc = {k_: (cpu(v) if isinstance(v, torch.Tensor) else v) for k_, v in kw.items()}
    with ref_ctx():
        qr, sr = qf.silu_and_mul_quant(cpu(x), qdt, **kwc)
    if mode == "static" and s is not kw["scale"]:
        raise Fail("static: the op did not return the given scale tensor")
    mm = x.numel() // (2 * h)
    emask, smask = None, None
    if special in ("nan", "inf", "ninf"):
        if mode == "token":
            keep = rows_mask(mm, [r])
            emask, smask = keep[:, None].expand(mm, h), keep[:, None]
        elif mode == "static":
            emask = torch.ones(mm, h, dtype=torch.bool)
            emask[r, min(h - 1, 3)] = False
        else:
            emask, smask = group_region_masks(mm, h, r, min(h - 1, 3), group)
    notes = [check_codes(flat(q, h), flat(qr, h), 1e-3, emask, "q(cpu ref)")]
    if mode != "static":
        notes.append(check_close(s, sr, 1e-5, smask, "scale"))
        if group is not None and transposed and not s.t().is_contiguous():
            raise Fail(f"transposed scales: expected a view of a contiguous [H/g, M], strides {s.stride()}")
    if DEV == "cuda":  # the GPU tests' own comparison: the reference evaluated on the device tensors
        qg, _ = qref.silu_and_mul_quant(x, qdt, group, kw.get("scale"), kw.get("scale_ub"), transposed)
        notes.append(check_codes(flat(q, h), flat(qg, h), TIE, emask, "q(dev ref)"))
    return ", ".join(notes)


def _q_operand(m, k, dt, layout):
    return make_rows(m, k, dt, layout, lambda s: rand_q(s, dt))


def _b_operand(k, n, dt, layout):
    """b [K, N]: wt (w.t() of a row-major [N, K]: K-contiguous), kn (row-major [K, N]), slice (both strides
    non-unit), wtpad16 / wtpadodd (w.t() of a padded-row [N, K] view), expk (stride-0 columns: b.t() rows of
    stride 0), expn (stride-0 rows)."""
    if layout == "wt":
        return rand_q((n, k), dt).t()
    if layout == "kn":
        return rand_q((k, n), dt)
    if layout == "slice":
        return rand_q((2 * k, 2 * n), dt)[::2, ::2]
    if layout == "wtpad16":
        return rand_q((n, k + 16), dt)[:, :k].t()
    if layout == "wtpadodd":
        return rand_q((n, k + 3), dt)[:, :k].t()
    if layout == "expk":
        return rand_q((k, 1), dt).expand(k, n)
    if layout == "expn":
        return rand_q((1, n), dt).expand(k, n)
    raise ValueError(layout)


REL_MM = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -22}


def check_scaled(out, a_c, b_c, sa_c, sb_c, bias_c, want, keep=None):
    """tests/gpu/test_scaled_mm_gpu.assert_within_bound against the CPU reference's float32 output."""
    n = b_c.shape[1]
    k = a_c.shape[-1]
    got = cpu(out).float().reshape(-1, n)
    want = want.float().reshape(-1, n)
    m = got.shape[0]
    sa = sa_c.float().reshape(-1, 1) if sa_c.numel() > 1 else sa_c.float().reshape(())
    sb = sb_c.float().reshape(1, -1) if sb_c.numel() > 1 else sb_c.float().reshape(())
    s = torch.broadcast_to(sa * sb, (m, n))
    bias_f = bias_c.float().reshape(1, n) if bias_c is not None else torch.zeros(1, n)
    unbiased = (want - bias_f).abs()
    bound = REL_MM[out.dtype] * want.abs() + 2.0 ** -20 * (unbiased + bias_f.abs())
    if out.dtype == F16:
        bound = bound + 2.0 ** -25
    if a_c.dtype == FP8:
        abs_dot = a_c.reshape(m, k).float().abs() @ b_c.float().abs()
        bound = bound + 2.0 ** -10 * s.abs() * abs_dot
    if keep is not None:
        got, want, bound = got[keep], want[keep], bound[keep]
    r = _ratio(got, want, bound)
    if r > 1:
        raise Fail(f"scaled_mm error/bound {r:.3g}", ratio=r)
    return r


def case_smm(m, k, n, dt=INT8, out_dt=BF16, per_token=True, per_channel=True, bias_dt=BF16, a_layout="contig",
             b_layout="wt", azp=None, special=None, scale_views=False):
    """scaled_mm on the device vs the CPU reference (float32 out), with the tests' bound."""
    a = _q_operand(m, k, dt, a_layout)
    b = _b_operand(k, n, dt, b_layout)
    mm = a.numel() // k
    r = mm // 2
    if scale_views:  # scale_a a column of a [M, 2] tensor, scale_b every other element of a [2N] one
        sa = (torch.rand(mm, 2, device=DEV) * 1e-3 + 1e-4)[:, 1:]
        sb = (torch.rand(2 * n, device=DEV) * 1e-3 + 1e-4)[::2]
    else:
        sa = torch.rand(mm if per_token else 1, 1, device=DEV) * 1e-3 + 1e-4
        sb = torch.rand(n if per_channel else 1, device=DEV) * 1e-3 + 1e-4
    bias = None if bias_dt is None else torch.randn(n, device=DEV).to(bias_dt)
    adj = zp = None
    if azp == "tensor":
        adj = qf.azp_adjustment(b, torch.tensor([-37], dtype=torch.int32, device=DEV))
    elif azp == "token":
        adj = qf.azp_adjustment(b)
        zp = torch.randint(-300, 300, (mm, 1), dtype=torch.int32, device=DEV)
    exclude = []
    clean_sa, clean_a = sa, a
    if special in ("nan_sa", "inf_sa"):
        sa = sa.clone()
        sa.view(-1)[r] = float("nan") if special == "nan_sa" else float("inf")
        exclude = [r]
    elif special == "zero_row":
        a = a.clone()
        row_of(a, r).view(torch.uint8).zero_()
    elif special == "fp8_nan":
        a = a.clone()
        row_of(a, r).view(torch.uint8)[min(k - 1, 3)] = 0x7F
        exclude = [r]
    with dev_ctx():
        y = qf.scaled_mm(a, b, sa, sb, out_dt, bias, adj, zp)
    sync()
    if tuple(y.shape) != (*a.shape[:-1], n) or y.dtype != out_dt or not y.is_contiguous():
        raise Fail(f"out shape/dtype/contiguity: {tuple(y.shape)} {y.dtype} contiguous={y.is_contiguous()}")
    ac, bc, sac, sbc, biasc, adjc, zpc = map(cpu, (a, b, sa, sb, bias, adj, zp))
    with ref_ctx():
        want = qf.scaled_mm(ac, bc, sac, sbc, F32, biasc, adjc, zpc)
    keep = rows_mask(mm, exclude) if exclude else None
    ratio = check_scaled(y, ac, bc, sac, sbc, biasc, want, keep)
    notes = [f"err/bound {ratio:.3g}"]
    if special == "zero_row" and azp is None:
        row = cpu(y).reshape(-1, n)[r].float()
        exp = (biasc.to(out_dt).float() if biasc is not None else torch.zeros(n))
        if not torch.equal(row, exp):
            raise Fail("all-zero row of a: output row != bias")
        notes.append("zero row = bias")
    if exclude:
        with dev_ctx():
            y_clean = qf.scaled_mm(clean_a, b, clean_sa, sb, out_dt, bias, adj, zp)
        sync()
        notes.append(check_exact(flat(y, n)[keep.to(y.device)], flat(y_clean, n)[keep.to(y.device)], None,
                                 "other rows vs clean run"))
    if azp is not None and dt == INT8:  # zero-point epilogue exact in int32: unit scales, float32 out
        one = torch.ones(1, device=DEV)
        with dev_ctx():
            y1 = qf.scaled_mm(a, b, one, one, F32, None, adj, zp)
        sync()
        with ref_ctx():
            w1 = qf.scaled_mm(ac, bc, cpu(one), cpu(one), F32, None, adjc, zpc)
        notes.append(check_exact(y1, w1, None, "unit-scale int32 epilogue"))
    return ", ".join(notes)


def case_bw(m, k, n, out_dt=F32, sa_layout="row", sb_layout="row", bias=True, a_layout="contig", b_layout="wt",
            special=None):
    """scaled_mm_blockwise on the device vs the CPU reference."""
    kb, nb = -(-k // 128), -(-n // 128)
    a = make_rows(m, k, FP8, a_layout, lambda s: (torch.randn(s, device=DEV) * 3 / 8).to(FP8))
    b = _b_operand(k, n, FP8, b_layout)
    mm = a.numel() // k
    sa = torch.rand(mm, kb, device=DEV) * 0.1 + 0.01
    if sa_layout == "t":
        sa = sa.t().contiguous().t()
    elif sa_layout == "tpad":  # transposed layout, rows of M + 4 floats
        big = torch.zeros(kb, mm + 4, device=DEV)
        big[:, :mm] = sa.t()
        sa = big[:, :mm].t()
    elif sa_layout == "expand":  # one scale per row, broadcast over the K blocks (stride 0)
        sa = sa[:, :1].expand(mm, kb)
    sb = torch.rand(kb, nb, device=DEV) * 1e-3 + 1e-4
    if sb_layout == "kmajor":
        sb = sb.t().contiguous().t()
    elif sb_layout == "odd":
        sb = torch.empty(kb, nb + 1, device=DEV)[:, :nb].copy_(sb)
    biast = torch.randn(n, device=DEV).to(BF16) if bias else None
    r = mm // 2
    exclude = []
    if special == "nan_sa":
        sa = sa.clone() if sa_layout != "expand" else sa.contiguous()
        sa[r, kb - 1] = float("nan")
        exclude = [r]
    elif special == "zero_row":
        a = a.clone()
        row_of(a, r).view(torch.uint8).zero_()
    with dev_ctx():
        y32 = qf.scaled_mm_blockwise(a, b, sa, sb, F32, biast)
        y = y32 if out_dt == F32 else qf.scaled_mm_blockwise(a, b, sa, sb, out_dt, biast)
    sync()
    ac, bc, sac, sbc, bc_bias = map(cpu, (a, b, sa, sb, biast))
    with ref_ctx():
        want = qf.scaled_mm_blockwise(ac, bc, sac, sbc, F32, bc_bias)
    got = cpu(y32).reshape(-1, n)
    want = want.reshape(-1, n)
    keep = rows_mask(mm, exclude)
    g, w = got[keep], want[keep]
    err = (g - w).abs()
    denom = w.abs().mean().clamp_min(1e-30)
    mean_rel = float(err.mean() / denom)
    if not math.isfinite(mean_rel) or mean_rel >= 1e-3:
        raise Fail(f"blockwise mean rel error {mean_rel:.3g} >= 1e-3", ratio=mean_rel / 1e-3)
    row_rel = float((err.mean(1) / torch.maximum(w.abs().mean(1), 1e-3 * denom)).max())
    col_rel = float((err.mean(0) / torch.maximum(w.abs().mean(0), 1e-3 * denom)).max())
    if max(row_rel, col_rel) >= 1e-2:
        raise Fail(f"blockwise worst row {row_rel:.3g} / column {col_rel:.3g} mean rel error >= 1e-2 "
                   f"(mean {mean_rel:.3g})",
                   ratio=max(row_rel, col_rel) / 1e-2)
    sa_e = sac.float().abs().repeat_interleave(128, dim=1)[:, :k]
    sb_e = sbc.float().abs().repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    mag = (ac.reshape(-1, k).float().abs() * sa_e) @ (bc.float().abs() * sb_e)
    bias_abs = bc_bias.float().abs().reshape(1, n) if bc_bias is not None else 0.0
    bound = 2.0 ** -8 * want.abs() + 2.0 ** -9 * mag + 2.0 ** -20 * bias_abs + 1e-30
    re_ = _ratio(g, w, bound[keep])
    if re_ > 1:
        raise Fail(f"blockwise elementwise(heuristic) error/bound {re_:.3g} (mean rel {mean_rel:.3g} ok)", ratio=re_)
    notes = [f"mean rel {mean_rel:.2e}, row {row_rel:.1e}, col {col_rel:.1e}, elem {re_:.2g}"]
    if out_dt != F32:
        floor = 2.0 ** -25 if out_dt == F16 else 1e-30
        y16 = cpu(y).float().reshape(-1, n)
        r16 = _ratio(y16[keep], got[keep], REL_MM[out_dt] * got[keep].abs() + floor)
        if r16 > 1:
            raise Fail(f"{SHORT[out_dt]} out not within one rounding of the fp32 out: {r16:.3g}", ratio=r16)
    if special == "zero_row":
        exp = bc_bias.float() if bc_bias is not None else torch.zeros(n)
        if not torch.equal(got[r], exp):
            raise Fail("all-zero row of a: output row != bias")
    if exclude:
        with dev_ctx():
            sa2 = sa.clone()
            sa2[r, kb - 1] = 0.05
            y_clean = qf.scaled_mm_blockwise(a, b, sa2, sb, F32, biast)
        sync()
        kd = keep.to(y32.device)
        notes.append(check_exact(flat(y32, n)[kd], flat(y_clean, n)[kd], None, "other rows vs clean run"))
    return ", ".join(notes)


REL_WO = {BF16: 2.0 ** -7 + 2.0 ** -14, F16: 2.0 ** -10 + 2.0 ** -17}
ABS_WO = {BF16: 0.0, F16: 2.0 ** -24}
UNIT = {BF16: 2.0 ** -8, F16: 2.0 ** -11}


def _weight(n, k):
    """tests/gpu/test_weight_only_gpu._weight: random [N, K] with a power-of-two magnitude (2^-3..2^3) per 128 columns,
    so a wrong group index or zero point blows the bound."""
    blocks = -(-k // 128)
    mag = torch.exp2(torch.randint(-3, 4, (n, blocks), device=DEV).float()).repeat_interleave(128, dim=1)[:, :k]
    return torch.randn(n, k, device=DEV) * mag


def check_wo(y, xc, w_hat, biasc, y_ref, keep=None):
    k = xc.shape[-1]
    n = w_hat.shape[0]
    xf = xc.reshape(-1, k).float()
    wf = w_hat.float()
    want = xf @ wf.t()
    mag = xf.abs() @ wf.abs().t()
    rms = ((xf * xf) @ (wf * wf).t()).sqrt()
    if biasc is not None:
        want = want + biasc.float()
        mag = mag + biasc.float().abs()
    dt = y.dtype
    bound = REL_WO[dt] * mag + ABS_WO[dt] + 1e-30
    got = cpu(y).float().reshape(-1, n)
    yr = y_ref.float().reshape(-1, n)
    if keep is not None:
        got, want, bound, yr, rms, mag = got[keep], want[keep], bound[keep], yr[keep], rms[keep], mag[keep]
    r1 = _ratio(got, want, bound)
    r2 = _ratio(got, yr, bound + UNIT[dt] * yr.abs())
    r = max(r1, r2)
    if r > 1:
        raise Fail(f"weight_only error/bound {r1:.3g} (vs fp32 x@w_hat.T), {r2:.3g} (vs the CPU op's output)", ratio=r)
    # the tests' informational tighter ratio: err / (u |ref| + 2^-20 |x| @ |w_hat|.T); ~1-3 is normal for kernels that
    # scale after the sums (one rounding per weight), much larger hints at a localized error within the bound
    tight = _ratio(got, want, UNIT[dt] * want.abs() + 2.0 ** -20 * mag + ABS_WO[dt])
    # Probe-specific statistical check (WARN, not FAIL): a correct kernel's error is the output rounding plus a random
    # walk of per-weight roundings (scale-after kernels, cuBLAS reduced-precision reductions), so
    #     |err| <= 2 u |ref| + 8 u sqrt((x^2) @ (w_hat^2).T) + 2^-20 |x| @ |w_hat|.T + ABS
    # (8 u rms is ~27 standard deviations of that walk). The stated bound scales with |x| @ |w_hat|.T and cannot see
    # a localized error, e.g. a partial last K chunk / group dropped or mis-scaled (~sqrt(K_tail / K) of |ref|).
    stat = _ratio(got, want, 2 * UNIT[dt] * want.abs() + 8 * UNIT[dt] * rms + 2.0 ** -20 * mag + ABS_WO[dt])
    return r, tight, stat


def case_wo(m, n, k, bits=4, group=128, sym=True, x_dt=BF16, s_dt=F32, bias=False, layout="contig", special=None,
            perm=False, x_scale=None):
    """weight_only_mm on the device vs the CPU reference (the same QuantizedWeight moved to the CPU)."""
    qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group, symmetric=sym, scale_dtype=s_dt)
    if perm:
        p = torch.randperm(k, device=DEV)
        qw = QuantizedWeight.from_codes(qw.biased_codes(), qw.scales, qw.zeros, bits, group, perm=p)
    xs = x_scale if x_scale is not None else (0.5 if x_dt == F16 else 1.0)
    x = make_rows(m, k, x_dt, layout, lambda s: rand_float(s, x_dt, xs))
    b = torch.randn(n, device=DEV).to(x_dt) if bias else None
    mm = x.numel() // k
    r = mm // 2
    clean = x
    if special in ("nan", "inf", "zero"):
        x = x.clone()
        _special_rows(x, special, r, c=min(k - 1, 7))
    path = wo_path(x, qw)
    with dev_ctx():
        y = qf.weight_only_mm(x, qw, b)
    sync()
    if tuple(y.shape) != (*x.shape[:-1], n) or y.dtype != x_dt or not y.is_contiguous():
        raise Fail(f"out shape/dtype/contiguity: {tuple(y.shape)} {y.dtype} contiguous={y.is_contiguous()}")
    qc = qw.to("cpu")
    xc, bc = cpu(x), cpu(b)
    with ref_ctx():
        y_ref = qf.weight_only_mm(xc, qc, bc)
        w_hat = qc.dequantize(x_dt)
    exclude = [r] if special in ("nan", "inf") else []
    keep = rows_mask(mm, exclude) if exclude else None
    ratio, tight, stat = check_wo(y, xc, w_hat, bc, y_ref, keep)
    notes = [f"[{path}] err/bound {ratio:.3g} (stat {stat:.3g}, tight {tight:.3g})"]
    warn = (f"[{path}] stated bound met (err/bound {ratio:.3g}) but err / statistical scale = {stat:.3g} > 1: "
            f"a localized error (K tail, one group / tile)?") if stat > 1 else None
    if special == "zero":
        row = cpu(y).reshape(-1, n)[r].float()
        exp = bc.float() if bc is not None else torch.zeros(n)
        if not torch.equal(row, exp):
            raise Fail(f"[{path}] all-zero row of x: output row != bias "
                       f"(max diff {float((row - exp).abs().max()):.3g})")
        notes.append("zero row = bias")
    if exclude:
        with dev_ctx():
            y_clean = qf.weight_only_mm(clean, qw, b)
        sync()
        kd = keep.to(y.device)
        yk, ck = flat(y, n)[kd], flat(y_clean, n)[kd]
        if not path.startswith("cublas"):
            notes.append(check_exact(yk, ck, None, "other rows vs clean run"))
    if warn:
        raise Warn(warn + "; " + ", ".join(notes), ratio=stat)
    return ", ".join(notes)


def case_wdeq(n, k, bits, group, sym, s_dt, out_dt):
    """QuantizedWeight.dequantize on the device vs on the CPU, bit for bit."""
    qw = qf.quantize_weight(_weight(n, k), bits=bits, group_size=group, symmetric=sym, scale_dtype=s_dt)
    with dev_ctx():
        w = qw.dequantize(out_dt)
    sync()
    qc = qw.to("cpu")
    with ref_ctx():
        wr = qc.dequantize(out_dt)
    return check_exact(w, wr, None, "w_hat")


def case_azpadj(k, n, layout, per_tensor):
    b = _b_operand(k, n, INT8, layout)
    z = torch.tensor([-91], dtype=torch.int32, device=DEV) if per_tensor else None
    with dev_ctx():
        adj = qf.azp_adjustment(b, z)
    sync()
    with ref_ctx():
        adjr = qf.azp_adjustment(cpu(b), cpu(z))
    return check_exact(adj, adjr, None, "azp_adj")


def case_error(fn, types):
    try:
        with dev_ctx():
            fn()
        sync()
    except types as e:
        raise Expected(f"{type(e).__name__}: {str(e)[:140]}")
    raise Fail(f"expected {'/'.join(t.__name__ for t in types)}, the call returned normally")


def _err_cases():
    x = rand_float((4, 64), BF16)
    qw = qf.quantize_weight(_weight(32, 64), bits=4, group_size=32)
    a8 = rand_q((4, 64), INT8)
    b8 = rand_q((32, 64), INT8).t()
    f8 = rand_q((32, 64), FP8).t()
    s1 = torch.ones(1, device=DEV)
    out = [
        ("err/wo-x-colstride", lambda: qf.weight_only_mm(rand_float((4, 128), BF16)[:, ::2], qw), (ValueError,)),
        ("err/wo-bias-dtype", lambda: qf.weight_only_mm(x, qw, torch.zeros(32, device=DEV)), (TypeError,)),
        ("err/smm-b-dtype", lambda: qf.scaled_mm(a8, f8, s1, s1), (TypeError,)),
        ("err/smm-azp-fp8", lambda: qf.scaled_mm(rand_q((4, 64), FP8), f8, s1, s1, BF16, None,
                                                  torch.zeros(32, dtype=torch.int32, device=DEV)), (ValueError,)),
        ("err/smm-scale-numel", lambda: qf.scaled_mm(a8, b8, torch.ones(3, device=DEV), s1), (ValueError,)),
        ("err/group-not-dividing", lambda: qf.quantize_per_group(rand_float((2, 96), BF16), FP8, 64), (ValueError,)),
        ("err/silu-odd-width", lambda: qf.silu_and_mul_quant(rand_float((2, 33), BF16), FP8), (ValueError,)),
        ("err/bw-scale-shape", lambda: qf.scaled_mm_blockwise(rand_q((4, 256), FP8), rand_q((64, 256), FP8).t(),
                                                               torch.ones(4, 1, device=DEV),
                                                               torch.ones(2, 1, device=DEV)), (ValueError,)),
        ("err/qweight-k12", lambda: qf.quantize_weight(torch.randn(8, 12, device=DEV)), (ValueError,)),
        ("err/token-x-colstride", lambda: qf.quantize_per_token(rand_float((4, 64), BF16)[:, ::2], INT8),
         (ValueError,)),
    ]
    return out


# ------------------------------------------------------------------------------------------------------------------
# the case list (name, priority, callable): lower priority runs first
# ------------------------------------------------------------------------------------------------------------------
CASES = []


def add(prio, name, fn, *args, **kw):
    CASES.append((prio, name, lambda: fn(*args, **kw)))


def build_full():
    # ---- expected errors: cheap, validation must fire before any launch
    for name, fn, types in _err_cases_lazy():
        add(0, name, case_error, fn, types)

    # ================================ weight_only_mm ================================
    # every M band on one 4096 x 4096 int4 g128 asymmetric weight (16.8M codes: gemv_mma at M <= 16 (x ring at
    # 9..16), tl tiles, wgmma / warp-specialized, cuBLAS), fp16 / bf16 and bias alternating
    ms = [1, 2, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 255, 256, 257, 511, 512, 1023, 1024, 1025, 2048, 2049]
    for i, m in enumerate(ms):
        dt = (BF16, F16)[i % 2]
        add(1, f"wo/w4g128a/M{m}/N4096xK4096/{SHORT[dt]}{'/bias' if i % 3 == 0 else ''}", case_wo, m, 4096, 4096,
            4, 128, False, dt, F32, i % 3 == 0)
    # odd N (scale rows not 16-byte aligned: the ws kernel falls back), K with a partial chunk
    for m in (1, 12, 40, 130, 300, 1030):
        add(1, f"wo/w4g128a/M{m}/N2051xK4104/bf16/bias", case_wo, m, 2051, 4104, 4, 128, False, BF16, F32, True)
    # per channel symmetric, odd N: single-row scales are describable, so the ws kernel takes odd N
    for m in (300, 1024):
        add(1, f"wo/w4pc-s/M{m}/N2051xK8192/bf16", case_wo, m, 2051, 8192, 4, -1, True, BF16, F32, m == 300)
    # 16-bit scales in x's dtype (packed conversions, small-M wgmma at 32/64/128, wgmma to M = 2048)
    for m in (1, 16, 32, 64, 128, 1500, 2048):
        add(1, f"wo/w4g128s/M{m}/N4096xK4096/bf16/s-bf16", case_wo, m, 4096, 4096, 4, 128, True, BF16, BF16,
            m in (32, 1500))
    for m in (64, 1024):
        add(2, f"wo/w4g128a/M{m}/N4096xK4096/fp16/s-fp16", case_wo, m, 4096, 4096, 4, 128, False, F16, F16, True)
    # 16-bit scales whose rows are not 16-byte aligned (N = 4100): no ws kernel; wgmma up to M = 2048
    for m in (300, 1100, 2048):
        add(1, f"wo/w4g128a/M{m}/N4100xK4096/bf16/s-bf16", case_wo, m, 4100, 4096, 4, 128, False, BF16, BF16)
    # scales of the other 16-bit dtype than x (no packed conversion; wgmma / ws refuse them)
    for m in (1, 64, 300):
        add(2, f"wo/w4g128a/M{m}/N4096xK2048/fp16/s-bf16", case_wo, m, 4096, 2048, 4, 128, False, F16, BF16)
    # int4 group sizes (32 / 64: no gemv_mma, no wgmma; 256: two chunks per group)
    for g, m, n, k in ((32, 1, 2048, 4096), (32, 40, 2048, 4096), (32, 300, 2048, 4096), (64, 16, 2048, 4096),
                       (64, 600, 4096, 4096), (256, 9, 2048, 4096), (256, 1024, 4096, 4096), (-1, 64, 2048, 4096),
                       (-1, 1024, 4096, 4096)):
        sym = g in (64, -1)
        dt = (BF16, F16)[m % 2]
        add(2, f"wo/w4g{g}{'s' if sym else 'a'}/M{m}/N{n}xK{k}/{SHORT[dt]}", case_wo, m, n, k, 4, g, sym, dt, F32,
            m % 3 == 0)
    # int8 per channel around w8_decode (2..32), the int8 wgmma band (256..2048), cuBLAS
    for m in (1, 2, 17, 32, 33, 256, 1000, 2049):
        sym = m % 2 == 0
        dt = (BF16, F16)[m % 2]
        add(1, f"wo/w8pc{'s' if sym else 'a'}/M{m}/N3072xK4096/{SHORT[dt]}", case_wo, m, 3072, 4096, 8, -1, sym, dt,
            F32, m % 3 == 1)
    # grouped int8 (the tl tiles; gemv_tma at M = 1 for g32 / g64)
    for g, m in ((32, 1), (32, 33), (64, 16), (64, 300), (128, 1), (128, 4), (256, 16), (256, 300)):
        add(2, f"wo/w8g{g}a/M{m}/N1024xK4096/bf16", case_wo, m, 1024, 4096, 8, g, False, BF16, F32, m == 16)
    add(2, "wo/w8g64s/M16/N2048xK2048/fp16/s-fp16", case_wo, 16, 2048, 2048, 8, 64, True, F16, F16)
    for m in (1, 64):
        add(2, f"wo/w8g128a/M{m}/N2048xK2048/bf16/s-bf16", case_wo, m, 2048, 2048, 8, 128, False, BF16, BF16)
    for m in (1, 300):
        add(2, f"wo/w8pca/M{m}/N1000xK4104/fp16", case_wo, m, 1000, 4104, 8, -1, False, F16, F32, True)
    # x layouts (descriptor / alignment conditions of gemv_mma's x ring, gemv_tma, wgmma, ws, the w8 wgmma)
    for layout, m, bits in (("expand", 12, 4), ("expand", 300, 4), ("expand", 1024, 4), ("expand", 1, 8),
                            ("overlap", 12, 4), ("overlap", 300, 8), ("overlap", 1024, 4), ("pad16", 1024, 4),
                            ("padodd", 12, 4), ("off16", 300, 4), ("offodd", 1, 4), ("3d", 300, 8),
                            ("3dperm", 1024, 4), ("offodd", 300, 8)):
        g, n = (128, 4096) if bits == 4 else (-1, 3072)
        add(2, f"wo/layout-{layout}/w{bits}g{g}/M{m}/N{n}xK4096/bf16", case_wo, m, n, 4096, bits, g, bits == 8, BF16,
            F32, False, layout)
    # NaN / Inf / zero rows stay in their rows
    for m, sp, bits, g, n, k in ((2, "nan", 4, 128, 4096, 4096), (12, "inf", 4, 128, 4096, 4096),
                                 (20, "nan", 8, -1, 3072, 4096), (40, "nan", 4, 32, 2048, 4096),
                                 (300, "nan", 4, 128, 4096, 4096), (1025, "nan", 4, 128, 4096, 4096),
                                 (300, "nan", 8, -1, 3072, 4096), (16, "zero", 4, 128, 4096, 4096),
                                 (1024, "zero", 4, 128, 4096, 4096)):
        add(2, f"wo/{sp}-row/w{bits}g{g}/M{m}/N{n}xK{k}/bf16/bias", case_wo, m, n, k, bits, g, False, BF16, F32, True,
            "contig", sp)
    # act-order permutation
    for m in (16, 300):
        add(3, f"wo/perm/w4g128a/M{m}/N4096xK4096/bf16", case_wo, m, 4096, 4096, 4, 128, False, BF16, F32, False,
            "contig", None, True)
    # tiny shapes
    for m, n, k, bits, g in ((1, 16, 8, 4, 32), (300, 16, 8, 4, 32), (17, 1, 24, 8, 32), (300, 3, 136, 4, 128)):
        add(3, f"wo/tiny/w{bits}g{g}/M{m}/N{n}xK{k}/bf16", case_wo, m, n, k, bits, g, False, BF16, F32, True)
    # QuantizedWeight.dequantize, bit for bit
    for bits, g, sym, sdt, odt in ((4, 32, False, F32, BF16), (4, 256, False, F16, F16), (4, -1, True, BF16, F32),
                                   (8, 32, False, F32, F16), (8, -1, True, BF16, BF16)):
        add(3, f"wdeq/w{bits}g{g}{'s' if sym else 'a'}/s-{SHORT[sdt]}/out-{SHORT[odt]}/N333xK1000", case_wdeq, 333,
            1000, bits, g, sym, sdt, odt)

    # ================================ scaled_mm ================================
    # every M bucket of the sm90 tables (decode, TMA decode, split-K, TMA persistent, the int8 warp-specialized
    # kernel from 1024 rows), odd-ish N (3000 = 11.7 tiles of 256)
    for m in (1, 2, 16, 17, 64, 65, 256, 257, 1024, 1025, 2047, 2049):
        add(1, f"smm/i8/M{m}/K2048xN3000/bf16/bias", case_smm, m, 2048, 3000, INT8, BF16)
    for m in (1, 16, 257, 1024, 2048, 2049):
        add(1, f"smm/fp8/M{m}/K2048xN3000/fp16", case_smm, m, 2048, 3000, FP8, F16, True, True, None)
    # the M = 1 / M = 16 N buckets (8192 / 16384 edges) with their TMA configs
    for m, n, dt in ((1, 8192, FP8), (1, 8193, INT8), (1, 16385, INT8), (16, 8193, INT8), (16, 16384, FP8),
                     (16, 16385, INT8)):
        add(1, f"smm/{SHORT[dt]}/M{m}/K1024xN{n}/bf16", case_smm, m, 1024, n, dt, BF16)
    # the int8 warp-specialized kernel: odd N, K tails, every out dtype and epilogue
    for m, n, k, odt, azp in ((1100, 4097, 1040, F32, None), (2047, 2051, 2064, F16, "token"),
                              (1024, 8192, 4096, BF16, "tensor"), (2048, 2048, 128, F16, None)):
        add(1, f"smm/i8-ws/M{m}/K{k}xN{n}/{SHORT[odt]}/azp-{azp}", case_smm, m, k, n, INT8, odt, True, True, BF16,
            "contig", "wt", azp)
    # row split (M a few rows past whole rounds of tiles)
    for dt in (INT8, FP8):
        add(1, f"smm/{SHORT[dt]}/rowsplit/M1040/K8192xN4096", case_smm, 1040, 8192, 4096, dt, BF16, True, True, BF16,
            "contig", "wt", "token" if dt == INT8 else None)
    # a layouts: descriptor conditions (16-byte rows / base), stride-0 rows, overlapping rows, 3-D
    for layout, m, dt in (("expand", 1, FP8), ("expand", 300, FP8), ("expand", 2048, INT8), ("overlap", 300, INT8),
                          ("overlap", 2048, INT8), ("pad16", 2048, INT8), ("padodd", 2048, INT8), ("off16", 1, FP8),
                          ("offodd", 300, FP8), ("3d", 1024, FP8), ("3dperm", 300, INT8)):
        add(2, f"smm/a-{layout}/{SHORT[dt]}/M{m}/K1024xN2048", case_smm, m, 1024, 2048, dt, BF16, True, True, BF16,
            layout)
    # b layouts: row-major [K, N], sliced, padded rows of w, stride-0 b
    for layout, m, dt in (("expk", 1, INT8), ("expk", 300, FP8), ("expk", 2048, INT8), ("expn", 300, INT8),
                          ("kn", 1, FP8), ("kn", 2048, INT8), ("slice", 300, FP8), ("wtpad16", 2048, INT8),
                          ("wtpadodd", 16, INT8)):
        add(2, f"smm/b-{layout}/{SHORT[dt]}/M{m}/K1024xN2048", case_smm, m, 1024, 2048, dt, BF16, True, True, None,
            "contig", layout)
    # epilogue variety (out dtype, scale granularity, bias dtype, zero points)
    for m, dt, odt, pt, pc, bdt, azp in ((1, INT8, F32, False, False, F16, "tensor"),
                                         (17, INT8, F16, True, False, None, "token"),
                                         (300, FP8, F32, False, True, F32, None),
                                         (300, INT8, F16, False, True, F16, "tensor"),
                                         (1024, FP8, F32, True, True, BF16, None)):
        add(2, f"smm/epi/{SHORT[dt]}/M{m}/K1536xN1000/{SHORT[odt]}/pt{int(pt)}pc{int(pc)}/azp-{azp}", case_smm, m,
            1536, 1000, dt, odt, pt, pc, bdt, "contig", "wt", azp)
    # special rows
    for m, dt, sp in ((300, INT8, "nan_sa"), (2048, INT8, "inf_sa"), (16, FP8, "fp8_nan"), (1024, FP8, "nan_sa"),
                      (1025, INT8, "zero_row")):
        add(2, f"smm/{sp}/{SHORT[dt]}/M{m}/K2048xN2048", case_smm, m, 2048, 2048, dt, BF16, True, True, BF16,
            "contig", "wt", None, sp)
    # scales as views, tiny K / N (no alignment demands)
    for m, dt in ((1, INT8), (1024, INT8)):
        add(2, f"smm/scale-views/{SHORT[dt]}/M{m}/K1024xN1024", case_smm, m, 1024, 1024, dt, BF16, True, True, BF16,
            "contig", "wt", None, None, True)
    for m, k, n, dt in ((1, 1, 1, INT8), (2049, 1, 3, INT8), (5, 16, 1, FP8), (1024, 16, 300, INT8)):
        add(2, f"smm/tiny/{SHORT[dt]}/M{m}/K{k}xN{n}", case_smm, m, k, n, dt, BF16)

    # ================================ scaled_mm_blockwise ================================
    for m in (1, 16, 65, 256, 257, 511, 1025):
        add(1, f"bw/M{m}/K1152xN1000/fp32/sa-{'t' if m % 2 else 'row'}", case_bw, m, 1152, 1000, F32,
            "t" if m % 2 else "row")
    for m, k, n, odt, sal, sbl, al, bl in ((300, 1000, 1000, BF16, "row", "row", "contig", "wt"),
                                           (528, 8192, 4096, BF16, "t", "row", "contig", "wt"),
                                           (257, 128, 129, F16, "tpad", "odd", "contig", "wt"),
                                           (260, 1024, 4096, BF16, "tpad", "kmajor", "contig", "wt"),
                                           (1024, 1024, 2048, F32, "expand", "row", "contig", "wt"),
                                           (700, 1024, 1024, F32, "t", "row", "offodd", "wt"),
                                           (300, 1024, 1024, F32, "row", "row", "expand", "wt"),
                                           (400, 1024, 1024, F32, "t", "row", "contig", "expk"),
                                           (1, 200, 130, BF16, "row", "odd", "contig", "slice"),
                                           (300, 1024, 1024, F32, "t", "row", "3d", "kn")):
        add(2, f"bw/M{m}/K{k}xN{n}/{SHORT[odt]}/sa-{sal}/sb-{sbl}/a-{al}/b-{bl}", case_bw, m, k, n, odt, sal, sbl,
            True, al, bl)
    for m, sp, sal in ((384, "nan_sa", "t"), (384, "zero_row", "row"), (16, "nan_sa", "row")):
        add(2, f"bw/{sp}/M{m}/K1024xN512/sa-{sal}", case_bw, m, 1024, 512, F32, sal, "row", True, "contig", "wt", sp)

    # ================================ silu_and_mul_quant ================================
    for m, h, idt, qdt, mode, tr, lay, ub, sp in (
            (1, 14336, BF16, FP8, "token", False, "contig", None, None),       # split per-token path
            (127, 1000, F16, INT8, "token", False, "contig", 0.01, None),      # split, odd H, scale_ub
            (128, 1000, BF16, FP8, "token", False, "pad16", None, None),       # single path
            (3, 20000, BF16, INT8, "token", False, "contig", None, "nan"),     # H past token_single_max
            (300, 17, F32, FP8, "token", False, "padodd", None, "inf"),
            (3, 48, F16, INT8, "g16", True, "contig", None, "nan"),
            (257, 768, BF16, FP8, "g256", False, "contig", None, None),
            (5, 5120, F16, FP8, "g128", True, "off16", None, "ninf"),
            (4099, 128, BF16, INT8, "g64", True, "contig", None, None),
            (64, 1000, BF16, FP8, "static", False, "contig", None, "nan"),
            (2, 1, BF16, INT8, "token", False, "contig", None, None),
            (200, 4096, F32, INT8, "token", False, "contig", 1e-41, "tiny"),    # subnormal scales: plain division
            (300, 2048, BF16, FP8, "g128", False, "expand", None, None),
            (16, 2048, BF16, INT8, "g32", False, "3dperm", 2.0 ** -126, "zero")):
        add(3, f"silu/{mode}{'T' if tr else ''}/{SHORT[qdt]}/M{m}/H{h}/{SHORT[idt]}/{lay}{'/ub' if ub else ''}"
               f"{'/' + sp if sp else ''}", case_silu, m, h, idt, qdt, mode, tr, lay, ub, sp)

    # ================================ activation quantization ================================
    for kind, m, k, idt, qdt, lay, sp, g, tr, ub, sym in (
            ("token", 1, 1, BF16, INT8, "contig", None, 0, False, None, True),
            ("token", 1025, 3, F16, FP8, "padodd", None, 0, False, None, True),
            ("token", 7, 16384, BF16, INT8, "contig", "nan", 0, False, None, False),
            ("token", 3, 16385, F32, FP8, "pad16", "inf", 0, False, 0.05, True),
            ("token", 5, 20000, BF16, INT8, "offodd", "nearconst", 0, False, None, False),
            ("token", 64, 4096, F16, INT8, "contig", "const", 0, False, None, False),
            ("token", 300, 1000, BF16, INT8, "expand", None, 0, False, None, False),
            ("token", 200, 4096, F32, INT8, "contig", "tiny", 0, False, 1e-41, True),
            ("group", 1, 1536, BF16, FP8, "contig", None, 512, True, None, True),
            ("group", 3, 80, F16, INT8, "offodd", "nan", 16, True, None, True),
            ("group", 255, 16400, BF16, FP8, "contig", None, 16, False, 0.02, True),
            ("group", 257, 768, F32, INT8, "3dperm", "inf", 256, True, None, True),
            ("group", 2, 4096, BF16, FP8, "overlap", None, 128, True, None, True),
            ("tensor", 4097, 1000, BF16, FP8, "contig", None, 0, False, None, True),
            ("tensor", 1, 7, F16, INT8, "padodd", "zero", 0, False, None, True)):
        add(3, f"quant/{kind}/{SHORT[qdt]}/M{m}/K{k}/{SHORT[idt]}/{lay}{'/g' + str(g) if g else ''}{'T' if tr else ''}"
               f"{'/ub' if ub else ''}{'' if sym else '/asym'}{'/' + sp if sp else ''}", case_quant, kind, m, k, idt,
            qdt, lay, sp, g or 128, tr, ub, sym)
    add(3, "quant/tensor-static/i8/M300/K1000/bf16/azp", case_quant, "tensor", 300, 1000, BF16, INT8, "contig",
        None, 128, False, None, True, 0.02, -5)
    add(3, "quant/tensor-static/i8/M64/K512/fp32/azp-2^22(f64 path)", case_quant_bigazp, 64, 512)
    for m, k, qdt, mode, odt, lay in ((300, 1024, INT8, "token", F32, "pad16"), (257, 512, FP8, "group", F16, "contig"),
                                      (5, 100, INT8, "token_azp_tensor", F32, "padodd")):
        add(3, f"deq/{mode}/{SHORT[qdt]}/M{m}/K{k}/out-{SHORT[odt]}/{lay}", case_dequant, m, k, qdt, mode, odt, lay)
    add(4, "azpadj/slice/K1000xN77/tensor", case_azpadj, 1000, 77, "slice", True)


def case_quant_bigazp(m, k):
    """Static per-tensor int8 with a zero point past 2^21 (the kernel's float64 path of to_int8_sat_azp)."""
    azp = -(1 << 22) - 3
    scale = 1e-6
    base = torch.full((m, k), float(-azp), device=DEV) + torch.randint(-150, 150, (m, k), device=DEV).float()
    x = (base + torch.rand(m, k, device=DEV)) * scale
    st = torch.tensor([scale], dtype=F32, device=DEV)
    zt = torch.tensor([azp], dtype=torch.int32, device=DEV)
    with dev_ctx():
        q, s, z = qf.quantize_per_tensor(x, INT8, st, zt)
    sync()
    with ref_ctx():
        qr, _, _ = qf.quantize_per_tensor(cpu(x), INT8, cpu(st), cpu(zt))
    spread = int((codes(cpu(qr)) == 127).float().mean() * 100)
    return check_codes(q, qr, TIE) + f" (saturated {spread}%)"


def _err_cases_lazy():
    # tensors for the error cases are made when the case runs (seeded like the others)
    names = ["err/wo-x-colstride", "err/wo-bias-dtype", "err/smm-b-dtype", "err/smm-azp-fp8", "err/smm-scale-numel",
             "err/group-not-dividing", "err/silu-odd-width", "err/bw-scale-shape", "err/qweight-k12",
             "err/token-x-colstride"]
    out = []
    for i, name in enumerate(names):
        def fn(i=i):
            name_, f, _ = _err_cases()[i]
            return f()
        types = (ValueError,) if i not in (1, 2) else (TypeError,)
        out.append((name, fn, types))
    return out


def build_dry():
    """Small versions of each builder (interpreter-sized) for --cpu-dry-run."""
    add(0, "dry/err/wo-bias-dtype", case_error, lambda: qf.weight_only_mm(rand_float((2, 64), BF16),
                                                                         qf.quantize_weight(_weight(16, 64)),
                                                                         torch.zeros(16, device=DEV)), (TypeError,))
    add(1, "dry/quant/token/i8/M5/K40/bf16/pad16/asym/nan", case_quant, "token", 5, 40, BF16, INT8, "pad16", "nan",
        128, False, None, False)
    add(1, "dry/quant/group/fp8/M3/K64/fp16/offodd/g16T/inf", case_quant, "group", 3, 64, F16, FP8, "offodd", "inf", 16,
        True)
    add(1, "dry/quant/tensor-static/i8/M4/K24/azp", case_quant, "tensor", 4, 24, F32, INT8, "3dperm", None, 128, False,
        None, True, 0.02, -5)
    add(1, "dry/quant/tensor-static/bigazp", case_quant_bigazp, 3, 32)
    add(1, "dry/deq/group/fp8/M3/K64", case_dequant, 3, 64, FP8, "group", F16, "contig", 32)
    add(1, "dry/silu/g16T/fp8/M3/H48/bf16/nan", case_silu, 3, 48, BF16, FP8, "g16", True, "pad16", None, "nan")
    add(1, "dry/silu/token/i8/M2/H20/fp32/ub", case_silu, 2, 20, F32, INT8, "token", False, "expand", 0.01, None)
    add(1, "dry/smm/i8/M9/K40xN24/azp-token/nan_sa", case_smm, 9, 40, 24, INT8, F16, True, True, BF16, "overlap",
        "slice", "token", "nan_sa")
    add(1, "dry/smm/fp8/M3/K48xN20/zero_row", case_smm, 3, 48, 20, FP8, BF16, False, True, F32, "3d", "expk", None,
        "zero_row")
    add(1, "dry/bw/M5/K200xN130/bf16/tpad/nan_sa", case_bw, 5, 200, 130, BF16, "tpad", "odd", True, "offodd", "wt",
        "nan_sa")
    add(1, "dry/wo/w4g32a/M3/N40xK136/bf16/nan", case_wo, 3, 40, 136, 4, 32, False, BF16, F32, True, "padodd", "nan")
    add(1, "dry/wo/w8pc/M2/N24xK64/fp16/zero/perm", case_wo, 2, 24, 64, 8, -1, True, F16, F32, False, "expand", "zero",
        True)
    add(1, "dry/wdeq/w4g64s/N20xK136", case_wdeq, 20, 136, 4, 64, True, BF16, F32)
    add(1, "dry/azpadj/slice", case_azpadj, 40, 7, "slice", True)


# ------------------------------------------------------------------------------------------------------------------
# runner
# ------------------------------------------------------------------------------------------------------------------
STATE = {"current": None, "started": None, "results": [], "t0": time.time(), "done": False}
FATAL_PAT = re.compile(r"illegal memory access|illegal address|unspecified launch failure|misaligned address|"
                       r"CUDA error|device-side assert|an illegal instruction|CUDA_ERROR|cudaError", re.I)


def _env():
    env = {"torch": torch.__version__, "mode": "cpu-dry-run" if DRY else ("cpu-selftest" if SELFTEST else "cuda")}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    if DEV == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    return env


def write_json(extra=None):
    out = os.environ.get("OUT")
    if not out:
        return
    res = STATE["results"]
    summary = {s: sum(1 for r in res if r["status"] == s)
               for s in ("PASS", "WARN", "FAIL", "ERROR", "XERR", "SKIP", "FATAL")}
    doc = {"env": _env(), "summary": summary, "results": res, "elapsed_s": round(time.time() - STATE["t0"], 1)}
    if extra:
        doc.update(extra)
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_probe.json"), "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as e:
        print(f"gpu_probe: could not write {out}/gpu_probe.json: {e}", file=sys.stderr)


def _watchdog():
    while not STATE["done"]:
        time.sleep(1.0)
        cur, st = STATE["current"], STATE["started"]
        if cur is not None and st is not None and time.time() - st > ARGS.case_timeout:
            msg = (f"gpu_probe: HANG? case '{cur}' has run {time.time() - st:.0f} s (> --case-timeout "
                   f"{ARGS.case_timeout:g} s); aborting")
            print(msg, flush=True)
            STATE["results"].append(dict(name=cur, status="FATAL", detail="watchdog: " + msg, ratio=None,
                                         seconds=round(time.time() - st, 1)))
            write_json({"aborted": msg})
            sys.stdout.flush()
            os._exit(3)


def _cuda_alive():
    """Whether the CUDA context still works after an error (a sticky error poisons every later call)."""
    if DEV != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").add_(1).item()) == 2.0
    except Exception:  # noqa: BLE001
        return False


def run_case(i, total, prio, name, fn):
    torch.manual_seed(seed_of(name))
    STATE["current"], STATE["started"] = name, time.time()
    t = time.time()
    status, detail, ratio = "PASS", "", None
    fatal = False
    try:
        detail = fn() or ""
        sync()
    except Expected as e:
        status, detail = "XERR", str(e)
    except Warn as e:
        status, detail, ratio = "WARN", str(e), e.ratio
    except Fail as e:
        status, detail, ratio = "FAIL", str(e), e.ratio
        if not _cuda_alive():
            status, detail, fatal = "FATAL", f"{detail}; then the CUDA context failed", True
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        tb = traceback.format_exc().strip().splitlines()
        where = [ln.strip() for ln in tb if ln.strip().startswith("File ")][-2:]
        status, detail = "ERROR", msg[:400] + ("  @ " + " | ".join(where) if where else "")
        if DEV == "cuda" and (FATAL_PAT.search(str(e)) or not _cuda_alive()) and not _cuda_alive():
            status, fatal = "FATAL", True
    dt = time.time() - t
    STATE["current"] = None
    STATE["results"].append(dict(name=name, status=status, detail=detail, ratio=ratio, seconds=round(dt, 2)))
    print(f"[{i:3d}/{total}] {status:5s} {name}  {detail}  ({dt:.1f}s)", flush=True)
    if fatal:
        print(f"gpu_probe: FATAL CUDA error in case '{name}' (the last case started); the CUDA context is unusable, "
              f"stopping. Re-run it alone with --only '{re.escape(name)}' (and CUDA_LAUNCH_BLOCKING=1).", flush=True)
    return fatal


def main():
    if DRY:
        build_dry()
    else:
        build_full()
    cases = sorted(CASES, key=lambda c: c[0])  # stable: priority, then definition order
    if ARGS.only:
        pat = re.compile(ARGS.only)
        cases = [c for c in cases if pat.search(c[1])]
    names = [c[1] for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        print(f"gpu_probe: duplicate case names {sorted(dup)[:5]}", file=sys.stderr)
    if ARGS.list:
        for p, n, _ in cases:
            print(p, n)
        print(f"{len(cases)} cases")
        return 0
    env = _env()
    print(f"gpu_probe: {len(cases)} cases, {env}", flush=True)
    threading.Thread(target=_watchdog, daemon=True).start()
    total = len(cases)
    fatal = False
    for i, (prio, name, fn) in enumerate(cases, 1):
        if fatal:
            STATE["results"].append(dict(name=name, status="SKIP", detail="after a FATAL CUDA error", ratio=None,
                                         seconds=0))
            continue
        if time.time() - STATE["t0"] > ARGS.budget and not (DRY or SELFTEST):
            STATE["results"].append(dict(name=name, status="SKIP", detail=f"budget {ARGS.budget:g}s spent", ratio=None,
                                         seconds=0))
            print(f"[{i:3d}/{total}] SKIP  {name}  (budget)", flush=True)
            continue
        fatal = run_case(i, total, prio, name, fn)
    STATE["done"] = True
    res = STATE["results"]
    summary = {s: sum(1 for r in res if r["status"] == s)
               for s in ("PASS", "WARN", "FAIL", "ERROR", "XERR", "SKIP", "FATAL")}
    print("\n==== summary:", ", ".join(f"{k} {v}" for k, v in summary.items()),
          f"| {time.time() - STATE['t0']:.0f} s", flush=True)
    for r in res:
        if r["status"] in ("WARN", "FAIL", "ERROR", "FATAL"):
            print(f"  {r['status']:5s} {r['name']}: {r['detail']}")
    write_json()
    return 1 if (summary["FAIL"] or summary["ERROR"] or summary["FATAL"]) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"gpu_probe: interrupted during case '{STATE['current']}'", flush=True)
        write_json({"aborted": f"interrupted during {STATE['current']}"})
        sys.exit(130)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit):
            raise
        print(f"gpu_probe: aborted by {type(e).__name__}: {e} (last case started: '{STATE['current']}')", flush=True)
        write_json({"aborted": f"{type(e).__name__}: {e}; last case started: {STATE['current']}"})
        raise
