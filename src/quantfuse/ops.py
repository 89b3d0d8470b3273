"""The public op surface of quantfuse (SPEC.md): validation, dispatch and torch.library registration.

Each op validates its arguments (clear ValueError/TypeError before any launch), then calls a
`quantfuse::*` custom op. The custom op runs the Triton kernel for CUDA tensors (or CPU tensors under
`backend("triton")` with TRITON_INTERPRET=1) and the reference (`quantfuse.reference`) otherwise. Fake
implementations give shapes to torch.compile, so every op traces with fullgraph=True and captures in
CUDA graphs (no host syncs anywhere on the GPU path).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference as ref
from ._backend import backend, use_triton
from ._validation import (
    FLOAT_DTYPES,
    QUANT_DTYPES,
    check_dtype_arg,
    check_group_size,
    check_last_dim_contiguous,
    check_same_device,
    check_scale,
    check_tensor,
    rows_view,
)

# Each section below appends its public names to __all__ (quantfuse re-exports them).
__all__ = ["backend"]

Tensor = torch.Tensor


class _EagerFastOp:
    """A `torch.library` custom op whose plain eager calls skip the dispatcher.

    The custom-op wrapper costs 150-250 us of host time per call (measured on the H100 machine: 156 us
    for quantize_per_token, 304 us for scaled_mm, against 51 us for F.linear), more than the kernels take
    at decode sizes, which made eager models launch-bound. Plain tensors outside torch.compile call the
    implementation directly; under torch.compile, with fake or functional tensors, any tensor subclass, or an
    input that requires grad while grad mode is on, the registered op runs, so tracing, fakes and
    `torch.ops.quantfuse.*` behave as before, and autograd sees the same op on every path (the ops have no
    autograd formula: a backward through one raises, rather than differentiating the CPU reference on one path
    and nothing on another)."""

    def __init__(self, op):
        self.op = op
        self.fn = op._init_fn
        self.register_fake = op.register_fake

    def __call__(self, *args):
        grad = torch.is_grad_enabled()
        if torch.compiler.is_compiling() or any(
            isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or (grad and a.requires_grad)) for a in args
        ):
            return self.op(*args)
        return self.fn(*args)


def _custom_op(name: str, mutates_args=()):
    def wrap(fn):
        return _EagerFastOp(torch.library.custom_op(name, mutates_args=mutates_args)(fn))

    return wrap


def _kernels():
    # Imported lazily so `import quantfuse` stays cheap and works where Triton cannot compile.
    from .kernels import quantize as kq

    return kq


def _m_of(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _check_activation(x, name: str = "x") -> None:
    check_tensor(name, x, FLOAT_DTYPES, ndim_min=1)
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty last dimension, got shape {tuple(x.shape)}")
    check_last_dim_contiguous(name, x)


def _check_scale_ub(scale_ub, x: Tensor) -> None:
    if scale_ub is not None:
        check_scale("scale_ub", scale_ub, x, (1,))


# ----------------------------------------------------------------------------------------------------
# Section 1: activation quantization
# ----------------------------------------------------------------------------------------------------
__all__ += ["quantize_per_tensor", "quantize_per_token", "quantize_per_group", "dequantize"]

@_custom_op("quantfuse::quantize_per_tensor_dynamic", mutates_args=())
def _quantize_per_tensor_dynamic(x: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scale = _kernels().quantize_per_tensor(x2d, dtype, None, None)
        return q.view(x.shape), scale
    q, scale, _ = ref.quantize_per_tensor(x, dtype)
    return q, scale


@_quantize_per_tensor_dynamic.register_fake
def _(x, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device), x.new_empty((1,), dtype=torch.float32)


@_custom_op("quantfuse::quantize_per_tensor_static", mutates_args=())
def _quantize_per_tensor_static(x: Tensor, dtype: torch.dtype, scale: Tensor, azp: Optional[Tensor]) -> Tensor:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, _ = _kernels().quantize_per_tensor(x2d, dtype, scale.reshape(1), None if azp is None else azp.reshape(1))
        return q.view(x.shape)
    return ref.quantize_per_tensor(x, dtype, scale, azp)[0]


@_quantize_per_tensor_static.register_fake
def _(x, dtype, scale, azp):
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def quantize_per_tensor(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor] = None, azp: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """q = sat(rne(x / scale) [+ azp]) with one scale for the whole tensor.

    Dynamic (scale=None): scale = max(amax(|x|), 1e-10) / qmax, returned with shape [1].
    Static: the given float32 `scale` (numel 1) and optional int32 `azp` (numel 1, int8 only) are used as
    is and returned as the same tensor objects. Returns (q, scale, azp_or_None); q has x's shape."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    if scale is None:
        if azp is not None:
            raise ValueError("azp: a zero point needs a static scale; got azp with scale=None")
        q, s = _quantize_per_tensor_dynamic(x, dtype)
        return q, s, None
    check_scale("scale", scale, x, (1,))
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, x)
        if azp.numel() != 1:
            raise ValueError(f"azp: expected numel 1 (per-tensor zero point), got shape {tuple(azp.shape)}")
        if dtype != torch.int8:
            raise ValueError(f"azp: asymmetric quantization needs dtype=torch.int8, got {dtype}")
    return _quantize_per_tensor_static(x, dtype, scale, azp), scale, azp


@_custom_op("quantfuse::quantize_per_token", mutates_args=())
def _quantize_per_token(
    x: Tensor, dtype: torch.dtype, scale_ub: Optional[Tensor], symmetric: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scale, azp = _kernels().quantize_per_token(x2d, dtype, scale_ub, symmetric)
        q = q.view(x.shape)
    else:
        q, scale, azp = ref.quantize_per_token(x, dtype, scale_ub, symmetric)
    return q, scale, torch.empty(0, dtype=torch.int32, device=x.device) if azp is None else azp


@_quantize_per_token.register_fake
def _(x, dtype, scale_ub, symmetric):
    m = _m_of(x)
    azp = x.new_empty((0,) if symmetric else (m, 1), dtype=torch.int32)
    return torch.empty(x.shape, dtype=dtype, device=x.device), x.new_empty((m, 1), dtype=torch.float32), azp


def quantize_per_token(
    x: Tensor, dtype: torch.dtype, scale_ub: Optional[Tensor] = None, symmetric: bool = True
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One dynamic scale per token (row of the flattened [M, K] input).

    Symmetric: scale[i] = min(max(amax_i, 1e-10) / qmax, scale_ub), q = sat(rne(x / scale)).
    Asymmetric (int8 only): scale[i] = max(max_i - min_i, 1e-10) / 255, azp[i] = rne(-128 - min_i / scale[i])
    as int32, q = sat(rne(x / scale) + azp). Returns (q, scale [M, 1], azp [M, 1] or None)."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    _check_scale_ub(scale_ub, x)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric: expected a bool, got {type(symmetric).__name__}")
    if not symmetric and dtype != torch.int8:
        raise ValueError(f"symmetric: asymmetric quantization needs dtype=torch.int8, got {dtype}")
    if not symmetric and scale_ub is not None:
        raise ValueError("scale_ub: only meaningful for symmetric quantization; got symmetric=False")
    q, scale, azp = _quantize_per_token(x, dtype, scale_ub, symmetric)
    return q, scale, (None if symmetric else azp)


@_custom_op("quantfuse::quantize_per_group", mutates_args=())
def _quantize_per_group(
    x: Tensor, dtype: torch.dtype, group_size: int, scale_ub: Optional[Tensor], transposed_scales: bool
) -> Tuple[Tensor, Tensor]:
    x2d = rows_view(x)
    if use_triton(x) and x.numel() > 0:
        q, scales = _kernels().quantize_per_group(x2d, dtype, group_size, scale_ub, transposed_scales)
        return q.view(x.shape), scales
    q, scales, _ = ref.quantize_per_group(x, dtype, group_size, scale_ub, transposed_scales)
    return q, scales


@_quantize_per_group.register_fake
def _(x, dtype, group_size, scale_ub, transposed_scales):
    m, groups = _m_of(x), x.shape[-1] // group_size
    if transposed_scales:
        scales = x.new_empty((groups, m), dtype=torch.float32).t()
    else:
        scales = x.new_empty((m, groups), dtype=torch.float32)
    return torch.empty(x.shape, dtype=dtype, device=x.device), scales


def quantize_per_group(
    x: Tensor,
    dtype: torch.dtype,
    group_size: int = 128,
    scale_ub: Optional[Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[Tensor, Tensor, None]:
    """One dynamic scale per `group_size` consecutive elements of each row.

    scales[i, g] = min(max(amax(|x[i, g*G:(g+1)*G]|), 1e-10) / qmax, scale_ub); q = sat(rne(x / scale)).
    group_size is a power of two in 16..512 dividing K. transposed_scales=True returns the [M, K/G] scales
    as a view of a contiguous [K/G, M] tensor. Returns (q, scales, None)."""
    _check_activation(x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    check_group_size(group_size, x.shape[-1])
    _check_scale_ub(scale_ub, x)
    if not isinstance(transposed_scales, bool):
        raise TypeError(f"transposed_scales: expected a bool, got {type(transposed_scales).__name__}")
    q, scales = _quantize_per_group(x, dtype, group_size, scale_ub, transposed_scales)
    return q, scales, None


@_custom_op("quantfuse::dequantize", mutates_args=())
def _dequantize(
    q: Tensor, scale: Tensor, azp: Optional[Tensor], group_size: Optional[int], out_dtype: torch.dtype
) -> Tensor:
    if use_triton(q) and q.numel() > 0:
        out = _kernels().dequantize(rows_view(q), scale, azp, group_size, out_dtype)
        return out.view(q.shape)
    return ref.dequantize(q, scale, azp, group_size, out_dtype)


@_dequantize.register_fake
def _(q, scale, azp, group_size, out_dtype):
    return torch.empty(q.shape, dtype=out_dtype, device=q.device)


def dequantize(
    q: Tensor,
    scale: Tensor,
    azp: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """x_hat = scale * (q - azp), float32 math, one rounding to out_dtype. Inverts the quantize ops:
    scale numel 1 (per tensor), numel M (per token), or [M, K/group_size] (per group, any strides)."""
    check_tensor("q", q, QUANT_DTYPES, ndim_min=1)
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a non-empty last dimension, got shape {tuple(q.shape)}")
    check_last_dim_contiguous("q", q)
    check_dtype_arg("out_dtype", out_dtype, FLOAT_DTYPES)
    m, k = _m_of(q), q.shape[-1]
    check_tensor("scale", scale, (torch.float32,))
    check_same_device("scale", scale, q, "q")
    if group_size is not None:
        check_group_size(group_size, k)
        if tuple(scale.shape) != (m, k // group_size):
            raise ValueError(
                f"scale: expected shape {(m, k // group_size)} for group_size={group_size}, got {tuple(scale.shape)}"
            )
    elif scale.numel() not in (1, m):
        raise ValueError(f"scale: expected numel 1 (per tensor) or {m} (per token), got shape {tuple(scale.shape)}")
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, q, "q")
        if q.dtype != torch.int8:
            raise ValueError(f"azp: zero points need int8 codes, got q of dtype {q.dtype}")
        if azp.numel() not in (1, m):
            raise ValueError(f"azp: expected numel 1 or {m}, got shape {tuple(azp.shape)}")
    return _dequantize(q, scale, azp, group_size, out_dtype)


# ----------------------------------------------------------------------------------------------------
# Section 2: scaled matmul with fused epilogues
# ----------------------------------------------------------------------------------------------------
__all__ += ["scaled_mm", "scaled_mm_blockwise", "azp_adjustment"]


def _mm_kernels():
    from .kernels import scaled_mm as kmm

    return kmm


def _mm_out_shape(a: Tensor, b: Tensor):
    return (*a.shape[:-1], b.shape[1])


def _check_mm_operands(a, b, dtypes) -> Tuple[int, int, int]:
    check_tensor("a", a, dtypes, ndim_min=1)
    check_last_dim_contiguous("a", a)
    check_tensor("b", b, dtypes)
    if b.dim() != 2:
        raise ValueError(f"b: expected a 2-D [K, N] tensor, got shape {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected the dtype of a ({a.dtype}), got {b.dtype}")
    check_same_device("b", b, a, "a")
    k = a.shape[-1]
    if k < 1:
        raise ValueError(f"a: expected K = a.shape[-1] >= 1, got shape {tuple(a.shape)}")
    if b.shape[0] != k:
        raise ValueError(f"b: expected {k} rows (K of a), got shape {tuple(b.shape)}")
    if b.shape[1] < 1:
        raise ValueError(f"b: expected N = b.shape[1] >= 1, got shape {tuple(b.shape)}")
    return _m_of(a), k, b.shape[1]


def _check_mm_bias(bias, a: Tensor, n: int) -> None:
    if bias is None:
        return
    check_tensor("bias", bias, FLOAT_DTYPES)
    check_same_device("bias", bias, a, "a")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias: expected shape ({n},) (one value per output column), got {tuple(bias.shape)}")


@_custom_op("quantfuse::scaled_mm", mutates_args=())
def _scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    azp_adj: Optional[Tensor],
    azp: Optional[Tensor],
) -> Tensor:
    if use_triton(a) and a.numel() > 0:
        out = _mm_kernels().scaled_mm(
            rows_view(a), b, scale_a, scale_b, out_dtype,
            None if bias is None else bias.contiguous(),
            None if azp_adj is None else azp_adj.reshape(-1).contiguous(),
            azp,
        )
        return out.view(_mm_out_shape(a, b))
    return ref.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


@_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp):
    return a.new_empty(_mm_out_shape(a, b), dtype=out_dtype)


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[Tensor] = None,
    azp_adj: Optional[Tensor] = None,
    azp: Optional[Tensor] = None,
) -> Tensor:
    """Quantized GEMM with a fused dequantization epilogue (the four CUTLASS epilogues of seed 000).

    a [..., K] and b [K, N], both int8 (int32 accumulation, exact) or both float8_e4m3fn (float32
    accumulation); a needs a unit last stride (padded rows are fine), b any strides (the transpose of a
    row-major [N, K] weight is the fast path). With acc = a @ b:
        out[i, j] = (scale_a[i] * scale_b[j]) * float(acc[i, j] - corr[i, j]) + bias[j]
    scale_a: float32, numel 1 or M; scale_b: float32, numel 1 or N; bias [N] (fp32/bf16/fp16, added in
    float32). corr is 0, azp_adj[j] (azp=None; azp_adj = z_a * colsum(b), see `azp_adjustment`) or
    azp[i] * azp_adj[j] (per-token int32 azp, azp_adj = colsum(b)), subtracted exactly in int32 (int8
    only). One rounding to out_dtype (bf16, fp16 or fp32). Returns [..., N]."""
    m, k, n = _check_mm_operands(a, b, QUANT_DTYPES)
    check_scale("scale_a", scale_a, a, (1, m), "a")
    check_scale("scale_b", scale_b, a, (1, n), "a")
    check_dtype_arg("out_dtype", out_dtype, FLOAT_DTYPES)
    _check_mm_bias(bias, a, n)
    if azp is not None and azp_adj is None:
        raise ValueError("azp: per-token zero points need azp_adj = azp_adjustment(b) (colsum of b); got azp_adj=None")
    if azp_adj is not None:
        if a.dtype != torch.int8:
            raise ValueError(f"azp_adj: zero-point epilogues need int8 operands, got a of dtype {a.dtype}")
        check_tensor("azp_adj", azp_adj, (torch.int32,))
        check_same_device("azp_adj", azp_adj, a, "a")
        if azp_adj.numel() != n:
            raise ValueError(f"azp_adj: expected numel {n} (one per output column), got shape {tuple(azp_adj.shape)}")
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, a, "a")
        if azp.numel() != m:
            raise ValueError(f"azp: expected numel {m} (one zero point per token), got shape {tuple(azp.shape)}")
    return _scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


def azp_adjustment(b_q: Tensor, azp: Optional[Tensor] = None) -> Tensor:
    """Offline zero-point term for `scaled_mm`: int32 [N] colsum(b_q) (use with per-token azp), or
    z_a * colsum(b_q) for a per-tensor int32 zero point z_a (numel 1; use without azp)."""
    check_tensor("b_q", b_q, (torch.int8,))
    if b_q.dim() != 2:
        raise ValueError(f"b_q: expected a 2-D [K, N] tensor, got shape {tuple(b_q.shape)}")
    if azp is not None:
        check_tensor("azp", azp, (torch.int32,))
        check_same_device("azp", azp, b_q, "b_q")
        if azp.numel() != 1:
            raise ValueError(
                f"azp: expected numel 1 (a per-tensor zero point; per-token ones are applied in scaled_mm), "
                f"got shape {tuple(azp.shape)}"
            )
    return ref.azp_adjustment(b_q, azp)


@_custom_op("quantfuse::scaled_mm_blockwise", mutates_args=())
def _scaled_mm_blockwise(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor]
) -> Tensor:
    if use_triton(a) and a.numel() > 0:
        out = _mm_kernels().scaled_mm_blockwise(
            rows_view(a), b, scale_a, scale_b, out_dtype, None if bias is None else bias.contiguous()
        )
        return out.view(_mm_out_shape(a, b))
    return ref.scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias)


@_scaled_mm_blockwise.register_fake
def _(a, b, scale_a, scale_b, out_dtype, bias):
    return a.new_empty(_mm_out_shape(a, b), dtype=out_dtype)


def scaled_mm_blockwise(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[Tensor] = None,
    block: Tuple[int, int] = (128, 128),
) -> Tensor:
    """Block-scaled fp8 GEMM (DeepSeek-style): 1x128 activation groups, 128x128 weight blocks.

        out[i, j] = sum_kb (scale_a[i, kb] * scale_b[kb, j // 128]) * (a[i, kb-block] . b[kb-block, j]) + bias[j]
    a [..., K] and b [K, N] float8_e4m3fn; scale_a float32 [M, ceil(K/128)] in any memory layout (row-major
    or the transposed view from quantize_per_group(..., transposed_scales=True)); scale_b float32
    [ceil(K/128), ceil(N/128)]; K and N need not be multiples of 128. Returns [..., N] in out_dtype."""
    m, k, n = _check_mm_operands(a, b, (torch.float8_e4m3fn,))
    if not isinstance(block, (tuple, list)) or tuple(block) != (128, 128):
        raise ValueError(f"block: expected (128, 128) (1x128 activation groups, 128x128 weight blocks), got {block!r}")
    kb, nb = -(-k // 128), -(-n // 128)
    check_tensor("scale_a", scale_a, (torch.float32,))
    check_same_device("scale_a", scale_a, a, "a")
    if tuple(scale_a.shape) != (m, kb):
        raise ValueError(f"scale_a: expected shape {(m, kb)} ([M, ceil(K/128)]), got {tuple(scale_a.shape)}")
    check_tensor("scale_b", scale_b, (torch.float32,))
    check_same_device("scale_b", scale_b, a, "a")
    if tuple(scale_b.shape) != (kb, nb):
        raise ValueError(f"scale_b: expected shape {(kb, nb)} ([ceil(K/128), ceil(N/128)]), got {tuple(scale_b.shape)}")
    check_dtype_arg("out_dtype", out_dtype, FLOAT_DTYPES)
    _check_mm_bias(bias, a, n)
    return _scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias)



# ----------------------------------------------------------------------------------------------------
# Section 3: fused SiLU-and-mul with quantization
# ----------------------------------------------------------------------------------------------------
__all__ += ["silu_and_mul_quant"]

SILU_QUANT_GROUP_SIZES = (16, 32, 64, 128, 256)


def _silu_kernels():
    from .kernels import silu_quant as ksq

    return ksq


def _silu_out_shape(x: Tensor):
    return (*x.shape[:-1], x.shape[-1] // 2)


@_custom_op("quantfuse::silu_and_mul_quant_dynamic", mutates_args=())
def _silu_and_mul_quant_dynamic(
    x: Tensor, dtype: torch.dtype, group_size: Optional[int], scale_ub: Optional[Tensor], transposed_scales: bool
) -> Tuple[Tensor, Tensor]:
    if use_triton(x) and x.numel() > 0:
        q, scales = _silu_kernels().silu_and_mul_quant(rows_view(x), dtype, group_size, None, scale_ub,
                                                       transposed_scales)
        return q.view(_silu_out_shape(x)), scales
    return ref.silu_and_mul_quant(x, dtype, group_size, None, scale_ub, transposed_scales)


@_silu_and_mul_quant_dynamic.register_fake
def _(x, dtype, group_size, scale_ub, transposed_scales):
    m = _m_of(x)
    if group_size is None:
        scales = x.new_empty((m, 1), dtype=torch.float32)
    elif transposed_scales:
        scales = x.new_empty((x.shape[-1] // 2 // group_size, m), dtype=torch.float32).t()
    else:
        scales = x.new_empty((m, x.shape[-1] // 2 // group_size), dtype=torch.float32)
    return torch.empty(_silu_out_shape(x), dtype=dtype, device=x.device), scales


@_custom_op("quantfuse::silu_and_mul_quant_static", mutates_args=())
def _silu_and_mul_quant_static(x: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    if use_triton(x) and x.numel() > 0:
        q, _ = _silu_kernels().silu_and_mul_quant(rows_view(x), dtype, None, scale, None, False)
        return q.view(_silu_out_shape(x))
    return ref.silu_and_mul_quant(x, dtype, scale=scale)[0]


@_silu_and_mul_quant_static.register_fake
def _(x, dtype, scale):
    return torch.empty(_silu_out_shape(x), dtype=dtype, device=x.device)


def silu_and_mul_quant(
    x: Tensor,
    dtype: torch.dtype,
    group_size: Optional[int] = None,
    scale: Optional[Tensor] = None,
    scale_ub: Optional[Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Fused y = silu(gate) * up = gate / (1 + exp(-gate)) * up, then quantization, in one pass.

    x is [..., 2H] = [gate | up] (fp16, bf16 or fp32); y is float32 and never rounded before quantizing.
    - group_size g (16..256, a power of two dividing H): scales[i, j] = min(max(amax |y[i, jg:(j+1)g]|,
      1e-10) / qmax, scale_ub), returned [M, H/g]; transposed_scales=True gives the same values as a view
      of a contiguous [H/g, M] tensor (the layout a blockwise GEMM reads along M).
    - scale (float32, numel 1): static per tensor, q = sat(rne(y / scale)); returns that same tensor.
    - neither: dynamic per token, scales [M, 1] (with optional scale_ub).
    q = sat(rne(y / scale)) with a true division, to int8 or float8_e4m3fn. Returns (q [..., H], scales)."""
    check_tensor("x", x, FLOAT_DTYPES, ndim_min=1)
    two_h = x.shape[-1]
    if two_h == 0 or two_h % 2 != 0:
        raise ValueError(f"x: expected an even, non-zero last dimension 2H ([gate | up]), got {two_h}")
    check_last_dim_contiguous("x", x)
    check_dtype_arg("dtype", dtype, QUANT_DTYPES)
    if not isinstance(transposed_scales, bool):
        raise TypeError(f"transposed_scales: expected a bool, got {type(transposed_scales).__name__}")
    if scale is not None:
        if group_size is not None:
            raise ValueError(
                f"group_size: a static scale is per tensor; expected group_size=None with scale given, "
                f"got {group_size!r}"
            )
        if scale_ub is not None:
            raise ValueError("scale_ub: only meaningful for dynamic scales; expected None with a static scale, "
                             "got a tensor")
        if transposed_scales:
            raise ValueError("transposed_scales: only meaningful with group_size; expected False with a static "
                             "scale, got True")
        check_scale("scale", scale, x, (1,))
        return _silu_and_mul_quant_static(x, dtype, scale), scale
    if group_size is not None:
        check_group_size(group_size, group_size, allowed=SILU_QUANT_GROUP_SIZES)
        if (two_h // 2) % group_size != 0:
            raise ValueError(
                f"group_size: expected a divisor of H = {two_h // 2} (half the last dimension of x), got {group_size}"
            )
    elif transposed_scales:
        raise ValueError("transposed_scales: only meaningful with group_size; expected False for per-token "
                         "scales, got True")
    _check_scale_ub(scale_ub, x)
    return _silu_and_mul_quant_dynamic(x, dtype, group_size, scale_ub, transposed_scales)



# ----------------------------------------------------------------------------------------------------
# Section 4: weight-only quantized GEMM
# ----------------------------------------------------------------------------------------------------
__all__ += ["QuantizedWeight", "quantize_weight", "weight_only_mm"]

from .weights import VALID_BITS, VALID_GROUP_SIZES, QuantizedWeight  # noqa: E402
from .weights import check_scale_dtype as _check_scale_dtype  # noqa: E402
from .weights import quantize_weight as _quantize_weight_impl  # noqa: E402
from .weights import unpack_codes as _unpack_codes  # noqa: E402


def _weight_only_kernels():
    from .kernels import weight_only as kw

    return kw


def _ref_dequantize_packed(qweight, scales, zeros, bits, group_size, k, dtype):
    u = _unpack_codes(qweight, bits, k)
    z = zeros if zeros is not None else torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    return ref.dequantize_weight(u, scales, z, group_size, dtype)


@_custom_op("quantfuse::dequantize_weight", mutates_args=())
def _dequantize_weight(
    qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], bits: int, group_size: int, k: int,
    dtype: torch.dtype,
) -> Tensor:
    if use_triton(qweight) and qweight.numel() > 0:
        return _weight_only_kernels().dequantize(qweight, scales, zeros, bits, group_size, k, dtype)
    return _ref_dequantize_packed(qweight, scales, zeros, bits, group_size, k, dtype)


@_dequantize_weight.register_fake
def _(qweight, scales, zeros, bits, group_size, k, dtype):
    return qweight.new_empty((qweight.shape[0], k), dtype=dtype)


@_custom_op("quantfuse::weight_only_mm", mutates_args=())
def _weight_only_mm(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], perm: Optional[Tensor],
    bias: Optional[Tensor], bits: int, group_size: int, n: int,
) -> Tensor:
    x2d = rows_view(x)
    if perm is not None:
        x2d = x2d.index_select(1, perm)  # act-order: columns in stored (group-sorted) order
    k = x2d.shape[1]
    if use_triton(x) and x2d.shape[0] > 0:
        out = _weight_only_kernels().weight_only_mm(x2d, qweight, scales, zeros, bias, bits, group_size, n)
    else:
        w_hat = _ref_dequantize_packed(qweight, scales, zeros, bits, group_size, k, x.dtype)
        out = ref.weight_only_mm(x2d, w_hat, bias)
    return out.view(*x.shape[:-1], n)


@_weight_only_mm.register_fake
def _(x, qweight, scales, zeros, perm, bias, bits, group_size, n):
    return x.new_empty((*x.shape[:-1], n))


def quantize_weight(w: Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Quantize a [N, K] weight (SPEC section 4): one scale (and, asymmetric, one integer zero point)
    per (group of `group_size` consecutive k, output channel); group_size=-1 is per channel.

    Symmetric: s = max(amax, 1e-10) / qmax, q in [-qmax-1, qmax]. Asymmetric: unsigned q in
    [0, 2^bits - 1] with z = rne(-min(w, 0) / s). w ~= (q - z) * s. K must be a multiple of 8; a last
    partial group is allowed. scale_dtype (float32, float16 or bfloat16): the dtype of the stored scales;
    a 16-bit s is the float32 one rounded up, and the codes are computed with it. Scales in the
    activation dtype let `weight_only_mm` convert two weights per packed 16-bit instruction (the "packed"
    conversion: int4 with float16 / bfloat16 activations, int8 with float16), with the same result."""
    check_tensor("w", w, FLOAT_DTYPES)
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    if w.shape[0] == 0 or w.shape[1] == 0 or w.shape[1] % 8 != 0:
        raise ValueError(f"w: expected N >= 1 and K a positive multiple of 8, got shape {tuple(w.shape)}")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in VALID_BITS:
        raise ValueError(f"bits: expected one of {VALID_BITS}, got {bits!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in VALID_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {VALID_GROUP_SIZES}, got {group_size!r}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric: expected a bool, got {type(symmetric).__name__}")
    _check_scale_dtype(scale_dtype)
    return _quantize_weight_impl(w, bits, group_size, symmetric, scale_dtype)


def weight_only_mm(x: Tensor, qw: QuantizedWeight, bias: Optional[Tensor] = None) -> Tensor:
    """x [..., K] (float16 / bfloat16) @ w_hat.T (+ bias [N]) with w_hat = qw.dequantize(x.dtype):
    float32 accumulation, one rounding to x.dtype. Returns [..., N].

    Kernels may apply each group's scale to the float32 sum of x times the exact integers u - z instead of
    rounding every weight to w_hat first (on the H100 the M = 1 GEMV does): that is x @ W.T with the
    unrounded W = (u - z) * s, within one rounding per weight of x @ w_hat.T."""
    check_tensor("x", x, (torch.float16, torch.bfloat16), ndim_min=1)
    check_last_dim_contiguous("x", x)
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw: expected a QuantizedWeight, got {type(qw).__name__}")
    n, k = qw.shape  # qw's own fields agree: QuantizedWeight checks them when it is built
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k} (qw.shape[1]), got shape {tuple(x.shape)}")
    check_same_device("qw", qw.qweight, x)
    if bias is not None:
        check_tensor("bias", bias, (x.dtype,))
        check_same_device("bias", bias, x)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        bias = bias.contiguous()
    return _weight_only_mm(x, qw.qweight, qw.scales, qw.zeros, qw.perm, bias, qw.bits, qw.group_size, n)
