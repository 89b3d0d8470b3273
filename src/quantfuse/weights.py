"""`QuantizedWeight`: an INT4/INT8 weight in quantfuse's packed layout, and loaders from checkpoint formats.

Math (SPEC section 4): w[n, k] ~= (q[n, k] - z[g, n]) * s[g, n], g = k // group_size. The object stores
*biased* unsigned codes u (u = q + 2^(bits-1) for symmetric weights, u = q for asymmetric ones) with the
matching integer zero point (2^(bits-1), implicit, for symmetric), so u - z = q - z_spec exactly and the
kernels need one code path. `pack_codes` documents the packed, interleaved word layout the kernels read.

Act-order (GPTQ `g_idx`): the columns of K are stored sorted by group, with `perm` such that stored
column k' is original column perm[k']; `weight_only_mm` gathers x's columns by `perm` (a tiny copy of the
activation), and `dequantize` returns the weight in the original column order.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from . import reference as ref

WORDS_PER_CHUNK = 16
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: field i of a word holds output column 8c + _AWQ_ORDER[i]
VALID_BITS = (4, 8)
VALID_GROUP_SIZES = (32, 64, 128, 256, -1)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _chunk(bits: int) -> int:
    return WORDS_PER_CHUNK * (32 // bits)


def check_quantized_weight(qw: "QuantizedWeight", name: str = "QuantizedWeight") -> None:
    """Raise ValueError / TypeError unless qw's fields agree with each other and with what the kernels read
    (bits 4 / 8; group size 32..256 or -1: the kernels locate groups by 16-code fields and power-of-two
    group sizes; words [N, K_pad / (32 / bits)] int32; scales [G, N] of a `SCALE_DTYPES` dtype with
    G = ceil(K / group) (1 per channel); zeros int32 [G, N] or None; perm int64 [K] or None). Shapes and
    dtypes and devices only: no data is read. Run by the constructor, so every QuantizedWeight is one the kernels
    can use."""
    fields = (("qweight", qw.qweight, False), ("scales", qw.scales, False), ("zeros", qw.zeros, True),
              ("perm", qw.perm, True))
    for field, t, optional in fields:
        if not isinstance(t, torch.Tensor) and not (optional and t is None):
            raise TypeError(f"{name}: expected {field} to be a torch.Tensor{' or None' if optional else ''}, "
                            f"got {type(t).__name__}")
    for field, t, _ in fields[1:]:
        if t is not None and t.device != qw.qweight.device:
            raise ValueError(f"{name}: expected {field} on {qw.qweight.device} (the device of qweight), "
                             f"got {t.device}")
    if qw.scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{name}: expected scales of dtype float32, float16 or bfloat16, got {qw.scales.dtype}")
    if qw.bits not in VALID_BITS:
        raise ValueError(f"{name}: expected bits in {VALID_BITS}, got {qw.bits}")
    if qw.group_size not in VALID_GROUP_SIZES:
        raise ValueError(f"{name}: expected group_size in {VALID_GROUP_SIZES}, got {qw.group_size}")
    n, k = qw.shape
    if n < 1 or k < 1 or k % 8:
        raise ValueError(f"{name}: expected shape (N >= 1, K a positive multiple of 8), got {qw.shape}")
    words = -(-k // _chunk(qw.bits)) * WORDS_PER_CHUNK
    if qw.qweight.dtype != torch.int32 or tuple(qw.qweight.shape) != (n, words):
        raise ValueError(f"{name}: expected qweight int32 of shape ({n}, {words}) for shape {qw.shape} and "
                         f"bits={qw.bits}, got {qw.qweight.dtype} {tuple(qw.qweight.shape)}")
    groups = 1 if qw.group_size == -1 else -(-k // qw.group_size)
    if qw.scales.dim() != 2 or tuple(qw.scales.shape) != (groups, n):
        raise ValueError(f"{name}: expected scales of shape ({groups}, {n}) (groups, N), got {tuple(qw.scales.shape)}")
    if qw.zeros is not None and (qw.zeros.dtype != torch.int32 or tuple(qw.zeros.shape) != (groups, n)):
        raise ValueError(f"{name}: expected int32 zeros of shape ({groups}, {n}), got {qw.zeros.dtype} "
                         f"{tuple(qw.zeros.shape)}")
    if qw.perm is not None and (qw.perm.dtype != torch.int64 or tuple(qw.perm.shape) != (k,)):
        raise ValueError(f"{name}: expected an int64 perm of shape ({k},), got {qw.perm.dtype} {tuple(qw.perm.shape)}")


def _to_int32_words(words64: torch.Tensor) -> torch.Tensor:
    """Reinterpret values in [0, 2^32) (int64) as int32 bit patterns."""
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def _fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split int32 words into their 32/bits unsigned fields (field i = bits i*b..i*b+b-1), new axis after
    `dim`, as int32."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    shape = [1] * (w.dim() + 1)
    shape[dim + 1] = per
    return ((w.unsqueeze(dim + 1) >> shifts.view(shape)) & ((1 << bits) - 1)).to(torch.int32)


def unpack_along(words: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unpack words packed along `dim` (field i of word c = element c * per + order[i], natural order by
    default) into int32 codes, `dim` growing by 32/bits."""
    f = _fields(words, bits, dim)
    if order is not None:
        inverse = [0] * len(order)
        for i, o in enumerate(order):
            inverse[o] = i
        f = f.index_select(dim + 1, torch.tensor(inverse, device=f.device))
    shape = list(words.shape)
    shape[dim] *= 32 // bits
    return f.reshape(shape)


def pack_along(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Inverse of `unpack_along` (codes.shape[dim] must be a multiple of 32/bits): int32 words."""
    per = 32 // bits
    shape = list(codes.shape)
    shape[dim : dim + 1] = [shape[dim] // per, per]
    f = codes.to(torch.int64).reshape(shape)
    if order is not None:
        f = f.index_select(dim + 1, torch.tensor(order, device=f.device))
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    sshape = [1] * f.dim()
    sshape[dim + 1] = per
    return _to_int32_words((f << shifts.view(sshape)).sum(dim + 1))


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Biased codes u [N, K] (0 .. 2^bits - 1) -> quantfuse words [N, K_pad / (32 / bits)] int32.

    K is padded with code 0 to whole chunks of 16 words (128 codes for int4, 64 for int8). Inside a
    chunk, field i of word j holds k = chunk * 16 * (32 / bits) + 16 * i + j, so one field of a 16-word
    tile is 16 consecutive k (see kernels/weight_only.py for why)."""
    n, k = u.shape
    per, chunk = 32 // bits, _chunk(bits)
    k_pad = -(-k // chunk) * chunk
    padded = torch.zeros((n, k_pad), dtype=torch.int64, device=u.device)
    padded[:, :k] = u.to(torch.int64)
    fields = padded.view(n, k_pad // chunk, per, WORDS_PER_CHUNK)
    shifts = (torch.arange(per, device=u.device, dtype=torch.int64) * bits).view(1, 1, per, 1)
    words = (fields << shifts).sum(dim=2)  # disjoint bit fields: the sum is the OR
    return _to_int32_words(words).reshape(n, k_pad // per)


def unpack_codes(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_codes`: biased codes [N, K] int32."""
    n = words.shape[0]
    f = _fields(words.view(n, -1, WORDS_PER_CHUNK), bits, 1)  # [N, chunks, per, 16]
    return f.reshape(n, -1)[:, :k]


class QuantizedWeight:
    """A [N, K] weight quantized to `bits` with one scale (and zero point) per (group, output channel).

    Attributes: qweight int32 [N, K_pad / (32/bits)] (packed, see `pack_codes`), scales [num_groups, N]
    float32, float16 or bfloat16 (`SCALE_DTYPES`; the kernels widen them exactly, and scales in the
    activation dtype enable the faster "packed" conversion), zeros int32 [num_groups, N] or None
    (symmetric: the bias 2^(bits-1)), bits, group_size (-1: per channel), shape (N, K), perm (int64 [K]
    or None, act-order)."""

    def __init__(self, qweight, scales, zeros, bits: int, group_size: int, shape: Tuple[int, int],
                 perm: Optional[torch.Tensor] = None):
        self.qweight = qweight
        self.scales = scales
        self.zeros = zeros
        self.bits = int(bits)
        self.group_size = int(group_size)
        self.shape = (int(shape[0]), int(shape[1]))
        self.perm = perm
        check_quantized_weight(self)
        # the kernels read each field packed (a word row with a unit stride, scales and zero points at g * N + n):
        # a view (one shard's channels of a larger weight, a transposed tensor) is copied once here, never misread
        self.qweight, self.scales = qweight.contiguous(), scales.contiguous()
        self.zeros = None if zeros is None else zeros.contiguous()
        self.perm = None if perm is None else perm.contiguous()
        capturing = perm is not None and perm.is_cuda and torch.cuda.is_current_stream_capturing()
        if perm is not None and not capturing and not torch.equal(  # (a host sync: not inside a graph capture)
                torch.sort(self.perm).values, torch.arange(self.shape[1], device=perm.device)):
            raise ValueError(f"perm: expected a permutation of 0..{self.shape[1] - 1} (stored column k' holds "
                             f"original column perm[k']), got values outside it or repeated")

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_codes(cls, u: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
                   group_size: int, perm: Optional[torch.Tensor] = None) -> "QuantizedWeight":
        """From biased codes u [N, K] (0..2^bits-1, in stored column order), float scales [G, N] (kept in
        float16 / bfloat16 / float32, any other dtype becomes float32) and integer zero points [G, N]
        (None: 2^(bits-1))."""
        n, k = u.shape
        zeros = None if zeros is None else zeros.to(torch.int32).contiguous()
        if scales.dtype not in SCALE_DTYPES:
            scales = scales.to(torch.float32)
        return cls(pack_codes(u, bits), scales.contiguous(), zeros, bits, group_size,
                   (n, k), None if perm is None else perm.to(torch.int64).contiguous())

    @classmethod
    def concat_rows(cls, parts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
        """One weight whose output channels are those of `parts` in order ([W_0; W_1; ...], N = sum N_i),
        for layers that read the same input (attention's q/k/v, a gated MLP's gate/up): one GEMM then
        streams all of them. The parts must agree on K, bits, group size, scale dtype and device and have
        no act-order permutation. Codes, scales and zero points are copied, not changed (a symmetric part
        gets its implicit zero point 2^(bits-1) written out when another part is asymmetric)."""
        parts = list(parts)
        if not parts or not all(isinstance(p, QuantizedWeight) for p in parts):
            raise TypeError("parts: expected a non-empty sequence of QuantizedWeight")
        for i, p in enumerate(parts):
            if p.perm is not None:
                raise ValueError(f"parts[{i}]: act-order weights (perm) cannot share a GEMM with other layers")
        mismatch = first_mismatch("parts", parts, {"bits": lambda p: p.bits, "group_size": lambda p: p.group_size,
                                                   "K": lambda p: p.shape[1], "scale dtype": lambda p: p.scales.dtype,
                                                   "device": lambda p: p.device})
        if mismatch:
            raise ValueError(mismatch)
        first = parts[0]
        zeros = None
        if any(not p.symmetric for p in parts):
            zeros = torch.cat([p.zero_points() for p in parts], dim=1)
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts], dim=1), zeros,
                   first.bits, first.group_size, (sum(p.shape[0] for p in parts), first.shape[1]))

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    def to(self, device) -> "QuantizedWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(mv(self.qweight), mv(self.scales), mv(self.zeros), self.bits, self.group_size,
                               self.shape, mv(self.perm))

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={self.shape}, bits={self.bits}, group_size={self.group_size}, "
                f"symmetric={self.symmetric}, act_order={self.perm is not None}, device={self.device})")

    # -- views --------------------------------------------------------------------------------------
    def biased_codes(self) -> torch.Tensor:
        """u [N, K] int32 in stored column order."""
        return unpack_codes(self.qweight, self.bits, self.shape[1])

    def zero_points(self) -> torch.Tensor:
        """Integer zero points [G, N] int32 matching `biased_codes` (2^(bits-1) for symmetric)."""
        if self.zeros is not None:
            return self.zeros
        return torch.full(tuple(self.scales.shape), 1 << (self.bits - 1), dtype=torch.int32, device=self.device)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """w_hat [N, K] = round(dtype, float32((q - z) * s)) (the float32 product, then the cast: one rounding with
        16-bit scales, whose products are exact), original column order; dtype float16, bfloat16 or float32."""
        from ._validation import FLOAT_DTYPES, check_dtype_arg
        from .ops import _dequantize_weight

        check_dtype_arg("dtype", dtype, FLOAT_DTYPES)
        w = _dequantize_weight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               self.shape[1], dtype)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w

    # -- loaders ------------------------------------------------------------------------------------
    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bits: int = 4,
                  checkpoint_format: str = "gptq", scale_dtype: Optional[torch.dtype] = torch.float32
                  ) -> "QuantizedWeight":
        """GPTQ: qweight int32 [K/(32/bits), N] packed along K (natural order), qzeros int32
        [G, N/(32/bits)] packed along N, scales [G, N]; "gptq" (v1) stores zero - 1, "gptq_v2" the zero.
        g_idx [K] (act-order) maps each input row to its group. scale_dtype: torch.float32 (default; an
        exact widening), None (keep the checkpoint's dtype, e.g. float16, which float16 activations use
        with the kernels' "packed" conversion) or a 16-bit dtype holding every scale exactly (else ValueError)."""
        _check_bits(bits, VALID_BITS)
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format: expected 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
        _check_int32("qweight", qweight, 2)
        _check_int32("qzeros", qzeros, 2)
        _check_float("scales", scales, 2)
        per = 32 // bits
        k, n = qweight.shape[0] * per, qweight.shape[1]
        if k % 8:
            raise ValueError(f"qweight: expected K = {per} x rows a multiple of 8 (bits={bits}), got "
                             f"{qweight.shape[0]} rows (K = {k})")
        groups = scales.shape[0]
        if scales.shape[1] != n:
            raise ValueError(f"scales: expected shape [G, {n}] (N from qweight), got {tuple(scales.shape)}")
        if tuple(qzeros.shape) != (groups, -(-n // per)):
            raise ValueError(f"qzeros: expected shape {(groups, -(-n // per))}, got {tuple(qzeros.shape)}")
        u = unpack_along(qweight, bits, 0).t()  # [N, K]
        z = unpack_along(qzeros, bits, 1)[:, :n]
        if checkpoint_format == "gptq":
            z = z + 1
        group_size, perm = _group_size_from_gidx(g_idx, k, groups, qweight.device)
        if perm is not None:
            u = u.index_select(1, perm)
        return cls.from_codes(u, _cast_scales(scales, scale_dtype), z, bits, group_size, perm)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bits: int = 4,
                 scale_dtype: Optional[torch.dtype] = torch.float32) -> "QuantizedWeight":
        """AWQ (GEMM layout): qweight int32 [K, N/8] packed along N in field order 0,2,4,6,1,3,5,7, qzeros
        int32 [G, N/8] likewise, scales [G, N]; w = (q - z) * s with the exact zero. scale_dtype as for
        `from_gptq`."""
        _check_bits(bits, (4,))
        _check_int32("qweight", qweight, 2)
        _check_int32("qzeros", qzeros, 2)
        _check_float("scales", scales, 2)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        if k % 8:
            raise ValueError(f"qweight: expected K = rows a multiple of 8, got {k} rows")
        groups = scales.shape[0]
        if tuple(scales.shape) != (groups, n):
            raise ValueError(f"scales: expected shape [G, {n}] (N = 8 * qweight.shape[1]), got {tuple(scales.shape)}")
        if tuple(qzeros.shape) != (groups, n // 8):
            raise ValueError(f"qzeros: expected shape {(groups, n // 8)}, got {tuple(qzeros.shape)}")
        u = unpack_along(qweight, 4, 1, _AWQ_ORDER).t()
        z = unpack_along(qzeros, 4, 1, _AWQ_ORDER)
        group_size, _ = _group_size_from_gidx(None, k, groups, qweight.device)
        return cls.from_codes(u, _cast_scales(scales, scale_dtype), z, 4, group_size)

    @classmethod
    def from_compressed_tensors(cls, weight_packed, weight_scale, weight_shape, weight_zero_point=None,
                                scale_dtype: Optional[torch.dtype] = torch.float32) -> "QuantizedWeight":
        """compressed-tensors pack-quantized: weight_packed int32 [N, ceil(K/(32/bits))] packed along K
        (natural order) with signed codes offset by 2^(bits-1); weight_scale [N, G]; weight_shape (N, K);
        weight_zero_point (asymmetric) int32 [ceil(N/(32/bits)), G], offset signed zero points packed
        along N. w = (q - zp) * s. scale_dtype as for `from_gptq`."""
        _check_int32("weight_packed", weight_packed, 2)
        _check_float("weight_scale", weight_scale, 2)
        shape = weight_shape.tolist() if isinstance(weight_shape, torch.Tensor) else list(weight_shape)
        if len(shape) != 2 or int(shape[1]) % 8 or int(shape[0]) < 1 or int(shape[1]) < 1:
            raise ValueError(f"weight_shape: expected (N, K) with N >= 1 and K a positive multiple of 8, got "
                             f"{tuple(shape)}")
        n, k = (int(v) for v in shape)
        if weight_packed.shape[0] != n:
            raise ValueError(f"weight_packed: expected {n} rows (weight_shape[0]), got {tuple(weight_packed.shape)}")
        cols = weight_packed.shape[1]
        if cols == -(-k // 8):
            bits = 4
        elif cols == -(-k // 4):
            bits = 8
        else:
            raise ValueError(f"weight_packed: expected {-(-k // 8)} (int4) or {-(-k // 4)} (int8) columns for "
                             f"K={k}, got {cols}")
        groups = weight_scale.shape[1]
        if weight_scale.shape[0] != n:
            raise ValueError(f"weight_scale: expected shape [{n}, G], got {tuple(weight_scale.shape)}")
        u = unpack_along(weight_packed, bits, 1)[:, :k]
        z = None
        if weight_zero_point is not None:
            _check_int32("weight_zero_point", weight_zero_point, 2)
            per = 32 // bits
            if tuple(weight_zero_point.shape) != (-(-n // per), groups):
                raise ValueError(f"weight_zero_point: expected shape {(-(-n // per), groups)}, "
                                 f"got {tuple(weight_zero_point.shape)}")
            # Both codes and zero points carry the same offset 2^(bits-1): their difference is q - zp.
            z = unpack_along(weight_zero_point, bits, 0)[:n].t()
        group_size, _ = _group_size_from_gidx(None, k, groups, weight_packed.device)
        return cls.from_codes(u, _cast_scales(weight_scale.t(), scale_dtype, "weight_scale"), z, bits, group_size)


def first_mismatch(name: str, items: Sequence, fields: Dict[str, Callable]) -> Optional[str]:
    """The error message for the first of `items` whose field (a getter in `fields`) differs from items[0]'s,
    or None when all agree (layers or weights that are to share one GEMM)."""
    for i, item in enumerate(items[1:], start=1):
        for field, get in fields.items():
            if get(item) != get(items[0]):
                return f"{name}[{i}]: expected {field} {get(items[0])} as {name}[0], got {get(item)}"
    return None


def _check_bits(bits, allowed) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"bits: expected one of {tuple(allowed)}, got {bits!r}")


def _check_int32(name, t, ndim) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_float(name, t, ndim) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, "
                        f"got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_scale_dtype(scale_dtype, allow_none: bool = False) -> None:
    """TypeError / ValueError naming `scale_dtype` unless it is one of `SCALE_DTYPES` (or None if allowed)."""
    if scale_dtype is None and allow_none:
        return
    if not isinstance(scale_dtype, torch.dtype):
        raise TypeError(f"scale_dtype: expected a torch.dtype ({', '.join(map(str, SCALE_DTYPES))}"
                        f"{' or None' if allow_none else ''}), got {type(scale_dtype).__name__}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype: expected one of {', '.join(map(str, SCALE_DTYPES))}"
                         f"{' or None' if allow_none else ''}, got {scale_dtype}")


def _cast_scales(scales: torch.Tensor, scale_dtype: Optional[torch.dtype], name: str = "scales") -> torch.Tensor:
    """A loader's scales in scale_dtype (None: the checkpoint's own dtype). Only exact conversions: a
    checkpoint's scales define the weight, so a cast that would round one raises ValueError."""
    check_scale_dtype(scale_dtype, allow_none=True)
    if scale_dtype is None or scale_dtype == scales.dtype:
        return scales
    out = scales.to(scale_dtype)
    if scale_dtype == torch.float32:
        return out  # widening a 16-bit float is exact
    same = (out.to(torch.float64) == scales.to(torch.float64)) | torch.isnan(scales)
    if not bool(same.all()):
        raise ValueError(f"scale_dtype: {name} ({str(scales.dtype).replace('torch.', '')}) are not all exactly "
                         f"representable in {str(scale_dtype).replace('torch.', '')}; pass None or torch.float32")
    return out


def _group_size_from_gidx(g_idx, k: int, groups: int, device) -> Tuple[int, Optional[torch.Tensor]]:
    """Group size from K and the number of groups (last group may be partial), and the act-order
    permutation when g_idx is not the trivial k // group_size."""
    if groups == 1:
        group_size = -1
    else:
        candidates = [g for g in (32, 64, 128, 256) if -(-k // g) == groups]
        if not candidates:
            raise ValueError(f"scales: {groups} groups for K={k} match no group size in (32, 64, 128, 256)")
        group_size = candidates[0]
    if g_idx is None:
        return group_size, None
    if not isinstance(g_idx, torch.Tensor) or g_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"g_idx: expected an int32/int64 tensor, got {getattr(g_idx, 'dtype', type(g_idx))}")
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx: expected shape ({k},), got {tuple(g_idx.shape)}")
    g = g_idx.to(device=device, dtype=torch.int64)
    gs = k if group_size == -1 else group_size
    natural = torch.arange(k, device=device) // gs
    if torch.equal(g, natural):
        return group_size, None
    num_groups = -(-k // gs)
    if bool(((g < 0) | (g >= num_groups)).any()):
        raise ValueError(f"g_idx: expected group indices in [0, {num_groups}), got values from {int(g.min())} to "
                         f"{int(g.max())}")
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], natural):
        raise ValueError(f"g_idx: expected each group to hold exactly {gs} rows (group_size), "
                         f"got group sizes {torch.bincount(g, minlength=num_groups).tolist()[:8]}...")
    return group_size, perm


def quantize_weight(w: torch.Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Quantize [N, K] w (SPEC section 4) and pack it; validation is in `quantfuse.ops.quantize_weight`.
    scale_dtype: see `quantfuse.reference.quantize_weight` (16-bit scales are rounded up, codes follow)."""
    q, scales, zeros = ref.quantize_weight(w, bits, group_size, symmetric, scale_dtype)
    u = q + (1 << (bits - 1)) if symmetric else q
    return QuantizedWeight.from_codes(u, scales, zeros, bits, group_size)
