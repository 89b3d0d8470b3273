"""The executable spec: every op of SPEC.md in plain PyTorch, on any device.

These functions define what the kernels must compute (tests compare against them) and they are what the
ops run on CPU tensors. They favour obviousness over speed: float32 math, float64 where an exact integer
identity is needed, one final rounding. Validation lives in `quantfuse.ops`; these assume valid input.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
INT32_MIN_F = -2147483648.0
# Largest float32 below 2^31: the upper clamp of a zero point computed in float32 (see `_azp_from_range`).
INT32_MAX_F = 2147483520.0
SCALE_FLOOR = 1e-10


# ----------------------------------------------------------------------------------------------------
# Section 0: rounding and the scale rule
# ----------------------------------------------------------------------------------------------------
def quantize_values(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = sat(rne(v)) for float32 v already divided by its scale.

    int8: round half to even, then saturate. fp8: clamp to +-448, then the round-to-nearest-even cast."""
    v = v.float()
    if dtype == torch.int8:
        return torch.round(v).clamp(-128, 127).nan_to_num(0.0).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    raise TypeError(f"dtype: expected int8 or float8_e4m3fn, got {dtype}")


def quantize_values_azp(v: torch.Tensor, azp: torch.Tensor) -> torch.Tensor:
    """q = sat_int8(rne(v) + azp), computed exactly in float64 (azp is int32 and may lie outside int8)."""
    w = torch.round(v.double()) + azp.double()
    return w.clamp(-128, 127).nan_to_num(0.0).to(torch.int8)


def true_div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """a / divisor as an IEEE float32 division. (PyTorch's CUDA kernels turn division by a Python scalar
    into multiplication by its rounded reciprocal, which is not the SPEC's true division.)"""
    return a / torch.tensor(divisor, dtype=torch.float32, device=a.device)


def dynamic_scale(amax: torch.Tensor, dtype: torch.dtype, scale_ub: Optional[torch.Tensor] = None) -> torch.Tensor:
    """scale = max(amax, 1e-10) / qmax, then min(scale, scale_ub) when an upper bound is given."""
    scale = true_div(torch.clamp(amax.float(), min=SCALE_FLOOR), QMAX[dtype])
    if scale_ub is not None:
        scale = torch.minimum(scale, scale_ub.float().reshape(()))
    return scale


def _azp_from_range(xmin: torch.Tensor, xmax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int8: scale = max(max - min, 1e-10) / 255, azp = rne(-128 - min / scale) as int32.

    A (near-)constant region gives a tiny scale and a zero point far outside int8; it is clamped to the
    float32-representable int32 range [-2^31, 2^31 - 128] so it never overflows and never gives NaN."""
    scale = true_div(torch.clamp(xmax.float() - xmin.float(), min=SCALE_FLOOR), 255.0)
    azp = torch.round(-128.0 - xmin.float() / scale)
    azp = azp.clamp(INT32_MIN_F, INT32_MAX_F).nan_to_num(0.0).to(torch.int32)
    return scale, azp


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


# ----------------------------------------------------------------------------------------------------
# Section 1: activation quantization
# ----------------------------------------------------------------------------------------------------
def quantize_per_tensor(
    x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None, azp: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Static (given scale [and azp]) or dynamic (amax over the whole tensor) per-tensor quantization."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())  # an empty tensor: amax 0, the floor scale
        scale = dynamic_scale(amax, dtype).reshape(1)
        return quantize_values(xf / scale, dtype), scale, None
    s = scale.float().reshape(())
    if azp is None:
        return quantize_values(xf / s, dtype), scale, None
    return quantize_values_azp(xf / s, azp.reshape(())), scale, azp


def quantize_per_token(
    x: torch.Tensor, dtype: torch.dtype, scale_ub: Optional[torch.Tensor] = None, symmetric: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One dynamic scale per row of the flattened [M, K] input; asymmetric adds an int32 zero point."""
    rows = _rows(x)
    if symmetric:
        scale = dynamic_scale(rows.abs().amax(dim=1, keepdim=True), dtype, scale_ub)
        return quantize_values(rows / scale, dtype).reshape(x.shape), scale, None
    scale, azp = _azp_from_range(rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True))
    return quantize_values_azp(rows / scale, azp).reshape(x.shape), scale, azp


def quantize_per_group(
    x: torch.Tensor,
    dtype: torch.dtype,
    group_size: int = 128,
    scale_ub: Optional[torch.Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, None]:
    """One dynamic scale per `group_size` consecutive elements of a row: scales [M, K / group_size].

    transposed_scales: the same values, stored as a contiguous [K/g, M] tensor and returned as its
    [M, K/g] transpose view (the layout a blockwise GEMM reads along M)."""
    rows = _rows(x)
    m, k = rows.shape
    groups = rows.reshape(m, k // group_size, group_size)
    scales = dynamic_scale(groups.abs().amax(dim=2), dtype, scale_ub)
    q = quantize_values(groups / scales.unsqueeze(2), dtype).reshape(x.shape)
    if transposed_scales:
        scales = scales.t().contiguous().t()
    return q, scales, None


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    azp: Optional[torch.Tensor] = None,
    group_size: Optional[int] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x = scale * (q - azp) in float32, one rounding to out_dtype.

    scale: numel 1 (per tensor), [M, 1] (per token) or [M, K/g] with group_size (per group)."""
    rows = _rows(q)
    m, k = rows.shape
    if azp is not None:
        rows = rows - azp.reshape(-1, 1).float() if azp.numel() > 1 else rows - azp.float().reshape(())
    s = scale.float()
    if group_size is not None:
        out = (rows.reshape(m, k // group_size, group_size) * s.reshape(m, k // group_size, 1)).reshape(m, k)
    elif s.numel() == 1:
        out = rows * s.reshape(())
    else:
        out = rows * s.reshape(m, 1)
    return out.to(out_dtype).reshape(q.shape)


# ----------------------------------------------------------------------------------------------------
# Section 2: scaled matmul with fused epilogues
# ----------------------------------------------------------------------------------------------------
def scaled_mm_accumulator(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc = a_q @ b_q for a [..., K] flattened to [M, K]: int32 (exact) for int8, float32 for fp8.

    Computed in float64, which holds every int8 dot product exactly (|acc| <= 2^14 K) and every fp8
    product exactly, so the only rounding for fp8 is the final one to float32."""
    rows = a.reshape(-1, a.shape[-1])
    acc = rows.double() @ b.double()
    if a.dtype == torch.int8:
        return acc.to(torch.int64).to(torch.int32)
    return acc.float()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    azp_adj: Optional[torch.Tensor] = None,
    azp: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[i, j] = (scale_a[i] * scale_b[j]) * float(acc[i, j] - corr[i, j]) + bias[j], one final rounding.

    corr = 0 (no azp_adj), azp_adj[j] (azp_adj = z_a * colsum(b_q), per-tensor zero point) or
    azp[i] * azp_adj[j] (azp_adj = colsum(b_q), per-token zero points); the subtraction is int32."""
    n = b.shape[1]
    acc = scaled_mm_accumulator(a, b)
    m = acc.shape[0]
    if azp_adj is not None:
        corr = azp_adj.reshape(1, n).to(torch.int32)
        if azp is not None:
            corr = azp.reshape(m, 1).to(torch.int32) * corr
        acc = acc - corr
    sa = scale_a.float().reshape(m, 1) if scale_a.numel() != 1 else scale_a.float().reshape(())  # per token: M (0..)
    sb = scale_b.float().reshape(1, n) if scale_b.numel() > 1 else scale_b.float().reshape(())
    out = (sa * sb) * acc.float()
    if bias is not None:
        out = out + bias.float().reshape(1, n)
    return out.to(out_dtype).reshape(*a.shape[:-1], n)


def azp_adjustment(b: torch.Tensor, azp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """colsum(b_q) as int32 [N] (per-token zero points), or z_a * colsum(b_q) for a per-tensor z_a."""
    colsum = b.to(torch.int64).sum(dim=0).to(torch.int32)
    if azp is not None:
        colsum = colsum * azp.reshape(()).to(torch.int32)
    return colsum


def scaled_mm_blockwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    block: Tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """out[i, j] = sum_kb (scale_a[i, kb] * scale_b[kb, j // 128]) * (a[i, kb-block] . b[kb-block, j]) + bias[j].

    scale_a [M, ceil(K/128)] per 1x128 activation group, scale_b [ceil(K/128), ceil(N/128)] per
    128x128 weight block; the last K and N blocks may be partial. Each block dot is exact in float64
    then rounded to float32; the scaled sum is float32."""
    group = block[0]
    rows = a.reshape(-1, a.shape[-1])
    m, k = rows.shape
    n = b.shape[1]
    sb_cols = scale_b.float().repeat_interleave(block[1], dim=1)[:, :n]
    out = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    for kb in range(-(-k // group)):
        ks = slice(kb * group, min(k, (kb + 1) * group))
        part = (rows[:, ks].double() @ b[ks].double()).float()
        out += (scale_a[:, kb].float().reshape(m, 1) * sb_cols[kb].reshape(1, n)) * part
    if bias is not None:
        out = out + bias.float().reshape(1, n)
    return out.to(out_dtype).reshape(*a.shape[:-1], n)



# ----------------------------------------------------------------------------------------------------
# Section 3: fused SiLU-and-mul with quantization
# ----------------------------------------------------------------------------------------------------
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """y = silu(gate) * up = gate / (1 + exp(-gate)) * up in float32 for x = [gate | up] of width 2H.

    Evaluated in exactly this order (true division, then the product) so a kernel computing the same
    float32 expression matches it bit for bit."""
    h = x.shape[-1] // 2
    xf = x.float()
    gate, up = xf[..., :h], xf[..., h:]
    return gate / (1.0 + torch.exp(-gate)) * up


def silu_and_mul_quant(
    x: torch.Tensor,
    dtype: torch.dtype,
    group_size: Optional[int] = None,
    scale: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
    transposed_scales: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) quantized per group (group_size), per tensor (given scale) or per token (neither).

    Returns (q [..., H], scales [M, H/g] | [M, 1] | the given scale)."""
    y = silu_and_mul(x)
    if group_size is not None:
        q, scales, _ = quantize_per_group(y, dtype, group_size, scale_ub, transposed_scales)
        return q, scales
    if scale is not None:
        return quantize_per_tensor(y, dtype, scale)[0], scale
    q, scales, _ = quantize_per_token(y, dtype, scale_ub)
    return q, scales



# ----------------------------------------------------------------------------------------------------
# Section 4: weight-only quantized GEMM
# ----------------------------------------------------------------------------------------------------
def _weight_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group] float32, the last group zero-padded when group_size does not divide K
    (zeros change neither amax nor the min(., 0) / max(., 0) range below)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    padded = torch.zeros((n, groups * g), dtype=torch.float32, device=w.device)
    padded[:, :k] = w.float()
    return padded.view(n, groups, g)


def quantize_weight(
    w: torch.Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Weight [N, K] -> (q [N, K] int32, scales [G, N] scale_dtype, zeros [G, N] int32 or None), G = ceil(K / g).

    Symmetric: s = max(amax, 1e-10) / qmax (qmax = 2^(bits-1) - 1), q = clamp(rne(w / s), -qmax-1, qmax).
    Asymmetric: lo = min(min w, 0), hi = max(max w, 0), s = max(hi - lo, 1e-10) / (2^bits - 1),
    z = clamp(rne(-lo / s), 0, 2^bits - 1), q = clamp(rne(w / s) + z, 0, 2^bits - 1). True divisions.
    scale_dtype float16 / bfloat16: s (float32 as above) is first rounded *up* to the nearest value of
    that dtype, and the codes are computed with the rounded s, the one that is stored. Rounding up keeps
    the grid covering [-amax, amax] (or [lo, hi]), so no code clips further than with the float32 scale
    and |w - (q - z) * s| <= s / 2 still holds with the stored s; a 16-bit scale lets the weight-only
    kernels scale in 16-bit arithmetic exactly (kernels/weight_only.py, "packed"). ValueError when a
    scale overflows the dtype (float16: a scale above 65504)."""
    n, k = w.shape
    groups = _weight_groups(w, group_size)

    def round_up(scales: torch.Tensor) -> torch.Tensor:
        if scale_dtype == torch.float32:
            return scales
        r = scales.to(scale_dtype)
        below = r.float() < scales
        r = (r.view(torch.int16) + below.to(torch.int16)).view(scale_dtype)  # s > 0: next bit pattern = next up
        bad = ~torch.isfinite(r) & torch.isfinite(scales)
        if bool(bad.any()):
            raise ValueError(f"scale_dtype: {str(scale_dtype).replace('torch.', '')} cannot hold the scale "
                             f"{float(scales[bad].max()):.6g} of this weight; use torch.bfloat16 or torch.float32")
        return r.float()

    if symmetric:
        qmax = float(2 ** (bits - 1) - 1)
        scales = round_up(true_div(torch.clamp(groups.abs().amax(dim=2), min=SCALE_FLOOR), qmax))
        q = torch.round(groups / scales.unsqueeze(2)).clamp(-qmax - 1, qmax)
        zeros = None
    else:
        top = float(2**bits - 1)
        lo = groups.amin(dim=2).clamp(max=0.0)
        hi = groups.amax(dim=2).clamp(min=0.0)
        scales = round_up(true_div(torch.clamp(hi - lo, min=SCALE_FLOOR), top))
        zeros = torch.round(-lo / scales).clamp(0.0, top)
        q = (torch.round(groups / scales.unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0.0, top)
        zeros = zeros.to(torch.int32).t().contiguous()
    q = q.nan_to_num(0.0).reshape(n, -1)[:, :k].to(torch.int32)
    return q, scales.t().contiguous().to(scale_dtype), zeros


def dequantize_weight(
    q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """w_hat[n, k] = round(dtype, float32(q[n, k] - z[g, n]) * s[g, n]), g = k // group_size.

    q - z is an exact small integer; the product is the one float32 rounding, then the cast to dtype."""
    n, k = q.shape
    g = k if group_size == -1 else group_size
    gidx = torch.arange(k, device=q.device) // g
    diff = q.to(torch.int32)
    if zeros is not None:
        diff = diff - zeros.to(torch.int32).t()[:, gidx]
    return (diff.float() * scales.float().t()[:, gidx]).to(dtype)


def weight_only_mm(x: torch.Tensor, w_hat: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ w_hat[N, K].T (+ bias), float32 accumulation, one rounding to x.dtype."""
    out = x.float() @ w_hat.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
