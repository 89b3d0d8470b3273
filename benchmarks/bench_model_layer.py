"""A Llama-3-8B-shaped (BENCH_MODEL: or Llama-3.2-1B / 3B) decoder layer (transformers' LlamaDecoderLayer,
random weights) in bf16 vs each quantfuse scheme (issue 6): decode (batch 1 and 16, one new token per sequence,
no KV cache) and prefill (2048 tokens), timed for the whole layer and for its seven linear layers alone.

Peers in the same run: the bf16 layer (F.linear through cuBLAS). CUDA graphs for the decode shapes
(launch overhead excluded, as in a graph-captured engine); prefill eager and graphed. Layer weights (~436 MB in
bf16) are far larger than L2, so every call streams them from HBM; activations rotate.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_ms, write_result  # noqa: E402

import quantfuse as qf  # noqa: E402

# BENCH_MODEL: the layer (its name, then hidden, intermediate, heads, KV heads); results go to
# model_layer<BENCH_SUFFIX>.json
MODELS = {"llama-3-8b": ("Llama-3-8B", 4096, 14336, 32, 8), "llama-3.2-1b": ("Llama-3.2-1B", 2048, 8192, 32, 8),
          "llama-3.2-3b": ("Llama-3.2-3B", 3072, 8192, 24, 8)}
MODEL = os.environ.get("BENCH_MODEL", "llama-3-8b")
MODEL_NAME, HIDDEN, INTER, HEADS, KV_HEADS = MODELS[MODEL]
SUFFIX = os.environ.get("BENCH_SUFFIX", "")
SCHEMES = {
    "int8_dynamic": lambda: qf.Int8DynamicConfig(),
    "int8_dynamic_unmerged": lambda: qf.Int8DynamicConfig(merge_projections=False),
    "int8_dynamic_unfused": lambda: qf.Int8DynamicConfig(fuse_gated_mlp=False),
    "fp8_dynamic": lambda: qf.Fp8DynamicConfig(),
    "fp8_dynamic_unmerged": lambda: qf.Fp8DynamicConfig(merge_projections=False),
    "fp8_dynamic_unfused": lambda: qf.Fp8DynamicConfig(fuse_gated_mlp=False),
    "fp8_block": lambda: qf.Fp8BlockConfig(),
    "int4_weight_only": lambda: qf.Int4WeightOnlyConfig(group_size=128),
    "int4_weight_only_unmerged": lambda: qf.Int4WeightOnlyConfig(group_size=128, merge_projections=False),
    "int8_weight_only": lambda: qf.Int8WeightOnlyConfig(),
    "int8_weight_only_unmerged": lambda: qf.Int8WeightOnlyConfig(merge_projections=False),
    # static per-tensor input scales, calibrated on random hidden states (calibration_batches): the gated MLP
    # stays three layers (its silu(gate) * up runs in torch), q|k|v and gate|up merged
    "int8_static": lambda: qf.Int8StaticConfig(calibrator="max"),
    "fp8_static": lambda: qf.Fp8StaticConfig(),
}
# BENCH_SCHEMES: a comma-separated subset of SCHEMES to run (bf16 always runs: it is the peer)
if os.environ.get("BENCH_SCHEMES"):
    _wanted = [s.strip() for s in os.environ["BENCH_SCHEMES"].split(",") if s.strip()]
    _unknown = [s for s in _wanted if s not in SCHEMES]
    if _unknown:
        raise SystemExit(f"BENCH_SCHEMES: unknown schemes {_unknown}; expected some of {list(SCHEMES)}")
    SCHEMES = {s: SCHEMES[s] for s in _wanted}
# (label, tokens, CUDA graph): prefill both eager (what a plain PyTorch caller sees, CPU launch overhead
# included) and graphed (the GPU time alone)
TOKENS = [("decode_b1", 1, True), ("decode_b16", 16, True), ("prefill_2048", 2048, False),
          ("prefill_2048_graph", 2048, True)]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def build_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=1, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return layer.to("cuda", torch.bfloat16).eval(), LlamaRotaryEmbedding(cfg).to("cuda")


def layer_fn(layer, rope):
    def run(x, pos):
        cos_sin = rope(x, pos)
        out = layer(x, position_embeddings=cos_sin, position_ids=pos, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out
    return run


def merged_bf16_linears(layer):
    """The bf16 peer with q|k|v and gate|up stacked (what an engine with merged projections runs): four
    F.linear calls on the layer's own weights."""
    import torch.nn.functional as F

    att, mlp = layer.self_attn, layer.mlp
    w_qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).contiguous()
    w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
    w_o, w_d = att.o_proj.weight, mlp.down_proj.weight
    return lambda x, xi: [F.linear(x, w_qkv), F.linear(x, w_o), F.linear(x, w_gu), F.linear(xi, w_d)]


def calibration_batches(rope, batches=4, tokens=512):
    """The layer's call arguments on random N(0, 1) bf16 hidden states (the static schemes' calibration)."""
    torch.manual_seed(1)
    out = []
    for _ in range(batches):
        x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(tokens, device="cuda").unsqueeze(0)
        out.append(dict(hidden_states=x, position_embeddings=rope(x, pos), position_ids=pos, attention_mask=None))
    return out


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    base, rope = build_layer()
    bf16_merged = merged_bf16_linears(base)
    layers = {"bf16": base}
    for scheme, make in SCHEMES.items():
        q = copy.deepcopy(base)
        config = make()
        qf.quantize_(q, config, calibration_data=calibration_batches(rope) if config.needs_calibration else None,
                     progress=False)
        layers[scheme] = q
    rows = []
    for label, tokens, graph in TOKENS:
        b, s = (tokens, 1) if label.startswith("decode") else (1, tokens)
        inputs = [(torch.randn(b, s, HIDDEN, device="cuda", dtype=torch.bfloat16),
                   torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)) for _ in range(4)]
        lin_inputs = [(torch.randn(b, s, HIDDEN, device="cuda", dtype=torch.bfloat16),
                       torch.randn(b, s, INTER, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
        times = {}
        for name, layer in layers.items():
            mods = dict(layer.named_modules())
            if all(n in mods for n in LINEARS) and all(hasattr(mods[n], "forward") for n in LINEARS):
                lin_t = time_ms(lambda x, xi, _m=mods: [_m[n](xi if n.endswith("down_proj") else x) for n in LINEARS],
                                lin_inputs, graph=graph)
            else:  # fused gated MLP (fp8_block, int8/fp8_dynamic): its projections are one module
                lin_t = float("nan")
            with torch.no_grad():
                layer_t = time_ms(layer_fn(layer, rope), inputs, graph=graph)
            times[name] = (layer_t, lin_t)
        with torch.no_grad():
            times["bf16_merged_linears"] = (float("nan"), time_ms(bf16_merged, lin_inputs, graph=graph))
        for name, (layer_t, lin_t) in times.items():
            base_layer, base_lin = times["bf16"]
            rows.append(dict(shape=label, tokens=tokens, scheme=name, layer_us=layer_t * 1e3, linears_us=lin_t * 1e3,
                             layer_speedup=(base_layer / layer_t) if layer_t == layer_t else float("nan"),
                             linears_speedup=(base_lin / lin_t) if lin_t == lin_t else float("nan"),
                             linears_vs_bf16_merged=(times["bf16_merged_linears"][1] / lin_t)
                             if lin_t == lin_t else float("nan")))
            print(rows[-1], flush=True)
    print_table(rows)
    write_result("model_layer" + SUFFIX, f"{MODEL_NAME} decoder layer: bf16 vs quantfuse schemes (H100)", rows,
                 notes="Decode: batch b, one token per sequence, no KV cache, CUDA graphs. Prefill: 2048 tokens, "
                       "eager and under a CUDA graph. linears = the seven projections alone (n/a where the gated "
                       "MLP is fused: fp8_block, int8_dynamic, fp8_dynamic; the *_unfused rows run the same scheme "
                       "layer by layer). int8_static / fp8_static: per-tensor input scales calibrated (max) on "
                       "four batches of 512 random N(0, 1) hidden states; their gated MLP is three layers (silu(gate) "
                       "* up in torch between them). "
                       "Weight-only schemes merge q|k|v and gate|up into one GEMM each, int8/fp8_dynamic q|k|v "
                       "(MergedProjections; the linears are called as the layer calls them, q/k/v and gate/up on "
                       "one tensor); *_unmerged: one GEMM per projection. bf16_merged_linears: the bf16 weights "
                       "stacked the same way (4 F.linear), linears only; speedups are against the bf16 layer as "
                       "transformers runs it. Eager prefill rows are host-bound and depend on the machine's CPU "
                       "(graphed rows: the GPU time).")


if __name__ == "__main__":
    with torch.no_grad():
        main()
