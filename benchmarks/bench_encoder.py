"""INT8 BERT encoder (SPEC section 6) against Hugging Face fp16 BERT-base, and padding removal.

Model: BERT-base shape (12 layers, hidden 768, 12 heads, intermediate 3072), random weights, built from
`transformers.BertConfig` / `BertModel` in fp16 on cuda with attn_implementation="sdpa".

Columns, per batch x seq (every time is the median of `triton.testing.do_bench`, eager launches, no CUDA
graphs for anyone, full-length sequences with an all-ones attention_mask unless said otherwise):
* hf_us: HF fp16 SDPA model, eager; compile_us: `torch.compile(model, dynamic=False)` (default mode);
  the faster of the two is the peer;
* mode1_us / mode2_us: `Int8Encoder` mode 1 (fp16 residual/output) and mode 2 (int8 residual/output),
  calibrated on two random batches (max calibration), padded path (all tokens valid: nothing to remove);
  speedup_modeN = peer / modeN;
* packed_us / padded_us: mode 1 on a batch with random lengths in [seq/4, 3seq/4] (about half the tokens
  valid), with padding removal (`remove_padding=True`: pack_mask, gather, packed layers, scatter, all
  inside the timed call) and without (`remove_padding=False`, every position runs, padded keys masked);
  packing_speedup = padded / packed;
* *_graph_us: the same calls replayed from one CUDA graph (launch overhead excluded, as in a graph-captured
  engine): hf_graph_us (HF eager captured), compile_graph_us (the torch.compile'd model captured), and
  graph_speedup_modeN = the faster of those two / modeN graphed; packed_graph_us / padded_graph_us: the
  varying-length batches with the packing metadata (`pack_mask`, whose nonzero syncs the host) computed
  once per batch outside the graph, as an engine's scheduler would, gather / packed layers / scatter inside;
  packing_graph_speedup = padded / packed graphed. mode2_graph_no_pdl_us: mode 2 graphed with the kernels in
  plain stream order, same run (= mode2_graph_us where the table's `pdl_max_tokens` leaves PDL off anyway).
  mode2_graph_no_ln_pdl_us / packed_graph_no_ln_pdl_us: the same with the LayerNorms behind the residual GEMMs
  also in stream order (the table's `pdl_layernorm_max_tokens` set to 0); *_no_attn_pdl_us: the attention behind
  the QKV GEMM likewise (`pdl_attention_max_tokens`). mode2_graph_one_stream_us / padded_graph_one_stream_us:
  where a captured forward splits its batch over two streams (`stream_split_min_tokens`), the same forwards with
  streams=1 (= mode2_graph_us / padded_graph_us where it does not split). dense_half_graph_us: mode 1 graphed on
  full-length sequences of seq / 2 tokens (no mask, nothing to pack): about the packed batch's token count with
  none of padding removal's own work, so packing_ceiling = padded_graph_us / dense_half_graph_us bounds what any
  padding removal could reach with these kernels.

Whole run: meant to stay under 150 s on one H100 (the torch.compile of each shape dominates; if the compiles
would exceed COMPILE_BUDGET_S (80 s), the remaining shapes get compile_us = null and the peer is
eager).

`python benchmarks/bench_encoder.py --dry-run` runs every code path once on a tiny model (CPU, reference
backend, no timing) to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_ms, write_result  # noqa: E402

from quantfuse.encoder import Int8Encoder, pack_mask  # noqa: E402
from quantfuse.kernels import encoder as ke  # noqa: E402
from quantfuse.kernels.configs import arch_key  # noqa: E402

SHAPES = [(1, 128), (8, 128), (32, 128), (128, 128), (32, 384)]
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100,
            max_position_embeddings=512)
COMPILE_BUDGET_S = 80.0
COLUMNS = ["batch", "seq", "tokens", "hf_us", "compile_us", "mode1_us", "mode2_us", "speedup_mode1",
           "speedup_mode2", "packed_us", "padded_us", "packing_speedup", "hf_graph_us", "compile_graph_us",
           "mode1_graph_us", "mode2_graph_us", "graph_speedup_mode1", "graph_speedup_mode2", "packed_graph_us",
           "padded_graph_us", "packing_graph_speedup", "mode2_graph_no_pdl_us",
           "mode2_graph_no_ln_pdl_us", "packed_graph_no_ln_pdl_us", "mode2_graph_no_attn_pdl_us",
           "packed_graph_no_attn_pdl_us", "mode2_graph_one_stream_us", "padded_graph_one_stream_us",
           "dense_half_graph_us", "packing_ceiling"]


def build_model(cfg_kwargs, device, dtype):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(**cfg_kwargs)
    model = BertModel._from_config(cfg, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def random_inputs(batch, seq, vocab, device, lengths=None):
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    if lengths is not None:
        mask = (torch.arange(seq, device=device)[None, :] < lengths.to(device)[:, None]).long()
    return ids, mask


def _us(ms):
    return None if ms is None else round(ms * 1e3, 1)


def _ratio(a, b):
    return None if a is None or b is None else round(a / b, 3)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, each path once, no timing")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    args = parser.parse_args(argv)

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.float16
    cfg_kwargs = TINY if dry else BERT_BASE
    shapes = [(2, 16), (3, 32)] if dry else SHAPES
    vocab = cfg_kwargs["vocab_size"]
    torch.manual_seed(0)
    t_start = time.perf_counter()

    model = build_model(cfg_kwargs, device, dtype)
    calib_seq = 32 if dry else 128
    calib = [random_inputs(8, calib_seq, vocab, device) for _ in range(2)]
    encoders = {mode: Int8Encoder.from_hf(model, calib, mode=mode, calibrator="max") for mode in (1, 2)}
    print(f"built model and encoders in {time.perf_counter() - t_start:.1f} s", flush=True)

    def hf_fn(m):
        def run(ids, mask):
            with torch.no_grad():
                return m(input_ids=ids, attention_mask=mask).last_hidden_state
        return run

    def enc_fn(e, remove_padding):
        def run(ids, mask):
            return e(ids, mask, remove_padding=remove_padding)
        return run

    def timed(fn, sets):
        if dry:
            for s in sets:
                fn(*s)
            return 0.0
        return time_ms(fn, sets, warmup=10, rep=50)

    def graphed(fn, sets):
        """CUDA-graph time (launch overhead excluded, as in a graph-captured engine); None if the callable
        cannot be captured (a host sync inside)."""
        if dry:
            return None
        try:
            return time_ms(fn, sets, graph=True, warmup=10, rep=50)
        except Exception as err:  # noqa: BLE001
            print(f"  graph capture failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
            torch.cuda.synchronize()
            return None

    compiled = None
    if not args.no_compile and not dry:
        import torch._dynamo as dynamo

        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, key):
                setattr(dynamo.config, key, 64)
        compiled = torch.compile(model, dynamic=False)
    compile_spent = last_compile = 0.0

    rows = []
    for batch, seq in shapes:
        sets = [random_inputs(batch, seq, vocab, device) for _ in range(2)]
        hf_ms = timed(hf_fn(model), sets)
        comp_ms = None
        # skip the compile when the last one would push the total past the budget
        if compiled is not None and compile_spent + last_compile <= COMPILE_BUDGET_S:
            t0 = time.perf_counter()
            comp_ms = timed(hf_fn(compiled), sets)
            last_compile = time.perf_counter() - t0
            compile_spent += last_compile
        m1_ms = timed(enc_fn(encoders[1], False), sets)
        m2_ms = timed(enc_fn(encoders[2], False), sets)
        peer = hf_ms if comp_ms is None else min(hf_ms, comp_ms)

        lengths = [torch.randint(seq // 4, 3 * seq // 4 + 1, (batch,)) for _ in range(2)]
        var_sets = [random_inputs(batch, seq, vocab, device, lengths=n) for n in lengths]
        packed_ms = timed(enc_fn(encoders[1], True), var_sets)
        padded_ms = timed(enc_fn(encoders[1], False), var_sets)
        if dry:  # check the paths agree on valid tokens
            ids, mask = var_sets[0]
            v = mask.bool()
            assert torch.equal(encoders[1](ids, mask, remove_padding=True)[v],
                               encoders[1](ids, mask, remove_padding=False)[v])

        m1_g = graphed(enc_fn(encoders[1], False), sets)
        m2_g = graphed(enc_fn(encoders[2], False), sets)
        hf_g = graphed(hf_fn(model), sets)
        comp_g = graphed(hf_fn(compiled), sets) if comp_ms is not None else None
        peer_g = min(t for t in (hf_g, comp_g) if t) if (hf_g or comp_g) else None
        # packing metadata per batch outside the graph (pack_mask syncs the host); the rest captured
        packs = [(ids, mask, pack_mask(mask)) for ids, mask in var_sets]

        def packed_fn(ids, mask, pk):
            return encoders[1](ids, mask, remove_padding=True, packed=pk)

        if dry:  # the graphed packed path's call, once
            packed_fn(*packs[0])
        packed_g = graphed(packed_fn, packs)
        padded_g = graphed(enc_fn(encoders[1], False), var_sets)
        # the most padding removal can give with this engine: mode 1 on full-length sequences of half the length
        # (about the packed token count, nothing to pack or mask), graphed
        half_sets = [random_inputs(batch, max(1, seq // 2), vocab, device) for _ in range(2)]
        half_fn = lambda ids, mask: encoders[1](ids, None, remove_padding=False)  # noqa: E731
        if dry:
            half_fn(*half_sets[0])
        half_g = graphed(half_fn, half_sets)
        # ablation: mode 2 graphed with its kernels launched in plain stream order (no programmatic
        # dependent launch), the same run
        dev = torch.device(device)
        table = ke.ENCODER_CONFIGS[arch_key(dev.type, dev.index)]
        pdl_was = table["pdl_max_tokens"]
        table["pdl_max_tokens"] = 0
        try:
            m2_nopdl_g = graphed(enc_fn(encoders[2], False), sets) if batch * seq <= pdl_was else m2_g
        finally:
            table["pdl_max_tokens"] = pdl_was
        # ablation: the batch on one stream where a captured forward splits it over two (Int8Encoder.forward's
        # streams=None: from the table's stream_split_min_tokens), the same run
        split_from = ke.stream_split_min_tokens(dev) if not dry else 0
        splits = bool(split_from) and batch >= 2 and batch * seq >= split_from
        one_stream = {}
        for key, mode, fn_sets in (("mode2", 2, sets), ("padded", 1, var_sets)):
            one_stream[key] = graphed(lambda ids, mask, e=encoders[mode]: e(ids, mask, remove_padding=False,
                                                                            streams=1), fn_sets) if splits else None
        # ablations: the LayerNorms behind the residual GEMMs, or the attention behind the QKV GEMM, in plain
        # stream order too (the table's pdl_layernorm_max_tokens / pdl_attention_max_tokens set to 0)
        ablated = {}
        for consumer in ("layernorm", "attention"):
            key = f"pdl_{consumer}_max_tokens"
            was = table.get(key, 0)
            table[key] = 0
            try:
                on = batch * seq <= was  # (the packed batch has fewer tokens: timed again whenever was > 0)
                ablated[consumer] = (graphed(enc_fn(encoders[2], False), sets) if on else m2_g,
                                     graphed(packed_fn, packs) if was else packed_g)
            finally:
                table[key] = was

        rows.append({
            "batch": batch, "seq": seq, "tokens": batch * seq,
            "hf_us": _us(hf_ms), "compile_us": _us(comp_ms),
            "mode1_us": _us(m1_ms), "mode2_us": _us(m2_ms),
            "speedup_mode1": _ratio(peer, m1_ms) if not dry else None,
            "speedup_mode2": _ratio(peer, m2_ms) if not dry else None,
            "packed_us": _us(packed_ms), "padded_us": _us(padded_ms),
            "packing_speedup": _ratio(padded_ms, packed_ms) if not dry else None,
            "hf_graph_us": _us(hf_g), "compile_graph_us": _us(comp_g), "mode1_graph_us": _us(m1_g),
            "mode2_graph_us": _us(m2_g),
            "graph_speedup_mode1": _ratio(peer_g, m1_g) if peer_g and m1_g else None,
            "graph_speedup_mode2": _ratio(peer_g, m2_g) if peer_g and m2_g else None,
            "packed_graph_us": _us(packed_g), "padded_graph_us": _us(padded_g),
            "packing_graph_speedup": _ratio(padded_g, packed_g) if packed_g and padded_g else None,
            "mode2_graph_no_pdl_us": _us(m2_nopdl_g),
            "mode2_graph_no_ln_pdl_us": _us(ablated["layernorm"][0]),
            "packed_graph_no_ln_pdl_us": _us(ablated["layernorm"][1]),
            "mode2_graph_no_attn_pdl_us": _us(ablated["attention"][0]),
            "packed_graph_no_attn_pdl_us": _us(ablated["attention"][1]),
            "mode2_graph_one_stream_us": _us(one_stream["mode2"] if splits else m2_g),
            "padded_graph_one_stream_us": _us(one_stream["padded"] if splits else padded_g),
            "dense_half_graph_us": _us(half_g),
            "packing_ceiling": _ratio(padded_g, half_g) if padded_g and half_g else None,
        })
        print(rows[-1], f"({time.perf_counter() - t_start:.0f} s)", flush=True)

    print_table(rows, COLUMNS)
    if dry:
        print(f"dry run ok in {time.perf_counter() - t_start:.1f} s")
        return
    write_result(
        "encoder",
        "INT8 BERT-base encoder (modes 1, 2) vs HF fp16 SDPA eager / torch.compile; padding removal",
        rows,
        columns=COLUMNS,
        notes="BERT-base shape, random weights, fp16 HF model with SDPA attention. Peer = faster of eager and "
        "torch.compile(dynamic=False, default mode). Int8Encoder calibrated (max) on two random 8x128 "
        "batches; mode1/mode2 run the padded path on full-length sequences. packed/padded: mode 1 on "
        "random lengths in [seq/4, 3seq/4], with / without padding removal (packing cost included). "
        "Eager columns: eager launches, do_bench medians. *_graph columns: the same calls replayed from one CUDA "
        "graph (launch overhead excluded), HF fp16 eager and its torch.compile captured the same way; "
        "graph_speedup_modeN against the faster of those two. packed/padded_graph: the varying-length batches "
        "graphed, packing metadata (pack_mask) computed once per batch outside the graph.",
        extra={"compile_seconds": round(compile_spent, 1), "total_seconds": round(time.perf_counter() - t_start, 1)},
    )


if __name__ == "__main__":
    main()
