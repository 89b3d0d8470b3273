"""Model-level API on CPU: quantize_ with every config, skip / overrides, plan(), config errors,
checkpoints (bit-exact round trip) and compressed-tensors interoperability."""

import json

import pytest
import torch
from torch import nn

import quantfuse as qf
from quantfuse import modules as qm
from quantfuse.checkpoint import load_quantized, save_quantized
from quantfuse.quantize_api import (
    Fp8BlockConfig,
    Fp8DynamicConfig,
    Fp8StaticConfig,
    Int4WeightOnlyConfig,
    Int8DynamicConfig,
    Int8StaticConfig,
    Int8WeightOnlyConfig,
    config_for_scheme,
    plan,
    quantize_,
    quantized_layers,
)


class GatedMLP(nn.Module):
    def __init__(self, d=128, h=256):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d=128, h=256):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d)
        self.mlp = GatedMLP(d, h)

    def forward(self, x):
        return x + self.mlp(self.norm(x + self.q_proj(x)))


class TinyLlama(nn.Module):
    def __init__(self, d=128, h=256, layers=2, vocab=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def sequential():
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))


ALL_CONFIGS = [
    Int8DynamicConfig(), Int8StaticConfig(), Int8StaticConfig(calibrator="percentile"),
    Int8StaticConfig(calibrator="mse", symmetric=False), Int8StaticConfig(calibrator="entropy"),
    Int8DynamicConfig(fuse_gated_mlp=False), config_for_scheme("fp8_dynamic"), Fp8DynamicConfig(fuse_gated_mlp=False),
    Fp8StaticConfig(), Fp8StaticConfig(calibrator="percentile"), Fp8BlockConfig(), Fp8BlockConfig(fuse_gated_mlp=False),
    Int4WeightOnlyConfig(), Int4WeightOnlyConfig(group_size=64, symmetric=False),
    Int4WeightOnlyConfig(algorithm="gptq"), Int8WeightOnlyConfig(), Int8WeightOnlyConfig(algorithm="gptq"),
]
IDS = [f"{c.scheme}-{i}" for i, c in enumerate(ALL_CONFIGS)]


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.detach().flatten(), b.detach().flatten(), dim=0))


def _ids(n=4):
    return [torch.randint(0, 64, (2, 9)) for _ in range(n)]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=IDS)
def test_quantize_sequential_every_config(config):
    model = sequential().eval()
    x = torch.randn(3, 5, 128)
    expected = model(x)
    calib = [torch.randn(4, 128) for _ in range(3)]
    quantize_(model, config, calibration_data=calib if config.needs_calibration else None, progress=False)
    layers = quantized_layers(model)
    assert set(layers) == {"0", "2"}
    assert all(isinstance(m, qm.QuantizedLinear) for m in layers.values())
    y = model(x)
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert _cos(y, expected) > 0.97


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=IDS)
def test_quantize_tiny_llama_every_config(config):
    model = TinyLlama().eval()
    ids = torch.randint(0, 64, (2, 7))
    expected = model(ids)
    quantize_(model, config, calibration_data=_ids() if config.needs_calibration else None, progress=False)
    assert isinstance(model.lm_head, nn.Linear)  # skipped by default
    assert isinstance(model.embed_tokens, nn.Embedding)
    fused = {Fp8BlockConfig: qm.Fp8BlockGatedMLP, Int8DynamicConfig: qm.Int8DynamicGatedMLP,
             Fp8DynamicConfig: qm.Fp8DynamicGatedMLP}.get(type(config)) if getattr(config, "fuse_gated_mlp", False) else None
    for layer in model.layers:
        assert isinstance(layer.q_proj, qm.QuantizedLinear)
        if fused:
            assert type(layer.mlp) is fused
        else:
            assert isinstance(layer.mlp.down_proj, qm.QuantizedLinear)
    assert _cos(model(ids), expected) > 0.97


@pytest.mark.parametrize("config_cls", [Fp8BlockConfig, Int8DynamicConfig, Fp8DynamicConfig])
def test_fused_gated_mlp_matches_unfused(config_cls):
    torch.manual_seed(0)
    a = TinyLlama().eval()
    b = TinyLlama().eval()
    b.load_state_dict(a.state_dict())
    quantize_(a, config_cls(), progress=False)
    quantize_(b, config_cls(fuse_gated_mlp=False), progress=False)
    assert isinstance(a.layers[0].mlp, qm.GatedMLP) and not isinstance(b.layers[0].mlp, qm.GatedMLP)
    ids = torch.randint(0, 64, (2, 5))
    assert _cos(a(ids), b(ids)) > 0.999


@pytest.mark.parametrize("layer_cls,mlp_cls", [(qm.Int8DynamicLinear, qm.Int8DynamicGatedMLP),
                                               (qm.Fp8DynamicLinear, qm.Fp8DynamicGatedMLP)])
def test_dynamic_gated_mlp_is_the_per_token_pipeline(layer_cls, mlp_cls):
    # the fused module computes exactly: x quantized per token once, one stacked gate|up GEMM, silu(g) * u
    # in float32 quantized per token, the down GEMM -- compared with those ops called one by one
    torch.manual_seed(2)
    mlp = GatedMLP(128, 96)
    with torch.no_grad():
        mlp.gate_proj.bias = nn.Parameter(torch.randn(96))  # one bias: the stacked bias pads up's with zeros
    fused = mlp_cls.from_mlp(mlp)
    x = torch.randn(2, 5, 128)
    g, u, d = (layer_cls.from_linear(getattr(mlp, p)) for p in ("gate_proj", "up_proj", "down_proj"))
    rows = x.reshape(-1, 128)
    q, s = g.quantize_input(rows)
    gu = torch.cat([g.matmul_quantized(q, s, torch.float32), u.matmul_quantized(q, s, torch.float32)], dim=1)
    h_q, h_s = qf.silu_and_mul_quant(gu, layer_cls.qdtype)
    expected = d.matmul_quantized(h_q, h_s, torch.float32).reshape(2, 5, 128)
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    assert _cos(fused(x), mlp(x)) > 0.99
    # split_layers gives back the three layers bit for bit
    parts = fused.split_layers()
    for name, layer in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
        assert torch.equal(parts[name].weight.view(torch.int8), layer.weight.view(torch.int8))
        assert torch.equal(parts[name].weight_scale, layer.weight_scale)
    with pytest.raises(TypeError, match="gate_up_proj: expected a"):
        mlp_cls(qm.Fp8BlockLinear.from_linear(nn.Linear(128, 256)), d)


@pytest.mark.parametrize("layer_cls", [qm.Int8DynamicLinear, qm.Fp8DynamicLinear, qm.Fp8BlockLinear])
def test_shared_input_quantization(layer_cls, monkeypatch):
    """Layers fed the same tensor (attention's q / k / v) quantize it once; the outputs are those of
    layers quantizing it themselves, bit for bit. An in-place write, another tensor, another rule or a
    freed tensor mean a fresh quantization."""
    import gc

    torch.manual_seed(3)
    layers = [layer_cls.from_linear(nn.Linear(256, n)) for n in (128, 64, 64)]
    calls = []
    original = layer_cls.quantize_input

    def counting(self, x2d):
        calls.append(x2d.shape)
        return original(self, x2d)

    monkeypatch.setattr(layer_cls, "quantize_input", counting)
    qm.SHARED_INPUT.clear()
    x = torch.randn(2, 3, 256)
    shared = [layer(x) for layer in layers]
    assert len(calls) == 1
    qm.SHARED_INPUT.enabled = False
    try:
        alone = [layer(x) for layer in layers]
    finally:
        qm.SHARED_INPUT.enabled = True
    assert len(calls) == 4
    for a, b in zip(shared, alone):
        assert torch.equal(a, b)
    x.mul_(2.0)  # in place: the cached codes are stale
    y = layers[1](x)
    assert len(calls) == 5 and torch.equal(y, layers[1](x)) and len(calls) == 5
    layers[0](x.clone())  # equal values, another tensor
    assert len(calls) == 6
    other = (qm.Fp8DynamicLinear if layer_cls is qm.Int8DynamicLinear else qm.Int8DynamicLinear)
    z = torch.randn(4, 256)
    layers[0](z)
    other.from_linear(nn.Linear(256, 32))(z)  # another rule on the same tensor: its own codes
    assert len(calls) == 7 + issubclass(other, layer_cls)  # (counted only where it inherits the counter)
    del z, x
    gc.collect()
    assert qm.SHARED_INPUT._entry is None  # nothing kept alive once the input is gone


def _tiny_llama_layer(seed: int):
    """(a transformers LlamaDecoderLayer with hidden 128 in eval mode, its rotary embedding, a factory of
    more such layers); skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    make = lambda: LlamaDecoderLayer(cfg, layer_idx=0).eval()  # noqa: E731
    return make(), LlamaRotaryEmbedding(cfg), make


def test_shared_input_quantization_in_a_transformers_llama_layer(monkeypatch):
    """transformers' Llama attention hands q_proj, k_proj and v_proj one tensor: per layer call, int8_dynamic
    quantizes three activations (q|k|v, o_proj's, the fused MLP's gate|up) instead of five, with the output
    of the layer quantizing per projection."""
    layer, rope, _ = _tiny_llama_layer(seed=4)
    quantize_(layer, Int8DynamicConfig(merge_projections=False), progress=False)  # (merged: one q|k|v GEMM)
    calls = []
    original = qm.Int8DynamicLinear.quantize_input
    monkeypatch.setattr(qm.Int8DynamicLinear, "quantize_input",
                        lambda self, x2d: calls.append(1) or original(self, x2d))
    x = torch.randn(2, 7, 128)
    pos = torch.arange(7)[None].expand(2, 7)

    def run():
        out = layer(x, position_embeddings=rope(x, pos), position_ids=pos, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        shared = run()
        assert len(calls) == 3
        qm.SHARED_INPUT.enabled = False
        try:
            alone = run()
        finally:
            qm.SHARED_INPUT.enabled = True
    assert len(calls) == 3 + 5
    assert torch.equal(shared, alone)


def test_skip_and_overrides():
    model = TinyLlama().eval()
    cfg = Int8DynamicConfig(skip=("q_proj",), overrides={
        "layers.0.mlp.down_proj": Int4WeightOnlyConfig(),
        "re:layers\\.1\\.mlp\\.(gate|up)_proj": None,
        "lm_head": config_for_scheme("fp8_dynamic"),
    })
    chosen = plan(model, cfg)
    assert "layers.0.q_proj" not in chosen and "layers.1.q_proj" not in chosen
    assert isinstance(chosen["layers.0.mlp.down_proj"], Int4WeightOnlyConfig)
    assert "layers.1.mlp.gate_proj" not in chosen and "layers.1.mlp.up_proj" not in chosen
    assert chosen["lm_head"].scheme == "fp8_dynamic"
    assert chosen["layers.0.mlp.gate_proj"] is cfg
    quantize_(model, cfg, progress=False)
    assert isinstance(model.layers[0].q_proj, nn.Linear)
    assert isinstance(model.layers[0].mlp.down_proj, qm.WeightOnlyLinear)
    assert isinstance(model.layers[0].mlp.gate_proj, qm.Int8DynamicLinear)
    assert isinstance(model.layers[1].mlp.gate_proj, nn.Linear)
    assert isinstance(model.lm_head, qm.Fp8DynamicLinear)


def test_plan_is_pure_and_lists_linears():
    model = sequential()
    chosen = plan(model, Int8DynamicConfig())
    assert list(chosen) == ["0", "2"]
    assert isinstance(model[0], nn.Linear)  # plan changes nothing
    # wildcard override that also matches a container is fine
    assert set(plan(TinyLlama(), Int8DynamicConfig(overrides={"*mlp*": None}))) == {
        "layers.0.q_proj", "layers.1.q_proj"}


def test_unsupported_layer_errors():
    model = TinyLlama()
    with pytest.raises(ValueError, match="unsupported layer: 'embed_tokens' is a Embedding"):
        plan(model, Int8DynamicConfig(overrides={"embed_tokens": Int8DynamicConfig()}))

    class Conv1D(nn.Module):  # GPT-2's linear-like layer
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

    m = nn.Sequential(nn.Linear(8, 8), Conv1D())
    with pytest.raises(ValueError, match="unsupported layer: '1' is a Conv1D.*skip"):
        quantize_(m, Int8DynamicConfig(), progress=False)
    quantize_(m, Int8DynamicConfig(skip=("1",)), progress=False)  # skipping it is the way out
    assert isinstance(m[0], qm.Int8DynamicLinear)


def test_fp8_static_layer_math_and_calibrated_scale():
    """fp8_static: s_x = max|x| over the calibration batches / 448 (max calibrator), weights per channel in e4m3,
    y = s_x * s_w[n] * (x_q @ W_q^T) + b with x_q = sat(rne(x / s_x)), inputs past the calibrated amax
    saturating at +-448 codes."""
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(64, 48))
    lin = model[0]
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    calib = [torch.randn(5, 64) * s for s in (1.0, 3.0, 2.0)]
    quantize_(model, Fp8StaticConfig(), calibration_data=calib, progress=False)
    layer = model[0]
    assert type(layer) is qm.Fp8StaticLinear and layer.weight.dtype == torch.float8_e4m3fn
    amax = max(float(c.abs().max()) for c in calib)
    assert float(layer.input_scale) == float(torch.tensor(amax, dtype=torch.float32) / 448)
    s_w = w.abs().amax(dim=1, keepdim=True).float() / 448
    torch.testing.assert_close(layer.weight_scale, s_w, rtol=0, atol=0)
    assert torch.equal(layer.weight, (w / s_w).clamp(-448, 448).to(torch.float8_e4m3fn))
    x = torch.randn(7, 64) * 4  # some values beyond the calibrated amax: saturated, not inf / NaN
    s_x = layer.input_scale.reshape(())
    x_q = (x / s_x).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = (s_x * layer.weight_scale.reshape(1, -1)) * (x_q.float() @ layer.weight.float().t()) + b
    y = layer(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert layer.ct_scheme()["input_activations"]["type"] == "float"
    assert layer.ct_scheme()["input_activations"]["strategy"] == "tensor"
    assert layer.ct_scheme()["input_activations"]["dynamic"] is False


def test_fp8_static_layer_refuses_zero_points():
    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="input_range: a zero point needs int8 codes"):
        qm.Fp8StaticLinear.from_linear(lin, input_range=(-1.0, 2.0))
    with pytest.raises(ValueError, match="amax"):
        qm.Fp8StaticLinear.from_linear(lin)
    q8 = qm.Int8StaticLinear.from_linear(lin, input_range=(-1.0, 2.0))
    with pytest.raises(ValueError, match="input_zero_point: fp8 static layers are symmetric"):
        qm.Fp8StaticLinear(q8.weight, q8.weight_scale, None, q8.input_scale, q8.input_zero_point)
    with pytest.raises(TypeError, match="weight_q: expected float8_e4m3fn"):
        qm.Fp8StaticLinear(q8.weight, q8.weight_scale, None, q8.input_scale)


def test_shape_error_names_layer():
    m = nn.Sequential(nn.Linear(96, 128))
    with pytest.raises(ValueError, match=r"layer '0' \(Linear 96->128\) cannot take scheme fp8_block"):
        quantize_(m, Fp8BlockConfig(), progress=False)


@pytest.mark.parametrize("make, err, match", [
    (lambda: Int8StaticConfig(calibrator="minmax"), ValueError, "calibrator"),
    (lambda: Int8StaticConfig(symmetric="yes"), TypeError, "symmetric"),
    (lambda: Int8StaticConfig(percentile=120.0), ValueError, "percentile"),
    (lambda: Fp8StaticConfig(calibrator="mse"), ValueError, "calibrator: expected 'max' or 'percentile'"),
    (lambda: Fp8StaticConfig(calibrator="entropy"), ValueError, "integer grid"),
    (lambda: Fp8StaticConfig(symmetric=False), ValueError, "symmetric only"),
    (lambda: Fp8StaticConfig(symmetric=1), TypeError, "symmetric"),
    (lambda: Int4WeightOnlyConfig(group_size=100), ValueError, "group_size"),
    (lambda: Int4WeightOnlyConfig(algorithm="awq"), ValueError, "algorithm"),
    (lambda: Int4WeightOnlyConfig(scale_dtype="bfloat16"), TypeError, "scale_dtype"),
    (lambda: Int8WeightOnlyConfig(scale_dtype=torch.float64), ValueError, "scale_dtype"),
    (lambda: Int8DynamicConfig(skip=(1,)), TypeError, "skip"),
    (lambda: Int8DynamicConfig(overrides={"x": "int8"}), TypeError, "overrides"),
    (lambda: Int8DynamicConfig(skip=("re:(",)), ValueError, "regular expression"),
    (lambda: config_for_scheme("int3"), ValueError, "scheme"),
])
def test_bad_configs(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_config_errors_found_before_calibration():
    """Arguments that could only fail after a whole calibration run, or per layer, fail at construction."""
    with pytest.raises(ValueError, match="num_bins: expected an integer >= 129 for calibrator='mse'"):
        Int8StaticConfig(calibrator="mse", num_bins=64)
    with pytest.raises(ValueError, match="num_bins: expected an integer >= 128 for calibrator='entropy'"):
        Int8StaticConfig(calibrator="entropy", num_bins=100)
    Int8StaticConfig(calibrator="entropy", num_bins=128)
    Int8StaticConfig(calibrator="max", num_bins=2)
    with pytest.raises(ValueError, match="group_size"):
        Int4WeightOnlyConfig(group_size=128.0)


def test_calibration_errors_name_the_layer_and_batch():
    with pytest.raises(TypeError, match="calibration_data: expected an iterable of batches"):
        quantize_(sequential(), Int8StaticConfig(), calibration_data=3, progress=False)
    bad = [torch.randn(4, 128), torch.full((4, 128), float("nan"))]
    for config in (Int8StaticConfig(), Int4WeightOnlyConfig(algorithm="gptq")):
        with pytest.raises(ValueError, match="batch 1 gave layer '0' an input it cannot calibrate on "
                                             "\\(x: expected finite values, got 512 NaN/Inf of 512 elements\\)"):
            quantize_(sequential(), config, calibration_data=bad, progress=False)

    class Unused(nn.Module):  # a layer the forward never calls sees no calibration data
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(128, 128), nn.Linear(128, 128)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match="layer 'unused' .*saw no calibration data"):
        quantize_(Unused(), Int8StaticConfig(), calibration_data=[torch.randn(2, 128)], progress=False)


def test_bad_calls():
    with pytest.raises(TypeError, match="config"):
        quantize_(sequential(), "int8_dynamic")
    with pytest.raises(TypeError, match="model"):
        quantize_("model", Int8DynamicConfig())
    with pytest.raises(ValueError, match="calibration_data"):
        quantize_(sequential(), Int8StaticConfig(), progress=False)
    with pytest.raises(ValueError, match="calibration_data: expected at least one batch"):
        quantize_(sequential(), Int4WeightOnlyConfig(algorithm="gptq"), calibration_data=[], progress=False)
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_(sequential(), Int8DynamicConfig(skip=("*",)), progress=False)


def test_gptq_beats_rtn_on_output_error():
    torch.manual_seed(1)
    lin = nn.Linear(256, 64)
    # correlated input channels (as in real activations): where GPTQ's error compensation pays off
    x = torch.randn(512, 48) @ torch.randn(48, 256) + 0.1 * torch.randn(512, 256)
    h = x.double().t() @ x.double()
    rtn = qm.WeightOnlyLinear.from_linear(lin, bits=4, group_size=128)
    gptq = qm.WeightOnlyLinear.from_linear(lin, bits=4, group_size=128, hessian=h)
    ref = (x @ lin.weight.t()).detach()
    e_rtn = (x @ rtn.dequantized_weight().t() - ref).pow(2).sum()
    e_gptq = (x @ gptq.dequantized_weight().t() - ref).pow(2).sum()
    assert e_gptq < 0.8 * e_rtn
    q, _ = gptq.codes()
    assert int(q.min()) >= -8 and int(q.max()) <= 7


# (config, model dtype, scale dtype the kernels' QuantizedWeight gets)
SCALE_DTYPE_CASES = [
    (Int4WeightOnlyConfig(), torch.bfloat16, torch.float32),  # default: float32 (measured faster overall)
    (Int4WeightOnlyConfig(scale_dtype="auto"), torch.bfloat16, torch.bfloat16),
    (Int4WeightOnlyConfig(group_size=64, symmetric=False, scale_dtype="auto"), torch.float16, torch.float16),
    (Int4WeightOnlyConfig(scale_dtype="auto"), torch.float32, torch.float32),
    (Int8WeightOnlyConfig(scale_dtype="auto"), torch.float16, torch.float16),
    (Int8WeightOnlyConfig(scale_dtype="auto"), torch.bfloat16, torch.float32),  # no packed int8 path in bfloat16
    (Int4WeightOnlyConfig(scale_dtype=torch.float32), torch.bfloat16, torch.float32),
    (Int8WeightOnlyConfig(group_size=32, symmetric=False, scale_dtype=torch.bfloat16), torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("config,model_dtype,scale_dtype", SCALE_DTYPE_CASES,
                         ids=[f"{c.scheme}-{str(m)[6:]}-{str(s)[6:]}" for c, m, s in SCALE_DTYPE_CASES])
def test_weight_only_scale_dtype(config, model_dtype, scale_dtype, tmp_path):
    """scale_dtype (None: float32, "auto": from the layer's weight dtype) reaches the kernels' QuantizedWeight, with the codes
    of ops.quantize_weight at that dtype; the module's weight_scale buffer keeps that dtype through a move
    and a checkpoint round trip (so the packed conversion survives them), and dequantized weight, forward
    and the reloaded model agree bit for bit."""
    model = sequential().to(model_dtype).eval()
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    quantize_(model, config, progress=False)
    x = torch.randn(3, 128).to(model_dtype)
    y = model(x)
    save_quantized(model, tmp_path)
    loaded = load_quantized(tmp_path, sequential().to(model_dtype))
    for i, w in zip((0, 2), weights):
        layer = model[i]
        qw = layer.quantized_weight()
        assert qw.scales.dtype == scale_dtype
        want = qf.quantize_weight(w, bits=config.bits, group_size=config.group_size, symmetric=config.symmetric,
                                  scale_dtype=scale_dtype)
        assert torch.equal(qw.qweight, want.qweight) and torch.equal(qw.scales, want.scales)
        assert layer.weight_scale.dtype == scale_dtype and torch.equal(layer.weight_scale, qw.scales.t())
        assert loaded[i].weight_scale.dtype == scale_dtype
        assert loaded[i].quantized_weight().scales.dtype == scale_dtype
        layer.to("cpu")  # a move rebuilds the kernel weight from the buffers
        assert layer.quantized_weight().scales.dtype == scale_dtype
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            assert torch.equal(layer.dequantized_weight(dt), qw.dequantize(dt))
            assert torch.equal(loaded[i].dequantized_weight(dt), layer.dequantized_weight(dt))
    assert torch.equal(loaded(x), y)


def test_weight_only_scale_dtype_gptq_rounds_scales_keeps_codes():
    torch.manual_seed(3)
    lin = nn.Linear(256, 64).to(torch.bfloat16)
    x = torch.randn(256, 256)
    h = x.double().t() @ x.double()
    stats = type("Stats", (), {"seen": 1, "hessian": h})()
    layer = Int4WeightOnlyConfig(algorithm="gptq", symmetric=False, scale_dtype="auto").convert(lin, stats)
    u, scales, zeros = qm.gptq_quantize(lin.weight, h, 4, 128, False)
    qw = layer.quantized_weight()
    assert qw.scales.dtype == torch.bfloat16 and torch.equal(qw.scales, scales.to(torch.bfloat16))
    assert torch.equal(qw.biased_codes(), u) and torch.equal(qw.zero_points(), zeros.to(torch.int32))
    assert torch.equal(layer.dequantized_weight(torch.float32), qw.dequantize(torch.float32))


def test_half_cast_keeps_codes():
    model = sequential()
    quantize_(model, Int8DynamicConfig(), progress=False)
    before = model[0].weight.clone()
    model.half()
    assert model[0].weight.dtype == torch.int8 and torch.equal(model[0].weight, before)
    assert model[0].weight_scale.dtype == torch.float32 and model[0].bias.dtype == torch.float16


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------
def _tensors_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype ==
                                                                    torch.float8_e4m3fn else a,
                                                                    b.view(torch.uint8) if b.dtype ==
                                                                    torch.float8_e4m3fn else b)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=IDS)
def test_checkpoint_round_trip_bit_exact(config, tmp_path):
    model = TinyLlama().eval()
    quantize_(model, config, calibration_data=_ids() if config.needs_calibration else None, progress=False)
    save_quantized(model, tmp_path)
    info = json.loads((tmp_path / "quantfuse.json").read_text())
    assert info["format_version"] == 1
    loaded = load_quantized(tmp_path, TinyLlama())
    sa, sb = model.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert _tensors_equal(sa[k], sb[k]), k
    assert [type(m) for m in model.modules()] == [type(m) for m in loaded.modules()]
    ids = torch.randint(0, 64, (2, 6))
    assert torch.equal(model(ids), loaded(ids))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_quantized(tmp_path / "missing", TinyLlama())
    with pytest.raises(FileNotFoundError, match="not a quantfuse checkpoint"):
        load_quantized(tmp_path, TinyLlama())
    with pytest.raises(ValueError, match="no quantfuse layer"):
        save_quantized(sequential(), tmp_path / "x")
    model = TinyLlama()
    quantize_(model, Int8DynamicConfig(), progress=False)
    save_quantized(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="same architecture"):
        load_quantized(tmp_path / "ckpt", sequential())
    with pytest.raises(ValueError, match="layer 'layers.0.q_proj' is Linear\\(128, 64\\) in the model, "
                                         "\\(128, 128\\) in the checkpoint"):
        skeleton = TinyLlama()
        skeleton.layers[0].q_proj = nn.Linear(128, 64)
        load_quantized(tmp_path / "ckpt", skeleton)


def _tampered(src, dst, tensors=None, info=None):
    """A copy of checkpoint `src` in `dst` with its tensors and / or quantfuse.json changed by the callables."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors")
    if info is not None:
        data = json.loads((dst / "quantfuse.json").read_text())
        (dst / "quantfuse.json").write_text(json.dumps(info(data)))
    return dst


def test_load_refuses_incomplete_or_relabelled_checkpoints(tmp_path):
    """A checkpoint that lost an optional tensor (bias, zero point), or whose layer class or fields were changed,
    fails with an error naming the layer instead of loading as another model."""
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))
    quantize_(model, Int8StaticConfig(symmetric=False), calibration_data=[torch.randn(4, 128)], progress=False)
    save_quantized(model, tmp_path / "ok")
    skeleton = lambda: nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))  # noqa: E731
    x = torch.randn(3, 128)
    assert torch.equal(load_quantized(tmp_path / "ok", skeleton())(x), model(x))
    cases = {
        "no bias": (dict(tensors=lambda t: t.pop("2.bias")), "layer '2' .*missing \\['bias'\\]"),
        "no zero point": (dict(tensors=lambda t: t.pop("0.input_zero_point")), "missing \\['input_zero_point'\\]"),
        "static as dynamic": (dict(info=lambda i: i["modules"]["0"].update({"class": "Int8DynamicLinear"}) or i),
                              "layer '0' \\(Int8DynamicLinear\\) uses the tensors"),
        "no modules": (dict(info=lambda i: {"format_version": i["format_version"]}), "'modules' object"),
        "a list": (dict(info=lambda i: []), "'modules' object"),
    }
    for label, (change, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_quantized(_tampered(tmp_path / "ok", tmp_path / label.replace(" ", "_"), **change), skeleton())
    wo = nn.Sequential(nn.Linear(128, 64))
    quantize_(wo, Int4WeightOnlyConfig(group_size=64), progress=False)
    save_quantized(wo, tmp_path / "wo")
    relabel = lambda i: i["modules"]["0"].update({"bits": 8}) or i  # noqa: E731
    with pytest.raises(ValueError, match="layer '0' \\(WeightOnlyLinear\\) cannot be rebuilt.*weight_packed"):
        load_quantized(_tampered(tmp_path / "wo", tmp_path / "wo8", info=relabel), nn.Sequential(nn.Linear(128, 64)))


def test_compressed_tensors_config_layout(tmp_path):
    model = TinyLlama()
    quantize_(model, Int8DynamicConfig(overrides={"layers.0.*": Int4WeightOnlyConfig()}), progress=False)
    save_quantized(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == "mixed-precision"
    assert qc["ignore"] == ["lm_head"]
    targets = sorted(t for g in qc["config_groups"].values() for t in g["targets"])
    assert len(targets) == 8
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["layers.0.q_proj.weight_packed"].dtype == torch.int32
    assert tensors["layers.1.q_proj.weight"].dtype == torch.int8
    assert tensors["layers.1.q_proj.weight_scale"].shape == (128, 1)


# ----------------------------------------------------------------------------------------------------
# compressed-tensors (the PyPI package) reads what we write
# ----------------------------------------------------------------------------------------------------
CT_CONFIGS = [Int8DynamicConfig(), Int8StaticConfig(symmetric=False), config_for_scheme("fp8_dynamic"),
              Fp8StaticConfig(), Fp8BlockConfig(), Int4WeightOnlyConfig(),
              Int4WeightOnlyConfig(group_size=64, symmetric=False),
              Int8WeightOnlyConfig(), Int4WeightOnlyConfig(symmetric=False, scale_dtype=torch.bfloat16)]


@pytest.mark.parametrize("config", CT_CONFIGS, ids=[c.scheme + str(i) for i, c in enumerate(CT_CONFIGS)])
def test_compressed_tensors_decompresses_our_files(config, tmp_path):
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    model = TinyLlama().eval()
    quantize_(model, config, calibration_data=_ids() if config.needs_calibration else None, progress=False)
    save_quantized(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    qconfig = QuantizationConfig.model_validate(raw)  # their schema accepts our config
    tensors = load_file(tmp_path / "model.safetensors")
    from quantfuse.checkpoint import _flat_layers

    ours = _flat_layers(model)
    checked = 0
    for group in qconfig.config_groups.values():
        fmt = group.format or qconfig.format
        compressor = BaseCompressor.get_value_from_registry(fmt)
        for name in group.targets:
            prefix = name + "."
            local = {k[len(prefix):]: v for k, v in tensors.items()
                     if k.startswith(prefix) and "." not in k[len(prefix):]}
            out = compressor.decompress(local, group)
            # they decompress in the scales' dtype (one rounding of (q - z) * s there, as ours)
            theirs = out["weight"]
            mine = ours[name].dequantized_weight(theirs.dtype)
            assert torch.equal(theirs, mine), (ct.__version__, name)
            checked += 1
    assert checked == len(ours) > 0


# ----------------------------------------------------------------------------------------------------
# Merged projections (weight-only: q/k/v and gate/up as one GEMM)
# ----------------------------------------------------------------------------------------------------
def _weight_only_layers(bits=4, group_size=64):
    torch.manual_seed(11)
    specs = [(96, True, True), (32, False, False), (40, True, True)]  # (N, bias, symmetric)
    return [qm.WeightOnlyLinear.from_linear(nn.Linear(128, n, bias=b), bits=bits, group_size=group_size,
                                            symmetric=s) for n, b, s in specs]


def _counting_gemm(monkeypatch):
    calls = []
    original = qm.ops.weight_only_mm

    def counting(x, qw, bias=None):
        calls.append(qw.shape)
        return original(x, qw, bias)

    monkeypatch.setattr(qm.ops, "weight_only_mm", counting)
    return calls


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, -1), (4, 128)])
def test_merged_projections_equal_the_layers_alone(bits, group_size, monkeypatch):
    """One GEMM over [W_q; W_k; W_v] (mixed bias / zero points) serves the three layers; each output is the
    layer's own (bf16 and float32 inputs; the CPU reference path sums each output in the same order)."""
    import gc

    layers = _weight_only_layers(bits, group_size)
    calls = _counting_gemm(monkeypatch)
    group = qm.MergedProjections(layers)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 5, 128).to(dtype)
        calls.clear()
        merged = [layer(x) for layer in layers]
        assert calls == [(168, 128)]
        group.enabled = False
        try:
            alone = [layer(x) for layer in layers]
        finally:
            group.enabled = True
        assert [c[0] for c in calls[1:]] == [96, 32, 40]
        for a, b, layer in zip(merged, alone, layers):
            assert a.shape == (2, 5, layer.out_features) and a.dtype == dtype
            torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 0, atol=0)
    # cache rules: a member served twice, an in-place write to x or to an output, another tensor: recompute
    x = torch.randn(3, 128)
    calls.clear()
    q, k = layers[0](x), layers[1](x)
    assert len(calls) == 1
    layers[1](x)
    assert len(calls) == 2
    x2 = torch.randn(3, 128)
    q = layers[0](x2)
    q.mul_(0.0)  # the outputs are views of one tensor: writing one invalidates the entry
    v = layers[2](x2)
    assert len(calls) == 4
    group.enabled = False
    torch.testing.assert_close(v, layers[2](x2), rtol=1e-6, atol=0)
    group.enabled = True
    calls.clear()
    layers[0](x2)  # the entry made by layers[2] on this x2 serves it
    assert len(calls) == 0
    x2.add_(1.0)
    layers[1](x2)
    layers[2](x2.clone())
    assert len(calls) == 2
    del x, x2, q, k, v
    gc.collect()
    assert group._entry is None  # nothing kept once the input is gone
    group.split()
    assert all(layer._merged is None for layer in layers)


def test_merged_projections_refuse_mismatched_layers():
    a = qm.WeightOnlyLinear.from_linear(nn.Linear(128, 32), bits=4, group_size=64)
    with pytest.raises(TypeError, match="two or more"):
        qm.MergedProjections([a])
    with pytest.raises(ValueError, match="in_features"):
        qm.MergedProjections([a, qm.WeightOnlyLinear.from_linear(nn.Linear(256, 32), bits=4, group_size=64)])
    with pytest.raises(ValueError, match="group_size"):
        qm.MergedProjections([a, qm.WeightOnlyLinear.from_linear(nn.Linear(128, 32), bits=4, group_size=128)])
    with pytest.raises(ValueError, match="scale dtype"):
        qm.MergedProjections([a, qm.WeightOnlyLinear.from_linear(nn.Linear(128, 32), bits=4, group_size=64,
                                                                 scale_dtype=torch.bfloat16)])
    b = qm.WeightOnlyLinear.from_linear(nn.Linear(128, 16), bits=4, group_size=64)
    qm.MergedProjections([a, b])
    with pytest.raises(ValueError, match="already"):
        qm.MergedProjections([b, qm.WeightOnlyLinear.from_linear(nn.Linear(128, 16), bits=4, group_size=64)])
    from quantfuse.weights import QuantizedWeight

    qa, qb = a.quantized_weight(), b.quantized_weight()
    with pytest.raises(ValueError, match="perm"):
        QuantizedWeight.concat_rows([qa, QuantizedWeight(qb.qweight, qb.scales, qb.zeros, 4, 64, qb.shape,
                                                         torch.arange(128))])
    with pytest.raises(TypeError, match="QuantizedWeight"):
        QuantizedWeight.concat_rows([])


def test_merged_projections_in_a_transformers_llama_layer(monkeypatch, tmp_path):
    """int4 weight-only on transformers' Llama layer: q/k/v and gate/up merge, a layer call runs 4 GEMMs
    instead of 7 with the output of the unmerged layer; the merge survives deepcopy, .to() and a checkpoint
    (save -> load gives the same groups); merge_projections=False leaves seven GEMMs."""
    import copy

    base, rope, make_layer = _tiny_llama_layer(seed=5)
    layer = copy.deepcopy(base)
    quantize_(layer, Int4WeightOnlyConfig(group_size=64), progress=False)
    assert sorted(qm.merged_groups(layer)) == [("mlp.gate_proj", "mlp.up_proj"),
                                               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
    calls = _counting_gemm(monkeypatch)
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16)
    pos = torch.arange(7)[None].expand(2, 7)

    def run(model):
        with torch.no_grad():
            out = model.to(torch.bfloat16)(x, position_embeddings=tuple(t.to(torch.bfloat16) for t in rope(x, pos)),
                                           position_ids=pos, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    merged = run(layer)
    assert len(calls) == 4
    for group in qm.merged_groups(layer).values():
        group.enabled = False
    alone = run(layer)
    assert len(calls) == 4 + 7
    torch.testing.assert_close(merged, alone, rtol=1e-2, atol=1e-2)
    for group in qm.merged_groups(layer).values():
        group.enabled = True

    twin = copy.deepcopy(layer)
    assert sorted(qm.merged_groups(twin)) == sorted(qm.merged_groups(layer))
    assert all(m in dict(twin.named_modules()).values() for g in qm.merged_groups(twin).values() for m in g.members)
    calls.clear()
    assert torch.equal(run(twin), merged) and len(calls) == 4

    save_quantized(layer, tmp_path)
    info = json.loads((tmp_path / "quantfuse.json").read_text())
    assert sorted(map(tuple, info["merged_projections"])) == sorted(qm.merged_groups(layer))
    loaded = load_quantized(tmp_path, make_layer())
    assert sorted(qm.merged_groups(loaded)) == sorted(qm.merged_groups(layer))
    calls.clear()
    assert torch.equal(run(loaded), merged) and len(calls) == 4

    plain = copy.deepcopy(base)
    quantize_(plain, Int4WeightOnlyConfig(group_size=64, merge_projections=False), progress=False)
    assert qm.merged_groups(plain) == {}
    calls.clear()
    torch.testing.assert_close(run(plain), alone, rtol=0, atol=0)
    assert len(calls) == 7
    with pytest.raises(TypeError, match="merge_projections"):
        Int4WeightOnlyConfig(merge_projections=1)


# (layer class, constructor from an nn.Linear, output sizes, the op its GEMM goes through)
W8A8_MERGE_CASES = {
    "int8_dynamic": (qm.Int8DynamicLinear, qm.Int8DynamicLinear.from_linear, (96, 32, 40), "scaled_mm"),
    "fp8_dynamic": (qm.Fp8DynamicLinear, qm.Fp8DynamicLinear.from_linear, (96, 32, 40), "scaled_mm"),
    "int8_static": (qm.Int8StaticLinear, lambda lin: qm.Int8StaticLinear.from_linear(lin, amax=3.0), (96, 32, 40),
                    "scaled_mm"),
    "int8_static_azp": (qm.Int8StaticLinear,
                        lambda lin: qm.Int8StaticLinear.from_linear(lin, input_range=(-2.0, 3.5)), (96, 32, 40),
                        "scaled_mm"),
    "fp8_static": (qm.Fp8StaticLinear, lambda lin: qm.Fp8StaticLinear.from_linear(lin, amax=3.0), (96, 32, 40),
                   "scaled_mm"),
    "fp8_block": (qm.Fp8BlockLinear, qm.Fp8BlockLinear.from_linear, (256, 128, 40), "scaled_mm_blockwise"),
}


@pytest.mark.parametrize("case", list(W8A8_MERGE_CASES))
def test_merged_w8a8_projections_equal_the_layers_alone(case, monkeypatch, tmp_path):
    """W8A8 q/k/v as one GEMM: x quantized once, each output the layer's own (int8: bit for bit, exact int32
    sums and the same epilogue), the members' weights and scales become row blocks of one stacked tensor (no
    extra memory), a dtype cast rebuilds the stack, and a checkpoint of the merged model round-trips."""
    layer_cls, make, sizes, op = W8A8_MERGE_CASES[case]
    torch.manual_seed(12)
    layers = [make(nn.Linear(128, n, bias=b)) for n, b in zip(sizes, (True, False, True))]
    mm_calls = []
    original_mm = getattr(qm.ops, op)
    monkeypatch.setattr(qm.ops, op, lambda *a, **k: mm_calls.append(a[1].shape) or original_mm(*a, **k))
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    group = qm.MergedProjections(layers)
    merged = [layer(x) for layer in layers]
    assert mm_calls == [(128, sum(sizes))]
    storage = {layer.weight.untyped_storage().data_ptr() for layer in layers}
    assert len(storage) == 1 and all(layer.weight.is_contiguous() for layer in layers)
    group.enabled = False
    alone = [layer(x) for layer in layers]
    group.enabled = True
    for a, b in zip(merged, alone):
        if layer_cls in (qm.Int8DynamicLinear, qm.Int8StaticLinear):
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2**-8, atol=1e-6)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = layers
    parent.half()  # bias cast: the stacked layer is rebuilt with it on the next call
    xh = torch.randn(3, 128, dtype=torch.float16)
    mm_calls.clear()
    outs = [layer(xh) for layer in layers]
    assert len(mm_calls) == 1 and all(o.dtype == torch.float16 for o in outs)
    save_quantized(parent, tmp_path)
    skeleton = nn.Module()
    skeleton.q_proj, skeleton.k_proj, skeleton.v_proj = (nn.Linear(128, n) for n in sizes)
    loaded = load_quantized(tmp_path, skeleton).half()
    assert sorted(qm.merged_groups(loaded)) == [("q_proj", "k_proj", "v_proj")]
    for a, b in zip(outs, [loaded.q_proj(xh), loaded.k_proj(xh), loaded.v_proj(xh)]):
        assert torch.equal(a, b)


def test_merge_refuses_static_scales_that_differ_and_ragged_fp8_blocks():
    torch.manual_seed(13)
    a, b = (qm.Int8StaticLinear.from_linear(nn.Linear(128, 32), amax=v) for v in (3.0, 4.0))
    with pytest.raises(ValueError, match="input_scale"):
        qm.MergedProjections([a, b])
    parent = nn.Module()
    parent.q_proj, parent.k_proj = a, b
    assert qm.merge_projections(parent) == {}
    c, d = (qm.Fp8BlockLinear.from_linear(nn.Linear(128, n)) for n in (100, 128))
    with pytest.raises(ValueError, match="whole 128-row"):
        qm.MergedProjections([c, d])
    qm.MergedProjections([d, c])  # a ragged last member is fine


def test_merged_w8a8_in_a_transformers_llama_layer(monkeypatch):
    """int8_dynamic on transformers' Llama layer: q|k|v merged (the MLP is the fused GatedMLP), 4 scaled_mm
    per layer call instead of 6, same output bit for bit; merge_projections=False keeps 6."""
    import copy

    base, rope, _ = _tiny_llama_layer(seed=7)
    mm_calls = []
    original_mm = qm.ops.scaled_mm
    monkeypatch.setattr(qm.ops, "scaled_mm", lambda *a, **k: mm_calls.append(1) or original_mm(*a, **k))
    x = torch.randn(2, 7, 128)
    pos = torch.arange(7)[None].expand(2, 7)
    outs = []
    for merge in (True, False):
        layer = copy.deepcopy(base)
        quantize_(layer, Int8DynamicConfig(merge_projections=merge), progress=False)
        assert bool(qm.merged_groups(layer)) == merge
        mm_calls.clear()
        with torch.no_grad():
            out = layer(x, position_embeddings=rope(x, pos), position_ids=pos, attention_mask=None)
        outs.append((out[0] if isinstance(out, tuple) else out, len(mm_calls)))
    (a, na), (b, nb) = outs
    assert (na, nb) == (4, 6)
    assert torch.equal(a, b)


INFERENCE_MODE_CONFIGS = [Int8DynamicConfig(), Int8DynamicConfig(merge_projections=False), Fp8BlockConfig(),
                          config_for_scheme("fp8_dynamic"), Int4WeightOnlyConfig(group_size=64),
                          Int8StaticConfig(), Fp8StaticConfig()]


@pytest.mark.parametrize("config", INFERENCE_MODE_CONFIGS, ids=[c.scheme for c in INFERENCE_MODE_CONFIGS])
def test_inference_mode_runs_like_no_grad(config):
    """Inference tensors carry no version counter: the shared-input and merged-projection caches step aside for
    them (the layers run alone) and the outputs equal those under no_grad, bit for bit."""
    layer, rope, _ = _tiny_llama_layer(seed=6)
    x = torch.randn(2, 5, 128)
    pos = torch.arange(5)[None].expand(2, 5)
    calib = [dict(hidden_states=x, position_embeddings=rope(x, pos), position_ids=pos, attention_mask=None)]
    quantize_(layer, config, calibration_data=calib if config.needs_calibration else None, progress=False)

    def run(inp):
        out = layer(inp, position_embeddings=rope(inp, pos), position_ids=pos, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        expected = run(x)
    with torch.inference_mode():
        got = run(x.clone())
    assert torch.equal(got, expected)
    with torch.inference_mode():
        made = x.clone()  # an inference tensor used later outside inference mode
    with torch.no_grad():
        assert torch.equal(run(made), expected)


def test_shared_input_sees_a_rebound_tensor(monkeypatch):
    """`x.data = other` keeps x's identity and version counter; the cache also compares x's memory."""
    layers = [qm.Int8DynamicLinear.from_linear(nn.Linear(64, 32)) for _ in range(2)]
    qm.SHARED_INPUT.clear()
    x = torch.randn(4, 64)
    layers[0](x)
    x.data = torch.randn(2, 64)
    y = layers[1](x)
    qm.SHARED_INPUT.enabled = False
    try:
        assert torch.equal(y, layers[1](x))
    finally:
        qm.SHARED_INPUT.enabled = True


LOAD_CONFIGS = [Int4WeightOnlyConfig(group_size=64), Int8StaticConfig(symmetric=False), Fp8BlockConfig(),
                Int8DynamicConfig(), Int8WeightOnlyConfig(), Fp8StaticConfig()]


@pytest.mark.parametrize("config", LOAD_CONFIGS, ids=[c.scheme for c in LOAD_CONFIGS])
def test_load_state_dict_into_a_quantized_model(config):
    """Tensors derived from the stored ones (the kernel's QuantizedWeight, zero-point corrections, transposed
    block scales, merged stacks) follow a load_state_dict: the target then computes what the source does."""
    calib = _ids()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = TinyLlama(d=256, h=256).eval()
        for layer in m.layers:  # siblings fed one tensor, so weight-only and static layers merge
            layer.k_proj = nn.Linear(256, 128)
            layer.forward = (lambda self: lambda x: x + self.mlp(self.norm(x + self.q_proj(x)))
                             + self.k_proj(x).repeat(1, 1, 2))(layer)
        quantize_(m, config, calibration_data=calib if config.needs_calibration else None, progress=False)
        models.append(m)
    target, source = models
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        target(ids)  # derived tensors and merged stacks built from the target's own weights
        target.load_state_dict(source.state_dict())
        assert torch.equal(target(ids), source(ids))


def test_a_layer_shared_by_two_parents_is_quantized_everywhere(tmp_path):
    class Holder(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    shared = nn.Linear(64, 64)
    model = nn.Sequential(Holder(shared), nn.ReLU(), Holder(shared)).eval()
    x = torch.randn(4, 64)
    quantize_(model, Int8DynamicConfig(), progress=False)
    assert isinstance(model[0].lin, qm.Int8DynamicLinear) and model[2].lin is model[0].lin
    assert set(quantized_layers(model)) == {"0.lin", "2.lin"}
    y = model(x)
    save_quantized(model, tmp_path)
    skeleton = nn.Sequential(Holder(nn.Linear(64, 64)), nn.ReLU(), Holder(nn.Linear(64, 64)))
    loaded = load_quantized(tmp_path, skeleton)
    assert isinstance(loaded[2].lin, qm.Int8DynamicLinear) and torch.equal(loaded(x), y)


def test_checkpoint_of_a_model_built_from_its_config(tmp_path):
    """A transformers model made from a config (no from_pretrained: architectures unset) reloads as its own class,
    and tied input / output embeddings come back tied."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert not model.config.architectures
    quantize_(model, Int8DynamicConfig(), progress=False)
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        y = model(ids).logits
    save_quantized(model, tmp_path)
    loaded = load_quantized(tmp_path)
    assert type(loaded) is type(model)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, y)
