"""Quantized drop-in replacements for `nn.Linear`, one per scheme, built on the ops of `quantfuse.ops`.

Every module keeps its quantized state as buffers named the way compressed-tensors names them
(`weight`, `weight_scale`, `weight_zero_point`, `weight_packed`, `weight_shape`, `input_scale`,
`input_zero_point`), so a checkpoint is the module's buffers as they are and `.to(device)` moves them.
Casting a model (`model.half()`) never touches codes or float32 scales: only the bias follows the cast.

Notation: x [M, K] activations, W [N, K] the float weight, y [M, N]; s_w, s_x scales; rne = round half
to even; sat = saturation to the code range (SPEC section 0).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from . import ops
from . import reference as ref

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
BLOCK = 128  # fp8 block scheme: 128x128 weight blocks, 1x128 activation groups


# ----------------------------------------------------------------------------------------------------
# Offline weight quantizers (the SPEC's rules, in plain PyTorch: weights are quantized once)
# ----------------------------------------------------------------------------------------------------
def quantize_weight_per_channel(w: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Symmetric, one scale per output channel: s[n] = max(amax_n, 1e-10) / qmax, q = sat(rne(w / s)).

    Returns (q [N, K] in `dtype`, s [N, 1] float32)."""
    wf = w.detach().float()
    scale = ref.dynamic_scale(wf.abs().amax(dim=1, keepdim=True), dtype)
    return ref.quantize_values(wf / scale, dtype), scale


def quantize_weight_blocks(w: Tensor, block: int = BLOCK) -> Tuple[Tensor, Tensor]:
    """fp8, one scale per block x block tile: s[bn, bk] = max(amax_tile, 1e-10) / 448, q = sat(rne(w / s)).

    Edge tiles are partial (N, K need not be multiples of the block). Returns (q [N, K] fp8,
    s [ceil(N/block), ceil(K/block)] float32), the layout of compressed-tensors' block strategy."""
    wf = w.detach().float()
    n, k = wf.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=wf.device)
    padded[:n, :k] = wf
    tiles = padded.reshape(nb, block, kb, block)
    scale = ref.dynamic_scale(tiles.abs().amax(dim=(1, 3)), FP8)
    q = ref.quantize_values(tiles / scale[:, None, :, None], FP8).reshape(nb * block, kb * block)
    return q[:n, :k].contiguous(), scale


def expand_block_scale(scale: Tensor, shape: Tuple[int, int], block: int = BLOCK) -> Tensor:
    """[ceil(N/b), ceil(K/b)] block scales -> the [N, K] scale of every element."""
    n, k = shape
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def pack_int32(codes: Tensor, bits: int, dim: int = 1) -> Tensor:
    """Pack signed `bits`-bit codes (int tensor in [-2^(bits-1), 2^(bits-1)-1]) into int32 words along `dim`,
    offset by 2^(bits-1), element i of a run at bit (i % (32/bits)) * bits of word i // (32/bits).
    This is compressed-tensors' pack-quantized layout (4 and 8 bits pack whole words)."""
    per_word = 32 // bits
    v = codes.to(torch.int64) + (1 << (bits - 1))
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    padded = -(-cols // per_word) * per_word
    if padded != cols:
        v = torch.nn.functional.pad(v, (0, padded - cols))
    v = v.reshape(rows, padded // per_word, per_word)
    shifts = torch.arange(per_word, device=v.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def unpack_int32(words: Tensor, bits: int, length: int, dim: int = 1) -> Tensor:
    """Inverse of `pack_int32`: the signed codes (int32) with `length` elements along `dim`."""
    per_word = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        w = w.t()
    shifts = torch.arange(per_word, device=w.device, dtype=torch.int64) * bits
    v = (w[:, :, None] >> shifts) & ((1 << bits) - 1)
    v = v.reshape(w.shape[0], -1)[:, :length] - (1 << (bits - 1))
    v = v.to(torch.int32)
    return v.t().contiguous() if dim == 0 else v.contiguous()


@torch.no_grad()
def gptq_quantize(w: Tensor, hessian: Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                  damp: float = 0.01, block: int = 128) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """GPTQ (Frantar et al., 2022): quantize the columns of W [N, K] one at a time and spread each column's
    rounding error over the columns not yet quantized, weighted by the inverse of H = sum x x^T (the
    layer's input second moments from calibration), which minimizes ||X W^T - X W_hat^T||.

    The grid is the SPEC's (section 4) with the scales taken from the error-updated weights when each group
    starts (group_size=-1: from W, once). Returns (biased codes u [N, K] int32, scales [G, N] float32,
    zeros [G, N] int32 or None): the inputs of `QuantizedWeight.from_codes`, so w_hat = (u - z) * s."""
    n, k = w.shape
    W = w.detach().to(torch.float64).clone()
    H = hessian.detach().to(device=W.device, dtype=torch.float64).clone()
    if H.shape != (k, k):
        raise ValueError(f"hessian: expected shape {(k, k)}, got {tuple(H.shape)}")
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(k, dtype=H.dtype, device=H.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    qmax = float(2 ** (bits - 1) - 1)
    top = float(2 ** bits - 1)
    offset = float(1 << (bits - 1))
    scales = torch.empty(groups, n, dtype=torch.float32, device=W.device)
    zeros = None if symmetric else torch.empty(groups, n, dtype=torch.float32, device=W.device)
    codes = torch.empty(n, k, dtype=torch.int32, device=W.device)

    def grid(cols: Tensor):
        cf = cols.float()
        if symmetric:
            s = torch.clamp(cf.abs().amax(dim=1), min=ref.SCALE_FLOOR) / qmax
            return s, None
        lo, hi = cf.amin(dim=1).clamp(max=0.0), cf.amax(dim=1).clamp(min=0.0)
        s = torch.clamp(hi - lo, min=ref.SCALE_FLOOR) / top
        return s, torch.round(-lo / s).clamp(0.0, top)

    s = z = None
    if group_size == -1:
        s, z = grid(W)
        scales[0] = s
        if zeros is not None:
            zeros[0] = z
    step = gs if group_size != -1 else block
    for b0 in range(0, k, step):
        b1 = min(b0 + step, k)
        w1 = W[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[b0:b1, b0:b1]
        if group_size != -1:
            s, z = grid(w1)
            scales[b0 // gs] = s
            if zeros is not None:
                zeros[b0 // gs] = z
        sd = s.double()
        for j in range(b1 - b0):
            col = w1[:, j]
            if symmetric:
                q = torch.round(col / sd).clamp(-qmax - 1, qmax)
                dq, u = q * sd, q + offset
            else:
                u = (torch.round(col / sd) + z.double()).clamp(0.0, top)
                dq = (u - z.double()) * sd
            codes[:, b0 + j] = u.to(torch.int32)
            e = (col - dq) / h1[j, j]
            w1[:, j:] -= e[:, None] * h1[j, j:][None, :]
            err1[:, j] = e
        W[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return codes, scales, None if zeros is None else zeros.to(torch.int32)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _out_dtype(x: Tensor) -> torch.dtype:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    return x.dtype


def _check_linear(linear, name: str = "linear") -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{name}: expected a torch.nn.Linear, got {type(linear).__name__}")


# ----------------------------------------------------------------------------------------------------
# Base class
# ----------------------------------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """Common plumbing: shapes, bias, dtype-safe `.to()`, checkpoint tensors and the compressed-tensors scheme.

    Subclasses define `scheme` (the quantfuse scheme name), `forward`, `dequantized_weight()`,
    `ct_scheme()` (the compressed-tensors config group body) and `_from_tensors`."""

    scheme = "base"
    # buffers that are codes or scales and must keep their dtype under model.half()/.to(dtype)
    _keep_dtype = ("weight", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape",
                   "input_scale", "input_zero_point", "azp_adj", "scale_b")

    def __init__(self, in_features: int, out_features: int, bias: Optional[Tensor]):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._merged: Optional[Tuple["MergedProjections", int]] = None  # (group, index) once merged

    def _merged_output(self, x: Tensor) -> Optional[Tensor]:
        """This layer's slice of its `MergedProjections` GEMM, or None when it runs alone."""
        if self._merged is None:
            return None
        group, index = self._merged
        if not group.enabled or torch.compiler.is_compiling() or x.is_inference():
            return None  # (an inference tensor has no version counter to prove x unchanged between members)
        if group._merged_layer is None and _stream_state(x)[1]:
            # stacking the weights inside a capture would record the copies into the graph (re-run on every
            # replay) and leave them unwritten until the first replay: run alone until an eager call stacks
            return None
        return group.output(x, index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        for name, buf in list(self._buffers.items()):
            if buf is None:
                continue
            moved = fn(buf)
            if name in self._keep_dtype and moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)  # a dtype cast of the model moves codes, never casts them
            self._buffers[name] = moved
        for name, param in list(self._parameters.items()):
            if param is not None:
                self._parameters[name] = nn.Parameter(fn(param.data), requires_grad=param.requires_grad)
        self._device_changed()
        if self._merged is not None:
            self._merged[0].invalidate()
        return self

    def _device_changed(self) -> None:
        """Hook for subclasses that cache device-specific objects."""

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        # what was derived from the old values (a cached QuantizedWeight, zero-point corrections, transposed block
        # scales, a merged group's stacked copy) is rebuilt from the loaded ones
        self._rebuild_derived()
        if self._merged is not None:
            self._merged[0].invalidate()

    def _rebuild_derived(self) -> None:
        """Hook: recompute tensors derived from the stored ones (after `load_state_dict` wrote new values)."""
        self._device_changed()

    # -- checkpoint ------------------------------------------------------------------------------
    def checkpoint_tensors(self) -> Dict[str, Tensor]:
        """Local tensor names -> tensors as written to a compressed-tensors checkpoint."""
        out = {name: buf for name, buf in self._buffers.items()
               if buf is not None and name in self._persistent_names()}
        return out

    def _persistent_names(self):
        return [n for n in self._buffers if n not in self._non_persistent_buffers_set]

    def checkpoint_meta(self) -> Dict[str, object]:
        """Everything besides tensors needed to rebuild the module (stored in quantfuse.json), and the names of its
        tensors (optional ones, bias and zero points, included: a checkpoint missing one must not load as a
        different layer)."""
        return {"class": type(self).__name__, "in_features": self.in_features, "out_features": self.out_features,
                "tensors": sorted(self.checkpoint_tensors())}

    @classmethod
    def from_checkpoint(cls, tensors: Dict[str, Tensor], meta: Dict[str, object]) -> "QuantizedLinear":
        return cls._from_tensors(tensors, meta)

    def ct_scheme(self) -> Dict[str, object]:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes of the stored weight representation (codes, scales, zero points; no bias)."""
        return sum(t.numel() * t.element_size() for n, t in self.checkpoint_tensors().items()
                   if n.startswith("weight") and n != "weight_shape")


def _ct_args(num_bits: int, type_: str, strategy: str, symmetric: bool = True, dynamic=False,
             group_size: Optional[int] = None, block_structure=None, observer: Optional[str] = "minmax"):
    args = {"num_bits": num_bits, "type": type_, "symmetric": symmetric, "strategy": strategy,
            "dynamic": dynamic, "group_size": group_size, "block_structure": block_structure,
            "actorder": None, "observer": None if dynamic else observer, "observer_kwargs": {}}
    return args


# ----------------------------------------------------------------------------------------------------
# W8A8: int8 / fp8 weights per output channel, activations per token (dynamic) or per tensor (static)
# ----------------------------------------------------------------------------------------------------
def _stream_state(x: Tensor) -> tuple:
    """(current raw stream of x's device, capturing?) for the caches below: torch.cuda.current_stream builds a
    Stream object per call (10-30 us of host time on the H100 machine, more than a kernel launch)."""
    if not x.is_cuda:
        return (0, False)
    return (torch._C._cuda_getCurrentRawStream(x.device.index), torch._C._cuda_isCurrentStreamCapturing())


def _same_memory(x: Tensor) -> tuple:
    """What an entry of the caches below must find unchanged in x: its version counter (in-place writes) and its
    memory (data pointer, shape, strides)."""
    return (x._version, x.data_ptr(), tuple(x.shape), x.stride())


class SharedInputQuantization:
    """The last dynamically quantized activation, reused when the next layer gets the very same tensor.

    Attention's q_proj, k_proj and v_proj (and any layers fed one tensor) quantize the same x with the same
    dynamic rule (per token, or per 1x128 group): the codes and scales depend only on x, so the first
    layer's result serves the others, bit for bit, and x is read and quantized once instead of three times.
    A hit needs the same tensor object (held by a weak reference: nothing is kept alive for it), an
    unchanged version counter (no in-place write since), the same rule (`key`: the layer class's
    quantize_input and its code dtype) and, on CUDA, the same current stream (so an entry made while a
    CUDA graph is captured, on the capture stream, never serves an eager call) and the same memory (data
    pointer, shape and strides: `x.data = other` rebinds x without a version bump). The entry is dropped
    when x is freed. Not used while torch.compile traces (the compiled graph quantizes per layer as
    before), nor for inference tensors (made under torch.inference_mode: they carry no version counter, so
    nothing proves them unchanged; use torch.no_grad() to keep the sharing); `enabled = False` turns it off.
    Writes the version counter does not see (through `x.data`, numpy or the raw storage) need `clear()`."""

    def __init__(self):
        self.enabled = True
        self._entry = None  # (weakref to x, _same_memory(x), key, stream, value): replaced as one object

    def get(self, x: Tensor, key: tuple, compute: Callable[[], Tuple[Tensor, Tensor]]):
        if not self.enabled or torch.compiler.is_compiling() or x.is_inference():
            return compute()
        stream = _stream_state(x)
        memory = _same_memory(x)
        entry = self._entry
        if entry is not None and entry[0]() is x and entry[1] == memory and entry[2] == key \
                and entry[3] == stream:
            return entry[4]
        value = compute()
        self._entry = (weakref.ref(x, self._drop), memory, key, stream, value)
        return value

    def _drop(self, ref) -> None:
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    def clear(self) -> None:
        self._entry = None


SHARED_INPUT = SharedInputQuantization()


class _ScaledMMLinear(QuantizedLinear):
    qdtype = torch.int8

    def __init__(self, weight_q: Tensor, weight_scale: Tensor, bias: Optional[Tensor]):
        n, k = weight_q.shape
        super().__init__(k, n, bias)
        self.register_buffer("weight", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(n, 1).contiguous())

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W_hat = q * s_w[n] in float32, one rounding to `dtype`."""
        return (self.weight.float() * self.weight_scale).to(dtype)

    @classmethod
    def _stacked(cls, members) -> "_ScaledMMLinear":
        """One layer of this class computing all `members`' outputs (`MergedProjections`, gated MLPs)."""
        return _stack_layers(cls, members)

    @staticmethod
    def _scale_rows(a: int, b: int) -> Tuple[int, int]:
        """Rows of weight_scale that belong to output channels a..b-1 (one per channel)."""
        return a, b

    def _mm(self, q: Tensor, scale_a: Tensor, out_dtype: torch.dtype, azp_adj=None) -> Tensor:
        return ops.scaled_mm(q, self.weight.t(), scale_a, self.weight_scale, out_dtype=out_dtype,
                             bias=self.bias, azp_adj=azp_adj)

    @classmethod
    def _from_tensors(cls, tensors, meta):
        return cls(tensors["weight"], tensors["weight_scale"], tensors.get("bias"))


class Int8DynamicLinear(_ScaledMMLinear):
    """W8A8 int8, dynamic per-token activations.

    Offline: s_w[n] = max|W[n, :]| / 127, W_q = sat(rne(W / s_w)).
    Per call: s_x[i] = max|x[i, :]| / 127, x_q = sat(rne(x / s_x)) (`quantize_per_token`), then
    y[i, n] = s_x[i] * s_w[n] * sum_k x_q[i, k] W_q[n, k] + b[n] (`scaled_mm`, int32 accumulation)."""

    scheme = "int8_dynamic"
    qdtype = torch.int8

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8DynamicLinear":
        _check_linear(linear)
        q, s = quantize_weight_per_channel(linear.weight, cls.qdtype)
        return cls(q, s, linear.bias)

    def quantize_input(self, x2d: Tensor):
        q, scale, _ = ops.quantize_per_token(x2d, self.qdtype)
        return q, scale

    def quantize_silu_and_mul(self, gate_up: Tensor):
        """This layer's input silu(g) * u from [g | u], quantized per token in one pass."""
        return ops.silu_and_mul_quant(gate_up, self.qdtype)

    def matmul_quantized(self, q: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
        return self._mm(q, scale, out_dtype)

    def forward(self, x: Tensor) -> Tensor:
        merged = self._merged_output(x)
        if merged is not None:
            return merged
        out_dtype = _out_dtype(x)
        q, scale = SHARED_INPUT.get(x, (type(self).quantize_input, self.qdtype),
                                    lambda: self.quantize_input(_rows(x)))
        return self._mm(q, scale, out_dtype).reshape(*x.shape[:-1], self.out_features)

    def ct_scheme(self):
        return {"format": "int-quantized",
                "weights": _ct_args(8, "int", "channel"),
                "input_activations": _ct_args(8, "int", "token", dynamic=True)}


class Fp8DynamicLinear(Int8DynamicLinear):
    """W8A8 fp8 (e4m3fn), dynamic per-token activations; the int8 math with qmax = 448 and
    fp8 x fp8 products accumulated in float32:
    y[i, n] = s_x[i] * s_w[n] * sum_k x_q[i, k] W_q[n, k] + b[n]."""

    scheme = "fp8_dynamic"
    qdtype = FP8

    def ct_scheme(self):
        return {"format": "float-quantized",
                "weights": _ct_args(8, "float", "channel"),
                "input_activations": _ct_args(8, "float", "token", dynamic=True)}


class Int8StaticLinear(_ScaledMMLinear):
    """W8A8 int8 with a static per-tensor activation scale from calibration.

    Symmetric: s_x = max(amax, 1e-10) / 127 from the calibrated amax; x_q = sat(rne(x / s_x));
    y = s_x * s_w[n] * (x_q @ W_q^T)[i, n] + b[n].
    Asymmetric (zero point z_x, from the calibrated range [lo, hi]): s_x = (hi - lo) / 255,
    z_x = rne(-128 - lo / s_x), x_q = sat(rne(x / s_x) + z_x), and, since x ~ s_x (x_q - z_x),
    y[i, n] = s_x * s_w[n] * ((x_q @ W_q^T)[i, n] - z_x * sum_k W_q[n, k]) + b[n]: the correction
    z_x * colsum is precomputed once (`azp_adjustment`) and subtracted exactly in int32 by the epilogue."""

    scheme = "int8_static"
    qdtype = torch.int8

    def __init__(self, weight_q, weight_scale, bias, input_scale: Tensor, input_zero_point: Optional[Tensor] = None):
        super().__init__(weight_q, weight_scale, bias)
        self.register_buffer("input_scale", input_scale.float().reshape(1).contiguous())
        self.register_buffer("input_zero_point",
                             None if input_zero_point is None else input_zero_point.to(torch.int32).reshape(1))
        self.register_buffer("azp_adj", self._azp_adj(), persistent=False)

    def _azp_adj(self) -> Optional[Tensor]:
        """z_x * colsum(W_q) (int32), the asymmetric epilogue's correction; None when symmetric."""
        if self.input_zero_point is None:
            return None
        return ops.azp_adjustment(self.weight.t(), self.input_zero_point).reshape(-1).to(torch.int32)

    def _rebuild_derived(self) -> None:
        super()._rebuild_derived()
        self.azp_adj = self._azp_adj()

    @property
    def symmetric(self) -> bool:
        return self.input_zero_point is None

    @classmethod
    def _stacked(cls, members) -> "Int8StaticLinear":  # the members share input_scale / zero point (checked)
        return _stack_layers(cls, members, members[0].input_scale, members[0].input_zero_point)

    @classmethod
    def from_linear(cls, linear: nn.Linear, amax: Optional[float] = None,
                    input_range: Optional[Tuple[float, float]] = None) -> "Int8StaticLinear":
        """`amax` (symmetric) or `input_range=(lo, hi)` (asymmetric) of the layer's input, from calibration."""
        _check_linear(linear)
        if input_range is not None and cls.qdtype != torch.int8:
            raise ValueError(f"input_range: a zero point needs int8 codes; {cls.__name__} is symmetric (pass amax)")
        q, s = quantize_weight_per_channel(linear.weight, cls.qdtype)
        dev = linear.weight.device
        if input_range is not None:
            lo, hi = float(min(input_range[0], 0.0)), float(max(input_range[1], 0.0))
            scale, zp = ref._azp_from_range(torch.tensor(lo, device=dev), torch.tensor(hi, device=dev))
            return cls(q, s, linear.bias, scale, zp)
        if amax is None:
            raise ValueError("amax: a static scale needs the calibrated amax (or input_range), got None")
        amax_t = torch.as_tensor(float(amax), dtype=torch.float32, device=dev)
        if not torch.isfinite(amax_t):
            raise ValueError(f"amax: expected a finite calibrated amax, got {float(amax)}")
        return cls(q, s, linear.bias, ref.dynamic_scale(amax_t, cls.qdtype))

    def forward(self, x: Tensor) -> Tensor:
        merged = self._merged_output(x)
        if merged is not None:
            return merged
        out_dtype = _out_dtype(x)
        q, scale, _ = ops.quantize_per_tensor(_rows(x), self.qdtype, self.input_scale, self.input_zero_point)
        return self._mm(q, scale, out_dtype, azp_adj=self.azp_adj).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def _from_tensors(cls, tensors, meta):
        return cls(tensors["weight"], tensors["weight_scale"], tensors.get("bias"),
                   tensors["input_scale"], tensors.get("input_zero_point"))

    def ct_scheme(self):
        kind = "float" if self.qdtype == FP8 else "int"
        return {"format": f"{kind}-quantized",
                "weights": _ct_args(8, kind, "channel"),
                "input_activations": _ct_args(8, kind, "tensor", symmetric=self.symmetric)}


class Fp8StaticLinear(Int8StaticLinear):
    """W8A8 fp8 (e4m3fn) with a static per-tensor activation scale from calibration: the layout of FP8
    checkpoints that carry an `input_scale` (vLLM's "fp8" models, llm-compressor's FP8 scheme).

    s_w[n] = max|W[n, :]| / 448, W_q = sat(rne(W / s_w)) in e4m3; s_x = max(amax, 1e-10) / 448 from the
    calibrated amax; per call x_q = sat(rne(x / s_x)) (`quantize_per_tensor` with the static scale) and
    y[i, n] = s_x * s_w[n] * sum_k x_q[i, k] W_q[n, k] + b[n] (`scaled_mm`, fp8 products accumulated in
    float32). Symmetric only: fp8 codes take no zero point. Saturation clips inputs beyond the calibrated
    amax to +-448 codes, as in the int8 scheme."""

    scheme = "fp8_static"
    qdtype = FP8

    def __init__(self, weight_q, weight_scale, bias, input_scale: Tensor, input_zero_point: Optional[Tensor] = None):
        if input_zero_point is not None:
            raise ValueError("input_zero_point: fp8 static layers are symmetric, got a zero point")
        if weight_q.dtype != FP8:
            raise TypeError(f"weight_q: expected float8_e4m3fn codes, got {weight_q.dtype}")
        super().__init__(weight_q, weight_scale, bias, input_scale)


# ----------------------------------------------------------------------------------------------------
# FP8 block scaling: 128x128 weight blocks, 1x128 activation groups
# ----------------------------------------------------------------------------------------------------
class Fp8BlockLinear(QuantizedLinear):
    """FP8 with 128x128 weight blocks and dynamic 1x128 activation groups (DeepSeek-V3 style).

    Offline: s_w[bn, bk] = max|W tile| / 448 per 128x128 tile. Per call: s_x[i, kb] = max|x[i, kb-group]| / 448
    (`quantize_per_group`, transposed scale layout), then (`scaled_mm_blockwise`)
    y[i, n] = sum_kb s_x[i, kb] * s_w[n // 128, kb] * (x_q[i, kb-group] . W_q[n, kb-group]) + b[n].
    K must be a multiple of 128 (the activation groups); N may be anything."""

    scheme = "fp8_block"

    def __init__(self, weight_q: Tensor, weight_scale: Tensor, bias: Optional[Tensor]):
        n, k = weight_q.shape
        if k % BLOCK != 0:
            raise ValueError(f"in_features: fp8 block scaling needs a multiple of {BLOCK}, got {k}")
        super().__init__(k, n, bias)
        self.register_buffer("weight", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        # the GEMM reads the weight as b = W^T [K, N], so its block scales as [K/128, N/128]
        self.register_buffer("scale_b", self.weight_scale.t().contiguous(), persistent=False)

    def _rebuild_derived(self) -> None:
        super()._rebuild_derived()
        self.scale_b = self.weight_scale.t().contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8BlockLinear":
        _check_linear(linear)
        if linear.in_features % BLOCK != 0:
            raise ValueError(
                f"linear: fp8 block scaling needs in_features divisible by {BLOCK}, got {linear.in_features}")
        q, s = quantize_weight_blocks(linear.weight)
        return cls(q, s, linear.bias)

    def quantize_input(self, x2d: Tensor):
        q, scales, _ = ops.quantize_per_group(x2d, FP8, BLOCK, transposed_scales=True)
        return q, scales

    def quantize_silu_and_mul(self, gate_up: Tensor):
        """This layer's input silu(g) * u from [g | u]: fp8 codes and 1x128 group scales (transposed)."""
        return ops.silu_and_mul_quant(gate_up, FP8, group_size=BLOCK, transposed_scales=True)

    def matmul_quantized(self, q: Tensor, scales: Tensor, out_dtype: torch.dtype) -> Tensor:
        return ops.scaled_mm_blockwise(q, self.weight.t(), scales, self.scale_b, out_dtype=out_dtype, bias=self.bias)

    def forward(self, x: Tensor) -> Tensor:
        merged = self._merged_output(x)
        if merged is not None:
            return merged
        out_dtype = _out_dtype(x)
        q, scales = SHARED_INPUT.get(x, (type(self).quantize_input,), lambda: self.quantize_input(_rows(x)))
        return self.matmul_quantized(q, scales, out_dtype).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def _stacked(cls, members) -> "Fp8BlockLinear":  # all but the last member whole 128-row blocks (checked)
        return _stack_layers(cls, members)

    @staticmethod
    def _scale_rows(a: int, b: int) -> Tuple[int, int]:
        """Rows of the 128x128 block scales that belong to output channels a..b-1 (a a multiple of 128)."""
        return a // BLOCK, -(-b // BLOCK)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W_hat[n, k] = q[n, k] * s_w[n // 128, k // 128] in float32, one rounding to `dtype`."""
        scale = expand_block_scale(self.weight_scale, (self.out_features, self.in_features))
        return (self.weight.float() * scale).to(dtype)

    @classmethod
    def _from_tensors(cls, tensors, meta):
        return cls(tensors["weight"], tensors["weight_scale"], tensors.get("bias"))

    def ct_scheme(self):
        return {"format": "float-quantized",
                "weights": _ct_args(8, "float", "block", block_structure=[BLOCK, BLOCK]),
                "input_activations": _ct_args(8, "float", "group", dynamic=True, group_size=BLOCK)}


def _stack_layers(cls, members, *extra):
    """A `cls` layer over the members' weights and scales stacked along the output channels (`extra`: the
    constructor's further arguments, shared by the members)."""
    return cls(torch.cat([m.weight for m in members]), torch.cat([m.weight_scale for m in members]),
               _stacked_biases(members), *extra)


def _stacked_biases(members) -> Optional[Tensor]:
    if all(m.bias is None for m in members):
        return None
    ref_bias = next(m.bias for m in members if m.bias is not None)
    return torch.cat([m.bias if m.bias is not None else
                      torch.zeros(m.out_features, dtype=ref_bias.dtype, device=ref_bias.device) for m in members])


class GatedMLP(nn.Module):
    """A gated MLP (Llama: down(silu(gate(x)) * up(x))) with the activation fused into the quantization.

    gate and up share one GEMM (weights and their scales stacked: [gate; up] -> [2H, K]); its output
    [M, 2H] = [g | u] goes straight into `silu_and_mul_quant`, which computes silu(g) * u in float32 and
    emits the codes and scales the down projection's GEMM reads, so the activation never makes a round
    trip in 16-bit precision and x is quantized once for both gate and up. The three projections are layers
    of one class (`layer_class`) with quantize_input / matmul_quantized / quantize_silu_and_mul.
    Checkpoints hold gate_proj / up_proj / down_proj as separate layers."""

    layer_class: type = nn.Module

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        for name, layer in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if type(layer) is not self.layer_class:  # exact: fp8 layers subclass the int8 ones
                raise TypeError(f"{name}: expected a {self.layer_class.__name__}, got {type(layer).__name__}")
        if gate_up_proj.out_features % 2 or gate_up_proj.out_features // 2 != down_proj.in_features:
            raise ValueError(f"gate_up_proj: expected 2 x down_proj.in_features = {2 * down_proj.in_features} "
                             f"outputs, got {gate_up_proj.out_features}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.hidden = gate_up_proj.out_features // 2

    @property
    def scheme(self) -> str:
        return self.down_proj.scheme

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "GatedMLP":
        for name in ("gate_proj", "up_proj", "down_proj"):
            _check_linear(getattr(mlp, name, None), f"mlp.{name}")
        return cls.from_layers(*(cls.layer_class.from_linear(getattr(mlp, p))
                                 for p in ("gate_proj", "up_proj", "down_proj")))

    @classmethod
    def from_layers(cls, gate: nn.Module, up: nn.Module, down: nn.Module) -> "GatedMLP":
        return cls(cls.layer_class._stacked([gate, up]), down)

    def split_layers(self) -> Dict[str, nn.Module]:
        """gate_proj, up_proj, down_proj as separate layers (views of the stacked tensors)."""
        h = self.hidden
        gu = self.gate_up_proj
        scale_rows = gu.weight_scale.shape[0] // 2  # per channel: h; per 128x128 block: h / 128
        bias = gu.bias
        gate = self.layer_class(gu.weight[:h], gu.weight_scale[:scale_rows], None if bias is None else bias[:h])
        up = self.layer_class(gu.weight[h:], gu.weight_scale[scale_rows:], None if bias is None else bias[h:])
        return {"gate_proj": gate, "up_proj": up, "down_proj": self.down_proj}

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = _out_dtype(x)
        q, scales = self.gate_up_proj.quantize_input(_rows(x))
        gate_up = self.gate_up_proj.matmul_quantized(q, scales, out_dtype)
        h_q, h_scales = self.down_proj.quantize_silu_and_mul(gate_up)
        y = self.down_proj.matmul_quantized(h_q, h_scales, out_dtype)
        return y.reshape(*x.shape[:-1], self.down_proj.out_features)


class Fp8BlockGatedMLP(GatedMLP):
    """`GatedMLP` on fp8 block scaling: the down projection reads 1x128 fp8 groups (transposed scales).
    H must be a multiple of 128 so no weight block straddles gate and up."""

    layer_class = Fp8BlockLinear

    def __init__(self, gate_up_proj: Fp8BlockLinear, down_proj: Fp8BlockLinear):
        if gate_up_proj.out_features % (2 * BLOCK) != 0:
            raise ValueError(f"gate_up_proj: the hidden size must be a multiple of {BLOCK}, "
                             f"got {gate_up_proj.out_features // 2}")
        super().__init__(gate_up_proj, down_proj)

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "Fp8BlockGatedMLP":
        gate = getattr(mlp, "gate_proj", None)
        if isinstance(gate, nn.Linear) and gate.out_features % BLOCK != 0:
            raise ValueError(f"mlp.gate_proj: out_features must be a multiple of {BLOCK} for the fused MLP, "
                             f"got {gate.out_features}")
        return super().from_mlp(mlp)


class Int8DynamicGatedMLP(GatedMLP):
    """`GatedMLP` with int8 per-channel weights and per-token activations: x quantized once for gate|up,
    silu(g) * u quantized per token by `silu_and_mul_quant` for the down projection."""

    layer_class = Int8DynamicLinear


class Fp8DynamicGatedMLP(GatedMLP):
    """`GatedMLP` with fp8 per-channel weights and per-token activations (as `Int8DynamicGatedMLP`)."""

    layer_class = Fp8DynamicLinear


GATED_MLP_CLASSES = {cls.__name__: cls for cls in (Fp8BlockGatedMLP, Int8DynamicGatedMLP, Fp8DynamicGatedMLP)}


# ----------------------------------------------------------------------------------------------------
# Weight-only INT4 / INT8 (activations stay 16-bit)
# ----------------------------------------------------------------------------------------------------
class WeightOnlyLinear(QuantizedLinear):
    """W4A16 / W8A16: integer weights per (channel, group), activations unquantized.

    W[n, k] ~ W_hat[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // group_size (one group per channel for
    group_size = -1; z = 0 when symmetric). y = x @ W_hat^T + b, accumulated in float32 (`weight_only_mm`).
    Float32 input runs in bfloat16 (the GEMM takes 16-bit activations) and is returned in float32.

    Stored in compressed-tensors' pack-quantized layout: `weight_packed` int32 [N, K*bits/32] (signed
    codes offset by 2^(bits-1), packed along K), `weight_scale` [N, G] float32, `weight_shape` [2],
    `weight_zero_point` [ceil(N*bits/32), G] (signed, packed along N) when asymmetric. The kernel's own
    packed form (`QuantizedWeight`) is built from these tensors and cached per device."""

    def __init__(self, weight_packed: Tensor, weight_scale: Tensor, weight_shape: Tensor, bits: int,
                 group_size: int, bias: Optional[Tensor], weight_zero_point: Optional[Tensor] = None):
        n, k = (int(v) for v in weight_shape.tolist())
        super().__init__(k, n, bias)
        if bits not in (4, 8):
            raise ValueError(f"bits: expected 4 or 8, got {bits}")
        words = -(-k // (32 // bits))
        if tuple(weight_packed.shape) != (n, words):
            raise ValueError(f"weight_packed: expected shape ({n}, {words}) for weight_shape ({n}, {k}) and "
                             f"bits={bits}, got {tuple(weight_packed.shape)}")
        self.bits = int(bits)
        self.group_size = int(group_size)
        self.register_buffer("weight_packed", weight_packed.to(torch.int32).contiguous())
        # float32, or float16 / bfloat16 scales (what the packed conversion of weight_only_mm reads); any
        # other float dtype is widened to float32
        scale = weight_scale if weight_scale.dtype in (torch.float16, torch.bfloat16) else weight_scale.float()
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("weight_shape", weight_shape.to(torch.int64).reshape(2).contiguous())
        self.register_buffer("weight_zero_point",
                             None if weight_zero_point is None else weight_zero_point.to(torch.int32).contiguous())
        self._qw = None

    @property
    def scheme(self) -> str:  # type: ignore[override]
        return f"int{self.bits}_weight_only"

    @property
    def symmetric(self) -> bool:
        return self.weight_zero_point is None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                    hessian: Optional[Tensor] = None, scale_dtype: torch.dtype = torch.float32) -> "WeightOnlyLinear":
        """Round to nearest (SPEC section 4), or GPTQ when `hessian` (sum of x x^T over calibration inputs,
        [K, K]) is given (`gptq_quantize`). scale_dtype: float32, float16 or bfloat16 scales; 16-bit scales
        in the activation dtype let the GEMM dequantize two weights per packed instruction. RTN rounds the
        float32 scale up to scale_dtype and computes the codes with it (`quantize_weight`); GPTQ keeps its
        codes and rounds its scales to nearest (w_hat moves by at most 2^-9 relative in bfloat16)."""
        _check_linear(linear)
        n, k = linear.weight.shape
        if bits not in (4, 8):
            raise ValueError(f"bits: expected 4 or 8, got {bits!r}")
        if group_size not in (32, 64, 128, 256, -1) or (group_size != -1 and k % group_size != 0):
            raise ValueError(f"group_size: expected -1 or one of 32, 64, 128, 256 dividing in_features={k}, "
                             f"got {group_size!r}")
        if k % 8 != 0:
            raise ValueError(f"linear: weight-only GEMM needs in_features divisible by 8, got {k}")
        # quantize_weight gives biased codes u = q + 2^(bits-1) (symmetric) or unsigned codes u with zero
        # points z; compressed-tensors stores both offset by -2^(bits-1): the difference u - z is unchanged.
        if hessian is None:
            qw = ops.quantize_weight(linear.weight.detach(), bits=bits, group_size=group_size, symmetric=symmetric,
                                     scale_dtype=scale_dtype)
        else:
            from .weights import QuantizedWeight, check_scale_dtype

            check_scale_dtype(scale_dtype)
            u, sc, zs = gptq_quantize(linear.weight, hessian, bits, group_size, symmetric)
            rounded = sc.to(scale_dtype)
            if not bool(torch.isfinite(rounded).all()):
                raise ValueError(f"scale_dtype: {scale_dtype} cannot hold this layer's GPTQ scales (max "
                                 f"{float(sc.max()):.6g}); use torch.bfloat16 or torch.float32")
            qw = QuantizedWeight.from_codes(u, rounded, zs, bits, group_size)
        offset = 1 << (bits - 1)
        packed = pack_int32(qw.biased_codes() - offset, bits, dim=1)
        zp = None if symmetric else pack_int32(qw.zero_points().t() - offset, bits, dim=0)
        shape = torch.tensor([n, k], dtype=torch.int64, device=linear.weight.device)
        module = cls(packed, qw.scales.t(), shape, bits, group_size, linear.bias, zp)
        module._qw = qw  # the same codes; skip rebuilding them from the packed tensors
        return module

    def codes(self) -> Tuple[Tensor, Optional[Tensor]]:
        """(q [N, K], z [N, G] or None) as signed codes (asymmetric: both offset by -2^(bits-1))."""
        q = unpack_int32(self.weight_packed, self.bits, self.in_features, dim=1)
        if self.weight_zero_point is None:
            return q, None
        return q, unpack_int32(self.weight_zero_point, self.bits, self.out_features, dim=0)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W_hat = (q - z) * s in float32 (q - z exact), one rounding to `dtype`."""
        q, z = self.codes()
        n, k = q.shape
        g = k if self.group_size == -1 else self.group_size
        diff = q.reshape(n, k // g, g).float()
        if z is not None:
            diff = diff - z.float()[:, :, None]
        return (diff * self.weight_scale.float()[:, :, None]).reshape(n, k).to(dtype)

    def _device_changed(self) -> None:
        self._qw = None

    def quantized_weight(self):
        """The kernel's `QuantizedWeight`, built from the compressed-tensors tensors on first use."""
        if self._qw is None:
            from .weights import QuantizedWeight

            self._qw = QuantizedWeight.from_compressed_tensors(
                self.weight_packed, self.weight_scale, self.weight_shape, self.weight_zero_point,
                scale_dtype=None)  # keep the buffer's dtype: 16-bit scales keep the packed conversion
        return self._qw

    def forward(self, x: Tensor) -> Tensor:
        merged = self._merged_output(x)
        if merged is not None:
            return merged
        return _weight_only_forward(x, self.quantized_weight(), self.bias, self.out_features)

    def checkpoint_meta(self):
        meta = super().checkpoint_meta()
        meta.update(bits=self.bits, group_size=self.group_size)
        return meta

    @classmethod
    def _from_tensors(cls, tensors, meta):
        return cls(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_shape"], int(meta["bits"]),
                   int(meta["group_size"]), tensors.get("bias"), tensors.get("weight_zero_point"))

    def ct_scheme(self):
        strategy = "channel" if self.group_size == -1 else "group"
        return {"format": "pack-quantized",
                "weights": _ct_args(self.bits, "int", strategy, symmetric=self.symmetric,
                                    group_size=None if self.group_size == -1 else self.group_size),
                "input_activations": None}


def _weight_only_forward(x: Tensor, qw, bias: Optional[Tensor], out_features: int) -> Tensor:
    out_dtype = _out_dtype(x)
    xin = x if out_dtype != torch.float32 else x.to(torch.bfloat16)
    bias = bias if bias is None else bias.to(xin.dtype)
    y = ops.weight_only_mm(_rows(xin), qw, bias)
    return y.to(out_dtype).reshape(*x.shape[:-1], out_features)


def _mergeable_kind(layer) -> Optional[type]:
    """The class a layer merges as (exactly: fp8 layers subclass the int8 ones), or None."""
    kind = type(layer)
    return kind if kind in (WeightOnlyLinear, Int8DynamicLinear, Fp8DynamicLinear, Int8StaticLinear,
                            Fp8StaticLinear, Fp8BlockLinear) else None


def _merge_mismatch(layers) -> Optional[str]:
    """Why `layers` cannot share one GEMM (None: they can): one mergeable class, and the same input size,
    weight format and device."""
    from .weights import first_mismatch

    kind = _mergeable_kind(layers[0])
    fields = {"class": lambda m: type(m).__name__, "in_features": lambda m: m.in_features}
    if kind is WeightOnlyLinear:
        fields.update({"bits": lambda m: m.bits, "group_size": lambda m: m.group_size,
                       "scale dtype": lambda m: m.weight_scale.dtype, "device": lambda m: m.weight_packed.device})
    else:
        fields.update({"weight dtype": lambda m: m.weight.dtype, "device": lambda m: m.weight.device})
    if kind in (Int8StaticLinear, Fp8StaticLinear):  # one quantization of x serves all: same scale and zero point
        fields.update({"input_scale": lambda m: float(m.input_scale),
                       "input_zero_point": lambda m: None if m.input_zero_point is None else int(m.input_zero_point)})
    mismatch = first_mismatch("members", layers, fields)
    if mismatch is None and kind is Fp8BlockLinear and any(m.out_features % BLOCK for m in layers[:-1]):
        return (f"members: fp8 block layers share a GEMM only when every member but the last has whole "
                f"{BLOCK}-row weight blocks, got out_features {[m.out_features for m in layers]}")
    return mismatch


class MergedProjections:
    """Sibling layers that read the same tensor (attention's q_proj / k_proj / v_proj, a gated MLP's
    gate_proj / up_proj) run as one GEMM over their stacked weights: weight-only layers (`WeightOnlyLinear`),
    W8A8 ones (`Int8DynamicLinear`, `Fp8DynamicLinear`, `Fp8BlockLinear`: x is quantized once either way, see
    `SharedInputQuantization`), and `Int8StaticLinear` / `Fp8StaticLinear` ones with the same calibrated input
    scale and zero point (x quantized once instead of once per layer).

    At decode sizes such a GEMM is bound by streaming its weight and by the fixed cost of a launch and its
    split-K reduction: one [sum N_i, K] GEMM costs about what the largest member alone does (Llama-3-8B int4
    at M = 1: q/k/v 4096 -> 6144 in ~10.6 us on the H100 instead of 8.7 + 6.3 + 6.3), with no change to the
    model's code. The first member called on x computes y = x @ [W_0; W_1; ...]^T + [b_0; b_1; ...] (each
    row of y as the members would compute it: bit for bit for int8, up to float32 summation order
    otherwise) and returns its column slice; the others called on the very same x get theirs from that
    result. A hit needs the same tensor object (held by a weak reference), an unchanged version counter of x
    and of the result (no in-place write since: the members' outputs are column views of one [.., sum N_i]
    tensor), the same current CUDA stream and capture state (an entry made while a CUDA graph is captured
    never serves an eager call) and a member not yet served from this entry; anything else computes the
    merged GEMM again, so results never depend on the call order. Under torch.compile (and with
    `enabled = False`) each member runs alone; so it does in a CUDA graph capture that comes before any eager
    call has stacked the weights (run the model once before capturing, as usual).

    Checkpoints are unchanged: the members keep their own tensors. Weight-only: the stacked
    `QuantizedWeight` is built on first use and replaces the members' per-layer copies (rebuilt only if a
    member runs alone). W8A8: the stacked weight and scales are one tensor whose row blocks become the
    members' buffers (views: no extra memory); moving or casting a member rebuilds it on the next call.
    (A static layer's int32 zero-point correction and an fp8 block layer's transposed scales are small
    per-layer copies, kept.)"""

    def __init__(self, members):
        members = list(members)
        if len(members) < 2 or not all(_mergeable_kind(m) for m in members):
            raise TypeError("members: expected two or more WeightOnlyLinear, Int8DynamicLinear, Fp8DynamicLinear, "
                            f"Int8StaticLinear, Fp8StaticLinear or Fp8BlockLinear layers, got "
                            f"{[type(m).__name__ for m in members]}")
        for i, m in enumerate(members):
            if m._merged is not None:
                raise ValueError(f"members[{i}]: already part of a MergedProjections")
        mismatch = _merge_mismatch(members)
        if mismatch:
            raise ValueError(mismatch)
        self.enabled = True
        self.members = members
        self.kind = type(members[0])
        self.bounds = []
        start = 0
        for m in members:
            self.bounds.append((start, start + m.out_features))
            start += m.out_features
        self.out_features = start
        self._merged_layer = None  # weight-only: (QuantizedWeight, bias); W8A8: a layer of the members' class
        self._entry = None  # (weakref to x, _same_memory(x), stream, y, y._version, served indices, parts)
        for i, m in enumerate(members):
            m._merged = (self, i)

    def invalidate(self) -> None:
        self._merged_layer = None
        self._entry = None

    def split(self) -> None:
        """Undo the merge: every member runs alone again."""
        for m in self.members:
            m._merged = None
        self.invalidate()

    def _build(self):
        if self.kind is WeightOnlyLinear:
            from .weights import QuantizedWeight

            qw = QuantizedWeight.concat_rows([m.quantized_weight() for m in self.members])
            for m in self.members:
                m._qw = None  # the stacked copy serves them; rebuilt from the buffers if one runs alone
            return qw, _stacked_biases(self.members)
        layer = self.kind._stacked(self.members)
        for m, (a, b) in zip(self.members, self.bounds):
            r0, r1 = m._scale_rows(a, b)
            m._buffers["weight"] = layer.weight[a:b]
            m._buffers["weight_scale"] = layer.weight_scale[r0:r1]
        return layer

    def _compute(self, x: Tensor) -> Tensor:
        if self._merged_layer is None:
            self._merged_layer = self._build()
        if self.kind is WeightOnlyLinear:
            qw, bias = self._merged_layer
            return _weight_only_forward(x, qw, bias, self.out_features)
        return self._merged_layer(x)

    def output(self, x: Tensor, index: int) -> Tensor:
        stream = _stream_state(x)
        memory = _same_memory(x)
        entry = self._entry
        if entry is not None and entry[0]() is x and entry[1] == memory and entry[2] == stream \
                and entry[3]._version == entry[4] and index not in entry[5]:
            entry[5].add(index)
            return entry[6][index]
        y = self._compute(x)
        parts = [y[..., a:b] for a, b in self.bounds]
        self._entry = (weakref.ref(x, self._drop), memory, stream, y, y._version, {index}, parts)
        return parts[index]

    def _drop(self, ref) -> None:
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    def __getstate__(self):  # copy.deepcopy / pickle: the cached result and weak reference stay behind
        state = dict(self.__dict__)
        state["_entry"] = None
        return state


# Sibling layer names merged by `merge_projections` (Llama/Mistral/Qwen attention and MLP, BERT attention,
# Mixtral-style experts' w1/w3).
MERGE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"), ("w1", "w3"))


def merged_groups(model: nn.Module) -> Dict[Tuple[str, ...], MergedProjections]:
    """{member names: group} of the `MergedProjections` in `model`."""
    found = {}
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module._merged is not None:
            group = module._merged[0]
            key = tuple(names.get(id(m), "?") for m in group.members)
            found[key] = group
    return found


def merge_projections(model: nn.Module, groups=MERGE_GROUPS,
                      only: Optional[Callable[[str], bool]] = None) -> Dict[Tuple[str, ...], MergedProjections]:
    """Merge sibling layers named in `groups` (children of one module, of one mergeable class with the same
    in_features and weight format: `MergedProjections`; two or more of a group's names present). Layers
    already merged, and layers whose full name `only` rejects, are left as they are. Returns the new groups
    by member names.
    A group's members must be called on the same tensor to gain anything (as attention's q/k/v and a
    gated MLP's gate/up are); called on different tensors each computes the whole merged GEMM (correct,
    slower)."""
    made = {}
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for names in groups:
            present = [n for n in names if _mergeable_kind(getattr(parent, n, None))
                       and getattr(parent, n)._merged is None and (only is None or only(prefix + n))]
            if len(present) < 2:
                continue
            layers = [getattr(parent, n) for n in present]
            if _merge_mismatch(layers):
                continue
            made[tuple(prefix + n for n in present)] = MergedProjections(layers)
    return made


MODULE_CLASSES = {cls.__name__: cls for cls in
                  (Int8DynamicLinear, Int8StaticLinear, Fp8StaticLinear, Fp8DynamicLinear, Fp8BlockLinear,
                   WeightOnlyLinear)}

__all__ = ["SharedInputQuantization", "SHARED_INPUT", "QuantizedLinear", "Int8DynamicLinear", "Int8StaticLinear",
           "Fp8StaticLinear", "Fp8DynamicLinear", "Fp8BlockLinear", "GatedMLP", "Fp8BlockGatedMLP",
           "Int8DynamicGatedMLP", "Fp8DynamicGatedMLP", "GATED_MLP_CLASSES", "WeightOnlyLinear", "MergedProjections",
           "merge_projections", "merged_groups", "MERGE_GROUPS", "quantize_weight_per_channel",
           "gptq_quantize", "quantize_weight_blocks", "pack_int32", "unpack_int32"]
