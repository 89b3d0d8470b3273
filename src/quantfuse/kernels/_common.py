"""Triton device helpers shared by every kernel family: exact rounding and saturating conversions.

The SPEC demands round-half-to-even with saturation for int8/int4 and a saturating RNE conversion for
fp8-e4m3. Triton's float->int cast truncates, so integer rounding uses the magic-number trick
(adding 1.5 * 2^23 pushes the fraction bits out of a float32 mantissa, which the FPU rounds to even).

The Triton interpreter's float32 -> fp8 cast neither rounds to even nor carries a rounded mantissa into
the exponent (126.5 becomes 64), so every fp8 store goes through `to_fp8e4m3`, which on the GPU is the
hardware `cvt.rn.satfinite` and under the interpreter an exact bit-level twin (`_fp8e4m3_bits`). The GPU
tests compare the two on every float32 pattern class so the twin cannot drift from the hardware.
"""

import inspect
import os

import torch
import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side ints. (`triton.cdiv` is a constexpr function whose host calls unwrap
    their arguments: ~5 us each on the H100 machine's CPU, dozens per launch.)"""
    return -(-a // b)


def cap_splits(splits: int, steps: int, min_steps_per_split: int) -> int:
    """An automatic split-K count held to at least `min_steps_per_split` K steps per split (and >= 1): on small
    weights the SM-count target alone gives one step per split, whose partials cost more than the split saves."""
    return max(1, min(splits, steps // min_steps_per_split))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n for host-side ints n >= 1 (0 for 0, as `triton.next_power_of_2`;
    see `cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


PLAN_CACHE_MAX = 4096  # distinct shapes remembered per launcher before its plan cache starts over


def remember_plan(cache: dict, key, plan) -> None:
    """Store a launcher's host-side plan for `key` (dropping all once PLAN_CACHE_MAX are held, so a
    workload of ever-new shapes cannot grow it without bound)."""
    if len(cache) >= PLAN_CACHE_MAX:
        cache.clear()
    cache[key] = plan


# Kernels take `INTERPRET: tl.constexpr` from here so the interpreter-safe twins are chosen at trace time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------
# Eager launches without Triton's per-call binding
# ----------------------------------------------------------------------------------------------------
# `kernel[grid](*args, **kw)` binds every argument through the JIT's generated binder, builds its cache key
# from the options, checks the kernel's globals and asks the driver for the device and stream on every call:
# 25-40 us of host time on the H100 machine, where the kernels of a decode step or a BERT layer take 5-50 us,
# so eager models were launch-bound (results/host_calls_ab.txt). `launch_kernel` keeps the compiled kernel of each
# (device, keyword arguments, argument specialization) and hands the arguments straight to its launcher.
# The key is at least as fine as Triton's own (each argument's type, pointer alignment, integer divisibility / one /
# width, descriptor block and, for Gluon's descriptors, shared layout), so a hit always runs the binary the JIT would
# pick; a miss, the interpreter, a launch hook (profilers) or anything unexpected goes through the JIT unchanged. (A
# hit does not re-check the kernel's global constants, which the JIT does: quantfuse's kernels never rebind theirs.)
# An argument of a type the key does not know makes every call a miss: until stop 49 that was every Gluon
# descriptor, so the sm90 Gluon kernels paid the JIT's binding on each eager call (results/host_calls_ab.txt, C).

class _Fallback(Exception):
    pass


def _arg_spec(a):
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is int:
        if a == 1:
            return 1
        return (a % 16 == 0, -(1 << 31) <= a < (1 << 31), 0 <= a < (1 << 63))
    if t is bool or t is float or a is None:
        return t
    if TensorDescriptor is not None and t is TensorDescriptor:
        return (a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None))
    if t is GluonTensorDescriptor:  # Triton keys it on its shared-memory layout too
        return (a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None))
    raise _Fallback


class _LaunchCache:
    __slots__ = ("fn", "entries", "names", "defaults", "enabled")

    def __init__(self, fn):
        self.fn = fn
        self.entries = {}
        params = getattr(fn, "params", None)
        self.enabled = params is not None
        if self.enabled:
            self.names = [p.name for p in params]
            self.defaults = {p.name: p.default for p in params}

    def miss(self, key, grid, args, kwargs):
        kernel = self.fn[grid](*args, **kwargs)
        if kernel is None or key is None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return  # (a tensor passed by keyword would key on its identity)
        if hasattr(kernel, "result"):  # asynchronous compilation hands back a future
            kernel = kernel.result()
        tail = []
        for name in self.names[len(args):]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif self.defaults.get(name, inspect.Parameter.empty) is not inspect.Parameter.empty:
                tail.append(self.defaults[name])
            else:  # a runtime argument passed by keyword: keep the JIT path for this key
                return
        remember_plan(self.entries, key, (kernel, tuple(tail)))


_LAUNCH_CACHES = {}


def launch_kernel(fn, grid, *args, **kwargs) -> None:
    """`fn[grid](*args, **kwargs)` for a @triton.jit (or Gluon) kernel, through the compiled kernel's own
    launcher once this combination has been compiled (see above). Runtime arguments go positionally,
    constexprs and launch options by keyword."""
    if INTERPRET or _HOOKS_SET():
        fn[grid](*args, **kwargs)
        return
    cache = _LAUNCH_CACHES.get(fn)
    if cache is None:
        cache = _LAUNCH_CACHES[fn] = _LaunchCache(fn)
    key = None
    if cache.enabled:
        try:
            key = (torch._C._cuda_getDevice(), tuple(kwargs.items()), tuple(map(_arg_spec, args)))
            hit = cache.entries.get(key)
        except (_Fallback, TypeError):  # an argument type we do not key, or an unhashable keyword
            key = hit = None
        if hit is not None:
            kernel, tail = hit
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            kernel.run(grid[0], g1, g2, _current_stream(key[0]), kernel.function, kernel.packed_metadata,
                       None, None, None, *args, *tail)
            return
    cache.miss(key, grid, args, kwargs)


def _hooks_set_fn():
    try:
        from triton import knobs

        runtime = knobs.runtime
        runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018 -- present, or the JIT path always

        def active(hook):  # Triton >= 3.5 keeps a chain of hooks, empty when none is set
            return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))

        return lambda: active(runtime.launch_enter_hook) or active(runtime.launch_exit_hook)
    except (ImportError, AttributeError):  # pragma: no cover -- older Triton: always the JIT path
        return lambda: True


_HOOKS_SET = _hooks_set_fn()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


try:  # grid dependency control (programmatic dependent launch, sm90+; Triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL_AVAILABLE = True
except ImportError:  # pragma: no cover -- older Triton: kernels launch in plain stream order
    gdc_launch_dependents = gdc_wait = None
    PDL_AVAILABLE = False


try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover -- older Triton: pointer loads only
    TensorDescriptor = None

try:  # Gluon's descriptors (with their shared-memory layout), which the sm90 Gluon kernels take
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except Exception:  # noqa: BLE001 -- no Gluon: _gluon.GLUON_AVAILABLE is False and no kernel passes one
    GluonTensorDescriptor = None


def describable(*tensors) -> bool:
    """Whether each 2-D tensor can back a tensor descriptor (TMA): unit inner stride, 16-byte aligned base
    address and row stride (one-byte elements: a multiple of 16)."""
    return TensorDescriptor is not None and all(t.dim() == 2 and _tma_strides_ok(t, t.stride(0), t.stride(1))
                                                for t in tensors)


def describable_transposed(t) -> bool:
    """`describable(t.t())` for a 2-D `t`, without making the view (a host-side aten call per launch)."""
    return TensorDescriptor is not None and t.dim() == 2 and _tma_strides_ok(t, t.stride(1), t.stride(0))


def _tma_strides_ok(t, row_stride: int, inner_stride: int) -> bool:
    return inner_stride == 1 and t.data_ptr() % 16 == 0 and (row_stride * t.element_size()) % 16 == 0


def descriptor(t, block) -> "TensorDescriptor":
    """A tensor descriptor over the 2-D `t` (see `describable`), loading [block[0], block[1]] boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def tma_variant(want_tma: bool, programs_per_sm: int, describable_operands: bool):
    """(use TMA, persistent programs per SM) for a launch that asked for `want_tma`: operands that cannot be
    described run pointer loads on a plain grid, since the persistence was measured with TMA only."""
    use_tma = bool(want_tma) and describable_operands
    return use_tma, (int(programs_per_sm) if use_tma or not want_tma else 0)


def persistent_grid(tiles: int, programs_per_sm: int, sms: int) -> int:
    """Programs of a persistent launch: programs_per_sm per SM, never more than the tiles; 0 per SM means a
    program per tile."""
    return min(tiles, programs_per_sm * sms) if programs_per_sm else tiles


def pdl_launch_options(enabled: bool) -> dict:
    """Launch keywords for programmatic dependent launch: `launch_pdl` where asked for, available and not
    under the interpreter (which has no grid dependency control); empty otherwise."""
    return {"launch_pdl": True} if enabled and pdl_supported() else {}


def pdl_supported() -> bool:
    """Programmatic dependent launch can be asked for: Triton has it and this is not the interpreter."""
    return PDL_AVAILABLE and not INTERPRET


@triton.jit
def tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M consecutive row tiles walk one column band together, so the tiles that run
    at the same time share A rows and B columns in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL, launched with `launch_pdl`): wait until the previous kernel in
    the stream has finished and its writes are visible, then let the next kernel launch. Called before the
    kernel's first global load or store, so only launch latency and index arithmetic overlap the previous
    kernel's tail: no read of its output and no write into memory it may still read (a buffer the caching
    allocator handed on) can race. Without PDL (and under the interpreter, PDL False) nothing is emitted."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

FP8_MAX = 448.0
INT8_MAX = 127.0

# 1.5 * 2^23: float32 x + C - C rounds x to the nearest integer, ties to even, for |x| < 2^22.
_RNE_MAGIC_F32 = 12582912.0
# 1.5 * 2^52: the same for float64 (|x| < 2^51).
_RNE_MAGIC_F64 = 6755399441055744.0


@triton.jit
def rne_f32(x):
    """Round float32 to the nearest integer (ties to even); exact for |x| < 2^22, callers clamp first."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def rne_f32_any(x):
    """Round float32 to nearest even for any magnitude (|x| >= 2^23 is already an integer)."""
    return tl.where(tl.abs(x) < 8388608.0, (x + 12582912.0) - 12582912.0, x)


@triton.jit
def rne_f64(x):
    """Round float64 to the nearest integer (ties to even) for |x| < 2^51."""
    return (x + 6755399441055744.0) - 6755399441055744.0


@triton.jit
def to_int8_rne(v):
    """rne(v) as int8 for float32 v already in [-128.5, 127.5) (callers clamp or bound it; `to_int8_sat`)."""
    return (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def to_int8_sat(v):
    """sat_int8(rne(v)) for float32 v. Clamping before rounding equals rounding before saturating
    because the bounds are integers; NaN becomes a bound (maxnum semantics), never a crash.

    The integer comes out of the float's bits rather than a float -> int conversion: v + 1.5 * 2^23 rounds v to
    even and leaves 2^22 + rne(v) in the mantissa, whose low byte is rne(v) as a two's complement int8
    (2^22 is a multiple of 256). On sm90 the conversion (F2I) issues on the quarter-rate pipe shared with
    exp2 / reciprocal; the byte extraction is free in the store's byte packing (offline SASS of the encoder's
    GELU epilogue: one FADD per element instead of FADD + FADD + F2I)."""
    return to_int8_rne(tl.minimum(tl.maximum(v, -128.0), 127.0))


@triton.jit
def to_int8_sat_nonneg(v):
    """to_int8_sat for v >= 0 (or NaN, which becomes 127): one bound to clamp, not two."""
    return to_int8_rne(tl.minimum(v, 127.0))


@triton.jit
def exp2_approx(x, INTERPRET: tl.constexpr):
    """2^x through the hardware approximation with denormals flushed (ex2.approx.ftz.f32, about 2 ulp): plain
    tl.exp2 compiles to the non-ftz form, which wraps the MUFU op in a range test and two multiplies per
    element. Results below 2^-126 become 0 (a softmax weight or an erfc tail that small is 0 after int8
    quantization anyway). The interpreter computes 2^x in float32."""
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def rcp_approx(x, INTERPRET: tl.constexpr):
    """1 / x through rcp.approx.ftz.f32 (1 ulp): one MUFU op, where tl.fdiv's div.full adds range fix-ups.
    The interpreter divides in float32."""
    if INTERPRET:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


# Divisors whose reciprocal and Markstein correction stay in float32's normal range (`div_rn_by`).
DIV_BY_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126
DIV_BY_MAX = tl.constexpr(8.507059173023462e37)  # 2^126


def div_rn_by_applies(d: float) -> bool:
    """Whether a host-side float32 divisor is in `div_rn_by`'s range (NaN is not)."""
    return DIV_BY_MIN.value <= d <= DIV_BY_MAX.value


@triton.jit
def div_rn_by(y, d, r):
    """y / d correctly rounded (IEEE div.rn) from r = 1 / d correctly rounded (tl.math.div_rn once per divisor,
    not per element), for d in [DIV_BY_MIN, DIV_BY_MAX]: q0 = y r, then one Markstein correction
    q = fma(fma(-q0, d, y), r, q0) (the remainder y - q0 d is exact in an FMA), three FMA-pipe instructions in
    place of div.rn's reciprocal, five FFMAs, range check and branch per element. Checked against exact division
    on 2e7 random and near-tie cases (silu_quant's module doc). An infinite or NaN quotient q0 (y infinite or NaN,
    or an overflow) is returned as is, which is then y / d (the correction would make inf - inf)."""
    q0 = y * r
    q = tl.fma(tl.fma(-q0, d, y), r, q0)
    return tl.where(tl.abs(q0) < float("inf"), q, q0)


@triton.jit
def to_int8_sat_azp(v, azp):
    """sat_int8(rne(v) + azp), exact for any int32 azp.

    Clamping v to [-128 - azp, 127 - azp] before rounding equals saturating after adding (integer bounds).
    With |azp| < 2^21 every step is exact in float32; a larger zero point (only a near-constant region
    gives one) takes the float64 path, whose mantissa holds every int32 bound exactly."""
    if tl.max(tl.abs(azp.to(tl.float32))) < 2097152.0:  # in float: abs(-2^31) overflows int32
        azp_f = azp.to(tl.float32)
        w = tl.minimum(tl.maximum(v, -128.0 - azp_f), 127.0 - azp_f)
        q = rne_f32(w) + azp_f
    else:
        # distinct names: Triton requires a variable to keep one type across both branches
        azp_d = azp.to(tl.float64)
        w_d = tl.minimum(tl.maximum(v.to(tl.float64), -128.0 - azp_d), 127.0 - azp_d)
        q = (rne_f64(w_d) + azp_d).to(tl.float32)
    return q.to(tl.int8)


@triton.jit
def _fp8e4m3_bits(v):
    """Bit-exact float32 -> fp8-e4m3fn (RNE, saturating to +-448) using integer arithmetic only."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # Normal range (|v| >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even; a carry
    # rolls into the exponent naturally. Then rebias the exponent from 127 to 7 (120 << 3 = 960).
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded.to(tl.int32) - 960
    # Subnormal range: the code is rne(|v| * 2^9); 8 rolls into the smallest normal, code 8.
    absv = mag.to(tl.float32, bitcast=True)
    sub = rne_f32(absv * 512.0).to(tl.int32)
    code = tl.where(mag < 0x3C800000, sub, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN stays NaN
    return (code | (sign.to(tl.int32) << 7)).to(tl.uint8)


@triton.jit
def to_fp8e4m3(v, INTERPRET: tl.constexpr):
    """sat(rne(v)) to float8_e4m3fn: the hardware conversion on GPU, the exact twin in the interpreter."""
    if INTERPRET:
        return _fp8e4m3_bits(v).to(tl.float8e4nv, bitcast=True)
    else:
        return tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def fp8e4m3_twin(v):
    """The bit-level twin as an fp8 value, for the GPU test that checks it against the hardware cast."""
    return _fp8e4m3_bits(v).to(tl.float8e4nv, bitcast=True)


@triton.jit
def quantize_value(v, IS_FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Symmetric q = sat(rne(v)) to int8 or fp8, v = x / scale already divided."""
    if IS_FP8:
        return to_fp8e4m3(v, INTERPRET)
    else:
        return to_int8_sat(v)


@triton.jit
def _bf16_bits(x):
    """Bit-exact float32 -> bfloat16, round to nearest even; NaN stays a quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(DTYPE) with round-to-nearest-even. The interpreter's own float32 -> bfloat16 cast does not
    round to even (about half the values come out one ulp off), so it gets the exact twin there."""
    if INTERPRET and DTYPE == tl.bfloat16:
        return _bf16_bits(x.to(tl.float32))
    else:
        return x.to(DTYPE)


# Per-tile arrival counters of the fused split-K reductions (weight-only GEMMs, the encoder's int8 GEMM): one
# zeroed int32 slot of COUNTER_SLOTS per stream, from a pool allocated per device at the first eager call (never
# while a CUDA graph is being captured: the graph's memory pool would own it). Every launch leaves its counters at
# zero again (the last program of a tile resets its counter) and launches on one stream run one after another, so
# a slot is reused without a memset; streams (the graph-capture stream too) get different slots, so launches that
# overlap on different streams never share counters. Without a slot (more than COUNTER_STREAMS streams, more tiles
# than slots, or a capture before any eager call) the caller reduces another way.
COUNTER_SLOTS = 1 << 14
COUNTER_STREAMS = 8
_COUNTER_POOLS: dict = {}


def tile_counters(device: torch.device, tiles: int) -> "torch.Tensor | None":
    """`tiles` zeroed int32 arrival counters for a launch on the current stream of `device`, or None."""
    if tiles > COUNTER_SLOTS:
        return None
    cuda = device.type == "cuda"
    dev_key = (device.type, device.index)
    pool = _COUNTER_POOLS.get(dev_key)
    if pool is None:
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros((COUNTER_STREAMS, COUNTER_SLOTS), dtype=torch.int32, device=device)
        if cuda:
            torch.cuda.current_stream(device).synchronize()  # zeroed before any stream uses a slot
        pool = _COUNTER_POOLS[dev_key] = {"buf": buf, "slots": {}}
    stream = torch.cuda.current_stream(device).cuda_stream if cuda else 0
    slot = pool["slots"].get(stream)
    if slot is None:
        if len(pool["slots"]) >= COUNTER_STREAMS:
            return None
        slot = pool["slots"][stream] = len(pool["slots"])
    return pool["buf"][slot]
