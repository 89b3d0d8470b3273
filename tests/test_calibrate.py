"""Calibrators (SPEC section 5) and SmoothQuant.

The histogram methods are checked against a separate, deliberately plain implementation written here
from the description of pytorch-quantization's algorithms (Python loops, bisect, float32 numpy scalars),
on shared histograms: the same bins and the same amax must come out, bit for bit.
"""

import bisect
import math
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from quantfuse.calibrate import (
    HistogramCalibrator,
    MaxCalibrator,
    apply_smoothquant,
    histogram_amax_entropy,
    histogram_amax_mse,
    histogram_amax_percentile,
    smoothquant_factors,
)


# ----------------------------------------------------------------------------------------------------
# The plain implementation
# ----------------------------------------------------------------------------------------------------
def plain_histogram(batches, num_bins):
    """|x| histogram from 0: the first batch with a non-zero value fixes width = max / num_bins (nudged
    up until num_bins * width covers the max); a later larger max appends bins of that width."""
    width, counts, zeros_before = None, [], 0
    for batch in batches:
        values = [abs(float(v)) for v in batch.reshape(-1).tolist()]
        top = max(values)
        if width is None:
            if top == 0.0:
                zeros_before += len(values)
                continue
            width = top / num_bins
            while num_bins * width < top:
                width = math.nextafter(width, math.inf)
            counts = [0] * num_bins
            counts[0] += zeros_before
        if top > len(counts) * width:
            more = math.ceil(top / width)
            while more * width < top:
                more += 1
            counts += [0] * (more - len(counts))
        edges = [k * width for k in range(len(counts) + 1)]
        for v in values:
            k = bisect.bisect_right(edges, v) - 1
            counts[min(k, len(counts) - 1)] += 1
    return counts, edges


def plain_percentile(counts, edges, percentile):
    total = sum(counts)
    running = 0
    for k, c in enumerate(counts):
        running += c
        if Fraction(running, total) >= Fraction(percentile) / 100:
            return edges[k]
    return edges[len(counts) - 1]


def plain_mse(counts, edges, start_bin, stride, qmax=127):
    centers = [(np.float32(edges[k]) + np.float32(edges[k + 1])) / np.float32(2) for k in range(len(counts))]
    best_err, best_amax = None, None
    for i in range(start_bin, len(centers), stride):
        amax = centers[i]
        scale = np.float32(qmax) / amax
        err = 0.0
        for c, n in zip(centers, counts):
            if n == 0:
                continue
            code = np.clip(np.rint(c * scale), np.float32(-qmax), np.float32(qmax))
            d = float(np.float32(code / scale - c))
            err += d * d * n
        if best_err is None or err < best_err:  # first minimum
            best_err, best_amax = err, float(amax)
    return best_amax


def plain_kl(p, q):
    sp, sq = sum(p), sum(q)
    if sq == 0:
        return math.inf
    kl = 0.0
    for a, b in zip(p, q):
        if a == 0:
            continue
        if b == 0:
            return math.inf
        kl += (a / sp) * math.log((a / sp) / (b / sq))
    return kl


def plain_entropy(counts, edges, start_bin, stride, levels=128):
    bins = [float(c) for c in counts]
    bins[0] = bins[1]
    best_kl, best_i = None, None
    for i in range(start_bin, len(bins) + 1, stride):
        # split [0, i) into `levels` equal intervals; bin j belongs to the interval holding j
        bounds = np.linspace(0, i, levels + 1).tolist()
        level = [bisect.bisect_right(bounds, j) - 1 for j in range(i)]
        level_total, level_used = {}, {}
        for j in range(i):
            if bins[j] > 0:
                level_total[level[j]] = level_total.get(level[j], 0.0) + bins[j]
                level_used[level[j]] = level_used.get(level[j], 0) + 1
        q = [level_total[level[j]] / level_used[level[j]] if bins[j] > 0 else 0.0 for j in range(i)]
        p = bins[:i]
        p[-1] += sum(bins[i:])
        kl = plain_kl(p, q)
        if best_kl is None or kl <= best_kl:  # last minimum
            best_kl, best_i = kl, i
    return edges[best_i]


def shared_histogram(batches, num_bins):
    """Our histogram and the plain one from the same batches; they must agree exactly."""
    cal = HistogramCalibrator(num_bins=num_bins)
    for b in batches:
        cal.collect(b)
    counts, edges = cal.histogram
    plain_counts, plain_edges = plain_histogram(batches, num_bins)
    assert counts.tolist() == plain_counts
    assert edges.tolist() == plain_edges
    return cal, plain_counts, plain_edges


def activation_like(n, scale=1.0):
    """Heavy-tailed values with exact zeros (post-ReLU/GELU-like) and a few outliers."""
    x = torch.randn(n) * scale
    x = torch.where(torch.rand(n) < 0.3, torch.zeros_like(x), x)
    x[torch.randint(0, n, (5,))] *= 8.0
    return x


# ----------------------------------------------------------------------------------------------------
# MaxCalibrator
# ----------------------------------------------------------------------------------------------------
def test_max_per_tensor_over_batches():
    cal = MaxCalibrator()
    batches = [torch.randn(7, 13), torch.randn(3, 5, 13) * 4, torch.randn(2, 13).to(torch.bfloat16)]
    for b in batches:
        cal.collect(b)
    expected = max(float(b.float().abs().max()) for b in batches)
    amax = cal.compute_amax()
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert float(amax) == expected


def test_max_per_channel_last_axis_varying_leading_dims():
    cal = MaxCalibrator(axis=-1)
    batches = [torch.randn(4, 9, 11), torch.randn(17, 11) * 3, torch.randn(1, 2, 3, 11).half()]
    for b in batches:
        cal.collect(b)
    expected = torch.stack([b.float().reshape(-1, 11).abs().amax(0) for b in batches]).amax(0)
    assert torch.equal(cal.compute_amax(), expected)


def test_max_per_channel_middle_axis_and_tuple():
    x1, x2 = torch.randn(2, 6, 5, 5), torch.randn(3, 6, 4, 4) * 2
    cal = MaxCalibrator(axis=1)
    cal.collect(x1)
    cal.collect(x2)
    expected = torch.maximum(x1.abs().amax((0, 2, 3)), x2.abs().amax((0, 2, 3)))
    assert torch.equal(cal.compute_amax(), expected)

    y1, y2 = torch.randn(4, 3, 7), torch.randn(4, 8, 7)
    cal2 = MaxCalibrator(axis=(0, -1))
    cal2.collect(y1)
    cal2.collect(y2)
    assert torch.equal(cal2.compute_amax(), torch.maximum(y1.abs().amax(1), y2.abs().amax(1)))


def test_max_reset_and_errors():
    cal = MaxCalibrator(axis=-1)
    with pytest.raises(RuntimeError, match="no data"):
        cal.compute_amax()
    cal.collect(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"channel shape \(8,\).*\(9,\)"):
        cal.collect(torch.randn(3, 9))
    cal.reset()
    cal.collect(torch.randn(2, 9))
    assert cal.compute_amax().shape == (9,)
    with pytest.raises(ValueError, match="NaN/Inf"):
        cal.collect(torch.tensor([[1.0, float("nan")] * 4 + [0.0]]))
    with pytest.raises(ValueError, match="axis: 3 is out of range"):
        MaxCalibrator(axis=3).collect(torch.randn(2, 2))
    with pytest.raises(TypeError, match="axis"):
        MaxCalibrator(axis="channels")
    with pytest.raises(TypeError, match="x: expected dtype"):
        MaxCalibrator().collect(torch.ones(3, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------
# Histogram: construction and growth
# ----------------------------------------------------------------------------------------------------
def test_histogram_growth_keeps_bin_width():
    cal = HistogramCalibrator(num_bins=64)
    cal.collect(torch.tensor([0.5, -1.0, 0.25]))
    width = cal.bin_width
    assert width == 1.0 / 64
    cal.collect(torch.tensor([-2.5, 0.0]))  # exceeds the range: bins of the same width are appended
    counts, edges = cal.histogram
    assert cal.bin_width == width and counts.numel() == 160 and float(edges[-1]) == 2.5
    assert counts.sum() == 5 and counts[0] == 1 and counts[16] == 1 and counts[32] == 1
    assert counts[63] == 1 and counts[159] == 1  # 1.0 is the first batch's top edge: last bin then
    cal.collect(torch.tensor([1.0]))  # now 1.0 is an inner edge: it opens bin 64
    assert cal.histogram[0][64] == 1


def test_histogram_zeros_before_first_range_and_reset():
    cal = HistogramCalibrator(num_bins=16)
    with pytest.raises(RuntimeError, match="no data"):
        cal.compute_amax()
    cal.collect(torch.zeros(5))
    assert float(cal.compute_amax("percentile")) == 0.0
    cal.collect(torch.tensor([0.0, 4.0, -2.0]))
    counts, edges = cal.histogram
    assert counts[0] == 6 and counts[8] == 1 and counts[15] == 1 and float(edges[-1]) == 4.0
    cal.reset()
    assert cal.histogram is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_histogram_matches_plain_across_growing_batches(dtype):
    batches = [activation_like(3000, s).to(dtype) for s in (1.0, 0.3, 2.5, 1.0, 6.0)]
    shared_histogram(batches, num_bins=512)


def test_histogram_bad_arguments():
    with pytest.raises(ValueError, match="num_bins: expected an integer >= 2, got 1"):
        HistogramCalibrator(num_bins=1)
    cal = HistogramCalibrator(num_bins=256)
    with pytest.raises(ValueError, match="NaN/Inf"):
        cal.collect(torch.tensor([1.0, float("inf")]))
    cal.collect(torch.randn(1000))
    with pytest.raises(ValueError, match="method: expected 'percentile', 'mse' or 'entropy', got 'kl'"):
        cal.compute_amax("kl")
    with pytest.raises(ValueError, match="percentile: expected a number in \\[0, 100\\], got 101"):
        cal.compute_amax("percentile", percentile=101)
    with pytest.raises(ValueError, match="start_bin: expected at most 256"):
        cal.compute_amax("entropy", start_bin=300)
    with pytest.raises(ValueError, match="stride: expected an integer >= 1, got 0"):
        cal.compute_amax("mse", stride=0)
    with pytest.raises(ValueError, match="edges: expected shape \\(5,\\)"):
        histogram_amax_percentile(torch.ones(4), torch.arange(4.0))


# ----------------------------------------------------------------------------------------------------
# Histogram methods: hand-computed cases
# ----------------------------------------------------------------------------------------------------
def test_percentile_hand_cases():
    counts, edges = torch.tensor([1, 1, 1, 1]), torch.arange(5, dtype=torch.float64)
    assert float(histogram_amax_percentile(counts, edges, 50)) == 1.0  # CDF 0.5 reached in bin 1
    assert float(histogram_amax_percentile(counts, edges, 50.0001)) == 2.0
    assert float(histogram_amax_percentile(counts, edges, 100)) == 3.0  # left edge of the last bin
    # 99.99 % of 10000 values is exactly 9999 of them: the bin holding the 9999th value
    counts = torch.zeros(10, dtype=torch.int64)
    counts[2], counts[5], counts[7] = 9998, 1, 1
    assert float(histogram_amax_percentile(counts, torch.arange(11.0), 99.99)) == 5.0


def test_mse_hand_cases():
    # 2-bit signed grid (qmax 1), unit bins: centres 0.5, 1.5, 2.5, 3.5; candidates exclude the last
    edges = torch.arange(5, dtype=torch.float64)
    one = dict(num_bits=2, start_bin=0)
    assert float(histogram_amax_mse(torch.tensor([3, 0, 0, 0]), edges, **one)) == 0.5
    # all mass at 2.5: amax 0.5 clips to 0.5 (error 4 each), 1.5 clips to 1.5 (1), 2.5 is exact
    assert float(histogram_amax_mse(torch.tensor([0, 0, 5, 0]), edges, **one)) == 2.5
    # mass at 0.5 and 1.5: amax 0.5 clips 1.5 to 0.5 (error 1 each); amax 1.5 rounds 0.5 to 0 (0.25 each)
    assert float(histogram_amax_mse(torch.tensor([5, 1, 0, 0]), edges, **one)) == 0.5
    assert float(histogram_amax_mse(torch.tensor([1, 4, 0, 0]), edges, **one)) == 1.5


def test_entropy_hand_cases():
    edges = torch.arange(5, dtype=torch.float64)
    # 2 levels. bins -> [2, 2, 2, 1] (bin 0 takes bin 1's count). KL: i=2 0.0949, i=3 0.0196, i=4 0.0243
    assert float(histogram_amax_entropy(torch.tensor([4, 2, 2, 1]), edges, num_bits=2, start_bin=2)) == 3.0
    # i=1 and i=4 both give P == Q (KL 0): the last minimum wins
    assert float(histogram_amax_entropy(torch.tensor([3, 3, 3, 3]), edges, num_bits=2, start_bin=1)) == 4.0
    # bins [5, 5, 0, 1]: i=3 folds the tail onto the empty bin 2 (inf); i=4 reproduces P exactly (0)
    assert float(histogram_amax_entropy(torch.tensor([0, 5, 0, 1]), edges, num_bits=2, start_bin=2)) == 4.0


# ----------------------------------------------------------------------------------------------------
# Histogram methods vs the plain implementation on shared histograms
# ----------------------------------------------------------------------------------------------------
SHAPES_OF_DATA = {
    "gaussian": lambda: [torch.randn(4000)],
    "activations_growing": lambda: [activation_like(2500, s) for s in (1.0, 2.0, 0.7, 3.5)],
    "uniform_then_outlier": lambda: [torch.rand(3000) * 2 - 1, torch.tensor([5.0, -0.1])],
    "sparse_levels": lambda: [torch.randint(-3, 4, (2000,)).float() * 0.25, torch.tensor([2.0])],
}


@pytest.mark.parametrize("data", sorted(SHAPES_OF_DATA))
def test_methods_match_plain_on_shared_histograms(data):
    batches = SHAPES_OF_DATA[data]()
    cal, counts, edges = shared_histogram(batches, num_bins=512)
    n = len(counts)
    stride = 1 if n <= 600 else 3
    for p in (99.0, 99.9, 99.99, 100.0):
        assert float(cal.compute_amax("percentile", percentile=p)) == np.float32(plain_percentile(counts, edges, p))
    mse = cal.compute_amax("mse", start_bin=128, stride=stride)
    assert float(mse) == plain_mse(counts, edges, 128, stride)
    ent = cal.compute_amax("entropy", start_bin=128, stride=stride)
    assert float(ent) == np.float32(plain_entropy(counts, edges, 128, stride))


def test_methods_match_plain_default_2048_bins_strided():
    batches = [activation_like(20000, 1.0), activation_like(20000, 1.6)]
    cal, counts, edges = shared_histogram(batches, num_bins=2048)
    assert len(counts) > 2048  # grew
    assert float(cal.compute_amax("entropy", stride=16)) == np.float32(plain_entropy(counts, edges, 128, 16))
    assert float(cal.compute_amax("mse", stride=16)) == plain_mse(counts, edges, 128, 16)
    assert float(cal.compute_amax("percentile")) == np.float32(plain_percentile(counts, edges, 99.99))


def test_entropy_and_mse_are_fast_on_2048_bins():
    cal = HistogramCalibrator()  # 2048 bins
    cal.collect(activation_like(200_000))
    counts, edges = cal.histogram
    histogram_amax_entropy(counts[:256], edges[:257])  # warm-up of torch's kernels
    for method in ("entropy", "mse"):
        start = time.perf_counter()
        cal.compute_amax(method)
        elapsed = time.perf_counter() - start
        assert elapsed < 1.0, f"{method} over 2048 bins took {elapsed:.2f} s"


def test_methods_give_sensible_ranges_for_gaussian():
    cal = HistogramCalibrator()
    x = torch.randn(200_000)
    cal.collect(x)
    top = float(x.abs().max())
    for method in ("percentile", "mse", "entropy"):
        amax = float(cal.compute_amax(method))
        assert 2.0 < amax <= top, (method, amax, top)
    assert float(cal.compute_amax("entropy")) < top * 0.97


# ----------------------------------------------------------------------------------------------------
# SmoothQuant
# ----------------------------------------------------------------------------------------------------
def test_smoothquant_factors_hand_case():
    act = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([[1.0, 4.0, 2.0], [-2.0, 1.0, 0.0]])
    s = smoothquant_factors(act, w, alpha=0.5)
    expected = torch.tensor([math.sqrt(4 / 2), math.sqrt(1 / 4), math.sqrt(1e-5 / 2)], dtype=torch.float32)
    torch.testing.assert_close(s, expected, rtol=1e-6, atol=0)
    # several consumers: the weight max is over all of them
    s2 = smoothquant_factors(act, [w, torch.tensor([[0.5, 9.0, 0.0]])], alpha=0.75)
    col = torch.tensor([2.0, 9.0, 2.0])
    expected2 = act.clamp(min=1e-5).double().pow(0.75) / col.double().pow(0.25)
    torch.testing.assert_close(s2, expected2.float(), rtol=1e-6, atol=0)
    assert torch.equal(smoothquant_factors(act, w, alpha=0.0), (1 / torch.tensor([2.0, 4.0, 2.0])))
    # a dead weight column gives a finite factor too
    assert torch.isfinite(smoothquant_factors(act, torch.zeros(2, 3))).all()


def _outlier_activations(m, k, dtype=torch.float64):
    x = torch.randn(m, k, dtype=dtype)
    x[:, [1, k // 2]] *= 30.0  # outlier channels, the reason for SmoothQuant
    return x


@pytest.mark.parametrize("norm_kind", ["layernorm", "rmsnorm"])
def test_smoothquant_norm_into_linears_keeps_function(norm_kind):
    k = 48
    norm = nn.LayerNorm(k) if norm_kind == "layernorm" else nn.RMSNorm(k, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k) + 0.5)
        norm.weight[3] *= 20.0
        if norm_kind == "layernorm":
            norm.bias.copy_(torch.randn(k))
    linears = [nn.Linear(k, n) for n in (40, 40, 24)]
    norm, linears = norm.double(), [lin.double() for lin in linears]
    x = _outlier_activations(37, k)

    with torch.no_grad():
        hidden = norm(x)
        before = [lin(hidden) for lin in linears]
    cal = MaxCalibrator(axis=-1)
    cal.collect(hidden)
    act_amax = cal.compute_amax()
    s = smoothquant_factors(act_amax.float(), [lin.weight for lin in linears], alpha=0.5)
    apply_smoothquant(norm, linears, s)

    with torch.no_grad():
        smoothed = norm(x)
        after = [lin(smoothed) for lin in linears]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(smoothed, hidden / s.double(), rtol=1e-12, atol=1e-12)
    # with alpha 0.5 the activation and weight column maxima meet: max|X'_j| == max|W'_:,j|
    w_cols = torch.stack([lin.weight.abs().amax(0) for lin in linears]).amax(0)
    torch.testing.assert_close(smoothed.abs().amax(0), w_cols, rtol=1e-5, atol=0)
    assert float(smoothed.abs().max()) < 0.5 * float(hidden.abs().max())


def test_smoothquant_linear_into_linear_float32():
    k = 32
    v_proj, o_proj = nn.Linear(24, k), nn.Linear(k, 24)
    x = torch.randn(19, 24)
    with torch.no_grad():
        v_proj.weight[5] *= 25.0
        before = o_proj(v_proj(x))
        s = smoothquant_factors(v_proj(x).abs().amax(0), o_proj.weight, alpha=0.6)
    apply_smoothquant(v_proj, [o_proj], s)
    with torch.no_grad():
        after = o_proj(v_proj(x))
    torch.testing.assert_close(after, before, rtol=2e-5, atol=2e-5)


def test_smoothquant_bf16_norm():
    k = 64
    norm, lin = nn.LayerNorm(k).to(torch.bfloat16), nn.Linear(k, 16).to(torch.bfloat16)
    x = _outlier_activations(8, k, torch.bfloat16)
    with torch.no_grad():
        before = lin(norm(x)).float()
        s = smoothquant_factors(norm(x).abs().amax(0), lin.weight)
    apply_smoothquant(norm, [lin], s)
    assert norm.weight.dtype == torch.bfloat16 and lin.weight.dtype == torch.bfloat16
    with torch.no_grad():
        after = lin(norm(x)).float()
    torch.testing.assert_close(after, before, rtol=0.05, atol=0.05 * float(before.abs().max()))


class OnePlusWeightNorm(nn.Module):
    """A norm computing normalize(x) * (1 + weight): 1/s cannot be folded into its weight."""

    def __init__(self, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k) * 0.1)

    def forward(self, x):
        return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + self.weight)


def test_smoothquant_bad_arguments():
    k = 8
    lin = nn.Linear(k, 4)
    s = torch.rand(k) + 0.5
    with pytest.raises(ValueError, match="linears\\[0\\]: expected in_features 9"):
        apply_smoothquant(nn.LayerNorm(9), [lin], torch.rand(9) + 0.5)
    with pytest.raises(TypeError, match="linears\\[0\\]: expected nn.Linear, got Conv1d"):
        apply_smoothquant(nn.LayerNorm(k), [nn.Conv1d(k, 4, 1)], s)
    with pytest.raises(ValueError, match="factors: expected finite, positive"):
        apply_smoothquant(nn.LayerNorm(k), [lin], torch.zeros(k))
    with pytest.raises(ValueError, match="norm_or_linear: expected out_features 8"):
        apply_smoothquant(nn.Linear(3, 5), [lin], s)
    with pytest.raises(ValueError, match="norm_or_linear: expected nn.Linear or a norm"):
        apply_smoothquant(nn.LayerNorm(k, elementwise_affine=False), [lin], s)
    odd = OnePlusWeightNorm(k)
    saved, lin_saved = odd.weight.detach().clone(), lin.weight.detach().clone()
    with pytest.raises(TypeError, match="does not scale its output by its weight"):
        apply_smoothquant(odd, [lin], s)
    assert torch.equal(odd.weight, saved) and torch.equal(lin.weight, lin_saved)
    with pytest.raises(ValueError, match="alpha: expected a number in \\[0, 1\\], got 1.5"):
        smoothquant_factors(torch.ones(k), lin.weight, alpha=1.5)
    with pytest.raises(ValueError, match="weight\\[0\\]: expected shape \\[N, 8\\]"):
        smoothquant_factors(torch.ones(k), torch.ones(4, 5))
    with pytest.raises(ValueError, match="act_amax_per_channel: expected finite, non-negative"):
        smoothquant_factors(-torch.ones(k), lin.weight)
