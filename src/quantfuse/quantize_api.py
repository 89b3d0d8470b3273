"""Model-level API: `quantize_(model, config, calibration_data=None)` swaps `nn.Linear` layers for the
quantized modules of `quantfuse.modules`, in place (in the spirit of torchao's `quantize_`).

    import quantfuse
    quantfuse.quantize_(model, quantfuse.Int8DynamicConfig(skip=("lm_head",)))
    quantfuse.quantize_(model, quantfuse.Int8StaticConfig(calibrator="entropy"), calibration_data=batches)
    quantfuse.quantize_(model, quantfuse.Fp8StaticConfig(), calibration_data=batches)  # input_scale per layer
    quantfuse.save_quantized(model, "out/")          # safetensors + compressed-tensors quantization_config

Which layers: every `nn.Linear` whose name does not match `config.skip` (fnmatch patterns matched against
the full dotted name and against its last component; "re:<regex>" for a regular expression).
`config.overrides` maps name patterns to another config (or None to leave the layer alone); the first
matching pattern wins. Static schemes calibrate first: forward pre-hooks on the target layers feed each
layer's input to a calibrator while the model runs over `calibration_data` (an iterable of batches:
tensors -> model(x), dicts -> model(**batch), tuples -> model(*batch)).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .modules import (
    Fp8BlockGatedMLP,
    Fp8BlockLinear,
    Fp8DynamicGatedMLP,
    Fp8DynamicLinear,
    Fp8StaticLinear,
    GatedMLP,
    Int8DynamicGatedMLP,
    Int8DynamicLinear,
    Int8StaticLinear,
    QuantizedLinear,
    WeightOnlyLinear,
    merge_projections,
)
from .weights import check_scale_dtype

CALIBRATORS = ("max", "percentile", "mse", "entropy")
WEIGHT_ALGORITHMS = ("rtn", "gptq")


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------
@dataclass
class QuantConfig:
    """Common fields. `skip`: name patterns left in floating point. `overrides`: {pattern: config or None}."""

    skip: Tuple[str, ...] = ("lm_head",)
    overrides: Dict[str, Optional["QuantConfig"]] = field(default_factory=dict)

    scheme = "base"
    needs_calibration = False

    def __post_init__(self):
        self._check_common()

    def _check_common(self) -> None:
        for f in fields(self):  # every flag of every config (symmetric, fuse_gated_mlp, merge_projections, ...)
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{f.name}: expected a bool, got {type(getattr(self, f.name)).__name__}")
        if isinstance(self.skip, str):
            self.skip = (self.skip,)
        if not isinstance(self.skip, (tuple, list)) or not all(isinstance(p, str) for p in self.skip):
            raise TypeError(f"skip: expected a tuple of name patterns (str), got {self.skip!r}")
        self.skip = tuple(self.skip)
        if not isinstance(self.overrides, dict):
            raise TypeError(f"overrides: expected a dict {{name pattern: config or None}}, "
                            f"got {type(self.overrides).__name__}")
        for pattern, override in self.overrides.items():
            if not isinstance(pattern, str):
                raise TypeError(f"overrides: expected str name patterns as keys, got {pattern!r}")
            if override is not None and not isinstance(override, QuantConfig):
                raise TypeError(f"overrides[{pattern!r}]: expected a QuantConfig or None, "
                                f"got {type(override).__name__}")
        for pattern in list(self.skip) + list(self.overrides):
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as err:
                    raise ValueError(f"pattern {pattern!r}: invalid regular expression: {err}") from err

    def convert(self, linear: nn.Linear, stats: Optional["_LayerStats"] = None) -> nn.Module:  # pragma: no cover
        raise NotImplementedError


@dataclass
class Int8DynamicConfig(QuantConfig):
    """INT8 weights per output channel, INT8 activations per token (dynamic). `fuse_gated_mlp`: gated MLPs
    (gate_proj/up_proj/down_proj with SiLU) become one `Int8DynamicGatedMLP` (one gate|up GEMM,
    `silu_and_mul_quant` per token into the down projection). `merge_projections`: sibling layers fed one
    tensor (q_proj / k_proj / v_proj, ...: `modules.MERGE_GROUPS`) run as one GEMM over their stacked
    weights (`modules.MergedProjections`: x quantized once, outputs bit for bit those of the layers alone)."""

    fuse_gated_mlp: bool = True
    merge_projections: bool = True
    scheme = "int8_dynamic"

    def convert(self, linear, stats=None):
        return Int8DynamicLinear.from_linear(linear)


@dataclass
class Fp8DynamicConfig(QuantConfig):
    """FP8 e4m3 weights per output channel, FP8 activations per token (dynamic). `fuse_gated_mlp` and
    `merge_projections` as for `Int8DynamicConfig` (`Fp8DynamicGatedMLP`; merged outputs within float32
    summation order of the layers alone)."""

    fuse_gated_mlp: bool = True
    merge_projections: bool = True
    scheme = "fp8_dynamic"

    def convert(self, linear, stats=None):
        return Fp8DynamicLinear.from_linear(linear)


@dataclass
class Fp8BlockConfig(QuantConfig):
    """FP8 with 128x128 weight blocks and 1x128 dynamic activation groups. `fuse_gated_mlp`: gated MLPs
    (gate_proj/up_proj/down_proj with SiLU) become one `Fp8BlockGatedMLP` using `silu_and_mul_quant`.
    `merge_projections` as for `Int8DynamicConfig` (members but the last need whole 128-row blocks)."""

    fuse_gated_mlp: bool = True
    merge_projections: bool = True
    scheme = "fp8_block"

    def convert(self, linear, stats=None):
        return Fp8BlockLinear.from_linear(linear)


@dataclass
class Int8StaticConfig(QuantConfig):
    """INT8 weights per output channel, a static per-tensor INT8 activation scale from calibration.

    calibrator: "max" (running max |x|), or a histogram method "percentile" (at `percentile`), "mse",
    "entropy" (SPEC section 5). symmetric=False calibrates the input range [lo, hi] (running min/max,
    clipped to [-amax, amax] of the chosen calibrator) and uses a zero point (the azp epilogue).
    merge_projections: siblings fed one tensor (q/k/v) calibrate to the same scale and then run as one
    GEMM with x quantized once (`modules.MergedProjections`)."""

    calibrator: str = "max"
    symmetric: bool = True
    percentile: float = 99.99
    num_bins: int = 2048
    merge_projections: bool = True
    scheme = "int8_static"
    needs_calibration = True
    layer_class = Int8StaticLinear

    def __post_init__(self):
        self._check_common()
        if self.calibrator not in CALIBRATORS:
            raise ValueError(f"calibrator: expected one of {CALIBRATORS}, got {self.calibrator!r}")
        if isinstance(self.percentile, bool) or not isinstance(self.percentile, (int, float)) \
                or not 0 < self.percentile <= 100:
            raise ValueError(f"percentile: expected a number in (0, 100], got {self.percentile!r}")
        # the mse search starts at bin 128 and never takes the last centre; entropy's first candidate is bin 128
        least = {"mse": 129, "entropy": 128}.get(self.calibrator, 2)
        if isinstance(self.num_bins, bool) or not isinstance(self.num_bins, int) or self.num_bins < least:
            raise ValueError(f"num_bins: expected an integer >= {least} for calibrator={self.calibrator!r}, "
                             f"got {self.num_bins!r}")

    def convert(self, linear, stats=None):
        if stats is None or not stats.seen:
            raise ValueError(f"{type(self).__name__}: the layer saw no calibration data (was it ever called?)")
        amax = stats.amax(self)
        if self.symmetric:
            return self.layer_class.from_linear(linear, amax=amax)
        lo, hi = max(stats.lo, -amax), min(stats.hi, amax)
        return Int8StaticLinear.from_linear(linear, input_range=(lo, hi))


@dataclass
class Fp8StaticConfig(Int8StaticConfig):
    """FP8 e4m3 weights per output channel, a static per-tensor FP8 activation scale from calibration
    (`Fp8StaticLinear`: s_x = amax / 448; the FP8 checkpoint layout with an `input_scale`).

    calibrator: "max" (running max |x|, the usual choice for fp8, whose range rather than its resolution
    is what a scale sets) or "percentile" (at `percentile`, over a `num_bins` histogram). The "mse" and
    "entropy" searches of SPEC section 5 score candidates on an evenly spaced integer grid, which fp8 is
    not, so they are refused here. Symmetric only. merge_projections as for `Int8StaticConfig`."""

    scheme = "fp8_static"
    layer_class = Fp8StaticLinear

    def __post_init__(self):
        if self.calibrator in ("mse", "entropy"):
            raise ValueError(f"calibrator: expected 'max' or 'percentile' for fp8_static (the {self.calibrator} "
                             f"search scores an evenly spaced integer grid; fp8 codes are not one), "
                             f"got {self.calibrator!r}")
        super().__post_init__()
        if self.symmetric is not True:
            raise ValueError(f"symmetric: fp8_static is symmetric only (fp8 codes take no zero point), "
                             f"got {self.symmetric!r}")


@dataclass
class Int4WeightOnlyConfig(QuantConfig):
    """INT4 weights per (channel, group of `group_size` inputs), 16-bit activations (W4A16).

    algorithm: "rtn" rounds each weight to nearest (no data needed); "gptq" calibrates the layers'
    input second moments H = sum x x^T on `calibration_data` and quantizes with GPTQ (`gptq_quantize`),
    which compensates each rounding error in the columns still to come. Same format either way.
    scale_dtype: the dtype of the scales the kernels read, float32, float16 or bfloat16. Scales in the
    activation dtype let the weight-only GEMM dequantize two weights per 16-bit pair instruction (the
    "packed" conversion, same results; int4 with float16 / bfloat16, int8 with float16 only). None
    (default): float32, measured faster overall on the H100 (packed with bfloat16 scales: 2-5% faster at
    M <= 16, 10-30% slower at M = 32..128; kernels/weight_only.py); "auto": the layer's weight dtype where
    the packed conversion can use it, else float32. A 16-bit scale is the float32 one rounded up and the
    codes are computed with it (RTN); GPTQ keeps its codes and rounds its scales to nearest (w_hat moves
    by at most 2^-9 relative). merge_projections: sibling layers that read one tensor (q_proj / k_proj /
    v_proj, gate_proj / up_proj, ...: `modules.MERGE_GROUPS`) run as one GEMM over their stacked weights
    (`modules.MergedProjections`; their outputs are column views of one tensor); layers and checkpoints
    stay as they are."""

    group_size: int = 128
    symmetric: bool = True
    algorithm: str = "rtn"
    scale_dtype: Any = None  # None, "auto" or a torch.dtype
    merge_projections: bool = True
    scheme = "int4_weight_only"
    bits = 4

    def __post_init__(self):
        self._check_common()
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) \
                or self.group_size not in (32, 64, 128, 256, -1):
            raise ValueError(f"group_size: expected one of (32, 64, 128, 256, -1), got {self.group_size!r}")
        if self.algorithm not in WEIGHT_ALGORITHMS:
            raise ValueError(f"algorithm: expected one of {WEIGHT_ALGORITHMS}, got {self.algorithm!r}")
        if self.scale_dtype != "auto":
            check_scale_dtype(self.scale_dtype, allow_none=True)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.algorithm == "gptq"

    def layer_scale_dtype(self, linear: nn.Linear) -> torch.dtype:
        """The scale dtype this config gives `linear` (None: float32; "auto": from its weight dtype)."""
        if self.scale_dtype is None:
            return torch.float32
        if self.scale_dtype != "auto":
            return self.scale_dtype
        dtype = linear.weight.dtype
        if dtype == torch.float16 or (dtype == torch.bfloat16 and self.bits == 4):
            return dtype
        return torch.float32  # (int8 with bfloat16: 128 + u is not exact in bfloat16, no packed path)

    def convert(self, linear, stats=None):
        hessian = None
        if self.algorithm == "gptq":
            if stats is None or not stats.seen:
                raise ValueError(f"{type(self).__name__}(algorithm='gptq'): the layer saw no calibration data "
                                 "(was it ever called?)")
            hessian = stats.hessian
        scale_dtype = self.layer_scale_dtype(linear) if isinstance(linear, nn.Linear) else torch.float32
        return WeightOnlyLinear.from_linear(linear, bits=self.bits, group_size=self.group_size,
                                            symmetric=self.symmetric, hessian=hessian, scale_dtype=scale_dtype)


@dataclass
class Int8WeightOnlyConfig(Int4WeightOnlyConfig):
    """INT8 weights per output channel (group_size=-1) or per group, 16-bit activations (W8A16).
    scale_dtype as for `Int4WeightOnlyConfig`; the packed conversion takes int8 with float16 only, so
    "auto" gives float16 scales to float16 layers and float32 to the others."""

    group_size: int = -1
    scheme = "int8_weight_only"
    bits = 8


CONFIGS = {cls.scheme: cls for cls in (Int8DynamicConfig, Int8StaticConfig, Fp8DynamicConfig, Fp8StaticConfig,
                                       Fp8BlockConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig)}


def config_for_scheme(scheme: str, **kwargs) -> QuantConfig:
    """The config class of a scheme name (int8_dynamic, int8_static, fp8_dynamic, fp8_static, fp8_block,
    int4_weight_only, int8_weight_only) built with `kwargs`."""
    if scheme not in CONFIGS:
        raise ValueError(f"scheme: expected one of {tuple(CONFIGS)}, got {scheme!r}")
    return CONFIGS[scheme](**kwargs)


# ----------------------------------------------------------------------------------------------------
# Layer selection
# ----------------------------------------------------------------------------------------------------
def name_matches(name: str, pattern: str) -> bool:
    """fnmatch on the full dotted name or on its last component; "re:<regex>" = regex fullmatch."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], pattern)


def _resolve(name: str, config: QuantConfig) -> Optional[QuantConfig]:
    for pattern, override in config.overrides.items():
        if name_matches(name, pattern):
            return override
    if any(name_matches(name, p) for p in config.skip):
        return None
    return config


# Linear-like layers from other libraries that we refuse loudly instead of silently leaving in float.
_UNSUPPORTED_LINEAR_LIKE = ("Conv1D", "Linear8bitLt", "Linear4bit", "QuantLinear")


def plan(model: nn.Module, config: QuantConfig) -> Dict[str, QuantConfig]:
    """{layer name: config} for every layer `quantize_` would convert; raises on unsupported layers."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config: expected a quantfuse QuantConfig (e.g. Int8DynamicConfig()), "
                        f"got {type(config).__name__}")
    chosen: Dict[str, QuantConfig] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        if isinstance(module, (QuantizedLinear, GatedMLP)):
            continue
        resolved = _resolve(name, config)
        if isinstance(module, nn.Linear):
            if resolved is not None:
                chosen[name] = resolved
            continue
        if resolved is None:
            continue
        # A weighted leaf layer (Embedding, Conv, ...) that an override names explicitly, or a known
        # linear-like layer of another library: refuse loudly. Containers matched by a pattern are fine.
        weighted_leaf = not any(True for _ in module.children()) and isinstance(
            getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2
        explicit = weighted_leaf and any(name_matches(name, p) and o is not None
                                         for p, o in config.overrides.items())
        if explicit or type(module).__name__ in _UNSUPPORTED_LINEAR_LIKE:
            raise ValueError(
                f"unsupported layer: '{name}' is a {type(module).__name__}; quantfuse quantizes torch.nn.Linear "
                f"layers only. Add '{name}' to the config's skip list to leave it in floating point.")
    return chosen


# ----------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------
class _LayerStats:
    """What calibration records about one layer's input: a calibrator plus the running min/max."""

    def __init__(self, config: QuantConfig, name: str = "?"):
        from .calibrate import HistogramCalibrator, MaxCalibrator

        self.name = name
        self.calibrator = None
        self.hessian: Optional[torch.Tensor] = None  # sum of x x^T (float64), for GPTQ
        self.want_hessian = isinstance(config, Int4WeightOnlyConfig)
        if isinstance(config, Int8StaticConfig):
            self.calibrator = MaxCalibrator() if config.calibrator == "max" else HistogramCalibrator(config.num_bins)
        self.lo = float("inf")
        self.hi = float("-inf")
        self.seen = 0

    @torch.no_grad()
    def collect(self, x: torch.Tensor, batch: int = 0) -> None:
        x = x.detach()
        if not x.is_floating_point() or x.numel() == 0:
            return
        from .calibrate import _check_finite_floats

        try:  # one finiteness check per path: the calibrators make it themselves
            if self.calibrator is not None:
                self.calibrator.collect(x)
            elif self.want_hessian:
                _check_finite_floats("x", x)
        except ValueError as err:
            raise ValueError(f"calibration_data: batch {batch} gave layer '{self.name}' an input it cannot "
                             f"calibrate on ({err})") from err
        if self.calibrator is not None:
            self.lo = min(self.lo, float(x.min()))
            self.hi = max(self.hi, float(x.max()))
        if self.want_hessian:
            rows = x.reshape(-1, x.shape[-1]).to(torch.float64)
            h = rows.t() @ rows
            self.hessian = h if self.hessian is None else self.hessian + h
        self.seen += 1

    def amax(self, config: Int8StaticConfig) -> float:
        if config.calibrator == "max":
            return float(self.calibrator.compute_amax())
        kwargs = {"percentile": config.percentile} if config.calibrator == "percentile" else {}
        return float(self.calibrator.compute_amax(config.calibrator, **kwargs))


def _model_device(model: nn.Module) -> Optional[torch.device]:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def _to_device(batch: Any, device):
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def run_batch(model: nn.Module, batch: Any):
    """Call the model on one calibration batch (tensor, dict of kwargs, or tuple of args)."""
    batch = _to_device(batch, _model_device(model))
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    raise TypeError(f"calibration_data: expected batches that are tensors, dicts or tuples, got {type(batch).__name__}")


@torch.no_grad()
def calibrate(model: nn.Module, layer_configs: Dict[str, QuantConfig], calibration_data: Iterable,
              progress: bool = True) -> Dict[str, _LayerStats]:
    """Run the model over the calibration batches with forward pre-hooks recording each layer's input."""
    from tqdm.auto import tqdm

    try:
        iter(calibration_data)
    except TypeError:
        raise TypeError(f"calibration_data: expected an iterable of batches (tensors, dicts or tuples), got "
                        f"{type(calibration_data).__name__}") from None
    stats = {name: _LayerStats(cfg, name) for name, cfg in layer_configs.items()}
    modules = dict(model.named_modules())
    hooks = []
    batches = 0
    for name, st in stats.items():
        def hook(mod, args, kwargs, st=st):
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor):
                st.collect(x, batches)

        hooks.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        total = len(calibration_data) if hasattr(calibration_data, "__len__") else None
        for batch in tqdm(calibration_data, total=total, desc="quantfuse: calibrating", disable=not progress,
                          leave=False):
            run_batch(model, batch)
            batches += 1
    finally:
        for h in hooks:
            h.remove()
    if batches == 0:
        raise ValueError("calibration_data: expected at least one batch, got an empty iterable")
    return stats


# ----------------------------------------------------------------------------------------------------
# quantize_
# ----------------------------------------------------------------------------------------------------
_FUSED_MLP_CLASSES = {Fp8BlockConfig: Fp8BlockGatedMLP, Int8DynamicConfig: Int8DynamicGatedMLP,
                      Fp8DynamicConfig: Fp8DynamicGatedMLP}


def _gated_mlps(model: nn.Module, chosen: Dict[str, QuantConfig]) -> Dict[str, type]:
    """{name: fused class} of the gated MLPs (Llama-style gate_proj / up_proj / down_proj + SiLU) whose three
    projections map to one fusing config type (fp8_block, int8_dynamic, fp8_dynamic with fuse_gated_mlp)."""
    found = {}
    for name, module in model.named_modules():
        parts = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) for p in parts):
            continue
        act = getattr(module, "act_fn", None)
        if not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")):
            continue
        prefix = f"{name}." if name else ""
        cfgs = [chosen.get(prefix + p) for p in ("gate_proj", "up_proj", "down_proj")]
        kinds = {type(c) for c in cfgs}
        if len(kinds) != 1 or next(iter(kinds)) not in _FUSED_MLP_CLASSES or not all(c.fuse_gated_mlp for c in cfgs):
            continue
        kind = next(iter(kinds))
        gate = module.gate_proj
        if gate.out_features != module.up_proj.out_features or gate.out_features != module.down_proj.in_features:
            continue
        if kind is Fp8BlockConfig and (gate.out_features % 128 or gate.in_features % 128
                                       or module.down_proj.in_features % 128):
            continue  # not block aligned: the three linears are converted one by one
        found[name] = _FUSED_MLP_CLASSES[kind]
    return found


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@torch.no_grad()
def quantize_(model: nn.Module, config: QuantConfig, calibration_data: Optional[Iterable] = None,
              progress: bool = True) -> nn.Module:
    """Replace the model's `nn.Linear` layers by quantized modules, in place; returns the model.

    Static configs (Int8StaticConfig, Fp8StaticConfig; Int4/Int8WeightOnlyConfig(algorithm="gptq"); also through
    `overrides`) need `calibration_data`. Layers whose
    shape a scheme cannot take (e.g. fp8_block with in_features not a multiple of 128) raise a
    ValueError naming the layer; skip them or override them with another config."""
    from tqdm.auto import tqdm

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    chosen = plan(model, config)
    if not chosen:
        raise ValueError(f"model: found no nn.Linear layer to quantize (skip={config.skip!r})")

    static = {n: c for n, c in chosen.items() if c.needs_calibration}
    stats: Dict[str, _LayerStats] = {}
    if static:
        if calibration_data is None:
            raise ValueError(f"calibration_data: {len(static)} layer(s) use a static scheme "
                             f"({next(iter(static.values())).scheme}) and need calibration batches, got None")
        was_training = model.training
        model.eval()
        try:
            stats = calibrate(model, static, calibration_data, progress)
        finally:
            model.train(was_training)

    fused = _gated_mlps(model, chosen)
    fused_children = {f"{n}.{p}" if n else p for n in fused for p in ("gate_proj", "up_proj", "down_proj")}
    work: List[Tuple[str, Any]] = [(n, cls) for n, cls in fused.items()] + [(n, c) for n, c in chosen.items()
                                                                          if n not in fused_children]
    modules = dict(model.named_modules())
    # a layer reached under several names (one module object set as two parents' child) is converted once
    # and installed under all of them: named_modules() lists it under the first name only
    aliases: Dict[int, List[str]] = {}
    for alias, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(alias)
    for name, cfg in tqdm(work, desc=f"quantfuse: {config.scheme}", disable=not progress, leave=False):
        module = modules[name]
        fused_cls = cfg if isinstance(cfg, type) else None
        try:
            if fused_cls is not None:
                new = fused_cls.from_mlp(module)
            else:
                new = cfg.convert(module, stats.get(name))
        except (ValueError, TypeError) as err:
            scheme = fused_cls.layer_class.scheme if fused_cls is not None else cfg.scheme
            raise ValueError(f"layer '{name}' ({type(module).__name__}"
                             + (f" {module.in_features}->{module.out_features}"
                                if isinstance(module, nn.Linear) else "")
                             + f") cannot take scheme {scheme}: {err}. "
                             "Add it to skip or give it another config in overrides.") from err
        for alias in aliases[id(module)]:
            _set_module(model, alias, new)
    merge_projections(model, only=lambda n: getattr(chosen.get(n), "merge_projections", False))
    return model


def quantized_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """{name: module} of every quantfuse module in the model (fused MLPs count once; a module set as the child of
    two parents under each of its names, so a checkpoint restores both)."""
    out = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, GatedMLP):
            out[name] = module
        elif isinstance(module, QuantizedLinear) and not any(name.startswith(f + ".") for f in out):
            out[name] = module
    return out


def linear_weight_nbytes(model: nn.Module) -> int:
    """Bytes of all linear-layer weights: quantized codes + scales (+ zero points), or float weights."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_nbytes()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


from .checkpoint import load_compressed_tensors, load_quantized, save_quantized  # noqa: E402  (re-exported)

__all__ = ["quantize_", "QuantConfig", "Int8DynamicConfig", "Int8StaticConfig", "Fp8DynamicConfig",
           "Fp8StaticConfig", "Fp8BlockConfig", "Int4WeightOnlyConfig", "Int8WeightOnlyConfig", "config_for_scheme",
           "save_quantized", "load_quantized", "load_compressed_tensors", "CONFIGS"]
