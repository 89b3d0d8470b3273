"""GPU tests of the INT8 encoder kernels at full sizes (BERT-base widths, sequence lengths up to 384):
each fused kernel against its fake-quant reference on the same device, and the whole encoder
(triton vs reference, padding removal vs padded path, fully masked rows)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _encoder_util as u  # noqa: E402
from quantfuse import ops  # noqa: E402
from quantfuse import encoder as enc  # noqa: E402
from quantfuse.encoder import Int8Encoder  # noqa: E402
from quantfuse.kernels import encoder as ke  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("m", [1, 31, 128, 4096 + 7])
@pytest.mark.parametrize("kind,residual", [("qkv", None), ("requant", None), ("residual", "fp16"),
                                           ("residual", "int8")])
def test_gemm_epilogues_full_size(m, kind, residual):
    n, k = {"qkv": (2304, 768), "requant": (3072, 768), "residual": (768, 3072)}[kind]
    out, ref = u.gemm_case(kind, m, n, k, DEV, heads=12, residual=residual)
    u.assert_gemm_close(kind, out, ref, m, tol=2e-3)


@pytest.mark.parametrize("m", [1, 64, 128, 200, 1023])
@pytest.mark.parametrize("kind,residual", [("qkv", None), ("requant", None), ("residual", "fp16"),
                                           ("residual", "int8")])
@pytest.mark.parametrize("splits", [None, 2, 3, 4])
def test_gemm_split_k_full_size(m, kind, residual, splits):
    # K splits at BERT-base widths (None: the table's rule, which splits FC2 at 64 and 128 tokens): the exact int32
    # sum of the partials, so the same outputs as one program per tile, launch after launch (the counters reset)
    n, k = {"qkv": (2304, 768), "requant": (3072, 768), "residual": (768, 3072)}[kind]
    tile = (64, 64, 128, 4, 4)
    whole, ref = u.gemm_case(kind, m, n, k, DEV, heads=12, residual=residual, config=tile, split_k=1, inputs_seed=4)
    u.assert_gemm_close(kind, whole, ref, m, tol=2e-3)
    for _ in range(3):
        split, _ = u.gemm_case(kind, m, n, k, DEV, heads=12, residual=residual, config=None if splits is None else tile,
                               split_k=splits, inputs_seed=4)
        if kind == "qkv":
            assert torch.equal(split[0], whole[0]) and torch.equal(split[1][:, :, :m], whole[1][:, :, :m])
        else:
            assert torch.equal(split, whole)


def test_gemm_split_k_table_rule_on_this_gpu():
    if ke.arch_key("cuda", 0) != "sm90":
        pytest.skip("the split rule's numbers are the sm90 table's")
    dev = torch.device(DEV)
    tiles = 2 * 12  # FC2 at 128 tokens on 64x64 tiles
    assert ke._pick_gemm_tile(dev, 128, 768, 3072, "residual")[:2] == (64, 64)
    assert ke._pick_split_k(dev, 128, tiles, 24) == 2


def test_gemm_split_k_refused_by_the_gluon_kernel():
    a, w = u.int8(256, 768, device=DEV), u.int8(768, 768, device=DEV)
    w_scale, bias = torch.ones(768, device=DEV), torch.zeros(768, device=DEV)
    config = (128, 128, 128, 4, 4, 1, 0, 0, 1)  # warp-specialized, no persistent grid
    if not ke.encoder_wgmma.applies(a, w, 0, True, False, True, False):
        pytest.skip("the Gluon kernel does not run here")
    with pytest.raises(ValueError, match="split_k.*Gluon"):
        ke.int8_gemm(a, w, 0.02, w_scale, bias, "residual", residual=torch.zeros(256, 768, device=DEV).half(),
                     config=config, split_k=2, reciprocal=True)


def test_gemm_split_k_replays_in_a_cuda_graph():
    # the counters of a capture stream's slot start at zero and every replay leaves them at zero
    torch.manual_seed(5)
    m, n, k = 96, 768, 3072
    a, w = u.int8(m, k, device=DEV), u.int8(n, k, device=DEV)
    w_scale = (torch.rand(n, device=DEV) * 0.01 + 0.002).float()
    bias = torch.randn(n, device=DEV).float()
    res = torch.randn(m, n, device=DEV).half()
    run = lambda: ke.int8_gemm(a, w, 0.02, w_scale, bias, "residual", residual=res,  # noqa: E731
                               config=(64, 64, 128, 4, 4), split_k=4)
    expected = ke.int8_gemm(a, w, 0.02, w_scale, bias, "residual", residual=res, config=(64, 64, 128, 4, 4),
                            split_k=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("variant", [(1, 0), (0, 1), (1, 1), (1, 2), (0, 0, 1), (1, 2, 1), (1, 1, 0, 1), (1, 1, 1, 1)],
                         ids=["tma", "persistent1", "tma_persistent1", "tma_persistent2", "tma_epilogue",
                              "tma_persistent2_epilogue", "ws_gluon", "ws_gluon_tma_out"])
@pytest.mark.parametrize("m", [1, 31, 4096 + 7])
@pytest.mark.parametrize("kind,residual", [("qkv", None), ("requant", None), ("residual", "fp16"),
                                           ("residual", "int8")])
def test_gemm_tma_persistent_full_size(variant, m, kind, residual):
    # tensor-descriptor loads and persistent grids on the 128x128x128 tile, at BERT-base widths
    n, k = {"qkv": (2304, 768), "requant": (3072, 768), "residual": (768, 3072)}[kind]
    out, ref = u.gemm_case(kind, m, n, k, DEV, heads=12, residual=residual, config=(128, 128, 128, 4, 3) + variant)
    u.assert_gemm_close(kind, out, ref, m, tol=2e-3)


@pytest.mark.parametrize("config", [None, (128, 128, 128, 4, 4, 1, 1, 0, 1), (128, 128, 128, 4, 4, 1, 1, 1, 1)],
                         ids=["table", "ws_gluon", "ws_gluon_tma_out"])
@pytest.mark.parametrize("m", [1, 31, 4096 + 7])
@pytest.mark.parametrize("kind,residual", [("requant", None), ("residual", "int8")])
def test_gemm_per_column_scales_full_size(m, kind, residual, config):
    # a smoothed encoder's epilogues: per-column requantization scales (FC1) and int8 residuals (mode 2)
    n, k = {"requant": (3072, 768), "residual": (768, 3072)}[kind]
    out, ref = u.gemm_case(kind, m, n, k, DEV, residual=residual, column=True, config=config)
    if kind == "requant":
        u.assert_int8_close(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


# the table's choice (one pass up to its key limit, two passes past it) and each one-pass tile forced
ONE_PASS_TILES = {f"one_pass_m{bm}_w{w}": {"block_m": bm, "num_warps": w, "num_stages": 1, "one_pass": True}
                  for bm, w in ((16, 4), (32, 8), (64, 4), (64, 8), (128, 8))}
PATHS = dict(ONE_PASS_TILES, table=None, two_pass={"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3},
             two_pass_m128_w8={"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3})


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("lengths", [[1], [31, 32], [127, 1, 64], [384, 200, 384], [512, 17], [600, 300]])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_attention_full_size(lengths, head_dim, path):
    if PATHS[path] is not None and PATHS[path].get("one_pass") and max(lengths) > ke.ONE_PASS_MAX_KEYS:
        pytest.skip("one pass holds at most ONE_PASS_MAX_KEYS keys per row (refused: CPU test)")
    out, ref, _, _ = u.attention_case(lengths, 12, head_dim, DEV, config=PATHS[path])
    u.assert_int8_close(out, ref)


@pytest.mark.parametrize("path", ["table", "two_pass", "one_pass_m64_w4"])
@pytest.mark.parametrize("lengths", [[1, 1, 7, 128], [384, 1, 200]])
def test_attention_fma_division_is_the_true_division(path, lengths, monkeypatch):
    """div_rn_by's output requantization equals the per-output div.rn bit for bit on the GPU (one-pass paths only
    for sequences that fit them)."""
    if PATHS[path] is not None and PATHS[path].get("one_pass") and max(lengths) > 128:
        pytest.skip("a one-pass tile of 128 keys")
    torch.manual_seed(len(lengths))
    fma, ref, _, _ = u.attention_case(lengths, 12, 64, DEV, config=PATHS[path])
    monkeypatch.setattr(ke, "div_rn_by_applies", lambda d: False)
    torch.manual_seed(len(lengths))
    true_div, _, _, _ = u.attention_case(lengths, 12, 64, DEV, config=PATHS[path])
    assert torch.equal(fma, true_div), int((fma != true_div).sum())
    u.assert_int8_close(fma, ref)


@pytest.mark.parametrize("path", ["table", "two_pass", "one_pass_m64_w4"])
def test_attention_wide_heads_full_size(path):
    # head_dim 512 (scores past the magic-number conversion's bound) with a fully masked sequence
    lengths = [100, 0, 37] if PATHS[path] is not None and PATHS[path].get("one_pass") else [384, 0, 100]
    out, ref, _, _ = u.attention_case(lengths, 2, 512, DEV, padded=True, config=PATHS[path])
    u.assert_int8_close(out, ref)
    s = max(lengths)
    assert int(out[s:2 * s].abs().max()) == 0


@pytest.mark.parametrize("path", ["table", "two_pass", "two_pass_m128_w8", "one_pass_m32_w8"])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("lengths", [[384, 100, 1, 0], [128, 77, 0, 128]])
@pytest.mark.parametrize("key_words", [False, True])
def test_attention_padded_equals_packed_and_masked_rows(path, aligned, lengths, key_words):
    # key_words: the mask as the encoder hands it over (int32 words made once per forward)
    out_p, ref_p, cu_p, _ = u.attention_case(lengths, 12, 64, DEV, padded=True, config=PATHS[path], aligned=aligned,
                                             key_words=key_words)
    u.assert_int8_close(out_p, ref_p)
    s, b = max(lengths), lengths.index(0)
    assert int(out_p[b * s:(b + 1) * s].abs().max()) == 0  # fully masked sequence: p = 0, ctx = 0


@pytest.mark.parametrize("path", ["table", "two_pass", "one_pass_m64_w4"])
@pytest.mark.parametrize("p_scale", [1.0 / 127, 1.0 / 300])
def test_attention_probability_scales(path, p_scale):
    """The encoder's 1 / 127 (codes not clamped: they cannot pass 127) and a smaller scale whose codes
    saturate (clamped), through the MUFU exponentials."""
    lengths = [1, 128, 77] if PATHS[path] is not None and PATHS[path].get("one_pass") else [1, 384, 200]
    out, ref, _, _ = u.attention_case(lengths, 12, 64, DEV, config=PATHS[path], p_scale=p_scale)
    u.assert_int8_close(out, ref)


@pytest.mark.parametrize("m,n", [(1, 768), (4099, 768), (77, 384)])
@pytest.mark.parametrize("write_fp16", [True, False])
def test_embedding_layernorm_full_size(m, n, write_fp16):
    (o16, o8), (p16, p8), (r16, r8) = u.embed_case(m, n, DEV, write_fp16, vocab=30522, max_pos=512)
    assert torch.equal(o8, p8)
    u.assert_int8_close(o8, r8)
    if write_fp16:
        assert torch.equal(o16, p16)
    (b16, _), _, _ = u.embed_case(m, n, DEV, True, bad=m // 2)
    assert torch.isnan(b16[m // 2]).all()


def test_layernorm_dequant_fp16_full_size():
    y = (torch.randn(4099, 768, device=DEV) * 4).half()
    gamma, beta = torch.rand(768, device=DEV) + 0.5, torch.randn(768, device=DEV) * 0.1
    s = enc._f32(4.0 / 127)
    o16, o8 = ke.layernorm_quant(y, gamma, beta, 1e-12, s, False, dequant_fp16=True)
    r16, r8 = enc.reference_layernorm_quant(y, gamma, beta, 1e-12, s, False, dequant_fp16=True)
    assert torch.equal(o16, (o8.float() * s).half())
    u.assert_int8_close(o8, r8)


@pytest.mark.parametrize("dequant", [False, True])
def test_layernorm_scatter_full_size(dequant):
    # the packed forward's last LayerNorm writing ~half of a 32x128 batch's tokens into the padded output
    m, n, r = 2160, 768, 4096
    y = (torch.randn(m, n, device=DEV) * 4).half()
    gamma, beta = torch.rand(n, device=DEV) + 0.5, torch.randn(n, device=DEV) * 0.1
    s = enc._f32(4.0 / 127)
    dest = torch.randperm(r, device=DEV)[:m - 13].sort().values
    fresh16, fresh8 = ke.layernorm_quant(y, gamma, beta, 1e-12, s, not dequant, dequant_fp16=dequant)
    whole = torch.full((r, n), 7.0, dtype=torch.float16, device=DEV)
    o16, o8 = ke.layernorm_quant(y, gamma, beta, 1e-12, s, not dequant, dequant_fp16=dequant, out_fp16=whole,
                                 scatter=dest)
    assert o16.data_ptr() == whole.data_ptr() and torch.equal(o8, fresh8)
    assert torch.equal(whole[dest], fresh16[:m - 13])
    kept = torch.ones(r, dtype=torch.bool, device=DEV)
    kept[dest] = False
    assert bool((whole[kept] == 7.0).all())


@pytest.mark.parametrize("m,n", [(1, 768), (4099, 768), (513, 1024), (77, 384)])
@pytest.mark.parametrize("write_fp16", [True, False])
def test_layernorm_full_size(m, n, write_fp16):
    (o16, o8), (r16, r8) = u.layernorm_case(m, n, DEV, write_fp16)
    if write_fp16:
        torch.testing.assert_close(o16.float(), r16.float(), rtol=1e-3, atol=2e-3)
    u.assert_int8_close(o8, r8)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    return u.make_bert(hidden=768, heads=12, layers=2, intermediate=3072).to(DEV)


@pytest.mark.parametrize("mode", [1, 2])
def test_encoder_triton_vs_reference_and_padding_removal(bert, mode):
    torch.manual_seed(1)
    calib = [u.random_batch(4, 128, device=DEV)]
    enc = Int8Encoder.from_hf(bert, calib, mode=mode, calibrator="max")
    for seq, lengths in [(1, [1, 1]), (31, [31, 7]), (32, [32, 32]), (127, [127, 64, 1]), (384, [384, 190])]:
        ids, mask = u.random_batch(len(lengths), seq, lengths=lengths, device=DEV)
        out = enc(ids, mask, remove_padding=False)
        packed = enc(ids, mask, remove_padding=True)
        with ops.backend("reference"):
            ref = enc(ids, mask, remove_padding=False)
        v = mask.bool()
        assert torch.isfinite(out).all()
        assert torch.equal(out[v], packed[v]), "padding removal differs from the padded path"
        assert bool((packed[~v] == 0).all()), "padding removal: padded positions must come back as 0"
        cos = torch.nn.functional.cosine_similarity(out[v].float(), ref[v].float(), dim=-1)
        assert float(cos.min()) > 0.999, (seq, float(cos.min()))
        hf = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        cos_hf = torch.nn.functional.cosine_similarity(out[v].float(), hf[v].float(), dim=-1)
        assert float(cos_hf.mean()) > 0.98, (seq, float(cos_hf.mean()))


def test_encoder_fully_masked_sequence(bert):
    torch.manual_seed(2)
    enc = Int8Encoder.from_hf(bert, [u.random_batch(2, 64, device=DEV)], mode=1, calibrator="max")
    ids, mask = u.random_batch(3, 40, lengths=[40, 0, 13], device=DEV)
    padded = enc(ids, mask, remove_padding=False)
    packed = enc(ids, mask, remove_padding=True)
    assert torch.isfinite(padded).all() and torch.isfinite(packed).all()
    assert int(packed[1].abs().max()) == 0
    v = mask.bool()
    assert torch.equal(padded[v], packed[v])


@pytest.mark.parametrize("mode", [1, 2])
def test_encoder_padded_path_is_cuda_graph_capturable(bert, mode):
    # the padded forward does no host synchronisation or host-to-device copy: one graph replays it exactly
    torch.manual_seed(3)
    enc = Int8Encoder.from_hf(bert, [u.random_batch(2, 64, device=DEV)], mode=mode, calibrator="max")
    ids, mask = u.random_batch(2, 48, lengths=[48, 30], device=DEV)
    expected = enc(ids, mask, remove_padding=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        enc(ids, mask, remove_padding=False)  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = enc(ids, mask, remove_padding=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def _sub_batch_forwards(e, ids, mask, chunks, remove_padding):
    out = torch.zeros(ids.shape + (e.hidden,), dtype=torch.float16, device=ids.device)
    for r0, r1 in chunks:
        out[r0:r1] = e(ids[r0:r1], mask[r0:r1], remove_padding=remove_padding, streams=1)
    return out


@pytest.mark.parametrize("remove_padding", [False, True])
@pytest.mark.parametrize("mode", [1, 2])
def test_encoder_split_over_streams_equals_sub_batch_forwards(bert, mode, remove_padding):
    # eager, forced: each chunk on its own stream is bit for bit the forward of that sub-batch alone
    torch.manual_seed(4)
    e = Int8Encoder.from_hf(bert, [u.random_batch(2, 64, device=DEV)], mode=mode, calibrator="max")
    ids, mask = u.random_batch(7, 128, lengths=[128, 5, 0, 77, 128, 1, 64], device=DEV)
    whole = e(ids, mask, remove_padding=remove_padding)
    for streams, chunks in ((2, [(0, 4), (4, 7)]), (3, [(0, 3), (3, 5), (5, 7)])):
        split = e(ids, mask, remove_padding=remove_padding, streams=streams)
        torch.cuda.synchronize()
        assert torch.equal(split, _sub_batch_forwards(e, ids, mask, chunks, remove_padding)), streams
        v = mask.bool()
        assert torch.isfinite(split).all()
        # against the unsplit forward: other tiles at other row counts, codes within rounding
        cos = torch.nn.functional.cosine_similarity(split[v].float(), whole[v].float(), dim=-1)
        assert float(cos.min()) > 0.9999, float(cos.min())


@pytest.mark.parametrize("remove_padding", [False, True])
def test_encoder_splits_over_two_streams_under_graph_capture(bert, remove_padding, monkeypatch):
    # automatic: eagerly one stream; captured in a CUDA graph at >= stream_split_min_tokens, two parallel
    # branches whose replay equals the eager two-stream forward bit for bit
    torch.manual_seed(5)
    e = Int8Encoder.from_hf(bert, [u.random_batch(2, 64, device=DEV)], mode=2, calibrator="max")
    threshold = ke.stream_split_min_tokens(torch.device(DEV))
    if not threshold:
        pytest.skip("this GPU's table never splits")
    batch = -(-threshold // 128) + (8 if remove_padding else 0)
    lengths = [128] * batch if not remove_padding else torch.randint(112, 129, (batch,)).tolist()
    ids, mask = u.random_batch(batch, 128, lengths=lengths, device=DEV)
    pk = enc.pack_mask(mask)
    tokens = pk.indices.numel() if remove_padding else batch * 128
    assert tokens >= threshold
    chunks_seen, streams_seen = [], []
    real = enc._in_streams

    def spy(dev, chunks, run):
        chunks_seen.append(chunks)

        def recording(r0, r1):
            streams_seen.append(torch.cuda.current_stream().cuda_stream)
            run(r0, r1)

        real(dev, chunks, recording)

    monkeypatch.setattr(enc, "_in_streams", spy)
    expected = e(ids, mask, remove_padding=remove_padding, packed=pk if remove_padding else None, streams=2)
    assert chunks_seen == [[(0, batch // 2), (batch // 2, batch)]]
    chunks_seen.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as an engine does: eagerly no split
        e(ids, mask, remove_padding=remove_padding, packed=pk if remove_padding else None)
    torch.cuda.current_stream().wait_stream(side)
    assert chunks_seen == []
    # the kept side stream is the capture's own stream (torch.cuda.Stream() cycles through PyTorch's pool of 32,
    # so this happens by itself after enough streams): the halves must still run on two streams
    capture = torch.cuda.Stream()
    monkeypatch.setitem(enc._SIDE_STREAMS, torch.cuda.current_device(), [capture])
    streams_seen.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        out = e(ids, mask, remove_padding=remove_padding, packed=pk if remove_padding else None)
    assert chunks_seen == [[(0, batch // 2), (batch // 2, batch)]]
    assert len(streams_seen) == 2 and len(set(streams_seen)) == 2 and capture.cuda_stream in streams_seen
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fast", [1, 0, 2])
def test_gelu_epilogue_accuracy_gpu(fast):
    """The epilogue's erf-GELU compiled for the GPU (fast reciprocal and exp2 there) against float64 erf:
    |error| <= 1e-6 on [-12, 12] and random values (the CPU test's bound)."""
    import math

    import triton
    from test_encoder import _gelu_probe

    x = torch.cat([torch.linspace(-12, 12, 240001), torch.randn(40000) * 3]).to(DEV)
    out = torch.empty_like(x)
    _gelu_probe[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FAST=fast, BLOCK=1024)
    xd = x.double()
    want = 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))
    assert float((out.double() - want).abs().max()) <= 1e-6
