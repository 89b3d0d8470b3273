"""Cases shared by the CPU (interpreter) and GPU tests of the INT8 encoder: each fused kernel of
`quantfuse.kernels.encoder` against its fake-quant reference in `quantfuse.encoder`, with the same scales."""

from __future__ import annotations

import math

import torch

from quantfuse import encoder as enc
from quantfuse import ops


def make_bert(hidden=64, heads=4, layers=2, intermediate=128, vocab=120, max_pos=512):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate, max_position_embeddings=max_pos)
    return BertModel(cfg).eval()


def random_batch(batch, seq, vocab=120, lengths=None, device="cpu"):
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    if lengths is not None:
        for b, n in enumerate(lengths):
            mask[b, n:] = 0
    return ids, mask


def assert_int8_close(actual: torch.Tensor, expected: torch.Tensor, min_equal: float = 0.999):
    """int8 codes: no element more than one code off, at least `min_equal` of them equal."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.int8
    diff = (actual.int() - expected.int()).abs()
    assert int(diff.max()) <= 1, f"a code differs by {int(diff.max())}"
    equal = float((diff == 0).float().mean())
    assert equal >= min_equal, f"only {equal:.5f} of the codes are equal"


def int8(*shape, device="cpu"):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=device)


def gemm_case(kind, m, n, k, device, heads=2, residual=None, column=False, config=None, split_k=None,
              inputs_seed=None):
    """Run one fused GEMM through the kernel and the reference; returns (kernel, reference) outputs.
    column: per-column requantization / int8-residual scales (a smoothed encoder's epilogues);
    config: a forced (block_m, block_n, block_k, num_warps, num_stages) tile; split_k: forced K splits;
    inputs_seed: draw the inputs from this seed (the same inputs for two calls)."""
    if inputs_seed is not None:
        torch.manual_seed(inputs_seed)
    a = int8(m, k, device=device)
    w = int8(n, k, device=device)
    # scales that put the dequantized values in a range where requantization is non-trivial
    a_scale = enc._f32(0.02)
    w_scale = (torch.rand(n, device=device) * 0.01 + 0.002).float()
    bias = torch.randn(n, device=device).float()
    kwargs = {}
    acc_rms = 127 * 74 * math.sqrt(k) * a_scale * 0.007
    if kind == "qkv":
        hidden = n // 3
        kwargs = dict(out_scale=torch.cat([torch.full((hidden,), acc_rms * f / 40) for f in (1.0, 1.5, 0.7)])
                      .float().to(device), heads=heads, head_dim=hidden // heads, vt_stride=m + 5)
    elif kind == "requant":
        if column:
            out_scale = (acc_rms / 50 * 2.0 ** torch.empty(n, device=device).uniform_(-2, 2)).float()
        else:
            out_scale = torch.tensor([acc_rms / 50], dtype=torch.float32, device=device)
        kwargs = dict(out_scale=out_scale, gelu=True)
    else:
        if residual == "fp16":
            kwargs = dict(residual=(torch.randn(m, n, device=device) * 3).half())
        elif residual == "int8":
            res_scale = (0.03 * 2.0 ** torch.empty(n, device=device).uniform_(-2, 2)).float() if column \
                else enc._f32(0.03)
            kwargs = dict(residual=int8(m, n, device=device), residual_scale=res_scale)
    epilogue = kind
    ref = enc.reference_int8_gemm(a, w, a_scale, w_scale, bias, epilogue, **kwargs)
    with ops.backend("triton"):
        from quantfuse.kernels import encoder as ke

        out = ke.int8_gemm(a, w, a_scale, w_scale, bias, epilogue, config=config, split_k=split_k, **kwargs)
    return out, ref


def assert_gemm_close(kind, out, ref, m, tol=1e-3):
    """A `gemm_case` result against its reference: int8 codes within one code ("qkv": Q|K and the first m
    columns of V^T, whose rows are padded past the tokens; "requant"), fp16 within `tol` ("residual")."""
    if kind == "qkv":
        assert_int8_close(out[0], ref[0])
        assert_int8_close(out[1][:, :, :m], ref[1][:, :, :m])
    elif kind == "requant":
        assert_int8_close(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def attention_case(lengths, heads, head_dim, device, masked_keys=None, padded=False, config=None, aligned=False,
                   vt_pad16=False, p_scale=1.0 / 127, key_words=False):
    """Packed (or padded to max length with a key mask) attention through kernel and reference; config: a
    forced kernel config (e.g. one of ATTENTION_PATHS). aligned: the kernel told that sequences start on
    multiples of 16 (padded to a multiple of 16 only), V^T rows a multiple of 16 long. vt_pad16: V^T rows
    padded to a multiple of 16 columns as the QKV GEMM writes them, random codes past the tokens (the
    kernel walks each sequence's keys from its start rounded down to 16 and must give the extra keys p = 0).
    p_scale: the probabilities' scale (the encoder's 1 / 127; a smaller one makes the kernel clamp the codes).
    key_words: the kernel gets the mask as `attention_key_words` made it (the encoder's form)."""
    assert not aligned or (padded and max(lengths) % 16 == 0)
    if padded:
        s = max(lengths)
        cu = torch.arange(0, (len(lengths) + 1) * s, s, dtype=torch.int32, device=device)
        key_mask = torch.zeros(len(lengths) * s, dtype=torch.int8, device=device)
        for b, n in enumerate(lengths):
            key_mask[b * s: b * s + n] = 1
        max_len = s
    else:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
        key_mask = None
        max_len = max(lengths)
    t = int(cu[-1])
    if masked_keys is not None:
        key_mask = torch.ones(t, dtype=torch.int8, device=device) if key_mask is None else key_mask
        key_mask[masked_keys] = 0
    qk = int8(2, heads, t, head_dim, device=device)
    if vt_pad16:
        vt = int8(heads, head_dim, max(16, -(-t // 16) * 16), device=device)
    else:
        # an odd V^T row length unless aligned (then the next multiple of 16 past t, plus one spare block)
        vt = torch.zeros(heads, head_dim, -(-t // 16) * 16 + 16 if aligned else t + 3, dtype=torch.int8,
                         device=device)
        vt[:, :, :t] = int8(heads, head_dim, t, device=device)
    # score std ~ 127*74*sqrt(d) * s_q s_k / sqrt(d): pick s_q s_k so scores spread over a few units
    args = (qk, vt, cu, max_len, key_mask, 0.02, 3.0 / (74 * 74 * 0.02), 0.05, p_scale, 0.1)
    ref = enc.reference_int8_attention(*args)
    with ops.backend("triton"):
        from quantfuse.kernels import encoder as ke

        if key_words and key_mask is not None:
            args = args[:4] + (ke.attention_key_words(key_mask),) + args[5:]
        out = ke.int8_attention(*args, config=config, aligned_starts=aligned)
    return out, ref, cu, key_mask


# the two kernel paths with small tiles (the interpreter's time grows with the programs)
ATTENTION_PATHS = {
    "one_pass": {"block_m": 32, "num_warps": 4, "num_stages": 1, "one_pass": True},
    "two_pass": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
}


def layernorm_case(m, n, device, write_fp16, with_int8=True):
    y = (torch.randn(m, n, device=device) * 4 + torch.randn(n, device=device)).half()
    gamma = (torch.rand(n, device=device) + 0.5).float()
    beta = (torch.randn(n, device=device) * 0.1).float()
    scale = enc._f32(4.0 / 127) if with_int8 else None
    ref = enc.reference_layernorm_quant(y, gamma, beta, 1e-12, scale, write_fp16)
    with ops.backend("triton"):
        from quantfuse.kernels import encoder as ke

        out = ke.layernorm_quant(y, gamma, beta, 1e-12, scale, write_fp16)
    return out, ref


def embed_case(m, n, device, write_fp16, column=False, vocab=50, max_pos=40, types=2, bad=None, source=None):
    """The embedding-gather LayerNorm (kernel) against the same kernel on the torch-gathered fp16 sum (must
    be bit-identical: the gather changes where y comes from, not the math) and against the reference.
    bad: a row given an out-of-range word id. source: ids / types / positions hold `source` tokens and row r
    is token gather[r] (random, repeats included; with bad, row `bad` gets the out-of-range index `source`)."""
    word = (torch.randn(vocab, n, device=device) * 2).half()
    pos = torch.randn(max_pos, n, device=device).half()
    typ = (torch.randn(types, n, device=device) * 0.5).half()
    count = m if source is None else source
    ids = torch.randint(0, vocab, (count,), device=device)
    tt = torch.randint(0, types, (count,), device=device, dtype=torch.int32)
    positions = torch.randint(0, max_pos, (count,), device=device)
    gather = None if source is None else torch.randint(0, source, (m,), device=device)
    extra = () if gather is None else (gather,)
    gamma = (torch.rand(n, device=device) + 0.5).float()
    beta = (torch.randn(n, device=device) * 0.1).float()
    scale = (enc._f32(4.0 / 127) * 2.0 ** torch.empty(n, device=device).uniform_(-1, 1)).float() if column \
        else 4.0 / 127
    ref = enc.reference_layernorm_quant(word, gamma, beta, 1e-12, scale, write_fp16,
                                        embed=(ids, tt, positions, typ, pos) + extra)
    if bad is not None:
        if gather is None:
            ids[bad] = vocab
        else:
            gather[bad] = source
    with ops.backend("triton"):
        from quantfuse.kernels import encoder as ke

        out = ke.layernorm_quant(word, gamma, beta, 1e-12, scale, write_fp16,
                                 embed=(ids, tt, positions, typ, pos) + extra)
        rows = torch.arange(m, device=device) if gather is None else gather.clamp(max=source - 1)
        ids_ok = ids.clamp(max=vocab - 1)
        emb16 = enc.reference_embedding_sum(word, pos, typ, ids_ok[rows], positions[rows], tt[rows])
        plain = ke.layernorm_quant(emb16, gamma, beta, 1e-12, scale, write_fp16)
    return out, plain, ref
