"""Scaled matmul on the GPU at full size (SPEC section 2).

Error bounds (stated, per element, against the float32 reference computed from the same quantized ints):
- int8: the int32 accumulator is exact, so the only error is the final rounding (half an ulp of the
  output type, relative, or half the smallest fp16 subnormal near zero) plus float32 epilogue rounding:
      |out - ref| <= 2^-8 |ref| + 2^-20 (|s_a s_b acc| + |bias|)        (bf16; 2^-11 + 2^-25 for fp16, 2^-22 for fp32)
- fp8: additionally the tensor-core accumulation. Hopper's fp8 wgmma accumulates with fewer than 24
  mantissa bits (about 14, as the DeepSeek-V3 report measured; cuBLAS's use_fast_accum=True is the
  same), so the accumulation term is 2^-10, not float32's 2^-12 (2^-12 was exceeded 2.7x on the H100):
      |out - ref| <= 2^-8 |ref| + 2^-10 s_a s_b (|a| @ |b|) + 2^-20 |bias|
- zero-point epilogues: exact in int32 before scaling (unit scales, fp32 out, compared to int64 math).
- blockwise fp8: mean|out - ref| / mean|ref| < 1e-3 with float32 output (the GEMM's own error: bf16
  rounding alone is ~1e-3 on average), and the bf16 output within one bf16 rounding of the fp32 one.
The tests print the worst observed error relative to each bound.
"""

import pytest
import torch

import quantfuse as qf
from quantfuse import reference as ref
from quantfuse.kernels import blockwise_wgmma as bw
from quantfuse.kernels import rowwise_wgmma as rw
from quantfuse.kernels import scaled_mm as kmm
from tests._util import KernelSpy

pytestmark = pytest.mark.gpu

INT8, FP8 = torch.int8, torch.float8_e4m3fn
M_GRID = [1, 7, 16, 17, 64, 128, 1024, 4096]
KN_GRID = [
    (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192),
    (3420, 1280), (255, 513), (971, 1024), (20486, 128),
]
REL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-22}
FP8_ACC_REL = 2.0**-10


def _operands(m, k, n, dtype, device="cuda"):
    if dtype == INT8:
        a = torch.randint(-128, 128, (m, k), dtype=INT8, device=device)
        w = torch.randint(-128, 128, (n, k), dtype=INT8, device=device)
    else:
        a = (torch.randn(m, k, device=device) * 60).to(FP8)
        w = (torch.randn(n, k, device=device) * 60).to(FP8)
    return a, w.t()  # b = w.t(): the K-contiguous fast path


def _scales(m, n, per_token=True, per_channel=True):
    sa = torch.rand(m if per_token else 1, 1, device="cuda") * 1e-3 + 1e-4
    sb = torch.rand(n if per_channel else 1, device="cuda") * 1e-3 + 1e-4
    return sa, sb


def assert_within_bound(out, a, b, sa, sb, bias, azp_adj=None, azp=None):
    want = ref.scaled_mm(a, b, sa, sb, torch.float32, bias, azp_adj, azp).reshape(-1, b.shape[1])
    got = out.float().reshape(-1, b.shape[1])
    m, n = got.shape
    s = (sa.reshape(-1, 1) if sa.numel() > 1 else sa.reshape(())) * (sb.reshape(1, -1) if sb.numel() > 1 else sb.reshape(()))
    bias_abs = bias.float().abs().reshape(1, n) if bias is not None else 0.0
    unbiased = (want - (bias.float().reshape(1, n) if bias is not None else 0.0)).abs()
    bound = REL[out.dtype] * want.abs() + 2.0**-20 * (unbiased + bias_abs)
    if out.dtype == torch.float16:
        bound = bound + 2.0**-25  # fp16 subnormals: absolute spacing 2^-24 below 2^-14
    if a.dtype == FP8:
        abs_dot = (a.reshape(m, -1).double().abs() @ b.double().abs()).float()
        bound = bound + FP8_ACC_REL * s.abs() * abs_dot
    ratio = float(((got - want).abs() / bound.clamp_min(1e-30)).max())
    print(f"worst error / bound = {ratio:.3g}")
    assert ratio <= 1.0, ratio


def _sampled_grid():
    cases = []
    for i, (k, n) in enumerate(KN_GRID):
        for j in (0, 3, 5):
            cases.append((M_GRID[(i + j) % len(M_GRID)], k, n))
    return cases


@pytest.mark.parametrize("m,k,n", _sampled_grid())
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_grid_per_token_per_channel_bias(m, k, n, dtype):
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_within_bound(out, a, b, sa, sb, bias)


# every out dtype, scale granularity and bias dtype at least once per operand type (each combination is a
# separate compile, so the CPU tests carry the full cross product on small shapes)
EPILOGUE_CASES = [
    (torch.bfloat16, True, True, torch.float32),
    (torch.float16, False, False, None),
    (torch.float32, True, False, torch.float16),
    (torch.bfloat16, False, True, torch.bfloat16),
    (torch.float16, True, True, None),
]


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("out_dtype,per_token,per_channel,bias_dtype", EPILOGUE_CASES)
def test_epilogues_and_granularities(dtype, out_dtype, per_token, per_channel, bias_dtype):
    m, k, n = 300, 4096, 1024 + 48
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n, per_token, per_channel)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
    out = qf.scaled_mm(a, b, sa, sb, out_dtype, bias)
    assert_within_bound(out, a, b, sa, sb, bias)


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("m,k,n", [(300, 128, 128), (259, 4096, 6144), (700, 4096, 4096)])
def test_float32_output_where_the_wide_tile_does_not_fit(dtype, m, k, n):
    """float32 output where the wave rule ties the 128x256 tl tile with the 128x128 one: the wide tile would ask
    278552 bytes of shared memory (fp8 300x128x128 failed to compile before the dispatch checked it); with b
    K-contiguous (fp8 there: the tl tiles) and N-contiguous (no Gluon kernel, both dtypes)."""
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda")
    for b_ in (b, b.contiguous()):
        out = qf.scaled_mm(a, b_, sa, sb, torch.float32, bias)
        assert out.dtype == torch.float32
        assert_within_bound(out, a, b_, sa, sb, bias)
        if dtype == INT8:  # exact sums, one epilogue: the bf16 output is the float32 one rounded
            out16 = qf.scaled_mm(a, b_, sa, sb, torch.bfloat16, bias)
            assert torch.equal(out16, out.to(torch.bfloat16))


@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (16, 14336, 4096), (17, 3420, 1280), (1024, 4096, 4096), (4096, 971, 1024)])
def test_zero_point_epilogues_exact_int32(m, k, n):
    a, b = _operands(m, k, n, INT8)
    one_a = torch.ones(1, device="cuda")
    one_b = torch.ones(1, device="cuda")
    acc64 = (a.double() @ b.double()).long()  # exact: |acc| < 2^53
    colsum = b.long().sum(0)
    z = torch.tensor([-37], dtype=torch.int32, device="cuda")
    adj_tensor = qf.azp_adjustment(b, z)
    got = qf.scaled_mm(a, b, one_a, one_b, torch.float32, None, adj_tensor)
    want = (acc64 - int(z) * colsum).to(torch.int32).float()
    assert torch.equal(got, want)
    azp = torch.randint(-300, 300, (m, 1), dtype=torch.int32, device="cuda")
    got = qf.scaled_mm(a, b, one_a, one_b, torch.float32, None, qf.azp_adjustment(b), azp)
    want = (acc64 - azp.long() * colsum).to(torch.int32).float()
    assert torch.equal(got, want)
    # and with real scales and a bias, against the bound
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda")
    out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, qf.azp_adjustment(b), azp)
    assert_within_bound(out, a, b, sa, sb, bias, qf.azp_adjustment(b), azp)


@pytest.mark.parametrize("variant", [(True, 0), (True, 2), (False, 2)], ids=["tma", "tma_persistent", "persistent"])
@pytest.mark.parametrize("tile", [(128, 128, 128, 4, 3, 8), (128, 256, 128, 8, 3, 16)], ids=["128x128", "128x256"])
@pytest.mark.parametrize("m,k,n", [(1024, 4096, 6144), (4096 + 17, 3424, 1280), (300, 971, 1024)])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_tma_and_persistent_variants(variant, tile, m, k, n, dtype):
    # tensor-descriptor operands and persistent grids at full size: a partial last row tile and a K tail
    # (3424 = 26.75 K steps) through TMA, and unaligned K (971: pointer loads, the row stride is no multiple
    # of 16)
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    cfg = kmm.MMConfig(*tile, tma=variant[0], persistent=variant[1])
    out = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, config=cfg)
    assert_within_bound(out, a, b, sa, sb, bias)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_layouts_padded_rows_and_strided_b(dtype):
    m, k, n = 1000, 4096, 2000
    a_full, _ = _operands(m, k + 64, n, dtype)
    a = a_full[:, 16 : 16 + k]  # padded-row view, row stride k + 64
    _, b_kmajor = _operands(m, k, n, dtype)
    b_nmajor = b_kmajor.contiguous()  # [K, N] row-major
    b_sliced = _operands(2 * k, 2 * n, 1, dtype)[0][::2, ::2]  # [K, N], both strides non-unit
    sa, sb = _scales(m, n)
    for b in (b_kmajor, b_nmajor, b_sliced):
        out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16)
        if dtype == INT8:  # exact accumulator: the layout cannot change a single bit
            assert torch.equal(out, qf.scaled_mm(a.contiguous(), b.contiguous(), sa, sb, torch.bfloat16))
        assert_within_bound(out, a, b, sa, sb, None)
    a3 = a_full[: 999].reshape(27, 37, k + 64)[..., :k]
    out3 = qf.scaled_mm(a3, b_kmajor, sa[:999], sb, torch.bfloat16)
    assert out3.shape == (27, 37, n)
    assert_within_bound(out3, a3, b_kmajor, sa[:999], sb, None)


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("split_k", [2, 5])
def test_forced_split_k(dtype, split_k):
    m, k, n = 33, 5000, 700
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda")
    cfg = kmm.MMConfig(16, 64, 128, 4, 3, split_k=split_k)
    out = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, config=cfg)
    assert_within_bound(out, a, b, sa, sb, bias)


def _block_operands(m, k, n, transposed_scales):
    x = torch.randn(m, k, device="cuda") * 3
    kb, nb = -(-k // 128), -(-n // 128)
    a = (x / 8).to(FP8)
    sa = torch.rand(m, kb, device="cuda") * 0.1 + 0.01
    if transposed_scales:
        sa = sa.t().contiguous().t()
    w = (torch.randn(n, k, device="cuda") * 60).to(FP8)
    sb = torch.rand(kb, nb, device="cuda") * 1e-3 + 1e-4
    return a, w.t(), sa, sb


@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (7, 14336, 4096), (64, 3420, 1280), (128, 255, 513), (1024, 8192, 10240), (4096, 4096, 4096), (17, 20486, 128), (300, 971, 1024)])
@pytest.mark.parametrize("transposed_scales", [False, True])
def test_blockwise(m, k, n, transposed_scales):
    a, b, sa, sb = _block_operands(m, k, n, transposed_scales)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out32 = qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    rel = float((out32 - want).abs().mean() / want.abs().mean())
    print(f"blockwise mean rel error {rel:.3g}")
    assert rel < 1e-3
    out = qf.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16, bias)
    assert out.dtype == torch.bfloat16
    assert bool(((out.float() - out32).abs() <= 2.0**-8 * out32.abs() + 1e-30).all())


def test_torch_compile_fullgraph_and_cuda_graph():
    m, k, n = 64, 4096, 1024
    a, b = _operands(m, k, n, INT8)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    fa, fb = _operands(m, k, n, FP8)
    bsa = torch.rand(m, k // 128, device="cuda") * 0.1
    bsb = torch.rand(k // 128, n // 128, device="cuda") * 1e-3

    azp7 = torch.randint(-50, 50, (7, 1), dtype=torch.int32, device="cuda")

    def f(a, b, fa, fb):
        return (
            qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias),
            qf.scaled_mm(fa, fb, sa, sb, torch.float16, None),
            qf.scaled_mm_blockwise(fa, fb, bsa, bsb, torch.bfloat16, bias),
            qf.scaled_mm(a[:7], b, sa[:7], sb, torch.bfloat16, None, qf.azp_adjustment(b), azp7),
        )

    eager = f(a, b, fa, fb)
    compiled = torch.compile(f, fullgraph=True)(a, b, fa, fb)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)

    static = [t.clone() for t in (a, b, fa, fb)]
    f(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(*static)
    new = _operands(m, k, n, INT8) + _operands(m, k, n, FP8)
    for s, t in zip(static, new):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, f(*new)):
        assert torch.equal(x, y)


# ---- the Gluon warp-specialized rowwise kernel (kernels/rowwise_wgmma.py): sm90 with describable operands ---
needs_ws = pytest.mark.skipif(
    not (torch.cuda.is_available() and rw.applies(*_operands(128, 128, 256, INT8))),
    reason="Gluon rowwise kernel: sm90 + Gluon with aggregates")
WS_TILES = [kmm.WsConfig(), kmm.WsConfig(128, 256, 3, 16), kmm.WsConfig(128, 128, 4, 1),
            kmm.WsConfig(128, 128, 5, 8, pingpong=True), kmm.WsConfig(128, 128, 3, 1, pingpong=True)]
# M, N off the tiles, K tails (1040 = 8 K steps + 16), one K step, more tiles than programs
WS_SHAPES = [(1, 128, 256), (300, 1040, 1000), (129, 4096, 257), (1100, 2064, 6144 + 40)]


def _tl_twin(a, b, sa, sb, out_dtype, bias, adj=None, azp=None):
    return kmm.scaled_mm(a, b, sa, sb, out_dtype, bias, adj, azp, config=kmm.MMConfig(128, 128, 128, 4, 3))


@needs_ws
@pytest.mark.parametrize("cfg", WS_TILES, ids=str)
@pytest.mark.parametrize("m,k,n", WS_SHAPES)
@pytest.mark.parametrize("epilogue", ["token_channel_bias", "tensor_scales", "azp_tensor", "azp_token"])
def test_rowwise_ws_int8_matches_tl_bit_for_bit(monkeypatch, cfg, m, k, n, epilogue):
    """The int32 accumulator is exact and the epilogue is the tl kernel's formula, so every output bit matches
    (and the bound holds)."""
    spy = KernelSpy(rw._rowwise_ws_kernel)
    monkeypatch.setattr(rw, "_rowwise_ws_kernel", spy)
    a, b = _operands(m, k, n, INT8)
    sa, sb = _scales(m, n, epilogue != "tensor_scales", epilogue != "tensor_scales")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if epilogue != "tensor_scales" else None
    adj = azp = None
    if epilogue == "azp_tensor":
        adj = qf.azp_adjustment(b, torch.tensor([-37], dtype=torch.int32, device="cuda"))
    elif epilogue == "azp_token":
        adj, azp = qf.azp_adjustment(b), torch.randint(-300, 300, (m, 1), dtype=torch.int32, device="cuda")
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = kmm.scaled_mm(a, b, sa, sb, out_dtype, bias, adj, azp, config=cfg)
        assert torch.equal(got, _tl_twin(a, b, sa, sb, out_dtype, bias, adj, azp))
    assert len(spy.calls) == 3 and spy.calls[0]["AZP_MODE"] == {"azp_tensor": 1, "azp_token": 2}.get(epilogue, 0)
    assert_within_bound(got, a, b, sa, sb, bias, adj, azp)


@needs_ws
@pytest.mark.parametrize("cfg", WS_TILES[:2] + WS_TILES[3:], ids=str)
@pytest.mark.parametrize("m,k,n", WS_SHAPES)
def test_rowwise_ws_fp8_within_bound(cfg, m, k, n):
    a, b = _operands(m, k, n, FP8)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float32):
        assert_within_bound(kmm.scaled_mm(a, b, sa, sb, out_dtype, bias, None, None, config=cfg), a, b, sa, sb,
                            bias)


def _int8_default_through_ws(monkeypatch, m, k, n):
    """qf.scaled_mm as dispatched on int8 operands, bf16 out + bias: one launch of the Gluon kernel, bit for bit the
    tl twin, also replayed from a CUDA graph. Returns (spy, a, b, scale_a, scale_b, bias)."""
    spy = KernelSpy(rw._rowwise_ws_kernel)
    monkeypatch.setattr(rw, "_rowwise_ws_kernel", spy)
    a, b = _operands(m, k, n, INT8)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    assert len(spy.calls) == 1
    assert torch.equal(out, _tl_twin(a, b, sa, sb, torch.bfloat16, bias))
    assert torch.equal(_graph_replayed(lambda: qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)), out)
    return spy, a, b, sa, sb, bias


@needs_ws
@pytest.mark.parametrize("m,k,n,fp8_ws", [(1024, 14336, 4096, True), (2048 + 100, 28672, 1024 + 8, False)])
def test_rowwise_ws_default_dispatch_long_k(monkeypatch, m, k, n, fp8_ws):
    """int8 takes the Gluon kernel by default at long and short K, also below 1024 rows; fp8 where its cooperative
    tiles fill a round of the SMs (1024 x 4096: 8 x 16 = 128 tiles; 2148 x 1032: 17 x 5 = 85, the tl tiles)."""
    spy, a, b, sa, sb, bias = _int8_default_through_ws(monkeypatch, m, k, n)
    short_k = _operands(m, 4096, n, INT8)
    assert torch.equal(qf.scaled_mm(*short_k, sa, sb, torch.bfloat16, bias),
                       _tl_twin(*short_k, sa, sb, torch.bfloat16, bias))
    assert len(spy.calls) == 3  # the graph capture and short K
    fp8 = _operands(m, k, n, FP8)
    assert_within_bound(qf.scaled_mm(*fp8, sa, sb, torch.bfloat16, bias), *fp8, sa, sb, bias)
    assert len(spy.calls) == 3 + fp8_ws and not (fp8_ws and spy.calls[-1]["PINGPONG"])
    qf.scaled_mm(a[:1023], b, sa[:1023], sb, torch.bfloat16, bias)
    assert len(spy.calls) == 4 + fp8_ws


@needs_ws
@pytest.mark.parametrize("m,k,n,pingpong", [(257, 4096, 4096, True), (384, 28672, 8192 + 8, False),
                                            (512, 14336, 4096 - 16, True), (700, 14336, 4096 - 16, False),
                                            (1000, 8192, 2048, True)])
def test_rowwise_ws_int8_below_a_round(monkeypatch, m, k, n, pingpong):
    """int8 from 257 rows takes the Gluon kernel at any round fill (scaled_mm.WS_MIN_ROUND_FILL), ping-pong or
    cooperative by `_ws_pick`: bit for bit the tl twin, also replayed from a CUDA graph; fp8 runs the tl tiles there
    (its cooperative tiles fill less than a round: 3 x 16, 3 x 33, 4 x 16, 6 x 16 and 8 x 8)."""
    spy, a, b, sa, sb, bias = _int8_default_through_ws(monkeypatch, m, k, n)
    assert spy.calls[0]["PINGPONG"] == pingpong
    fp8 = _operands(m, k, n, FP8)
    assert_within_bound(qf.scaled_mm(*fp8, sa, sb, torch.bfloat16, bias), *fp8, sa, sb, bias)
    assert len(spy.calls) == 2  # the graph capture only


def _both_dtypes_through_ws(monkeypatch, m, k, n, pingpong):
    """qf.scaled_mm as dispatched, int8 then fp8, bf16 out + bias: one launch of the Gluon kernel each, in the
    schedule `pingpong` names (5 stages; cooperative: 4), int8 bit for bit the tl twin, both within the bound and
    replayed from a CUDA graph. Returns the kernel spy."""
    spy = KernelSpy(rw._rowwise_ws_kernel)
    monkeypatch.setattr(rw, "_rowwise_ws_kernel", spy)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for dtype in (INT8, FP8):
        a, b = _operands(m, k, n, dtype)
        calls = len(spy.calls)
        out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
        assert len(spy.calls) == calls + 1
        assert spy.calls[-1]["PINGPONG"] == pingpong and spy.calls[-1]["STAGES"] == (5 if pingpong else 4)
        if dtype == INT8:
            assert torch.equal(out, _tl_twin(a, b, sa, sb, torch.bfloat16, bias))
        assert_within_bound(out, a, b, sa, sb, bias)
        assert torch.equal(_graph_replayed(lambda: qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)), out)
    return spy


@needs_ws
@pytest.mark.parametrize("m,k,n", [(1024, 4096, 6144), (1100, 2048 + 48, 4104), (1024, 8192 + 16, 10240 - 8)])
def test_rowwise_ws_pingpong_dispatch(monkeypatch, m, k, n):
    """Up to K = 4096, and where its 128x128 tiles fill the last round better (scaled_mm.ws_units), the ping-pong
    schedule runs."""
    _both_dtypes_through_ws(monkeypatch, m, k, n, True)


@needs_ws
@pytest.mark.parametrize("m,k,n,pingpong", [(116, 4096, 4096 + 8, True), (128, 14336, 4096, True),
                                            (231, 8192 + 16, 10240, False), (256, 4096, 28672 - 8, True)])
def test_rowwise_ws_batched_decode(monkeypatch, m, k, n, pingpong):
    """116..128 and 231..256 rows take the Gluon kernels (scaled_mm.WS_MIN_ROW_FILL), int8 and fp8; 192 rows keep
    the split-K tl tiles."""
    spy = _both_dtypes_through_ws(monkeypatch, m, k, n, pingpong)
    calls = len(spy.calls)
    for dtype in (INT8, FP8):
        a, b = _operands(192, k, n, dtype)
        qf.scaled_mm(a, b, *_scales(192, n), torch.bfloat16, None)
    assert len(spy.calls) == calls


@needs_ws
def test_rowwise_ws_padded_rows_and_nonfinite_scales():
    m, k, n = 700, 2048, 1536
    a_full, b = _operands(m, k + 64, n, INT8)
    a = a_full[:, 16 : 16 + k]  # padded-row view (row stride k + 64: describable)
    b = b[:k]
    sa, sb = _scales(m, n)
    sa[5] = float("nan")
    sa[9] = float("inf")
    sb[17] = 0.0
    got = kmm.scaled_mm(a, b, sa, sb, torch.float32, None, None, None, config=kmm.WsConfig())
    want = _tl_twin(a.contiguous(), b, sa, sb, torch.float32, None)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[5]).all())
    keep = torch.isfinite(want)
    assert torch.equal(got[keep], want[keep]) and not bool(keep[9].any())


@needs_ws
def test_rowwise_ws_config_errors():
    a, b = _operands(128, 128, 256, INT8)
    sa, sb = _scales(128, 256)
    # 7 slots of 32 KiB fit beside the barriers but not with a 16-bit result's exchange buffers
    for bad in (kmm.WsConfig(64, 256), kmm.WsConfig(128, 256, 5), kmm.WsConfig(128, 192),
                kmm.WsConfig(128, 256, 3, pingpong=True), kmm.WsConfig(128, 128, 7, pingpong=True)):
        with pytest.raises(ValueError, match="block_m 128"):
            kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, None, None, None, config=bad)
    seven = kmm.scaled_mm(a, b, sa, sb, torch.float32, None, None, None,
                          config=kmm.WsConfig(128, 128, 7, pingpong=True))
    assert torch.equal(seven, _tl_twin(a, b, sa, sb, torch.float32, None))  # a float32 result has no exchange
    empty = kmm.scaled_mm(a[:0], b, sa[:0], sb, torch.bfloat16, None, None, None, config=kmm.WsConfig())
    assert empty.shape == (0, 256)
    odd_k = _operands(128, 100, 256, INT8)  # rows of 100 bytes: no tensor descriptor
    with pytest.raises(ValueError, match="WsConfig needs"):
        kmm.scaled_mm(odd_k[0], odd_k[1], sa, sb, torch.bfloat16, None, None, None, config=kmm.WsConfig())


# ---- the Gluon blockwise kernel (kernels/blockwise_wgmma.py): sm90 with describable operands --------------
needs_wgmma = pytest.mark.skipif(
    not (bw.GLUON_AVAILABLE and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="Gluon wgmma kernel: sm90 + Gluon")


# the Gluon kernel the sm90 table's first config runs
_DEFAULT_WGMMA = "_ws_kernel" if bw.WGMMA_CONFIGS["sm90"][0][1][0].specialized else "_blockwise_wgmma_kernel"


def _spy_wgmma(monkeypatch, name=_DEFAULT_WGMMA):
    spy = KernelSpy(getattr(bw, name))
    monkeypatch.setattr(bw, name, spy)
    return spy


def _default_blockwise_checked(monkeypatch, m, k, n, transposed_scales):
    """qf.scaled_mm_blockwise as dispatched, float32 out: one launch of the sm90 table's Gluon kernel and the
    blockwise bound (mean relative error < 1e-3). Returns (a, b, scale_a, scale_b, bias, out, reference)."""
    spy = _spy_wgmma(monkeypatch)
    a, b, sa, sb = _block_operands(m, k, n, transposed_scales)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out32 = qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert len(spy.calls) == 1
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    rel = float((out32 - want).abs().mean() / want.abs().mean())
    print(f"{m}x{k}x{n} blockwise mean rel error {rel:.3g}")
    assert rel < 1e-3
    return a, b, sa, sb, bias, out32, want


def _graph_replayed(fn):
    """fn() captured in a CUDA graph and replayed once: its output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


# K steps: 1 (odd, no loop), 2 (one pair), 27 with a K tail (3424 = 26 * 128 + 96), 112; M and N off the tiles
@needs_wgmma
@pytest.mark.parametrize("m,k,n", [(257, 128, 256), (300, 256, 384), (1000, 3424, 1000), (513, 14336, 4096), (4096, 4096, 6144)])
@pytest.mark.parametrize("transposed_scales", [False, True])
def test_blockwise_wgmma_default(monkeypatch, m, k, n, transposed_scales):
    a, b, sa, sb, bias, out32, want = _default_blockwise_checked(monkeypatch, m, k, n, transposed_scales)
    # the tl kernel (variant 2: the same per-step rounding) agrees to the tensor cores' accumulation order
    tl_out = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, kmm.MMConfig(64, 128, 128, 4, 3, variant=2))
    assert float((out32 - tl_out).abs().mean() / want.abs().mean()) < 1e-4
    for dt, floor in ((torch.bfloat16, 1e-30), (torch.float16, 2.0**-25)):  # fp16: half its smallest subnormal
        out = qf.scaled_mm_blockwise(a, b, sa, sb, dt, bias)
        assert out.dtype == dt
        assert bool(((out.float() - out32).abs() <= REL[dt] * out32.abs() + floor).all())


@needs_wgmma
@pytest.mark.parametrize("m,k,n", [(100, 8192, 10240), (128, 4096, 6144), (192, 14336, 4096 + 16), (253, 3424, 1000)])
def test_blockwise_wgmma_batched_decode(monkeypatch, m, k, n):
    """96..128 and 192..256 rows take the Gluon kernel by default (blockwise_wgmma.takes_m), within the bound, also
    replayed from a CUDA graph; 95 and 160 rows run the tl kernel instead, within the same bound."""
    a, b, sa, sb, bias, out32, want = _default_blockwise_checked(monkeypatch, m, k, n, False)
    assert torch.equal(_graph_replayed(lambda: qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)), out32)
    spy = _spy_wgmma(monkeypatch)
    tl_spy = KernelSpy(kmm._blockwise_kernel)
    monkeypatch.setattr(kmm, "_blockwise_kernel", tl_spy)
    rows_run = [r for r in (95, 160) if r < m]
    for rows in rows_run:
        out = qf.scaled_mm_blockwise(a[:rows], b, sa[:rows], sb, torch.float32, bias)
        assert float((out - want[:rows]).abs().mean() / want[:rows].abs().mean()) < 1e-3, rows
    assert len(spy.calls) == 0 and len(tl_spy.calls) >= len(rows_run)


@needs_wgmma
@pytest.mark.parametrize("cfg", [bw.WgmmaConfig(128, 128, 8, 4), bw.WgmmaConfig(128, 64, 8, 5), bw.WgmmaConfig(64, 128, 4, 5),
                                 bw.WgmmaConfig(128, 128, 8, 3, 1), bw.WgmmaConfig(128, 128, 8, 4, 8, 1),
                                 bw.WgmmaConfig(128, 64, 8, 5, 1, 1)], ids=str)
# 2048x2176: 272 tiles (more than one wave), 9 K steps each (odd)
@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (16, 1280, 130), (700, 3424, 1000), (2048, 1152, 2176)])
def test_blockwise_wgmma_configs(monkeypatch, cfg, m, k, n):
    spy = _spy_wgmma(monkeypatch, "_ws_kernel" if cfg.specialized else "_blockwise_wgmma_kernel")
    a, b, sa, sb = _block_operands(m, k, n, True)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, cfg)
    assert len(spy.calls) == 1
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None)
    assert float((got - want).abs().mean() / want.abs().mean()) < 1e-3


WS = bw.WgmmaConfig(128, 128, 8, 4, 8, 1)


# the warp-specialized kernel's scale paths: scale_a through the copy engine with the operands (transposed layout,
# 16-byte aligned; scale_b in any layout, stored by the loader) or both from global memory; M off the tile, a K
# tail, several tiles per program
@needs_wgmma
@pytest.mark.parametrize("sa_layout,sb_layout,smem", [("t", "kmajor", True), ("t", "rows", True), ("rows", "rows", False),
                                                       ("t", "odd", True)])
@pytest.mark.parametrize("m,k,n", [(520, 4000, 1000), (4100, 1024, 8192), (523, 640, 384)])
def test_blockwise_ws_scale_paths(monkeypatch, sa_layout, sb_layout, smem, m, k, n):
    spy = _spy_wgmma(monkeypatch, "_ws_kernel")
    a, b, sa, sb = _block_operands(m, k, n, sa_layout == "t")
    if sb_layout == "kmajor":
        sb = sb.t().contiguous().t()
    elif sb_layout == "odd":  # rows of nb + 1 floats
        sb = torch.empty(sb.shape[0], sb.shape[1] + 1, device="cuda")[:, :sb.shape[1]].copy_(sb)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, WS)
    # 523 rows: the transposed scale_a's rows are 2092 bytes, not a multiple of 16
    assert [c["SCALE_SMEM"] for c in spy.calls] == [smem and m % 4 == 0]
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert float((got - want).abs().mean() / want.abs().mean()) < 1e-3
    # the same rounding as the pointer-loaded kernel: the two agree to the tensor cores' accumulation order
    old = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, bw.WgmmaConfig(128, 128, 8, 4))
    assert float((got - old).abs().mean() / want.abs().mean()) < 1e-5


@needs_wgmma
@pytest.mark.parametrize("transposed", [False, True])
def test_blockwise_ws_nonfinite_and_zero_rows(transposed):
    m, k, n = 384, 1024, 512
    a, b, sa, sb = _block_operands(m, k, n, transposed)
    a[7] = 0
    sa[9, 3] = float("nan")
    sa[11, 0] = float("inf")
    got = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, WS)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None)
    assert bool((got[7] == 0).all())
    assert bool(torch.isnan(got[9]).all())
    assert torch.equal(torch.isfinite(got[11]), torch.isfinite(want[11]))
    keep = torch.ones(m, dtype=torch.bool, device="cuda")
    keep[[9, 11]] = False
    assert float((got[keep] - want[keep]).abs().mean() / want[keep].abs().mean()) < 1e-3


@needs_wgmma
def test_blockwise_wgmma_nonfinite_and_zero_rows():
    m, k, n = 384, 1024, 512
    a, b, sa, sb = _block_operands(m, k, n, False)
    a[7] = 0  # an all-zero row: bias only
    sa[9, 3] = float("nan")  # one NaN scale: that row only
    sa[11, 0] = float("inf")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    got = qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)
    assert torch.equal(got[7], bias.float())
    assert bool(torch.isnan(got[9]).all()) and bool(torch.isnan(want[9]).all())
    assert torch.equal(torch.isfinite(got[11]), torch.isfinite(want[11]))
    keep = torch.ones(m, dtype=torch.bool, device="cuda")
    keep[[9, 11]] = False
    assert torch.isfinite(got[keep]).all()
    assert float((got[keep] - want[keep]).abs().mean() / want[keep].abs().mean()) < 1e-3


@needs_wgmma
def test_blockwise_wgmma_unaligned_falls_back(monkeypatch):
    spies = [_spy_wgmma(monkeypatch, name) for name in ("_ws_kernel", "_blockwise_wgmma_kernel")]
    a, b, sa, sb = _block_operands(512, 3420, 256, False)  # 3420-byte rows: not describable
    got = qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32)
    assert [spy.calls for spy in spies] == [[], []]
    want = ref.scaled_mm_blockwise(a, b, sa, sb, torch.float32)
    assert float((got - want).abs().mean() / want.abs().mean()) < 1e-3
    with pytest.raises(ValueError, match="config"):
        kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, None, bw.WgmmaConfig(128, 128, 8, 4))


@needs_wgmma
def test_blockwise_wgmma_cuda_graph_and_compile():
    m, k, n = 1024, 2048, 1024
    a, b, sa, sb = _block_operands(m, k, n, True)
    f = lambda a: qf.scaled_mm_blockwise(a, b, sa, sb, torch.bfloat16)  # noqa: E731
    eager = f(a)
    assert torch.equal(torch.compile(f, fullgraph=True)(a), eager)
    static = a.clone()
    f(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(static)
    fresh = _block_operands(m, k, n, True)[0]
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, f(fresh))


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("m", [1040, 1100, 2064])
def test_row_split_default_full_size(monkeypatch, dtype, m):
    """Rows just past a whole round of tiles at K = 14336 run as two calls by default (kernels.scaled_mm.row_split):
    int8 bit for bit the one-call result (exact int32 rows), fp8 within the stated bound; CUDA-graph capturable.
    1100 rows run the ping-pong kernel (1024 rows of its 128x128 tiles fill a round of 132 programs x 2 consumers),
    whose part-filled extra round costs one of its tiles, less than the model's 76-row tail call: one call there,
    and the forced split must agree with it."""
    k, n = 14336, 4096
    a, b = _operands(m, k, n, dtype)
    sa, sb = _scales(m, n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    splits = []
    two_calls = kmm._rows_as_two_calls
    monkeypatch.setattr(kmm, "_rows_as_two_calls", lambda *args: splits.append(args[-1]) or two_calls(*args))
    out = qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    if m == 1100:
        assert splits == []
        out = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, split_rows=1024)
    assert splits == [m // 1024 * 1024]
    one = kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, bias, None, None, split_rows=0)
    if dtype == INT8:
        assert torch.equal(out, one)
    assert_within_bound(out, a, b, sa, sb, bias)
    replayed = _graph_replayed(lambda: qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias))
    assert torch.equal(replayed, one if m == 1100 else out)  # the default path: one call at 1100 rows


@needs_wgmma
@pytest.mark.parametrize("transposed_scales", [False, True])
def test_blockwise_row_split_default_full_size(monkeypatch, transposed_scales):
    """Blockwise rows just past whole rounds (1040 at 14336x4096: rounds of 512 rows for one 128x128 program per SM)
    run as the Gluon kernel on 1024 rows and a 16-row decode call: within the blockwise bound, CUDA-graph capturable."""
    a, b, sa, sb, bias, out32, _ = _default_blockwise_checked(monkeypatch, 1040, 14336, 4096, transposed_scales)
    one = kmm.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias, split_rows=0)
    assert torch.equal(out32[:1024], one[:1024])  # the first call is the one call's first rows
    assert torch.equal(_graph_replayed(lambda: qf.scaled_mm_blockwise(a, b, sa, sb, torch.float32, bias)), out32)
