"""Merged weight-only projections on the GPU (`modules.MergedProjections`: q/k/v and gate/up as one GEMM).

What is checked, at Llama-3-8B sizes (hidden 4096, 32 query and 8 key/value heads, MLP 14336), so the merged
GEMMs take the shipped decode kernels (q|k|v 6144 x 4096; gate|up 28672 x 4096 on the tensor-core decode
kernel at M = 1):
- every member's slice of the merged GEMM against the member run alone: both are the GEMM's result for that
  layer up to float32 summation order (the merged GEMM may split K differently), so they may differ by at
  most two output roundings: |merged - alone| <= 2 (2^-7 + 2^-14) (|x| @ |w_hat|.T) + |bias| terms (bf16),
  M in {1, 4, 16, 33}, int4 g128 symmetric / asymmetric with bias, int8 per channel;
- a CUDA graph captured over q, k, v (one GEMM in the graph) replays on new input data to the members'
  results, and an eager call after the capture computes afresh (an entry made in a capture never serves);
- torch.compile of a function calling the members runs them one by one, to the same values;
- a transformers LlamaDecoderLayer (hidden 1024) quantized int4: the merged layer's output against the
  unmerged one's, and 4 GEMM launches per call instead of 7;
- W8A8 q|k|v (4096 -> 6144; int8 / fp8 dynamic, int8 static with and without zero point, fp8 static, fp8
  blocks): int8 slices bit for bit the layers' own (exact int32 sums, same epilogue per element) at M in
  {1, 4, 16, 33, 2048}, fp8 within two output roundings; int8 dynamic under a CUDA graph too; a Llama layer
  with int8_dynamic gives the unmerged layer's output bit for bit with 4 scaled_mm launches instead of 6;
- the static W8A8 layers (fp8, int8 with and without zero point) on CUDA against their CPU path.
"""

import copy

import pytest
import torch
from torch import nn

import quantfuse as qf
from quantfuse import modules as qm

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
DEV = "cuda"
REL = 2.0**-7 + 2.0**-14


def _linears(sizes, k=4096, seed=21):
    """bf16 nn.Linear layers K -> each of `sizes` (weights N(0, 0.02)); the middle one has no bias."""
    torch.manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        lin = nn.Linear(k, n, bias=i != 1, device=DEV, dtype=BF16)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02)
        out.append(lin)
    return out


def _layers(bits, group_size, symmetric, sizes=(4096, 1024, 1024)):
    return [qm.WeightOnlyLinear.from_linear(lin, bits=bits, group_size=group_size, symmetric=symmetric)
            for lin in _linears(sizes)]


# W8A8 layer constructors from an nn.Linear, and whether a merged slice must equal the layer's own bit for bit
# (int8: exact int32 sums and the same epilogue per element; fp8: float32 sums in another order)
W8A8 = {
    "int8_dynamic": (qm.Int8DynamicLinear.from_linear, True),
    "fp8_dynamic": (qm.Fp8DynamicLinear.from_linear, False),
    "int8_static": (lambda lin: qm.Int8StaticLinear.from_linear(lin, amax=4.0), True),
    "int8_static_azp": (lambda lin: qm.Int8StaticLinear.from_linear(lin, input_range=(-3.0, 5.0)), True),
    "fp8_static": (lambda lin: qm.Fp8StaticLinear.from_linear(lin, amax=4.0), False),
    "fp8_block": (qm.Fp8BlockLinear.from_linear, False),
}


def _w8a8_layers(case, sizes=(4096, 1024, 1024)):
    return [W8A8[case][0](lin) for lin in _linears(sizes, seed=22)]


def _assert_two_roundings(merged, alone, x, layer):
    w = layer.dequantized_weight(torch.float32)
    scale = x.reshape(-1, x.shape[-1]).float().abs() @ w.abs().t()
    if layer.bias is not None:
        scale = scale + layer.bias.float().abs()
    err = (merged.float() - alone.float()).reshape(scale.shape).abs()
    bad = err > 2 * REL * scale
    assert not bool(bad.any()), f"{int(bad.sum())} outputs beyond two roundings; worst {float((err / scale).max()):.3g}"


def _merged_and_alone(group, layers, x):
    merged = [layer(x) for layer in layers]
    group.enabled = False
    alone = [layer(x) for layer in layers]
    group.enabled = True
    return merged, alone


def _graph_replay(layers, new):
    """Capture the layers' calls on a static input in a CUDA graph, replay it on `new`'s values; returns
    (the replayed outputs, eager calls on the static input after the capture)."""
    static = torch.randn_like(new)
    [layer(static) for layer in layers]  # build the stacked weight and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [layer(static) for layer in layers]
    static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [c.clone() for c in captured]
    return replayed, [layer(static) for layer in layers]


def _llama_layer_outputs(config_factory, seed, tokens, counted_op, monkeypatch, grad_mode=torch.no_grad):
    """A transformers LlamaDecoderLayer (hidden 1024, bf16, weights N(0, 0.02)) quantized with each config of
    `config_factory` (a list of callables); per config and per batch size in `tokens`: (output, launches of
    `counted_op` in quantfuse.ops during the call), each call under `grad_mode()`."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                   num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    base = LlamaDecoderLayer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    base = base.to(DEV, BF16).eval()
    rope = LlamaRotaryEmbedding(cfg).to(DEV)
    calls = []
    original = getattr(qm.ops, counted_op)
    monkeypatch.setattr(qm.ops, counted_op, lambda *a, **k: calls.append(1) or original(*a, **k))
    results = []
    for make in config_factory:
        layer = copy.deepcopy(base)
        qf.quantize_(layer, make(), progress=False)
        per_tokens = []
        for m in tokens:
            x = torch.randn(m, 1, 1024, device=DEV, dtype=BF16, generator=torch.Generator(DEV).manual_seed(m))
            pos = torch.zeros(m, 1, dtype=torch.long, device=DEV)
            calls.clear()
            with grad_mode():
                out = layer(x, position_embeddings=rope(x, pos), position_ids=pos, attention_mask=None)
            per_tokens.append((out[0] if isinstance(out, tuple) else out, len(calls)))
        results.append(per_tokens)
    return results


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 128, True), (4, 128, False), (8, -1, True)])
@pytest.mark.parametrize("sizes", [(4096, 1024, 1024), (14336, 14336)], ids=["qkv", "gate_up"])
def test_merged_slices_match_each_layer(bits, group_size, symmetric, sizes):
    layers = _layers(bits, group_size, symmetric, sizes)
    group = qm.MergedProjections(layers)
    for m in (1, 4, 16, 33):
        x = torch.randn(m, 4096, device=DEV, dtype=BF16)
        merged, alone = _merged_and_alone(group, layers, x)
        for a, b, layer in zip(merged, alone, layers):
            assert a.shape == b.shape == (m, layer.out_features) and a.dtype == BF16
            _assert_two_roundings(a, b, x, layer)


def test_cuda_graph_capture_and_eager_after():
    layers = _layers(4, 128, True)
    group = qm.MergedProjections(layers)
    new = torch.randn(1, 4096, device=DEV, dtype=BF16)
    replayed, eager = _graph_replay(layers, new)  # eager after the capture: computed afresh
    group.enabled = False
    alone = [layer(new) for layer in layers]
    for r, e, a, layer in zip(replayed, eager, alone, layers):
        assert torch.equal(r, e)
        _assert_two_roundings(r, a, new, layer)


def test_torch_compile_runs_members_alone():
    layers = _layers(4, 128, False)
    qm.MergedProjections(layers)

    def f(x):
        return [layer(x) for layer in layers]

    x = torch.randn(2, 4096, device=DEV, dtype=BF16)
    eager = f(x)
    got = torch.compile(f)(x)
    for a, b, layer in zip(got, eager, layers):
        assert a.shape == b.shape
        _assert_two_roundings(a, b, x, layer)


def test_llama_layer_merged_vs_unmerged(monkeypatch):
    merged, plain = _llama_layer_outputs([qf.Int4WeightOnlyConfig,
                                          lambda: qf.Int4WeightOnlyConfig(merge_projections=False)],
                                         6, (1, 16), "weight_only_mm", monkeypatch)
    for (a, na), (b, nb) in zip(merged, plain):
        assert (na, nb) == (4, 7)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", list(W8A8))
def test_w8a8_merged_slices_match_each_layer(case):
    layers = _w8a8_layers(case)
    group = qm.MergedProjections(layers)
    for m in (1, 4, 16, 33, 2048):
        x = torch.randn(m, 4096, device=DEV, dtype=BF16)
        merged, alone = _merged_and_alone(group, layers, x)
        for a, b, layer in zip(merged, alone, layers):
            assert a.shape == b.shape == (m, layer.out_features)
            if W8A8[case][1]:
                assert torch.equal(a, b), f"M={m}"
            else:
                _assert_two_roundings(a, b, x, layer)


@pytest.mark.parametrize("case", ["fp8_static", "int8_static", "int8_static_azp"])
def test_static_layer_on_cuda_matches_its_cpu_path(case):
    """A static W8A8 layer on CUDA (quantize_per_tensor with the calibrated scale, then scaled_mm's kernels)
    against the same layer moved to the CPU (the reference ops), M in {1, 33, 2048}, inputs partly past the
    calibrated amax (saturated codes): outputs within two output roundings."""
    layer = W8A8[case][0](_linears((1024,), seed=23)[0])
    cpu = copy.deepcopy(layer).to("cpu")
    assert cpu.weight.dtype == layer.weight.dtype and torch.equal(cpu.weight.cpu(), layer.weight.cpu())
    for m in (1, 33, 2048):
        x = (torch.randn(m, 4096, device=DEV) * 2).to(BF16)
        got = layer(x)
        want = cpu(x.cpu()).to(DEV)
        assert got.dtype == want.dtype == BF16 and torch.isfinite(got).all()
        _assert_two_roundings(got, want, x, layer)


def test_w8a8_merged_under_cuda_graph():
    layers = _w8a8_layers("int8_dynamic")
    group = qm.MergedProjections(layers)
    new = torch.randn(1, 4096, device=DEV, dtype=BF16)
    replayed, eager = _graph_replay(layers, new)
    group.enabled = False
    for r, e, a in zip(replayed, eager, [layer(new) for layer in layers]):
        assert torch.equal(r, a) and torch.equal(e, a)


def test_llama_layer_int8_dynamic_merged_bit_exact(monkeypatch):
    merged, plain = _llama_layer_outputs([qf.Int8DynamicConfig, lambda: qf.Int8DynamicConfig(merge_projections=False)],
                                         8, (4,), "scaled_mm", monkeypatch)
    (a, na), (b, nb) = merged[0], plain[0]
    assert (na, nb) == (4, 6)
    assert torch.equal(a, b)


def test_capture_before_any_eager_call_runs_members_alone():
    """A capture that comes first must not stack the weights inside the graph: the members run alone in it
    (the replay equals the unmerged layers bit for bit), and the next eager call stacks and merges."""
    layers = _w8a8_layers("int8_dynamic")
    group = qm.MergedProjections(layers)
    static = torch.randn(2, 4096, device=DEV, dtype=BF16)
    group.enabled = False
    [layer(static) for layer in layers]  # compile the kernels outside the capture, without stacking
    group.enabled = True
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [layer(static) for layer in layers]
    assert group._merged_layer is None
    new = torch.randn(2, 4096, device=DEV, dtype=BF16)
    static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = [layer(new) for layer in layers]
    assert group._merged_layer is not None
    for c, e in zip(captured, eager):
        assert torch.equal(c, e)


@pytest.mark.parametrize("config, op", [(qf.Int8DynamicConfig, "scaled_mm"),
                                        (qf.Int4WeightOnlyConfig, "weight_only_mm")])
def test_llama_layer_under_inference_mode(config, op, monkeypatch):
    """Inference tensors carry no version counter: a merged layer's members run alone under
    torch.inference_mode, giving the unmerged layer's output bit for bit with its launch count."""
    merged = _llama_layer_outputs([config], 9, (1, 16), op, monkeypatch, grad_mode=torch.inference_mode)
    plain = _llama_layer_outputs([lambda: config(merge_projections=False)], 9, (1, 16), op, monkeypatch)
    for (a, na), (b, nb) in zip(merged[0], plain[0]):
        assert na == nb and torch.equal(a, b)
