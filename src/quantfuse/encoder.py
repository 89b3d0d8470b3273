"""A fully fused INT8 transformer encoder for Hugging Face `BertModel`-style models (SPEC section 6).

`Int8Encoder.from_hf(model, calibration_batches, mode=1|2, calibrator=...)` calibrates every activation
the pipeline quantizes (per tensor, from an fp32 pass over the calibration batches), quantizes every
weight per output channel (`s_w[n] = max(amax_n, 1e-10) / 127`) and returns a module whose
`forward(input_ids, attention_mask)` returns the last hidden states [B, S, hidden] in fp16.

Before the first layer one LayerNorm kernel gathers word + position + type embeddings, sums them
(float32, rounded once to fp16), normalises and quantizes; in mode 2 the last layer's
LayerNorm also writes the encoder output as its int8 codes dequantized, fp16(q * s).

One layer, with `x ~ s_in * x_q` its input (fp16 copy `x` too in mode 1):

    qk, v^T  = qkv_gemm(x_q)                 # dequant + bias + head split + requant (s_q, s_k, s_v)
    ctx_q    = attention(qk, v^T)            # int8 QK^T, fp32 masked softmax, int8 P (s_p), P.V,
                                             # dequant + head merge + requant (s_ctx)
    y        = o_gemm(ctx_q) + residual      # residual: fp16 x (mode 1) or s_in * x_q (mode 2)
    h, h_q   = layernorm(y)                  # fp16 h only in mode 1; h_q with s_h
    f_q      = fc1_gemm(h_q)                 # dequant + bias + GELU + requant (s_f)
    y2       = fc2_gemm(f_q) + residual      # residual: fp16 h (mode 1) or s_h * h_q (mode 2)
    x', x'_q = layernorm(y2)                 # x'_q with the next layer's s_in: one layer's output
                                             # scale is the next layer's input scale (per column with
                                             # smoothing, below)

SmoothQuant (`smoothing=alpha`, default 0.8): the three activations that reach an int8 GEMM from a
LayerNorm or from the FC1 epilogue (QKV input x, FC1 input h, FC2 input f) carry BERT's outlier channels,
and one per-tensor int8 scale then leaves the ordinary channels a handful of codes. Per channel c a factor
f_c = max|X_c|^alpha / max|W_{:,c}|^(1-alpha) moves range from the activation to the consumer's weight:
W_{:,c} *= f_c before the per-output-channel weight quantization, and the producing kernel quantizes with
the per-column scale s_x * f_c (the fp16 residual copy of mode 1 is never scaled; mode 2's int8 residuals
are dequantized with the same per-column scales). The GEMMs are unchanged. On all-MiniLM-L6-v2 with the
bundled sentences (percentile calibrator, CPU reference) mean cosine to fp32 goes 0.9885 -> 0.9973
(mode 1) and 0.9812 -> 0.9969 (mode 2); alpha 0.8-1.0 are on a plateau, 0.5 gives 0.9906 / 0.9891, and a
held-out split (calibrate on half the sentences, score the other half) gives the same picture.

Padding removal packs the valid tokens of a batch into one [T, hidden] matrix before the first layer
(attention walks each sequence through `cu_seqlens`) and scatters them back after the last; padded
positions of the result are 0. The padded path (remove_padding=False) runs every position and masks
padded keys; on valid tokens both paths are identical, bit for bit. Its sequences start on multiples of
the padded length, so when that is a multiple of 16 the attention kernel is told (`aligned_starts`) and
loads V^T in aligned 16-byte copies. Packed sequences start anywhere: the kernel walks each one's keys
from its start rounded down to 16 (the keys before it masked; the QKV GEMM pads V^T's rows to 16 columns),
so V^T loads in aligned copies there too.

Streams: a forward captured in a CUDA graph from the kernel table's `stream_split_min_tokens` (9216 on the H100)
runs its batch as two contiguous chunks of sequences, each on its own stream: the graph holds two parallel
branches whose kernels overlap on the GPU (torch.profiler of a 32x384 replay), 2-8% faster from that size on and
slower below it (benchmarks/results/tune_encoder_streams.json). `forward(streams=k)` forces k chunks.

On CUDA tensors (or under `backend("triton")` with the interpreter) the kernels of
`quantfuse.kernels.encoder` run; otherwise the same pipeline runs as a fake-quant PyTorch reference
(`reference_*` below) that uses the same scales and the same integer arithmetic.

Calibrators: "max", and with `quantfuse.calibrate` the histogram methods "percentile", "mse",
"entropy". Softmax probabilities are not calibrated: their scale is fixed at 1/127 (amax 1). A
calibrated amax is set by the calibration sequences' lengths, and a shorter sequence at run time (one
token: p = 1) would then saturate every probability of its rows (seen on the H100: cosine vs the fp32
model fell to 0.92 at length 1 after calibrating at 128).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ._backend import use_triton
from .reference import SCALE_FLOOR, quantize_values, true_div

Tensor = torch.Tensor

CALIBRATORS = ("max", "percentile", "mse", "entropy")
_ACTS_PER_LAYER = ("in", "q", "k", "v", "p", "ctx", "h", "f")


def _f32(value: float) -> float:
    """The float32 value nearest to `value`, as a Python float (kernels receive float32 scalars)."""
    return float(torch.tensor(value, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------
# The fake-quant reference of each fused kernel (same arguments as the launchers)
# ----------------------------------------------------------------------------------------------------
def _int_matmul(a: Tensor, b_t: Tensor) -> Tensor:
    """a @ b_t.T for integer codes, exact (float64 holds every int32 sum), as float32 like the kernels'
    int32 -> float32 conversion."""
    return (a.double() @ b_t.double().T).float()


def _quant(v: Tensor, scale) -> Tensor:
    if isinstance(scale, Tensor):
        return quantize_values(v / scale, torch.int8)
    return quantize_values(true_div(v, scale), torch.int8)


def reference_int8_gemm(a, w, a_scale, w_scale, bias, epilogue, *, out_scale=None, gelu=False, residual=None,
                        residual_scale=1.0, heads=1, head_dim=1, vt_stride=None):
    """`v = float(a_q @ w_q^T) * (s_a * s_w[n]) + bias[n]`, then the epilogue (see kernels.encoder)."""
    acc = _int_matmul(a, w)
    scale = torch.tensor(a_scale, dtype=torch.float32, device=a.device) * w_scale.float()
    v = acc * scale + bias.float()
    if epilogue == "residual":
        if residual is not None:
            r = residual.float()
            if residual.dtype == torch.int8:
                if isinstance(residual_scale, Tensor):  # per-column scales of a smoothed int8 activation
                    r = r * residual_scale.float()
                else:
                    r = r * torch.tensor(residual_scale, dtype=torch.float32, device=a.device)
            v = v + r
        return v.to(torch.float16)
    if epilogue == "requant":
        if gelu:
            v = 0.5 * v * (1.0 + torch.erf(v * 0.7071067811865476))
        return _quant(v, out_scale.float() if out_scale.numel() > 1 else out_scale.reshape(()).float())
    q = _quant(v, out_scale.float())
    m = q.shape[0]
    qkv = q.view(m, 3, heads, head_dim)
    qk = qkv[:, :2].permute(1, 2, 0, 3).contiguous()
    vt_stride = vt_stride or m
    vt = torch.zeros((heads, head_dim, vt_stride), dtype=torch.int8, device=a.device)
    vt[:, :, :m] = qkv[:, 2].permute(1, 2, 0)
    return qk, vt


def reference_int8_attention(qk, vt, cu_seqlens, max_seqlen, key_mask, q_scale, k_scale, v_scale, p_scale,
                             out_scale, aligned_starts=False):
    """Per sequence: s = (Q_q K_q^T) * s_q s_k / sqrt(d) over unmasked keys, p = softmax(s) in float32,
    p_q = sat(rne(p / s_p)), ctx = (P_q V_q) * s_p s_v, out = sat(rne(ctx / s_ctx)) with heads merged.
    A row with no unmasked key gets p = 0. aligned_starts (a layout promise the kernel uses) changes nothing."""
    _, heads, t, d = qk.shape
    out = torch.zeros((t, heads * d), dtype=torch.int8, device=qk.device)
    score_scale = torch.tensor(_f32(q_scale * k_scale / math.sqrt(d)), dtype=torch.float32, device=qk.device)
    ctx_scale = torch.tensor(_f32(p_scale * v_scale), dtype=torch.float32, device=qk.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        st, en = bounds[b], bounds[b + 1]
        if en == st:
            continue
        q = qk[0, :, st:en].double()
        k = qk[1, :, st:en].double()
        v = vt[:, :, st:en].double().transpose(1, 2)
        s = (q @ k.transpose(1, 2)).float() * score_scale
        valid = torch.ones(en - st, dtype=torch.bool, device=qk.device)
        if key_mask is not None:
            valid = key_mask[st:en] != 0
        s = s.masked_fill(~valid.view(1, 1, -1), float("-inf"))
        row_max = s.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max)
        denom = e.sum(-1, keepdim=True)
        p = torch.where(denom > 0, e / denom.clamp_min(1e-30), torch.zeros_like(e))
        p_q = _quant(p, _f32(p_scale))
        ctx = (p_q.double() @ v).float() * ctx_scale
        out[st:en] = _quant(ctx, _f32(out_scale)).permute(1, 0, 2).reshape(en - st, heads * d)
    return out


def _rows_or_nan(table: Tensor, index: Tensor) -> Tensor:
    """table[index] as float32, NaN rows where index is outside [0, rows) (the kernel's rule: never a wrapped
    negative index or an out-of-bounds read)."""
    index = index.long()
    ok = (index >= 0) & (index < table.shape[0])
    rows = table[torch.where(ok, index, 0)].float()
    return torch.where(ok[..., None], rows, float("nan"))


def reference_embedding_sum(word, pos, typ, ids, positions, types):
    """fp16(word[ids] + pos[positions] + type[types]): the fp16 table rows summed in float32 in that order,
    one rounding to fp16 at the end (the encoder's embedding LayerNorm kernel computes the same); an index
    outside its table gives a NaN row."""
    return (_rows_or_nan(word, ids) + _rows_or_nan(pos, positions) + _rows_or_nan(typ, types)).to(torch.float16)


def reference_layernorm_quant(y, gamma, beta, eps, out_scale, write_fp16, embed=None, dequant_fp16=False,
                              out_fp16=None, scatter=None):
    """o = (y - mean) / sqrt(var + eps) * gamma + beta per row (float32); fp16 copy if asked; int8
    sat(rne(o' / s_out)) with o' the fp16 copy when written, else o. embed = (input_ids, token_type_ids,
    positions, type_table, pos_table[, gather]): y is the word table and the rows fp16(word[ids] + pos[positions]
    + type[types]), summed in float32 in that order (with gather, row r is token gather[r]). dequant_fp16: the
    fp16 output is fp16(float(q) * s_out). out_fp16: the fp16 output copied into this tensor, which is returned;
    with scatter (int [T], T <= M), row r < T of the fp16 output goes to row scatter[r] of out_fp16 (destinations
    outside its rows dropped) and the rest of out_fp16 is left as it was."""
    if embed is not None:
        ids, types, positions, type_emb, pos_emb = embed[:5]
        if len(embed) == 6:  # row r is token gather[r]; an index outside [0, tokens) gets id -1: a NaN row
            gather = embed[5].long()
            ok = (gather >= 0) & (gather < ids.numel())
            gather = torch.where(ok, gather, 0)
            ids = torch.where(ok, ids[gather].long(), -1)
            types, positions = types[gather], positions[gather]
        y = reference_embedding_sum(y, pos_emb, type_emb, ids, positions, types)
    yf = y.float()
    centered = yf - yf.mean(-1, keepdim=True)
    var = (centered * centered).mean(-1, keepdim=True)
    o = centered * (1.0 / torch.sqrt(var + eps)) * gamma.float() + beta.float()
    out16 = None
    if write_fp16:
        out16 = o.to(torch.float16)
        o = out16.float()
    if out_scale is None:
        out8 = None
    elif isinstance(out_scale, Tensor):  # per-column scales (smoothing folded into the consumer's weight)
        out8 = _quant(o, out_scale.float())
    else:
        out8 = _quant(o, _f32(out_scale))
    if dequant_fp16:
        out16 = (out8.float() * _f32(out_scale)).to(torch.float16)
    if scatter is not None:
        rows = out16[:scatter.numel()]
        dest = scatter.long()
        ok = (dest >= 0) & (dest < out_fp16.shape[0])
        out_fp16[dest[ok]] = rows[ok]
        out16 = out_fp16
    elif out_fp16 is not None:
        out16 = out_fp16.copy_(out16)
    return out16, out8


class _ReferenceOps:
    int8_gemm = staticmethod(reference_int8_gemm)
    int8_attention = staticmethod(reference_int8_attention)
    attention_key_words = staticmethod(lambda key_mask: key_mask)
    layernorm_quant = staticmethod(reference_layernorm_quant)
    stream_split_min_tokens = staticmethod(lambda device: 0)


def _ops_for(x: Tensor):
    if use_triton(x):
        from .kernels import encoder as kernels

        return kernels
    return _ReferenceOps


# ----------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------
class _LocalMax:
    def __init__(self):
        self.amax = 0.0

    def collect(self, x):
        if x.numel():
            self.amax = max(self.amax, float(x.detach().abs().max()))

    def compute_amax(self, *args, **kwargs):
        return torch.tensor(self.amax)


def _make_calibrator(method: str, is_probability: bool):
    if method == "max" or is_probability:
        try:
            from .calibrate import MaxCalibrator

            return MaxCalibrator()
        except ImportError:
            return _LocalMax()
    from .calibrate import HistogramCalibrator  # the histogram methods need helper D's calibrators

    return HistogramCalibrator(num_bins=2048)


def _amax(cal, method: str, percentile: float, is_probability: bool) -> float:
    if is_probability:
        return 1.0  # see the module docstring
    if method == "max":
        return float(cal.compute_amax())
    if method == "percentile":
        return float(cal.compute_amax("percentile", percentile=percentile))
    return float(cal.compute_amax(method))


_SMOOTHED = ("in", "h", "f")  # activations whose int8 producer is a LayerNorm or the FC1 epilogue


@torch.no_grad()
def _smoothing_factors(fp: "_FloatParams", batches, alpha: float) -> Dict[str, List[Tensor]]:
    """SmoothQuant factors per layer for the QKV input ("in"), FC1 input ("h") and FC2 input ("f"), from
    per-channel maxima of those activations over the valid tokens of `batches`."""
    from .calibrate import MaxCalibrator, smoothquant_factors

    n = len(fp.layers)
    cals = {(name, i): MaxCalibrator(axis=-1) for name in _SMOOTHED for i in range(n)}

    def observe(name, i, x, mask):
        if name in _SMOOTHED and i < n:
            cals[(name, i)].collect(x[mask] if mask is not None else x)

    for ids, mask, tt in batches:
        _float_forward(fp, ids, mask, tt, observe)
    consumers = {"in": lambda lp: [lp["wq"], lp["wk"], lp["wv"]], "h": lambda lp: [lp["w1"]],
                 "f": lambda lp: [lp["w2"]]}
    return {name: [smoothquant_factors(cals[(name, i)].compute_amax().reshape(-1), consumers[name](lp), alpha)
                   for i, lp in enumerate(fp.layers)]
            for name in _SMOOTHED}


def _scale_of(amax: float) -> float:
    return _f32(max(amax, SCALE_FLOOR) / 127.0)


def _quantize_weight(w: Tensor):
    """Per output channel: s[n] = max(amax_n, 1e-10) / 127, q = sat(rne(w / s))."""
    w = w.detach().float()
    scale = true_div(w.abs().amax(dim=1).clamp_min(SCALE_FLOOR), 127.0)
    return quantize_values(w / scale[:, None], torch.int8), scale


# ----------------------------------------------------------------------------------------------------
# The fp32 model (same math as HF BertModel, eager attention) used to observe activations
# ----------------------------------------------------------------------------------------------------
def _hf_parts(model):
    bert = model
    if not hasattr(bert, "encoder") and hasattr(bert, "bert"):
        bert = bert.bert
    embeddings = getattr(bert, "embeddings", None)
    if not isinstance(bert, torch.nn.Module) or not hasattr(getattr(bert, "encoder", None), "layer") \
            or not hasattr(embeddings, "position_embeddings") or not hasattr(bert, "config"):
        raise ValueError(f"model: expected a BERT-style Hugging Face model (embeddings with position_embeddings, "
                         f"encoder.layer), got {type(model).__name__}")
    if getattr(embeddings.position_embeddings, "padding_idx", None) is not None:
        # RoBERTa / XLM-R: positions start at padding_idx + 1 and skip padding; this encoder uses 0..S-1
        raise ValueError(f"model: expected BERT position embeddings (positions 0..S-1), got "
                         f"{type(bert).__name__}'s, which count from padding_idx + 1 (RoBERTa-style)")
    if len(bert.encoder.layer) == 0:
        raise ValueError("model: expected at least one encoder layer, got none")
    cfg = bert.config
    if getattr(cfg, "hidden_act", "gelu") != "gelu":
        raise ValueError(f"model: expected hidden_act 'gelu' (erf GELU), got {cfg.hidden_act!r}")
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"model: expected position_embedding_type 'absolute', got {cfg.position_embedding_type!r}"
        )
    heads = cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"model: expected a power-of-two head size >= 16, got {head_dim}")
    return bert, cfg


def _float_forward(params: "_FloatParams", input_ids, attention_mask, token_type_ids, observe=None):
    """fp32 forward of the source model; observe(name, layer, tensor, valid_mask) sees every activation
    the int8 pipeline quantizes."""
    b, s = input_ids.shape
    mask = attention_mask.bool()
    pos = torch.arange(s, device=input_ids.device).expand(b, s)
    x = params.word[input_ids] + params.pos[pos] + params.type[token_type_ids]
    x = F.layer_norm(x, (params.hidden,), params.emb_ln_w, params.emb_ln_b, params.eps)
    heads, d = params.heads, params.hidden // params.heads
    additive = torch.zeros((b, 1, 1, s), device=x.device).masked_fill(~mask.view(b, 1, 1, s), float("-inf"))
    note = observe or (lambda *a: None)
    for i, lp in enumerate(params.layers):
        note("in", i, x, mask)
        q = F.linear(x, lp["wq"], lp["bq"])
        k = F.linear(x, lp["wk"], lp["bk"])
        v = F.linear(x, lp["wv"], lp["bv"])
        note("q", i, q, mask)
        note("k", i, k, mask)
        note("v", i, v, mask)
        qh, kh, vh = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(d) + additive
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        note("p", i, probs, None)
        ctx = (probs @ vh).transpose(1, 2).reshape(b, s, params.hidden)
        note("ctx", i, ctx, mask)
        h = F.layer_norm(F.linear(ctx, lp["wo"], lp["bo"]) + x, (params.hidden,), lp["ln1_w"], lp["ln1_b"], params.eps)
        note("h", i, h, mask)
        f = F.gelu(F.linear(h, lp["w1"], lp["b1"]))
        note("f", i, f, mask)
        x = F.layer_norm(F.linear(f, lp["w2"], lp["b2"]) + h, (params.hidden,), lp["ln2_w"], lp["ln2_b"], params.eps)
    note("out", len(params.layers), x, mask)
    return x


@dataclass
class _FloatParams:
    word: Tensor
    pos: Tensor
    type: Tensor
    emb_ln_w: Tensor
    emb_ln_b: Tensor
    hidden: int
    heads: int
    eps: float
    layers: List[Dict[str, Tensor]] = field(default_factory=list)

    @classmethod
    def from_hf(cls, bert, cfg, device):
        def t(p):
            return p.detach().to(device=device, dtype=torch.float32)

        emb = bert.embeddings
        params = cls(
            word=t(emb.word_embeddings.weight), pos=t(emb.position_embeddings.weight),
            type=t(emb.token_type_embeddings.weight), emb_ln_w=t(emb.LayerNorm.weight),
            emb_ln_b=t(emb.LayerNorm.bias), hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
            eps=float(cfg.layer_norm_eps),
        )
        for layer in bert.encoder.layer:
            att = layer.attention
            params.layers.append({
                "wq": t(att.self.query.weight), "bq": t(att.self.query.bias),
                "wk": t(att.self.key.weight), "bk": t(att.self.key.bias),
                "wv": t(att.self.value.weight), "bv": t(att.self.value.bias),
                "wo": t(att.output.dense.weight), "bo": t(att.output.dense.bias),
                "ln1_w": t(att.output.LayerNorm.weight), "ln1_b": t(att.output.LayerNorm.bias),
                "w1": t(layer.intermediate.dense.weight), "b1": t(layer.intermediate.dense.bias),
                "w2": t(layer.output.dense.weight), "b2": t(layer.output.dense.bias),
                "ln2_w": t(layer.output.LayerNorm.weight), "ln2_b": t(layer.output.LayerNorm.bias),
            })
        return params


def _batch_fields(batch, device):
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        tt = batch.get("token_type_ids")
    elif isinstance(batch, (tuple, list)):
        ids = batch[0]
        mask = batch[1] if len(batch) > 1 else None
        tt = batch[2] if len(batch) > 2 else None
    else:
        ids, mask, tt = batch, None, None
    if not isinstance(ids, Tensor) or ids.dim() != 2 or 0 in ids.shape:
        raise ValueError(f"calibration_batches: expected input_ids of shape [batch, seq] (non-empty) in each batch, "
                         f"got {getattr(ids, 'shape', type(ids).__name__)}")
    ids = ids.to(device)
    mask = torch.ones_like(ids) if mask is None else mask.to(device)
    tt = torch.zeros_like(ids) if tt is None else tt.to(device)
    return ids, mask, tt


# ----------------------------------------------------------------------------------------------------
# The encoder
# ----------------------------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """Where the valid tokens of a padded [B, S] batch live once packed (computed once per mask)."""
    indices: Tensor      # int64 [T]: flat positions b * S + s of the valid tokens, in order
    cu_seqlens: Tensor   # int32 [B + 1]
    max_seqlen: int
    batch: int
    seq_len: int
    # int64 [T rounded up to 16]: `indices`, then copies of position 0 (rows outside every sequence)
    gather: Optional[Tensor] = None
    # cu_seqlens on the host (pack_mask reads it back anyway): where each row chunk's tokens start, so a forward
    # split over streams slices the batch without a host synchronisation (CUDA-graph capturable)
    cu_host: Optional[Tuple[int, ...]] = None


# The packed layers run on a token count rounded up to this (the extra rows belong to no sequence: the
# attention never reads them as keys with p != 0, and every other kernel is row-wise): the GEMMs' row
# masks are then constant over 16 rows, as at the padded path's token counts (H100, BERT-base FC2 at 2143
# tokens 19.2 us vs 17.5 at 2160).
_TOKEN_ROUND = 16


def pack_mask(attention_mask: Tensor) -> PackedBatch:
    """Valid tokens of each sequence (attention_mask != 0, any positions) packed in order."""
    b, s = attention_mask.shape
    valid = attention_mask.reshape(-1) != 0
    indices = torch.nonzero(valid).reshape(-1)
    lengths = (attention_mask != 0).sum(1)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=attention_mask.device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    gather = torch.cat([indices, indices.new_zeros(-indices.numel() % _TOKEN_ROUND)])
    cu_host = tuple(int(v) for v in cu.tolist())
    return PackedBatch(indices, cu, _max_length(cu_host, 0, b), b, s, gather, cu_host)


def _max_length(cu_host: Tuple[int, ...], r0: int, r1: int) -> int:
    """The longest of sequences r0 .. r1 - 1 (0 for none)."""
    return max((cu_host[i + 1] - cu_host[i] for i in range(r0, r1)), default=0)


def _row_chunks(b: int, parts: int) -> List[Tuple[int, int]]:
    """[r0, r1) ranges of `parts` contiguous chunks of b rows, sizes within one of each other (longer first)."""
    step, extra = divmod(b, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + step + (j < extra))
    return list(zip(bounds[:-1], bounds[1:]))


# side streams of split forwards, per CUDA device, made once and reused (graph branches need no new ones)
_SIDE_STREAMS: Dict[int, List["torch.cuda.Stream"]] = {}


def _side_streams(device: torch.device, main: "torch.cuda.Stream", count: int) -> List["torch.cuda.Stream"]:
    """`count` streams of `device`, distinct from `main` and from each other. torch.cuda.Stream() hands out
    PyTorch's pool of 32 streams per priority in turn, so a stream made earlier can be the very stream a later
    graph capture runs on (seen in a bench_encoder run: the "side" half then launched into the capture stream, the
    two halves in series, 11% slower than one batch)."""
    pool = _SIDE_STREAMS.setdefault(torch.cuda.current_device() if device.index is None else device.index, [])
    taken = {main.cuda_stream}
    sides = []
    for candidate in pool:
        if len(sides) == count:
            break
        if candidate.cuda_stream not in taken:
            sides.append(candidate)
            taken.add(candidate.cuda_stream)
    while len(sides) < count:
        candidate = torch.cuda.Stream(device=device)
        if candidate.cuda_stream not in taken:
            pool.append(candidate)
            sides.append(candidate)
            taken.add(candidate.cuda_stream)
    return sides


def _in_streams(device: torch.device, chunks: List[Tuple[int, int]], run) -> None:
    """run(r0, r1) for each row chunk: the first on the current stream, the others each on a side stream forked
    from it and joined back before returning (under CUDA-graph capture: parallel branches of the graph). On the
    CPU, or with one chunk, in order."""
    if device.type != "cuda" or len(chunks) == 1:
        for r0, r1 in chunks:
            run(r0, r1)
        return
    main = torch.cuda.current_stream(device)
    sides = _side_streams(device, main, len(chunks) - 1)
    for side, (r0, r1) in zip(sides, chunks[1:]):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run(r0, r1)
    run(*chunks[0])
    for side in sides:
        main.wait_stream(side)


class Int8Encoder(torch.nn.Module):
    """INT8 BERT encoder; build with `from_hf`. Buffers move with `.to(device)`."""

    def __init__(self, fp: _FloatParams, scales: Dict[str, List[float]], mode: int, calibrator: str,
                 smooth: Optional[Dict[str, List[Tensor]]] = None, smoothing: Optional[float] = None):
        super().__init__()
        if mode not in (1, 2):
            raise ValueError(f"mode: expected 1 (fp16 residual/output) or 2 (int8 residual/output), got {mode!r}")
        self.mode = mode
        self.calibrator = calibrator
        self._padded_cache: Dict[tuple, Tuple[Tensor, Tensor, Tensor]] = {}
        self.hidden = fp.hidden
        self.heads = fp.heads
        self.head_dim = fp.hidden // fp.heads
        self.eps = fp.eps
        self.num_layers = len(fp.layers)
        self.scales = scales  # name -> per-layer float32 scales (python floats)
        self.smoothing = smoothing  # SmoothQuant alpha, or None
        self.register_buffer("word_emb", fp.word.half())
        self.register_buffer("pos_emb", fp.pos.half())
        self.register_buffer("token_type", fp.type.half())
        self.register_buffer("emb_ln_w", fp.emb_ln_w.clone())
        self.register_buffer("emb_ln_b", fp.emb_ln_b.clone())
        for i, lp in enumerate(fp.layers):
            if smooth is not None:
                # SmoothQuant folded exactly: the consumer's weight columns times the factor, the producer's
                # int8 output divided by it through per-column quantization scales s_x * factor[c].
                lp = dict(lp)
                for key in ("wq", "wk", "wv"):
                    lp[key] = lp[key] * smooth["in"][i][None, :]
                lp["w1"] = lp["w1"] * smooth["h"][i][None, :]
                lp["w2"] = lp["w2"] * smooth["f"][i][None, :]
            for name, width in (("in", fp.hidden), ("h", fp.hidden), ("f", lp["w1"].shape[0])):
                col = torch.full((width,), scales[name][i], dtype=torch.float32, device=fp.word.device)
                if smooth is not None:
                    col = col * smooth[name][i]
                self.register_buffer(f"l{i}_{name}_cs", col.contiguous())
            w_qkv = torch.cat([lp["wq"], lp["wk"], lp["wv"]], 0)
            for name, w, bias in (("qkv", w_qkv, torch.cat([lp["bq"], lp["bk"], lp["bv"]])),
                                  ("o", lp["wo"], lp["bo"]), ("fc1", lp["w1"], lp["b1"]), ("fc2", lp["w2"], lp["b2"])):
                q, s = _quantize_weight(w)
                self.register_buffer(f"l{i}_{name}_w", q)
                self.register_buffer(f"l{i}_{name}_ws", s)
                self.register_buffer(f"l{i}_{name}_b", bias.float().clone())
            h = fp.hidden
            qkv_out = torch.cat([torch.full((h,), scales[k][i]) for k in ("q", "k", "v")]).float()
            self.register_buffer(f"l{i}_qkv_os", qkv_out)
            for name in ("ln1_w", "ln1_b", "ln2_w", "ln2_b"):
                self.register_buffer(f"l{i}_{name}", lp[name].clone())

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_hf(cls, model, calibration_batches: Iterable, mode: int = 1, calibrator: str = "percentile",
                percentile: float = 99.99, device=None, smoothing: Optional[float] = 0.8) -> "Int8Encoder":
        """Calibrate on `calibration_batches` (dicts with input_ids / attention_mask / token_type_ids,
        tuples (input_ids, attention_mask[, token_type_ids]) or bare input_ids tensors), quantize, return
        the encoder on `device` (default: the model's).

        smoothing: SmoothQuant alpha for the three activations that feed int8 GEMMs from a LayerNorm or a
        GELU (QKV and FC1 inputs, FC2 input): per channel c, f_c = max|X_c|^alpha / max|W_{:,c}|^(1-alpha)
        (`calibrate.smoothquant_factors`, from a first pass), W_{:,c} *= f_c, and the producing kernel
        quantizes X_c / f_c with the per-tensor scale calibrated on X / f (second pass). Exact algebra;
        only where the rounding happens moves. None: plain per-tensor quantization."""
        if mode not in (1, 2):
            raise ValueError(f"mode: expected 1 or 2, got {mode!r}")
        if calibrator not in CALIBRATORS:
            raise ValueError(f"calibrator: expected one of {CALIBRATORS}, got {calibrator!r}")
        if smoothing is not None and (isinstance(smoothing, bool) or not isinstance(smoothing, (int, float))
                                      or not 0.0 <= smoothing <= 1.0):
            raise ValueError(f"smoothing: expected None or a SmoothQuant alpha in [0, 1], got {smoothing!r}")
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
            raise ValueError(f"percentile: expected a number in (0, 100], got {percentile!r}")
        if isinstance(calibration_batches, Tensor):
            raise TypeError("calibration_batches: expected an iterable of batches (e.g. a list of input_ids tensors "
                            "or dicts), got one Tensor; wrap it in a list")
        bert, cfg = _hf_parts(model)
        src_device = next(bert.parameters()).device
        device = torch.device(device) if device is not None else src_device
        fp = _FloatParams.from_hf(bert, cfg, src_device)
        n = len(fp.layers)
        batches = [_batch_fields(batch, src_device) for batch in calibration_batches]
        if not batches:
            raise ValueError("calibration_batches: expected at least one batch, got none")
        smooth = None
        if smoothing is not None:
            smooth = _smoothing_factors(fp, batches, float(smoothing))
        cals = {(name, i): _make_calibrator(calibrator, name == "p") for name in _ACTS_PER_LAYER for i in range(n)}
        cals[("out", n)] = _make_calibrator(calibrator, False)

        def observe(name, i, x, mask):
            if name == "in" and ("in", i) not in cals:
                return
            x = x[mask] if mask is not None else x
            if smooth is not None and name in _SMOOTHED:
                x = x / smooth[name][i]
            cals[(name, i)].collect(x)

        for ids, mask, tt in batches:
            _float_forward(fp, ids, mask, tt, observe)
        scales = {name: [_scale_of(_amax(cals[(name, i)], calibrator, percentile, name == "p")) for i in range(n)]
                  for name in _ACTS_PER_LAYER}
        # one layer's output scale is the next layer's input scale
        scales["in"].append(_scale_of(_amax(cals[("out", n)], calibrator, percentile, False)))
        enc = cls(fp, scales, mode, calibrator, smooth, None if smoothing is None else float(smoothing))
        return enc.to(device)

    # -- forward -----------------------------------------------------------------------------------
    def _layers(self, input_ids: Tensor, token_type_ids: Tensor, positions: Tensor, cu_seqlens: Tensor,
                max_seqlen: int, key_mask: Optional[Tensor], aligned_starts: bool = False,
                gather: Optional[Tensor] = None, out: Optional[Tensor] = None,
                scatter: Optional[Tensor] = None) -> Tensor:
        """Tokens [T] (ids, token types, positions) -> the last layer's hidden states [T, H] fp16 (written into
        `out`, a contiguous fp16 [T, H], where given). With gather (int64 [T]), token r is entry gather[r] of ids /
        types / positions (the padded batch's flat tokens). With scatter (int64 [T'], T' <= T) and out (fp16
        [R, H]), the last LayerNorm writes token r < T' into row scatter[r] of out, which is returned."""
        ops = _ops_for(self.word_emb)
        mode1 = self.mode == 1
        s_in = self.scales["in"]
        # the embedding sum, its LayerNorm and the first quantization in one kernel (and the packed path's
        # token selection: no torch gathers)
        embed = (input_ids.contiguous(), token_type_ids.contiguous(), positions.contiguous(), self.token_type,
                 self.pos_emb) + (() if gather is None else (gather,))
        x16, xq = ops.layernorm_quant(self.word_emb, self.emb_ln_w, self.emb_ln_b, self.eps, self.l0_in_cs, mode1,
                                      embed=embed, out_fp16=out if self.num_layers == 0 else None,
                                      scatter=scatter if self.num_layers == 0 else None)
        t = input_ids.numel() if gather is None else gather.numel()
        if key_mask is not None:
            key_mask = ops.attention_key_words(key_mask)  # once per forward, not per layer
        for i in range(self.num_layers):
            g = lambda name: getattr(self, f"l{i}_{name}")  # noqa: E731
            sc = {k: self.scales[k][i] for k in _ACTS_PER_LAYER}
            qk, vt = ops.int8_gemm(xq, g("qkv_w"), sc["in"], g("qkv_ws"), g("qkv_b"), "qkv", out_scale=g("qkv_os"),
                                   heads=self.heads, head_dim=self.head_dim, vt_stride=max(16, -(-t // 16) * 16))
            ctx = ops.int8_attention(qk, vt, cu_seqlens, max_seqlen, key_mask, sc["q"], sc["k"], sc["v"], sc["p"],
                                     sc["ctx"], aligned_starts=aligned_starts)
            y = ops.int8_gemm(ctx, g("o_w"), sc["ctx"], g("o_ws"), g("o_b"), "residual",
                              residual=x16 if mode1 else xq, residual_scale=g("in_cs"))
            h16, hq = ops.layernorm_quant(y, g("ln1_w"), g("ln1_b"), self.eps, g("h_cs"), mode1)
            fq = ops.int8_gemm(hq, g("fc1_w"), sc["h"], g("fc1_ws"), g("fc1_b"), "requant", out_scale=g("f_cs"),
                               gelu=True)
            y2 = ops.int8_gemm(fq, g("fc2_w"), sc["f"], g("fc2_ws"), g("fc2_b"), "residual",
                               residual=h16 if mode1 else hq, residual_scale=g("h_cs"))
            last = i == self.num_layers - 1
            if last:
                # the encoder's output: per tensor (no consumer weight to fold a factor into)
                next_scale = None if mode1 else s_in[i + 1]
            else:
                next_scale = getattr(self, f"l{i + 1}_in_cs")
            # mode 2's output is its last int8 activation dequantized, written by the same kernel
            x16, xq = ops.layernorm_quant(y2, g("ln2_w"), g("ln2_b"), self.eps, next_scale, mode1,
                                          dequant_fp16=last and not mode1, out_fp16=out if last else None,
                                          scatter=scatter if last else None)
        return x16

    def forward_packed(self, input_ids: Tensor, token_type_ids: Tensor, positions: Tensor, cu_seqlens: Tensor,
                       max_seqlen: int) -> Tensor:
        """Packed tokens [T] (ids, token types, positions within their sequence) -> hidden states [T, H] fp16.
        No host synchronisation: capturable in a CUDA graph. Tokens past cu_seqlens[-1] (up to T) belong to no
        sequence; their rows come back unspecified (`forward` rounds T up to a multiple of 16 with such rows)."""
        return self._layers(input_ids, token_type_ids, positions, cu_seqlens, max_seqlen, None)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, remove_padding: bool = True,
                packed: Optional[PackedBatch] = None, streams: Optional[int] = None) -> Tensor:
        """Last hidden states [B, S, hidden] (fp16). remove_padding packs the valid tokens (padded
        positions come back as 0); otherwise every position runs and padded keys are masked.

        streams: how many contiguous chunks of the batch's sequences run the layers at once, each on its own CUDA
        stream (parallel branches of a captured graph). None: two where the kernel table says a split pays off
        (`stream_split_min_tokens`: from 9216 tokens on the H100) and the call is being captured in a CUDA graph
        (eager, the doubled kernel launches would cost more host time than the overlap saves), else one. Each
        chunk is exactly the forward of that sub-batch alone; its GEMMs may pick other tiles than the whole
        batch's, so an int8 code can differ by one at a rounding tie between a split and an unsplit forward."""
        if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 1):
            raise ValueError(f"streams: expected None (automatic) or an int >= 1, got {streams!r}")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids: expected a non-empty [batch, seq] tensor, "
                             f"got {getattr(input_ids, 'shape', input_ids)!r}")
        b, s = input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (b, s):
            raise ValueError(f"attention_mask: expected shape {(b, s)}, got {tuple(attention_mask.shape)}")
        if token_type_ids is not None and tuple(token_type_ids.shape) != (b, s):
            raise ValueError(f"token_type_ids: expected shape {(b, s)}, got {tuple(token_type_ids.shape)}")
        if packed is not None and (packed.batch, packed.seq_len) != (b, s):
            raise ValueError(f"packed: made for a [{packed.batch}, {packed.seq_len}] batch, input_ids is "
                             f"[{b}, {s}]")
        # positions, zero token types and the padded sequence starts depend on (b, s) only; the packed path
        # picks its tokens out of these and out of the ids in the embedding kernel (through `gather`)
        positions, zero_types, cu = self._padded_constants(b, s, input_ids.device)
        types = zero_types if token_type_ids is None else token_type_ids.reshape(-1)
        dev = input_ids.device
        if not remove_padding:
            parts = self._stream_parts(streams, b, b * s, dev)
            if parts > 1:
                out = torch.empty((b, s, self.hidden), dtype=torch.float16, device=dev)

                def run(r0, r1):
                    positions_c, _, cu_c = self._padded_constants(r1 - r0, s, dev)
                    mask_c = None if attention_mask is None else attention_mask[r0:r1]
                    # the chunk's last LayerNorm writes its rows of `out` (no copy)
                    self._padded_layers(input_ids[r0:r1], types[r0 * s:r1 * s], positions_c, cu_c, mask_c,
                                        out=out[r0:r1])

                _in_streams(dev, _row_chunks(b, parts), run)
                return out
            return self._padded_layers(input_ids, types, positions, cu, attention_mask)
        pk = packed or pack_mask(torch.ones_like(input_ids) if attention_mask is None else attention_mask)
        idx = pk.indices
        gather = pk.gather if pk.gather is not None else idx
        ids = input_ids.reshape(-1)
        out = torch.zeros((b * s, self.hidden), dtype=torch.float16, device=dev)
        parts = self._stream_parts(streams, b, idx.numel(), dev)
        if parts > 1 and pk.cu_host is None:
            if streams is None:
                parts = 1  # automatic: a PackedBatch made elsewhere, without host offsets, runs whole
            elif dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError("packed: a forward split over streams under CUDA-graph capture needs the host "
                                 "offsets that pack_mask records (cu_host); this PackedBatch has none")
            else:
                pk = dataclasses.replace(pk, cu_host=tuple(int(v) for v in pk.cu_seqlens.tolist()))
        if parts == 1:
            # the last LayerNorm writes each token straight into its padded row (no index_put after it)
            self._layers(ids, types, positions, pk.cu_seqlens, pk.max_seqlen, None, gather=gather, out=out,
                         scatter=idx)
            return out.view(b, s, self.hidden)

        def run_packed(r0, r1):
            start, end = pk.cu_host[r0], pk.cu_host[r1]
            if end == start:
                return
            # the chunk's rows rounded up to _TOKEN_ROUND with position 0, as pack_mask rounds the whole batch (the
            # same kernel specializations: no compilation inside a graph capture)
            gather_c = F.pad(idx[start:end], (0, -(end - start) % _TOKEN_ROUND))
            self._layers(ids, types, positions, pk.cu_seqlens[r0:r1 + 1] - start, _max_length(pk.cu_host, r0, r1),
                         None, gather=gather_c, out=out, scatter=idx[start:end])

        _in_streams(dev, _row_chunks(b, parts), run_packed)
        return out.view(b, s, self.hidden)

    def _padded_layers(self, input_ids: Tensor, types: Tensor, positions: Tensor, cu: Tensor,
                       attention_mask: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
        """The padded path on a [b, s] batch: every position runs, padded keys masked; [b, s, hidden] fp16 (into
        `out`, contiguous, where given)."""
        b, s = input_ids.shape
        # no mask: every key attends (the kernels skip the mask); else True = attend (the layers turn it into the
        # attention's key words once)
        key_mask = None if attention_mask is None else attention_mask.reshape(-1) != 0
        # cu holds multiples of s: the attention may assume 16-aligned sequence starts when s is a multiple of 16
        return self._layers(input_ids.reshape(-1), types, positions, cu, s, key_mask, aligned_starts=s % 16 == 0,
                            out=None if out is None else out.view(b * s, self.hidden)).view(b, s, self.hidden)

    def _stream_parts(self, streams: Optional[int], b: int, tokens: int, device: torch.device) -> int:
        """How many row chunks (streams) a forward of b sequences and `tokens` rows runs as (`forward`'s
        streams)."""
        if streams is not None:
            return max(1, min(streams, b))
        if b < 2 or device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return 1
        threshold = _ops_for(self.word_emb).stream_split_min_tokens(device)
        return 2 if threshold and tokens >= threshold else 1

    def _padded_constants(self, b: int, s: int, device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
        """(positions int64 [b * s], zero token types int64 [b * s], cu_seqlens int32 [b + 1]) of a padded
        [b, s] batch, kept per (b, s, device) so that a forward launches no kernels to rebuild them (each one a
        launch in a CUDA graph). Not kept while a CUDA graph is being captured: memory allocated there belongs
        to the graph's pool."""
        key = (b, s, str(device))
        cache = self.__dict__.setdefault("_padded_cache", {})  # a module pickled before the cache existed has none
        hit = cache.get(key)
        if hit is not None:
            return hit
        made = (torch.arange(s, device=device).repeat(b), torch.zeros(b * s, dtype=torch.int64, device=device),
                torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(cache) >= 16:
                cache.pop(next(iter(cache)))
            cache[key] = made
        return made
