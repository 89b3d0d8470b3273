"""The warp-specialized Gluon int4 kernel for prefill-sized M (kernels/weight_only_ws.py, sm90) on the GPU.

- Identity rows of x give w_hat bit for bit (each output is one exact product): which field, word, group, zero
  point and scale the producer converts into which slot, for every scheme (group 128 / 256 / per channel,
  symmetric or not, float32 scales and 16-bit scales of x's dtype), bf16 and fp16, K with a partial chunk and
  group, N past the last full tile, with and without the tail split.
- Random x against ref = x.float() @ w_hat.float().T + bias (TF32 off) within the bound of
  test_weight_only_wgmma_gpu.py.
- The tail split is the two launches it stands for: main columns bit for bit this kernel's whole product, tail
  columns bit for bit weight_only_wgmma's split-K launch.
- NaN / inf / all-zero rows stay in their rows; quantfuse.weight_only_mm runs the kernel where `prefer` says
  (M = 1024..2048, and M = 256..1023 where the model keeps whole-K 256 x 128 tiles; float32 or 16-bit scales) and
  not elsewhere; CUDA graph capture and replay.
"""

import pytest
import torch

import quantfuse as qf
from quantfuse.kernels import weight_only_wgmma as ww
from quantfuse.kernels import weight_only_ws as ws
from tests.gpu import sm90_gluon_marks
from tests.gpu.test_weight_only_wgmma_gpu import (BF16, FP16, SCHEMES, _check_bound, _graph_replayed, _quantized,
                                                   special_rows_checked)

pytestmark = sm90_gluon_marks("warp-specialized kernel")

DEV = "cuda"
TILE_CFG = next(c for c in ww.all_configs("sm90") if (c.block_m, c.block_n) == (ws.BLOCK_M, ws.BLOCK_N))


def _run(x, qw, bias=None, tail=None):
    assert ws.applies(x, qw.qweight, qw.scales, 4, qw.group_size, qw.zeros)
    return ws.ws_w4_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, qw.shape[0],
                       tail=None if tail is None else (TILE_CFG, tail))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"g{s[0]}{'s' if s[1] else 'a'}-{str(s[2])[6:]}")
def test_identity_rows_give_w_hat_bit_for_bit(scheme, dtype):
    k, n = 392, 264  # 3 full chunks + 8 codes; a partial last group; N past the last full tile (describable rows)
    qw = _quantized(n, k, scheme, dtype)
    w_hat = qw.dequantize(dtype)
    for rows, tail in ((range(0, k), None), (range(0, 300), ww.TailSplit(1, 3)), (range(50, k), ww.TailSplit(2, 2))):
        rows = torch.tensor(list(rows), device=DEV)
        x = torch.zeros(len(rows), k, device=DEV, dtype=dtype)
        x[torch.arange(len(rows), device=DEV), rows] = 1
        y = _run(x, qw, tail=tail)
        bad = int((y != w_hat[:, rows].t()).sum())
        assert bad == 0, f"tail={tail}: {bad} outputs differ from w_hat"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n,ms", [(4096, 6144, [256, 1024]), (7392, 264, [513]), (256, 128, [300]),
                                    (14336, 4096, [1100])])
def test_random_x_within_bound(k, n, ms, dtype):
    for scheme in SCHEMES:
        if scheme[0] > 0 and k < scheme[0]:
            continue
        qw = _quantized(n, k, scheme, dtype)
        bias = torch.randn(n, device=DEV).to(dtype)
        for m in ms:
            x = torch.randn(m, k, device=DEV).to(dtype)
            _check_bound(_run(x, qw, bias), x, qw, bias, f"ws g{scheme[0]} K{k}N{n}M{m} {dtype}")


@pytest.mark.parametrize("k,n,m,tail", [(4096, 6144, 1024, ww.TailSplit(33, 2)), (7392, 264, 513, ww.TailSplit(1, 3)),
                                        (392, 520, 256, ww.TailSplit(2, 4))])
def test_tail_split_is_the_two_launches_it_stands_for(k, n, m, tail):
    for si, scheme in enumerate(SCHEMES[:3]):
        dtype = BF16 if si % 2 == 0 else FP16
        qw = _quantized(n, k, scheme, dtype)
        bias = torch.randn(n, device=DEV).to(dtype)
        x = torch.randn(m, k, device=DEV).to(dtype)
        y = _run(x, qw, bias, tail)
        n_main = tail.main_tiles_n * ws.BLOCK_N
        whole = _run(x, qw, bias)
        split = ww.wgmma_w4_mm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, n, config=TILE_CFG,
                               splits=tail.splits)
        assert torch.equal(y[:, :n_main], whole[:, :n_main]), f"{tail}: main columns"
        assert torch.equal(y[:, n_main:], split[:, n_main:]), f"{tail}: tail columns"
        _check_bound(y, x, qw, bias, f"ws {tail} g{scheme[0]} K{k}N{n}M{m}")


def test_bad_tail_refused():
    qw = _quantized(520, 392, SCHEMES[1], BF16)
    x = torch.randn(256, 392, device=DEV).to(BF16)
    other = next(c for c in ww.all_configs("sm90") if c.block_m != ws.BLOCK_M)
    with pytest.raises(ValueError, match="tail"):
        ws.ws_w4_mm(x, qw.qweight, qw.scales, qw.zeros, None, 128, 520, tail=(other, ww.TailSplit(1, 2)))


def test_special_rows_stay_in_their_rows():
    special_rows_checked(_run, _quantized(1024, 4096, SCHEMES[1], BF16))


def test_dispatch_graph_and_fallback(monkeypatch):
    calls = []
    real = ws.ws_w4_mm

    def spy(*args, **kwargs):
        calls.append((args[0].shape[0], kwargs.get("tail")))
        return real(*args, **kwargs)

    monkeypatch.setattr(ws, "ws_w4_mm", spy)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 16-bit scales, M = 1024: this kernel (whole waves: no tail)
    qw = _quantized(8192, 4096, SCHEMES[1], BF16)
    x = torch.randn(1024, 4096, device=DEV).to(BF16)
    y = qf.weight_only_mm(x, qw)
    assert calls == [(1024, None)] and torch.equal(y, _run(x, qw))
    x2, y2 = _graph_replayed(x, qw)
    assert torch.equal(y2, _run(x2, qw))
    # float32 scales, M = 2048: this kernel too
    calls.clear()
    qw32 = _quantized(8192, 4096, SCHEMES[0], BF16)
    x = torch.randn(2048, 4096, device=DEV).to(BF16)
    y = qf.weight_only_mm(x, qw32)
    assert calls == [(2048, None)] and torch.equal(y, _run(x, qw32))
    # M = 256..1023 where the model keeps whole-K 256 x 128 tiles: this kernel (M = 512: whole waves; 640: a tail)
    calls.clear()
    y = qf.weight_only_mm(x[:512], qw32)
    assert calls == [(512, None)] and torch.equal(y, _run(x[:512], qw32))
    calls.clear()
    plan = ws.tail_plan(640, 8192, 4096, "sm90", sms)
    assert plan is not None
    y = qf.weight_only_mm(x[:640], qw32)
    assert calls == [(640, plan)] and torch.equal(y, _run(x[:640], qw32, tail=plan[1]))
    # where the model splits K (M = 256 here), and past M = 2048: weight_only_wgmma / dequantize + cuBLAS as before
    calls.clear()
    qf.weight_only_mm(x[:256], qw)
    qf.weight_only_mm(torch.randn(4096, 4096, device=DEV).to(BF16), qw)
    assert calls == []
    # a last wave the model splits: this kernel on whole waves, weight_only_wgmma's split-K launch on the rest
    qw = _quantized(10240, 8192, SCHEMES[3], FP16)
    x = torch.randn(1024, 8192, device=DEV).to(FP16)
    plan = ws.tail_plan(1024, 10240, 8192, "sm90", sms)
    assert plan is not None
    y = qf.weight_only_mm(x, qw)
    assert calls == [(1024, plan)] and torch.equal(y, _run(x, qw, tail=plan[1]))
    x2, y2 = _graph_replayed(x, qw)
    assert torch.equal(y2, _run(x2, qw, tail=plan[1]))
