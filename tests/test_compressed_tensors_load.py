"""Loading compressed-tensors checkpoints that another tool wrote (no quantfuse.json): `load_compressed_tensors`,
and `load_quantized`'s fallback to it. Round trips through our own writer with quantfuse.json removed, and
hand-written llm-compressor-style checkpoints (class and regex targets, an ignore list, per-tensor weight
scales, sharded safetensors with an index)."""

import json
import os

import pytest
import torch
from torch import nn

from quantfuse import modules as qm
from quantfuse.checkpoint import QUANTFUSE_FILE, load_compressed_tensors, load_quantized, save_quantized
from quantfuse.quantize_api import (
    Fp8BlockConfig,
    Fp8DynamicConfig,
    Fp8StaticConfig,
    Int4WeightOnlyConfig,
    Int8DynamicConfig,
    Int8StaticConfig,
    Int8WeightOnlyConfig,
    quantize_,
)
from tests.test_model_api import TinyLlama, _ids

FP8 = torch.float8_e4m3fn

# fused gated MLPs are written as their three layers and load as such: unfused configs compare bit for bit
ROUND_TRIP = [Int8DynamicConfig(fuse_gated_mlp=False), Int8StaticConfig(symmetric=False),
              Fp8DynamicConfig(fuse_gated_mlp=False), Fp8StaticConfig(), Fp8BlockConfig(fuse_gated_mlp=False),
              Int4WeightOnlyConfig(group_size=64, symmetric=False), Int4WeightOnlyConfig(scale_dtype=torch.bfloat16),
              Int8WeightOnlyConfig()]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=[f"{c.scheme}-{i}" for i, c in enumerate(ROUND_TRIP)])
def test_our_files_without_quantfuse_json_load_from_the_config(config, tmp_path):
    torch.manual_seed(31)
    model = TinyLlama().eval()
    quantize_(model, config, calibration_data=_ids() if config.needs_calibration else None, progress=False)
    save_quantized(model, tmp_path)
    os.remove(tmp_path / QUANTFUSE_FILE)
    loaded = load_quantized(tmp_path, TinyLlama())  # falls back to load_compressed_tensors
    ours = {n: m for n, m in model.named_modules() if isinstance(m, qm.QuantizedLinear)}
    theirs = {n: m for n, m in loaded.named_modules() if isinstance(m, qm.QuantizedLinear)}
    assert sorted(ours) == sorted(theirs) and len(ours) == 8  # 2 blocks x (q, gate, up, down); lm_head skipped
    for name, layer in ours.items():
        assert type(theirs[name]) is type(layer), name
        for key, t in layer.checkpoint_tensors().items():
            assert torch.equal(theirs[name].checkpoint_tensors()[key], t), (name, key)
    assert isinstance(loaded.lm_head, nn.Linear) and torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert sorted(qm.merged_groups(loaded)) == sorted(qm.merged_groups(model))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def _write(directory, tensors, quantization_config, shards=1):
    """A checkpoint directory: config.json with the quantization_config, tensors in `shards` files (an index
    json when more than one)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"quantization_config": quantization_config}, f)
    if shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(directory, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _args(num_bits, type_, strategy, dynamic=False, symmetric=True, group_size=None):
    return {"num_bits": num_bits, "type": type_, "strategy": strategy, "dynamic": dynamic, "symmetric": symmetric,
            "group_size": group_size}


def _float_model(seed):
    """A float TinyLlama, a copy of its state dict, and its (name, nn.Linear) pairs but lm_head (the layers a
    checkpoint writer quantizes)."""
    torch.manual_seed(seed)
    model = TinyLlama().eval()
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    return model, tensors, linears


def _foreign_checkpoint(directory, shards=2):
    """What llm-compressor writes for a mixed recipe: q_proj fp8 with a per-tensor weight scale and a static input
    scale, the MLP's projections W4A16 g64 pack-quantized with bfloat16 scales (both groups target by regex),
    lm_head ignored. Returns (float model, the expected quantfuse layers by name, the tensors, the config)."""
    model, tensors, linears = _float_model(32)
    expected = {}
    for name, lin in linears:
        for key in [k for k in tensors if k.startswith(name + ".")]:
            del tensors[key]
        w = lin.weight.detach()
        if name.endswith("q_proj"):
            s_w = (w.abs().max() / 448).reshape(1)
            codes = (w / s_w).clamp(-448, 448).to(FP8)
            s_x = torch.tensor([0.03])
            layer_tensors = {"weight": codes, "weight_scale": s_w, "input_scale": s_x}
            expected[name] = qm.Fp8StaticLinear(codes, s_w.expand(w.shape[0], 1), lin.bias, s_x)
        else:
            ref = qm.WeightOnlyLinear.from_linear(lin, bits=4, group_size=64, scale_dtype=torch.bfloat16)
            layer_tensors = dict(ref.checkpoint_tensors())
            expected[name] = ref
        if lin.bias is not None:
            layer_tensors["bias"] = lin.bias.detach().clone()
        tensors.update({f"{name}.{k}": v for k, v in layer_tensors.items()})
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
          "ignore": ["lm_head"],
          "config_groups": {
              "group_0": {"targets": ["re:.*q_proj$"], "format": "float-quantized",
                          "weights": _args(8, "float", "tensor"), "input_activations": _args(8, "float", "tensor")},
              "group_1": {"targets": ["re:.*mlp\\..*_proj$"], "format": "pack-quantized",
                          "weights": _args(4, "int", "group", group_size=64), "input_activations": None}}}
    _write(directory, tensors, qc, shards)
    return model, expected, tensors, qc


@pytest.mark.parametrize("shards", [1, 3])
def test_a_foreign_mixed_checkpoint(shards, tmp_path):
    model, expected, _, _ = _foreign_checkpoint(tmp_path, shards)
    loaded = load_compressed_tensors(tmp_path, TinyLlama())
    for name, want in expected.items():
        got = loaded.get_submodule(name)
        assert type(got) is type(want), name
        for key, t in want.checkpoint_tensors().items():
            assert torch.equal(got.checkpoint_tensors()[key], t), (name, key)
    q = loaded.layers[0].q_proj
    assert q.weight_scale.shape == (128, 1) and bool((q.weight_scale == q.weight_scale[0]).all())
    assert type(loaded.lm_head) is nn.Linear and torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    assert sorted(qm.merged_groups(loaded)) == [("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"),
                                               ("layers.1.mlp.gate_proj", "layers.1.mlp.up_proj")]
    # the same model assembled by hand from the expected layers computes the same, bit for bit
    for name, layer in expected.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def _edit(directory, tensors, qc):
    for f in os.listdir(directory):
        os.remove(os.path.join(directory, f))
    _write(directory, tensors, qc, shards=1)


def test_foreign_checkpoint_errors(tmp_path):
    _, _, tensors, qc = _foreign_checkpoint(tmp_path, shards=1)
    bad = json.loads(json.dumps(qc))
    bad["quantization_status"] = "frozen"
    _edit(tmp_path, tensors, bad)
    with pytest.raises(ValueError, match="quantization_status 'compressed'"):
        load_compressed_tensors(tmp_path, TinyLlama())
    bad = json.loads(json.dumps(qc))
    bad["config_groups"]["group_0"]["weights"]["symmetric"] = False
    _edit(tmp_path, tensors, bad)
    with pytest.raises(ValueError, match=r"group 'group_0' \(layer 'layers.0.q_proj'.*asymmetric weights.*quantfuse "
                                         r"runs"):
        load_compressed_tensors(tmp_path, TinyLlama())
    no_scale = {k: v for k, v in tensors.items() if k != "layers.1.q_proj.input_scale"}
    _edit(tmp_path, no_scale, qc)
    with pytest.raises(ValueError, match="layers.1.q_proj.*no input_scale"):
        load_compressed_tensors(tmp_path, TinyLlama())
    extra = dict(tensors, **{"layers.0.mlp.up_proj.weight_g_idx": torch.zeros(128, dtype=torch.int32)})
    _edit(tmp_path, extra, qc)
    with pytest.raises(ValueError, match=r"\['weight_g_idx'\] have no place"):
        load_compressed_tensors(tmp_path, TinyLlama())
    stray = dict(tensors, **{"layers.0.norm.running_thing": torch.zeros(1)})
    _edit(tmp_path, stray, qc)
    with pytest.raises(ValueError, match="does not match the model.*unexpected"):
        load_compressed_tensors(tmp_path, TinyLlama())
    bad = json.loads(json.dumps(qc))
    bad["config_groups"] = {"g": dict(qc["config_groups"]["group_0"], targets=["Conv2d"])}
    _edit(tmp_path, tensors, bad)
    with pytest.raises(ValueError, match="target no nn.Linear"):
        load_compressed_tensors(tmp_path, TinyLlama())
    for change, match in [
        (lambda c: c["config_groups"]["group_1"]["weights"].update(symmetric=False), "no weight_zero_point"),
        (lambda c: c["config_groups"]["group_1"]["weights"].update(group_size=128), r"\(expected \(256, 1\)\)"),
        (lambda c: c["config_groups"]["group_1"]["weights"].update(group_size=None), "group_size None"),
        (lambda c: c.update(transform_config={"config_groups": {"u": {}}}), "transforms"),
        (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
        (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse weights"),
        (lambda c: c["config_groups"]["group_0"].update(output_activations=_args(8, "float", "tensor")),
         "quantized outputs"),
        (lambda c: c["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
         "asymmetric activations other than static int8"),
    ]:
        bad = json.loads(json.dumps(qc))
        change(bad)
        _edit(tmp_path, tensors, bad)
        with pytest.raises(ValueError, match=match):
            load_compressed_tensors(tmp_path, TinyLlama())
    nested = dict(tensors, **{"layers.0.mlp.down_proj.hadamard_input.weight": torch.zeros(4, 4)})
    _edit(tmp_path, nested, qc)
    with pytest.raises(ValueError, match="tensors of submodules of the layer"):
        load_compressed_tensors(tmp_path, TinyLlama())
    with pytest.raises(ValueError, match="has no quantfuse.json; as a compressed-tensors checkpoint"):
        load_quantized(tmp_path, TinyLlama())
    bad = dict(qc, quant_method="gptq")
    _edit(tmp_path, tensors, bad)
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        load_compressed_tensors(tmp_path, TinyLlama())
    with pytest.raises(FileNotFoundError, match="missing quantfuse.json"):  # no fallback without the config
        load_quantized(tmp_path, TinyLlama())


# (format, weights, input_activations, expected quantfuse class): schemes whose tensors compressed-tensors' own
# compressors write below
CT_WRITER_CASES = {
    "w4a16_g64": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=64), None,
                  qm.WeightOnlyLinear),
    "w4a16_g128_asym": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=128,
                                               symmetric=False), None, qm.WeightOnlyLinear),
    "w8a16_channel": ("pack-quantized", dict(num_bits=8, type="int", strategy="channel"), None, qm.WeightOnlyLinear),
    "w8a8_int8_dynamic": ("int-quantized", dict(num_bits=8, type="int", strategy="channel"),
                          dict(num_bits=8, type="int", strategy="token", dynamic=True), qm.Int8DynamicLinear),
    "w8a8_fp8_static": ("float-quantized", dict(num_bits=8, type="float", strategy="channel"),
                        dict(num_bits=8, type="float", strategy="tensor", dynamic=False), qm.Fp8StaticLinear),
    "w8a8_fp8_tensor_dynamic": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor"),
                                dict(num_bits=8, type="float", strategy="token", dynamic=True), qm.Fp8DynamicLinear),
}


def _ct_scales(w, weights):
    """Scales (and zero points) for `w` [N, K] by the args, as a calibration would set them."""
    qmax = 448.0 if weights["type"] == "float" else float(2 ** (weights["num_bits"] - 1) - 1)
    strategy, n, k = weights["strategy"], w.shape[0], w.shape[1]
    if strategy == "group":
        g = weights["group_size"]
        blocks = w.reshape(n, k // g, g)
        if weights.get("symmetric", True):
            return {"weight_scale": (blocks.abs().amax(-1) / qmax).to(torch.bfloat16)}
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        levels = 2 ** weights["num_bits"] - 1
        scale = ((hi - lo) / levels).to(torch.bfloat16)
        zp = (-(2 ** (weights["num_bits"] - 1)) - torch.round(lo / scale.float())).clamp(-8, 7).to(torch.int8)
        return {"weight_scale": scale, "weight_zero_point": zp}
    if strategy == "channel":
        return {"weight_scale": w.abs().amax(1, keepdim=True) / qmax}
    return {"weight_scale": (w.abs().amax() / qmax).reshape(1)}


@pytest.mark.parametrize("case", list(CT_WRITER_CASES))
def test_tensors_packed_by_compressed_tensors_load_bit_exact(case, tmp_path):
    """compressed-tensors' own compressors quantize and pack every Linear but lm_head (their code, their layout);
    the loaded quantfuse layers dequantize to what their decompressor returns, bit for bit, and compute their
    scheme on the CPU."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    fmt, weights, acts, layer_cls = CT_WRITER_CASES[case]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if acts is None else QuantizationArgs(**acts))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    model, tensors, linears = _float_model(33)
    compressed = {}
    for name, lin in linears:
        local = {"weight": lin.weight.detach().clone(), **_ct_scales(lin.weight.detach(), weights)}
        if acts is not None and not acts.get("dynamic"):
            local["input_scale"] = torch.tensor([0.05])
        out = compressor.compress(local, scheme)
        del tensors[f"{name}.weight"]
        tensors.update({f"{name}.{k}": v for k, v in out.items()})
        compressed[name] = out
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=["lm_head"])
    _write(tmp_path, tensors, json.loads(json.dumps(qc.model_dump(), default=str)))
    loaded = load_quantized(tmp_path, TinyLlama())
    for name, out in compressed.items():
        layer = loaded.get_submodule(name)
        assert type(layer) is layer_cls, (name, type(layer))
        theirs = compressor.decompress(dict(out), scheme)["weight"]
        assert torch.equal(layer.dequantized_weight(theirs.dtype), theirs), name
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        y = loaded(ids)
    assert y.shape == (2, 6, 64) and torch.isfinite(y).all()
    with torch.no_grad():
        assert torch.nn.functional.cosine_similarity(y.flatten(), model(ids).flatten(), dim=0) > 0.98


class _SubLinear(nn.Linear):
    """An nn.Linear subclass (as some model files define): a class target "Linear" still matches it."""


def test_group_resolution_as_compressed_tensors_does(tmp_path):
    """An exact name before a regex before a class name (anywhere in the class hierarchy); a target string listed by
    two groups belongs to the later one."""
    _, expected, tensors, qc = _foreign_checkpoint(tmp_path, shards=1)

    def skeleton():
        model = TinyLlama()
        for layer in model.layers:
            old = layer.q_proj
            layer.q_proj = _SubLinear(old.in_features, old.out_features, bias=old.bias is not None)
        return model

    # q_proj by class name through the subclass; the MLP's regex beats the class target
    by_class = json.loads(json.dumps(qc))
    by_class["config_groups"]["group_0"]["targets"] = ["Linear"]
    _edit(tmp_path, tensors, by_class)
    loaded = load_compressed_tensors(tmp_path, skeleton())
    for name, want in expected.items():
        assert type(loaded.get_submodule(name)) is type(want), name
    # an exact name beats the regex: up_proj now takes group_3's scheme (8-bit packing), which its tensors refuse
    exact = json.loads(json.dumps(qc))
    exact["config_groups"]["group_3"] = dict(qc["config_groups"]["group_1"], targets=["layers.0.mlp.up_proj"],
                                             weights=_args(8, "int", "channel"))
    _edit(tmp_path, tensors, exact)
    with pytest.raises(ValueError, match="group 'group_3' \\(layer 'layers.0.mlp.up_proj'"):
        load_compressed_tensors(tmp_path, skeleton())
    # the same target string in two groups: the later one
    twice = json.loads(json.dumps(qc))
    twice["config_groups"]["group_4"] = dict(qc["config_groups"]["group_1"], targets=["re:.*q_proj$"])
    _edit(tmp_path, tensors, twice)
    with pytest.raises(ValueError, match="group 'group_4' \\(layer 'layers.0.q_proj'"):
        load_compressed_tensors(tmp_path, skeleton())


def test_tied_output_weight_and_all_zero_zero_points(tmp_path):
    """A checkpoint that stores a tied output weight once (as transformers' save_pretrained does) loads with the
    output layer taking the embedding's tensor; all-zero zero points of a symmetric scheme (older writers) are left
    out, a nonzero one is refused."""

    def tied():
        model = TinyLlama()
        model.lm_head.weight = model.embed_tokens.weight
        return model

    _, expected, tensors, qc = _foreign_checkpoint(tmp_path, shards=1)
    del tensors["lm_head.weight"]
    zp = torch.zeros(256 // 8, 128 // 64, dtype=torch.int32)  # packed along N for [256, 128] g64
    with_zeros = dict(tensors, **{"layers.0.mlp.gate_proj.weight_zero_point": zp})
    _edit(tmp_path, with_zeros, qc)
    loaded = load_compressed_tensors(tmp_path, tied())
    assert loaded.lm_head.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()  # one tensor, still tied
    assert torch.equal(loaded.embed_tokens.weight, tensors["embed_tokens.weight"])
    gate = loaded.layers[0].mlp.gate_proj
    assert torch.equal(gate.dequantized_weight(), expected["layers.0.mlp.gate_proj"].dequantized_weight())
    with_zeros["layers.0.mlp.gate_proj.weight_zero_point"] = zp + 1
    _edit(tmp_path, with_zeros, qc)
    with pytest.raises(ValueError, match=r"\['weight_zero_point'\] have no place"):
        load_compressed_tensors(tmp_path, tied())
