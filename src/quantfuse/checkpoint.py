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
from typing import Dict, Optional, Union

import torch
from torch import nn

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


@torch.no_grad()
def load_quantized(directory: Union[str, os.PathLike], model_skeleton_or_hf_dir: Union[None, str, os.PathLike,
                   nn.Module] = None, device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Rebuild a model written by `save_quantized`: bit-exact tensors, the same quantfuse modules.

    `model_skeleton_or_hf_dir`: a float model of the same architecture (modified in place), a Hugging
    Face model directory whose config.json describes it, or None to use the config.json saved with the
    checkpoint. `device`: where the result goes (default: CPU)."""
    from safetensors.torch import load_file

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: expected a quantized checkpoint directory, got {directory!r} "
                                "(no such directory)")
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
    prefixes_t = tuple(prefixes)

    rest = {k: v for k, v in tensors.items() if not k.startswith(prefixes_t)}
    expected = {k for k in model.state_dict() if not k.startswith(prefixes_t)}
    missing = sorted(expected - set(rest))
    unexpected = sorted(set(rest) - expected)
    if missing or unexpected:
        raise ValueError(f"{TENSORS_FILE}: does not match the model: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(rest, strict=False, assign=True)
    tie = getattr(model, "tie_weights", None)
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    if callable(tie) and getattr(getattr(model, "config", None), "tie_word_embeddings", False) \
            and not isinstance(output_embeddings, (QuantizedLinear, GatedMLP)):
        tie()  # assign=True gave the tied embedding and output weights two tensors: one again (a quantized
        # output layer has its own codes and stays as loaded)
    for names in info.get("merged_projections", []):
        try:
            MergedProjections([model.get_submodule(n) for n in names])
        except (AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"{QUANTFUSE_FILE}: cannot merge the projections {names}: {err}") from err
    model.eval()
    if device is not None:
        model.to(device)
    return model


__all__ = ["save_quantized", "load_quantized", "compressed_tensors_config", "checkpoint_state"]
