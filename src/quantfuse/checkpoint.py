"""Quantized checkpoints: safetensors tensors named as compressed-tensors names them, and a
`quantization_config` (quant_method "compressed-tensors", status "compressed") in config.json.

A directory written by `save_quantized` holds
  model.safetensors   every tensor: float layers as in `state_dict()`, quantized layers as
                      `<layer>.weight` (int8/fp8 codes) + `<layer>.weight_scale` (+ `input_scale`,
                      `input_zero_point`), or `<layer>.weight_packed` / `weight_scale` / `weight_shape`
                      (/ `weight_zero_point`) for the packed weight-only formats, and `<layer>.bias`.
  config.json         the model's Hugging Face config (when it has one) + `quantization_config`.
  quantfuse.json      which quantfuse module each layer is (what the compressed-tensors config cannot
                      say, e.g. a fused gated MLP), so `load_quantized` rebuilds the exact modules.
Fused gated MLPs are written as their three layers gate_proj / up_proj / down_proj, the way every other
reader of the format expects them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from . import modules as qm
from .modules import GATED_MLP_CLASSES, MODULE_CLASSES, GatedMLP, MergedProjections, QuantizedLinear, merged_groups

TENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
QUANTFUSE_FILE = "quantfuse.json"
FORMAT_VERSION = 1


def _quantized_layers(model: nn.Module) -> Dict[str, nn.Module]:
    from .quantize_api import quantized_layers

    return quantized_layers(model)


def _flat_layers(model: nn.Module) -> Dict[str, QuantizedLinear]:
    """Every quantized layer as the checkpoint sees it (fused MLPs split into their three layers)."""
    flat: Dict[str, QuantizedLinear] = {}
    for name, module in _quantized_layers(model).items():
        if isinstance(module, GatedMLP):
            for sub, layer in module.split_layers().items():
                flat[f"{name}.{sub}" if name else sub] = layer
        else:
            flat[name] = module
    return flat


def compressed_tensors_config(model: nn.Module) -> Dict[str, object]:
    """The `quantization_config` of compressed-tensors for the model's quantized layers."""
    groups: Dict[str, dict] = {}
    members: Dict[str, list] = {}
    for name, layer in _flat_layers(model).items():
        scheme = layer.ct_scheme()
        key = json.dumps(scheme, sort_keys=True)
        groups.setdefault(key, scheme)
        members.setdefault(key, []).append(name)
    config_groups = {}
    formats = set()
    for i, (key, scheme) in enumerate(groups.items()):
        body = {"targets": members[key], "weights": scheme["weights"],
                "input_activations": scheme["input_activations"], "output_activations": None,
                "format": scheme["format"]}
        config_groups[f"group_{i}"] = body
        formats.add(scheme["format"])
    ignore = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def checkpoint_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """All tensors of the checkpoint, by name (CPU, contiguous, no shared storage)."""
    layers = _quantized_layers(model)
    prefixes = tuple(f"{name}." for name in layers)
    state: Dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if not key.startswith(prefixes):
            state[key] = t
    for name, layer in _flat_layers(model).items():
        for local, t in layer.checkpoint_tensors().items():
            state[f"{name}.{local}"] = t
    # safetensors refuses tensors that share storage (tied embeddings, views): give each its own copy
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def save_quantized(model: nn.Module, directory: Union[str, os.PathLike]) -> str:
    """Write the quantized model to `directory` (created if needed); returns the directory."""
    from safetensors.torch import save_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    layers = _quantized_layers(model)
    if not layers:
        raise ValueError("model: has no quantfuse layer; run quantfuse.quantize_(model, config) first")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    save_file(checkpoint_state(model), os.path.join(directory, TENSORS_FILE), metadata={"format": "pt"})

    hf_config = getattr(model, "config", None)
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    if config and not config.get("architectures"):
        # a model built from its config (not from_pretrained) has none; without it the loader could only build
        # the base model (AutoModel), whose layer names differ
        config["architectures"] = [type(model).__name__]
    config["quantization_config"] = compressed_tensors_config(model)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, default=str)

    modules = {}
    for name, module in layers.items():
        if isinstance(module, GatedMLP):
            modules[name] = {"class": type(module).__name__,
                             "layers": {sub: layer.checkpoint_meta() for sub, layer in module.split_layers().items()}}
        else:
            modules[name] = module.checkpoint_meta()
    from . import __version__

    with open(os.path.join(directory, QUANTFUSE_FILE), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "quantfuse_version": __version__,
                   "has_hf_config": hasattr(hf_config, "to_dict"), "modules": modules,
                   "merged_projections": [list(names) for names in merged_groups(model)]}, f, indent=2)
    return directory


def _skeleton_from_hf(path: str) -> nn.Module:
    """A float model with random weights built from the Hugging Face config.json in `path` (offline)."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("load_quantized: building the model from a config needs `transformers` "
                          "(pip install 'quantfuse[model]'), or pass a model skeleton") from err
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"model_skeleton_or_hf_dir: expected a Hugging Face model directory with "
                                f"{CONFIG_FILE}, got {path!r} (no such file: {config_path})")
    with open(config_path) as f:
        raw = json.load(f)
    raw.pop("quantization_config", None)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{config_path}: expected a 'model_type' entry (a Hugging Face config), found none")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    cls = hf_model_class(config)
    return cls.from_config(config) if cls is transformers.AutoModel else cls(config)


def hf_model_class(config):
    """The transformers class a config was saved from (its first `architectures` entry), else AutoModel."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    return transformers.AutoModel if cls is None else cls


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _local(tensors: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    n = len(prefix)
    return {k[n:]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[n:]}


def _build_layer(meta: dict, tensors: Dict[str, torch.Tensor], name: str) -> QuantizedLinear:
    if not isinstance(meta, dict):
        raise ValueError(f"{QUANTFUSE_FILE}: layer '{name}': expected an object, got {type(meta).__name__}")
    cls = MODULE_CLASSES.get(meta.get("class"))
    if cls is None:
        raise ValueError(f"{QUANTFUSE_FILE}: layer '{name}' has unknown class {meta.get('class')!r}; "
                         f"expected one of {sorted(MODULE_CLASSES)}")
    local = _local(tensors, f"{name}.")
    if not local:
        raise ValueError(f"{TENSORS_FILE}: no tensors for layer '{name}'")
    if "tensors" in meta and sorted(local) != sorted(meta["tensors"]):  # (files before it recorded no list)
        missing, extra = sorted(set(meta["tensors"]) - set(local)), sorted(set(local) - set(meta["tensors"]))
        raise ValueError(f"{TENSORS_FILE}: layer '{name}' ({meta['class']}) expected tensors {meta['tensors']}; "
                         f"missing {missing}, unexpected {extra}")
    try:
        layer = cls.from_checkpoint(local, meta)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{TENSORS_FILE} / {QUANTFUSE_FILE}: layer '{name}' ({meta['class']}) cannot be rebuilt "
                         f"from its tensors {sorted(local)}: {type(err).__name__}: {err}") from err
    if sorted(layer.checkpoint_tensors()) != sorted(local):  # e.g. a static layer's input_scale read by no one
        raise ValueError(f"{TENSORS_FILE} / {QUANTFUSE_FILE}: layer '{name}' ({meta['class']}) uses the tensors "
                         f"{sorted(layer.checkpoint_tensors())}, the checkpoint holds {sorted(local)}")
    shape = (meta.get("in_features"), meta.get("out_features"))
    if shape != (layer.in_features, layer.out_features):
        raise ValueError(f"{QUANTFUSE_FILE}: layer '{name}' records in / out features {shape}, its tensors hold "
                         f"{(layer.in_features, layer.out_features)}")
    return layer


def _check_skeleton_layer(model: nn.Module, name: str, new: nn.Module) -> None:
    """The skeleton's layer at `name` must exist and, where it is an nn.Linear, have the checkpoint layer's
    shape (load_state_dict's size check, which installing the quantized module would bypass; the checkpoint's
    tensors, bias included, define the layer)."""
    try:
        old = model.get_submodule(name)
    except AttributeError as err:
        raise ValueError(f"model_skeleton_or_hf_dir: the model has no layer '{name}' that the checkpoint "
                         "quantized; is it the same architecture?") from err
    if isinstance(old, nn.Linear) and isinstance(new, QuantizedLinear) \
            and (old.in_features, old.out_features) != (new.in_features, new.out_features):
        raise ValueError(f"model_skeleton_or_hf_dir: layer '{name}' is Linear({old.in_features}, {old.out_features}) "
                         f"in the model, ({new.in_features}, {new.out_features}) in the checkpoint; is it the same "
                         "configuration?")


def _load_float_tensors(model: nn.Module, tensors: Dict[str, torch.Tensor], prefixes: tuple, source: str) -> None:
    """The checkpoint's tensors outside the quantized layers (`prefixes`) into the model: exactly the model's own
    state-dict keys there, none missing, none left over."""
    rest = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    state = model.state_dict()
    expected = {k for k in state if not k.startswith(prefixes)}
    # tied parameters (an output layer sharing the embedding's weight): writers such as transformers' save_pretrained
    # store one of the names; the other takes the same tensor
    by_storage: Dict[tuple, str] = {}
    for key in sorted(rest):
        if key in state:
            by_storage.setdefault((state[key].untyped_storage().data_ptr(), tuple(state[key].shape)), key)
    for key in sorted(expected - set(rest)):
        partner = by_storage.get((state[key].untyped_storage().data_ptr(), tuple(state[key].shape)))
        if partner is not None:
            rest[key] = rest[partner]
    missing = sorted(expected - set(rest))
    unexpected = sorted(set(rest) - expected)
    if missing or unexpected:
        raise ValueError(f"{source}: does not match the model: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(rest, strict=False, assign=True)
    tie = getattr(model, "tie_weights", None)
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    if callable(tie) and getattr(getattr(model, "config", None), "tie_word_embeddings", False) \
            and not isinstance(output_embeddings, (QuantizedLinear, GatedMLP)):
        tie()  # assign=True gave the tied embedding and output weights two tensors: one again (a quantized
        # output layer has its own codes and stays as loaded)


@torch.no_grad()
def load_quantized(directory: Union[str, os.PathLike], model_skeleton_or_hf_dir: Union[None, str, os.PathLike,
                   nn.Module] = None, device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Rebuild a model written by `save_quantized`: bit-exact tensors, the same quantfuse modules. A directory
    without quantfuse.json whose config.json holds a compressed-tensors `quantization_config` (a checkpoint
    written by another tool) goes to `load_compressed_tensors` (fused gated MLPs then come back as three layers, and
    sibling projections merged by the default groups).

    `model_skeleton_or_hf_dir`: a float model of the same architecture (modified in place), a Hugging
    Face model directory whose config.json describes it, or None to use the config.json saved with the
    checkpoint. `device`: where the result goes (default: CPU)."""
    from safetensors.torch import load_file

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: expected a quantized checkpoint directory, got {directory!r} "
                                "(no such directory)")
    if not os.path.isfile(os.path.join(directory, QUANTFUSE_FILE)) and _ct_config(directory) is not None:
        # written by another tool (llm-compressor, ...): the compressed-tensors config says what each layer is
        try:
            return load_compressed_tensors(directory, model_skeleton_or_hf_dir, device)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{directory!r} has no {QUANTFUSE_FILE}; as a compressed-tensors checkpoint: "
                                    f"{err}") from err
        except ValueError as err:
            raise ValueError(f"{directory!r} has no {QUANTFUSE_FILE}; as a compressed-tensors checkpoint: "
                             f"{err}") from err
    for fname in (TENSORS_FILE, QUANTFUSE_FILE):
        if not os.path.isfile(os.path.join(directory, fname)):
            raise FileNotFoundError(f"directory: {directory!r} is not a quantfuse checkpoint (missing {fname}; "
                                    "write one with quantfuse.save_quantized)")
    with open(os.path.join(directory, QUANTFUSE_FILE)) as f:
        info = json.load(f)
    if not isinstance(info, dict) or not isinstance(info.get("modules"), dict):
        raise ValueError(f"{QUANTFUSE_FILE}: expected an object with a 'modules' object (layer name -> layer), "
                         f"got {type(info).__name__}"
                         + (f" with keys {sorted(info)}" if isinstance(info, dict) else ""))
    if info.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{QUANTFUSE_FILE}: expected format_version {FORMAT_VERSION}, "
                         f"got {info.get('format_version')!r}")
    tensors = load_file(os.path.join(directory, TENSORS_FILE))

    if isinstance(model_skeleton_or_hf_dir, nn.Module):
        model = model_skeleton_or_hf_dir
    elif model_skeleton_or_hf_dir is None:
        model = _skeleton_from_hf(directory)
    else:
        model = _skeleton_from_hf(os.fspath(model_skeleton_or_hf_dir))
    model = model.to("cpu")

    prefixes = []
    for name, meta in info["modules"].items():
        if isinstance(meta, dict) and meta.get("class") in GATED_MLP_CLASSES:
            if not isinstance(meta.get("layers"), dict) or sorted(meta["layers"]) != ["down_proj", "gate_proj",
                                                                                    "up_proj"]:
                raise ValueError(f"{QUANTFUSE_FILE}: fused MLP '{name}': expected 'layers' with gate_proj, up_proj "
                                 f"and down_proj, got {meta.get('layers')!r}"[:300])
            subs = {sub: _build_layer(m, tensors, f"{name}.{sub}" if name else sub)
                    for sub, m in meta["layers"].items()}
            new = GATED_MLP_CLASSES[meta["class"]].from_layers(subs["gate_proj"], subs["up_proj"], subs["down_proj"])
            for sub, layer in subs.items():
                _check_skeleton_layer(model, f"{name}.{sub}" if name else sub, layer)
        else:
            new = _build_layer(meta, tensors, name)
            _check_skeleton_layer(model, name, new)
        _set_module(model, name, new)
        prefixes.append(f"{name}.")
    _load_float_tensors(model, tensors, tuple(prefixes), TENSORS_FILE)
    for names in info.get("merged_projections", []):
        try:
            MergedProjections([model.get_submodule(n) for n in names])
        except (AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"{QUANTFUSE_FILE}: cannot merge the projections {names}: {err}") from err
    model.eval()
    if device is not None:
        model.to(device)
    return model


# ----------------------------------------------------------------------------------------------------
# Checkpoints written by other tools: the compressed-tensors config alone says what each layer is
# ----------------------------------------------------------------------------------------------------
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_CT_SCHEMES = (
    "pack-quantized int4 / int8 weights per group or channel, no activation quantization (W4A16 / W8A16)",
    "int8 weights per channel or tensor (symmetric) with int8 activations per token (dynamic, symmetric) or per "
    "tensor (static, optionally with a zero point)",
    "fp8 e4m3 weights per channel or tensor with fp8 activations per token (dynamic) or per tensor (static)",
    "fp8 e4m3 weights in 128x128 blocks with fp8 activations in dynamic 1x128 groups",
)


def _ct_config(directory: str) -> Optional[dict]:
    """The compressed-tensors `quantization_config` of directory/config.json, or None when there is none."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return qc
    return None


def _load_safetensors(directory: str) -> Dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards a model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    single = os.path.join(directory, TENSORS_FILE)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        return load_file(single)
    if not os.path.isfile(index):
        raise FileNotFoundError(f"directory: {directory!r} has neither {TENSORS_FILE} nor {INDEX_FILE}")
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{INDEX_FILE}: expected a non-empty 'weight_map' object (tensor name -> shard file)")
    tensors: Dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(directory, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(path):
            raise FileNotFoundError(f"{INDEX_FILE}: shard {shard!r} is not a file in {directory!r}")
        tensors.update(load_file(path))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"{INDEX_FILE}: tensors listed but in no shard: {missing[:5]}")
    return tensors


def _ct_match_kind(name: str, module: nn.Module, pattern) -> int:
    """How a compressed-tensors target / ignore entry matches a layer: 3 its exact name, 2 "re:<regex>" matched at
    the start of the name, 1 the name of a class in the module's class hierarchy (e.g. "Linear"), 0 not at all."""
    if not isinstance(pattern, str):
        raise ValueError(f"quantization_config: expected string targets / ignore entries, got {pattern!r}")
    if pattern.startswith("re:"):
        return 2 if re.match(pattern[3:], name) else 0
    if pattern == name:
        return 3
    return 1 if any(cls.__name__ == pattern for cls in type(module).__mro__) else 0


def _ct_group_of(name: str, module: nn.Module, groups: dict) -> Optional[str]:
    """The config group that quantizes a layer, resolved as compressed-tensors does: its exact name before a regex
    (the first matching target in sorted order) before a class name; a target string listed by several groups
    belongs to the last of them."""
    by_target: Dict[str, Tuple[int, str]] = {}
    for group_name, body in groups.items():
        for target in (body.get("targets") or ()) if isinstance(body, dict) else ():
            kind = _ct_match_kind(name, module, target)
            if kind:
                by_target[target] = (kind, group_name)
    if not by_target:
        return None
    best = max(kind for kind, _ in by_target.values())
    return by_target[min(t for t, (kind, _) in by_target.items() if kind == best)][1]


def _ct_weight_scale_per_channel(scale: torch.Tensor, n: int, strategy: str, name: str) -> torch.Tensor:
    """weight_scale as [N, 1]: per channel as stored, a per-tensor scale repeated (exact)."""
    if strategy == "channel" and scale.numel() == n:
        return scale.reshape(n, 1)
    if strategy == "tensor" and scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous()
    raise ValueError(f"layer '{name}': weight_scale of shape {tuple(scale.shape)} does not fit the {strategy!r} "
                     f"strategy of {n} output channels")


def _ct_layer(name: str, group_name: str, group: dict, fmt: str, local: Dict[str, torch.Tensor]) -> QuantizedLinear:
    """The quantfuse layer for one compressed-tensors layer (its tensors by local name, bias included)."""
    w = group.get("weights") or {}
    a = group.get("input_activations")
    where = f"quantization_config group '{group_name}' (layer '{name}', format {fmt!r})"

    def need(*keys):
        missing = [k for k in keys if k not in local]
        if missing:
            raise ValueError(f"{where}: the checkpoint has no {', '.join(missing)} for this layer "
                             f"(it holds {sorted(local)})")

    def unsupported(why: str):
        return ValueError(f"{where}: {why}; quantfuse runs: " + "; ".join(SUPPORTED_CT_SCHEMES))

    bias = local.get("bias")
    if group.get("output_activations") is not None:
        raise unsupported("quantized outputs (output_activations)")
    if fmt == "pack-quantized":
        if a is not None:
            raise unsupported("pack-quantized weights with quantized activations")
        need("weight_packed", "weight_scale", "weight_shape")
        strategy = w.get("strategy")
        if strategy == "group":
            group_size = w.get("group_size")
            if group_size not in (32, 64, 128, 256):
                raise unsupported(f"group_size {group_size!r} (quantfuse takes 32, 64, 128, 256 or per channel)")
        elif strategy == "channel":
            group_size = -1
        else:
            raise unsupported(f"weight strategy {strategy!r}")
        n, k = (int(v) for v in local["weight_shape"].reshape(-1).tolist()[:2])
        groups_expected = 1 if group_size == -1 else -(-k // group_size)
        if tuple(local["weight_scale"].shape) != (n, groups_expected):
            raise ValueError(f"{where}: weight_scale of shape {tuple(local['weight_scale'].shape)} does not fit "
                             f"{strategy} quantization of a [{n}, {k}] weight (expected ({n}, {groups_expected}))")
        if not w.get("symmetric", True):
            need("weight_zero_point")
        if w.get("num_bits") not in (4, 8) or w.get("type", "int") != "int":
            raise unsupported(f"{w.get('num_bits')}-bit {w.get('type')} packed weights")
        if w.get("actorder") not in (None, False, "static", "weight"):
            raise unsupported(f"activation-ordered groups (actorder {w.get('actorder')!r}) with a weight_g_idx")
        zero_point = local.get("weight_zero_point") if not w.get("symmetric", True) else None
        return qm.WeightOnlyLinear(local["weight_packed"], local["weight_scale"], local["weight_shape"],
                                   int(w["num_bits"]), group_size, bias, zero_point)
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized"):
        raise unsupported(f"format {fmt!r}")
    need("weight", "weight_scale")
    codes, w_scale = local["weight"], local["weight_scale"].float()
    n = codes.shape[0]
    if a is None:
        raise unsupported("unpacked weights without activation quantization (W8A16 as naive-quantized)")
    if not w.get("symmetric", True) or (not a.get("symmetric", True) and (a.get("dynamic") or a.get("type") != "int")):
        raise unsupported("asymmetric weights, or asymmetric activations other than static int8")
    kind = (w.get("type"), w.get("num_bits"), a.get("type"), a.get("num_bits"))
    dynamic, a_strategy = bool(a.get("dynamic")), a.get("strategy")
    if kind == ("float", 8, "float", 8) and codes.dtype == torch.float8_e4m3fn:
        if w.get("strategy") == "block":
            if list(w.get("block_structure") or []) != [qm.BLOCK, qm.BLOCK] or not dynamic \
                    or a_strategy != "group" or a.get("group_size") != qm.BLOCK:
                raise unsupported(f"fp8 blocks {w.get('block_structure')} with activations {a_strategy} "
                                  f"(group {a.get('group_size')}, dynamic {dynamic})")
            return qm.Fp8BlockLinear(codes, w_scale, bias)
        scale = _ct_weight_scale_per_channel(w_scale, n, w.get("strategy"), name)
        if dynamic and a_strategy == "token":
            return qm.Fp8DynamicLinear(codes, scale, bias)
        if not dynamic and a_strategy == "tensor":
            need("input_scale")
            return qm.Fp8StaticLinear(codes, scale, bias, local["input_scale"].float())
        raise unsupported(f"fp8 activations with strategy {a_strategy!r}, dynamic {dynamic}")
    if kind == ("int", 8, "int", 8) and codes.dtype == torch.int8:
        scale = _ct_weight_scale_per_channel(w_scale, n, w.get("strategy"), name)
        if dynamic and a_strategy == "token":
            return qm.Int8DynamicLinear(codes, scale, bias)
        if not dynamic and a_strategy == "tensor":
            need("input_scale", *(() if a.get("symmetric", True) else ("input_zero_point",)))
            return qm.Int8StaticLinear(codes, scale, bias, local["input_scale"].float(), local.get("input_zero_point"))
        raise unsupported(f"int8 activations with strategy {a_strategy!r}, dynamic {dynamic}")
    raise unsupported(f"weights {w.get('type')}{w.get('num_bits')} stored as {codes.dtype} with activations "
                      f"{a.get('type')}{a.get('num_bits')}")


def _drop_zero_points_of_symmetric(local: Dict[str, torch.Tensor], group: dict) -> Dict[str, torch.Tensor]:
    """Older writers stored all-zero zero points for symmetric schemes: those say nothing and are left out (a
    nonzero one stays, and is refused as a tensor the scheme has no place for)."""
    out = dict(local)
    for key, args in (("weight_zero_point", group.get("weights")),
                      ("input_zero_point", group.get("input_activations"))):
        if key in out and (args or {}).get("symmetric", True) and not bool(out[key].any()):
            del out[key]
    return out


@torch.no_grad()
def load_compressed_tensors(directory: Union[str, os.PathLike], model_skeleton_or_hf_dir: Union[None, str,
                            os.PathLike, nn.Module] = None, device: Optional[Union[str, torch.device]] = None,
                            merge: bool = True) -> nn.Module:
    """Load a compressed-tensors checkpoint written by another tool (llm-compressor, ...; "compressed" status,
    model.safetensors or sharded with model.safetensors.index.json) into quantfuse modules.

    Each nn.Linear of the model that a `config_groups` entry targets and `ignore` does not name becomes the
    quantfuse layer of its scheme, the group chosen as compressed-tensors chooses it (an exact name before a
    "re:" regex before a class name anywhere in the module's class hierarchy, such as "Linear"):
    SUPPORTED_CT_SCHEMES, i.e. W4A16 / W8A16 pack-quantized, W8A8 int8 and fp8 with dynamic per-token or static
    per-tensor activations, fp8 128x128 blocks; a per-tensor weight scale is repeated per channel (exact). The
    codes, scales and zero points are used as stored (all-zero zero points of a symmetric scheme, which older
    writers stored, are left out); the other tensors load into the float model, a tied output weight taking the
    embedding's. Other schemes, a group size or scale shape that do not agree, a missing or leftover tensor (a
    weight_g_idx, a submodule's tensor), transforms, sparsity, quantized outputs or KV cache: a ValueError naming
    what and, for a layer, its group. `model_skeleton_or_hf_dir` and `device` as for `load_quantized`; `merge`: run
    sibling projections fed one tensor as one GEMM (`modules.merge_projections`)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: expected a checkpoint directory, got {directory!r} (no such directory)")
    qc = _ct_config(directory)
    if qc is None:
        raise ValueError(f"directory: {os.path.join(directory, CONFIG_FILE)} holds no compressed-tensors "
                         "quantization_config (quant_method 'compressed-tensors')")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_config: expected quantization_status 'compressed' (codes and scales "
                         f"stored), got {status!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config: expected a non-empty 'config_groups' object")
    # what would change the model's math beyond the quantized linear layers: refused rather than dropped
    if qc.get("transform_config"):
        raise ValueError("quantization_config: transforms (transform_config: rotated weights and online Hadamard "
                         "transforms) are not supported")
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"quantization_config: sparse weights (sparsity_config format {sparsity.get('format')!r}) are "
                         "not supported")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError("quantization_config: a quantized KV cache (kv_cache_scheme) is not supported")
    tensors = _load_safetensors(directory)
    if isinstance(model_skeleton_or_hf_dir, nn.Module):
        model = model_skeleton_or_hf_dir
    else:
        model = _skeleton_from_hf(directory if model_skeleton_or_hf_dir is None
                                  else os.fspath(model_skeleton_or_hf_dir))
    model = model.to("cpu")

    chosen: List[Tuple[str, str, dict]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(_ct_match_kind(name, module, p) for p in qc.get("ignore") or ()):
            continue
        group_name = _ct_group_of(name, module, groups)
        if group_name is not None:
            chosen.append((name, group_name, groups[group_name]))
    if not chosen:
        raise ValueError("quantization_config: its config_groups target no nn.Linear layer of the model; is it the "
                         "same architecture?")
    # one pass over the tensors: each chosen layer's own (by local name) and those of its submodules
    own: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name, _, _ in chosen}
    nested: Dict[str, List[str]] = {name: [] for name, _, _ in chosen}
    for key, t in tensors.items():
        parent, _, leaf = key.rpartition(".")
        if parent in own:
            own[parent][leaf] = t
        else:
            parts = parent.split(".")
            owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in own),
                         None)
            if owner is not None:
                nested[owner].append(key)
    prefixes = []
    for name, group_name, body in chosen:
        fmt = body.get("format") or qc.get("format")
        if nested[name]:  # e.g. an online transform registered under the layer: it would be lost
            raise ValueError(f"quantization_config group '{group_name}' (layer '{name}'): the checkpoint has "
                             f"tensors of submodules of the layer, {sorted(nested[name])[:3]}, which no scheme "
                             "here reads")
        local = _drop_zero_points_of_symmetric(own[name], body)
        layer = _ct_layer(name, group_name, body, fmt, local)
        unused = sorted(set(local) - set(layer.checkpoint_tensors()))
        if unused:  # e.g. a weight_g_idx (activation order) or a zero point of a symmetric scheme: never dropped
            raise ValueError(f"quantization_config group '{group_name}' (layer '{name}'): the checkpoint's "
                             f"{unused} have no place in its scheme")
        _check_skeleton_layer(model, name, layer)
        _set_module(model, name, layer)
        prefixes.append(f"{name}.")
    _load_float_tensors(model, tensors, tuple(prefixes), directory)
    if merge:
        qm.merge_projections(model)
    model.eval()
    if device is not None:
        model.to(device)
    return model


__all__ = ["save_quantized", "load_quantized", "load_compressed_tensors", "compressed_tensors_config",
           "checkpoint_state", "SUPPORTED_CT_SCHEMES"]
