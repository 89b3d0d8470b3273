"""The Gluon wgmma int4 kernel for prefill-sized M (kernels/weight_only_wgmma.py, sm90) on the GPU.

- Identity rows of x give w_hat bit for bit (each output is one exact product: w_hat times 1, then exact zeros):
  which field, word, group, zero point and scale lands where, for every scheme (group 128 / 256 / per channel,
  symmetric or not, float32 scales and 16-bit scales of x's dtype), bf16 and fp16, both shipped tiles, with and
  without split-K, K with a partial chunk and group, N not a multiple of the tile.
- Random x against ref = x.float() @ w_hat.float().T + bias (TF32 off) within the bound of
  test_weight_only_gpu.py: |y - ref| <= REL * ((|x| @ |w_hat|.T) + |bias|) + ABS (one output rounding and the
  tensor cores' float32 accumulation); the worst ratio is printed.
- NaN / inf / all-zero rows of x stay in their own output rows; padded-row x views that the copy engine cannot
  describe fall back to the tl kernels; quantfuse.weight_only_mm dispatches here where `prefer` says; CUDA graph
  capture and replay.
"""

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import weight_only_wgmma as ww
from quantfuse.kernels import weight_only_ws as ws
from tests.gpu import sm90_gluon_marks

pytestmark = sm90_gluon_marks("wgmma kernel")

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"
REL = {BF16: 2.0**-7 + 2.0**-14, FP16: 2.0**-10 + 2.0**-17}
ABS = {BF16: 0.0, FP16: 2.0**-24}
# (group, symmetric, scale dtype; "x": the activation dtype)
SCHEMES = [(128, True, torch.float32), (128, False, "x"), (256, False, torch.float32), (-1, True, "x"),
           (-1, False, torch.float32)]
CFGS = ww.all_configs("sm90")


def _weight(n, k):
    blocks = -(-k // 128)
    mag = torch.exp2(torch.randint(-3, 4, (n, blocks), device=DEV).float()).repeat_interleave(128, dim=1)[:, :k]
    return torch.randn(n, k, device=DEV) * mag


def _quantized(n, k, scheme, dtype):
    group, sym, sdt = scheme
    return qf.quantize_weight(_weight(n, k), bits=4, group_size=group, symmetric=sym,
                              scale_dtype=dtype if sdt == "x" else sdt)


def _run(x, qw, bias=None, cfg=None, splits=None, tail=None):
    return ww.wgmma_w4_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, qw.shape[0], config=cfg,
                          splits=splits, tail=tail)


def _graph_replayed(x, qw):
    """quantfuse.weight_only_mm captured in a CUDA graph on a copy of x, replayed on fresh values x2: (x2, output)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qf.weight_only_mm(static_x, qw)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = qf.weight_only_mm(static_x, qw)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    return x2, static_y


def _check_bound(y, x, qw, bias, label):
    w = qw.dequantize(x.dtype).float()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        b = bias.float() if bias is not None else torch.zeros(w.shape[0], device=DEV)
        want = x.float() @ w.t() + b
        mag = x.float().abs() @ w.abs().t() + b.abs()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    ratio = float(((y.float() - want).abs() / (REL[y.dtype] * mag + ABS[y.dtype] + 1e-30)).max())
    print(f"{label}: worst err / bound {ratio:.3g}")
    assert ratio <= 1.0, label


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"g{s[0]}{'s' if s[1] else 'a'}-{str(s[2])[6:]}")
def test_identity_rows_give_w_hat_bit_for_bit(scheme, dtype):
    k, n = 392, 257  # 3 full chunks + 8 codes; a partial last group; N past the last full tile
    qw = _quantized(n, k, scheme, dtype)
    w_hat = qw.dequantize(dtype)
    for i, cfg in enumerate(CFGS):
        # whole-K tiles, split-K, and the tail split (the last column tiles split over K in a second launch)
        for rows, splits, tail in ((range(0, 256), None, None), (range(256, k), 3, None),
                                   (range(0, 200), None, ww.TailSplit(1, 3)),
                                   (range(100, k), None, ww.TailSplit(2, 2))):
            rows = torch.tensor(list(rows), device=DEV)
            x = torch.zeros(len(rows), k, device=DEV, dtype=dtype)
            x[torch.arange(len(rows), device=DEV), rows] = 1
            y = _run(x, qw, cfg=cfg, splits=splits, tail=tail)
            bad = int((y != w_hat[:, rows].t()).sum())
            assert bad == 0, f"{cfg} splits={splits} tail={tail}: {bad} outputs differ from w_hat"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n,ms", [(4096, 6144, [1, 17, 129, 256, 1024]), (7392, 257, [200, 513]),
                                    (200, 100, [130, 300]), (14336, 4096, [384])])
def test_random_x_within_bound(k, n, ms, dtype):
    for si, scheme in enumerate(SCHEMES):
        if scheme[0] > 0 and k < scheme[0]:
            continue
        qw = _quantized(n, k, scheme, dtype)
        bias = torch.randn(n, device=DEV).to(dtype)
        for j, m in enumerate(ms):
            x = torch.randn(m, k, device=DEV).to(dtype)
            assert ww.applies(x, qw.qweight, qw.scales, 4, qw.group_size)
            cfg = CFGS[(si + j) % len(CFGS)]
            for splits in (None, 1) if j % 2 == 0 else (None, 5):
                y = _run(x, qw, bias, cfg, splits)
                _check_bound(y, x, qw, bias, f"{cfg.block_m} splits={splits} g{scheme[0]} K{k}N{n}M{m} {dtype}")


@pytest.mark.parametrize("k,n,m,tail", [(4096, 6144, 1024, ww.TailSplit(33, 2)),
                                        (8192, 10240, 512, ww.TailSplit(66, 4)),
                                        (7392, 257, 513, ww.TailSplit(1, 3)), (392, 300, 77, ww.TailSplit(2, 4))])
def test_tail_split_is_the_two_launches_it_stands_for(k, n, m, tail):
    """Main columns bit for bit the one-launch product, the tail columns bit for bit a split-K launch with the same
    K partition (same partials, same reduce), bias on both; within the bound against the reference."""
    for si, scheme in enumerate(SCHEMES[:3]):
        dtype = BF16 if si % 2 == 0 else FP16
        qw = _quantized(n, k, scheme, dtype)
        bias = torch.randn(n, device=DEV).to(dtype)
        x = torch.randn(m, k, device=DEV).to(dtype)
        for cfg in CFGS:
            if tail.main_tiles_n >= -(-n // cfg.block_n):
                continue
            y = _run(x, qw, bias, cfg, tail=tail)
            n_main = tail.main_tiles_n * cfg.block_n
            whole = _run(x, qw, bias, cfg, splits=1)
            split = _run(x, qw, bias, cfg, splits=tail.splits)
            assert torch.equal(y[:, :n_main], whole[:, :n_main]), f"{cfg} {tail}: main columns"
            assert torch.equal(y[:, n_main:], split[:, n_main:]), f"{cfg} {tail}: tail columns"
            _check_bound(y, x, qw, bias, f"{cfg.block_m} {tail} g{scheme[0]} K{k}N{n}M{m}")


def test_tail_split_chosen_by_the_model_runs_under_a_graph(monkeypatch):
    monkeypatch.setattr(ws, "WS_W4_DISPATCH", {})  # weight_only_mm's M = 1024 goes to the warp-specialized kernel
    qw = _quantized(10240, 8192, SCHEMES[0], BF16)
    x = torch.randn(1024, 8192, device=DEV).to(BF16)
    cfg = ww.pick_config(1024, 10240, 8192, x.device)
    tail = ww.tail_split_for(1024, 10240, 8192, cfg, torch.cuda.get_device_properties(0).multi_processor_count)
    assert tail is not None
    want = _run(x, qw, cfg=cfg, tail=tail)
    assert torch.equal(qf.weight_only_mm(x, qw), want)
    x2, y2 = _graph_replayed(x, qw)
    assert torch.equal(y2, _run(x2, qw, cfg=cfg, tail=tail))


def test_bad_tail_refused():
    qw = _quantized(300, 392, SCHEMES[0], BF16)
    x = torch.randn(64, 392, device=DEV).to(BF16)
    for tail in (ww.TailSplit(0, 2), ww.TailSplit(3, 2), ww.TailSplit(1, 1), ww.TailSplit(1, 5)):
        with pytest.raises(ValueError, match="tail"):
            _run(x, qw, cfg=CFGS[0], tail=tail)
    with pytest.raises(ValueError, match="splits and tail"):
        _run(x, qw, cfg=CFGS[0], splits=2, tail=ww.TailSplit(1, 2))


def special_rows_checked(run, qw):
    """A NaN, an inf and an all-zero row of x through run(x, qw): each stays in its own output row, every other row
    bit for bit the clean product's."""
    x = torch.randn(300, qw.shape[1], device=DEV).to(BF16)
    clean = run(x, qw)
    x[5, 17] = float("nan")
    x[77, 3] = float("inf")
    x[200] = 0
    y = run(x, qw)
    assert torch.isnan(y[5]).all() and not torch.isfinite(y[77]).any() and (y[200] == 0).all()
    others = torch.ones(300, dtype=torch.bool, device=DEV)
    others[[5, 77, 200]] = False
    assert torch.equal(y[others], clean[others])


def test_special_rows_stay_in_their_rows():
    special_rows_checked(_run, _quantized(1024, 4096, SCHEMES[0], BF16))


def _spy_dispatch(monkeypatch):
    """Wraps ww.wgmma_w4_mm for weight_only_mm's dispatch: (the (M, config) of each call, the unwrapped function)."""
    calls = []
    real = ww.wgmma_w4_mm

    def spy(*args, **kwargs):
        calls.append((args[0].shape[0], kwargs.get("config")))
        return real(*args, **kwargs)

    monkeypatch.setattr(ww, "wgmma_w4_mm", spy)
    return calls, real


# 16-bit scales at M = 32 / 64 / 128 (weight_only_wgmma.small_m_config): this kernel with M's config; float32
# scales, other M and a poorly filled grid: the tl tiles
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_small_m_16bit_scales_dispatch(monkeypatch, dtype):
    calls, _ = _spy_dispatch(monkeypatch)
    for scheme in ((128, True, "x"), (-1, False, "x")):
        qw = _quantized(6144, 4096, scheme, dtype)
        bias = torch.randn(6144, device=DEV).to(dtype)
        for m in (32, 64, 128):
            x = torch.randn(m, 4096, device=DEV).to(dtype)
            y = qf.weight_only_mm(x, qw, bias)
            assert calls[-1] == (m, ww.SMALL_M_16BIT["sm90"][m])
            _check_bound(y, x, qw, bias, f"small M {m} g{scheme[0]} {dtype}")
        n_calls = len(calls)
        qf.weight_only_mm(torch.randn(96, 4096, device=DEV).to(dtype), qw)  # rows past M: the tl tile
        assert len(calls) == n_calls
    qw32 = _quantized(6144, 4096, SCHEMES[0], dtype)  # float32 scales
    qf.weight_only_mm(torch.randn(64, 4096, device=DEV).to(dtype), qw32)
    # 160 tiles of 64 x 64 at M = 64, 2 splits: 320 of 3 x SMs (0.81 on the H100): this kernel
    qw_wide = _quantized(10240, 8192, (128, True, "x"), dtype)
    x = torch.randn(64, 8192, device=DEV).to(dtype)
    _check_bound(qf.weight_only_mm(x, qw_wide), x, qw_wide, torch.zeros(10240, device=DEV, dtype=dtype), "160 tiles")
    assert len(calls) == 7
    # 3 x SMs + 4 tiles, no split: about half of two rounds of 3 x SMs (under SMALL_M_MIN_FILL): the tl tile
    n_poor = (3 * torch.cuda.get_device_properties(0).multi_processor_count + 4) * 64
    qw_poor = _quantized(n_poor, 512, (128, True, "x"), dtype)
    qf.weight_only_mm(torch.randn(64, 512, device=DEV).to(dtype), qw_poor)
    assert len(calls) == 7


def test_dispatch_graph_and_fallback(monkeypatch):
    qw = _quantized(6144, 4096, SCHEMES[0], BF16)
    calls, real = _spy_dispatch(monkeypatch)
    x = torch.randn(256, 4096, device=DEV).to(BF16)
    y = qf.weight_only_mm(x, qw)
    assert calls == [(256, None)] and torch.equal(y, real(x, qw.qweight, qw.scales, qw.zeros, None, 128, 6144))
    qf.weight_only_mm(x[:64], qw)  # M <= 128: the tl wide tile
    qf.weight_only_mm(torch.randn(2048, 4096, device=DEV).to(BF16), qw)  # the warp-specialized kernel
    assert calls == [(256, None)]
    # a padded-row view whose row stride (4100 x 2 bytes) no tensor descriptor takes: the tl kernels
    xp = torch.randn(256, 4100, device=DEV).to(BF16)[:, :4096]
    assert not ww.applies(xp, qw.qweight, qw.scales, 4, 128)
    _check_bound(qf.weight_only_mm(xp, qw), xp, qw, None, "padded view")
    assert calls == [(256, None)]
    # CUDA graph capture and replay
    x2, y2 = _graph_replayed(x, qw)
    assert torch.equal(y2, real(x2, qw.qweight, qw.scales, qw.zeros, None, 128, 6144))
