"""Calibration (SPEC section 5) and SmoothQuant migration.

Calibrators watch activations batch by batch (`collect(x)`, once per batch) and then propose the
clipping range `amax` from which a static scale follows (`scale = amax / qmax`, SPEC section 0).

* `MaxCalibrator(axis=None)`: running max |x| over the whole tensor, or per channel along `axis`.
* `HistogramCalibrator(num_bins=2048)`: a histogram of |x| and three ways to pick amax from it, with
  the semantics of NVIDIA pytorch-quantization's calibrators:

  - histogram: bins start at 0 and all have one width `w`, fixed by the first batch with a non-zero
    value (`w = max|x| / num_bins`). Bin k covers [k*w, (k+1)*w); the last bin also holds its right
    edge. A later batch whose max exceeds the last edge appends bins of the same width until it fits.
  - "percentile": the left edge of the first bin whose CDF reaches `percentile`/100.
  - "mse": candidate amax = the centres of bins start_bin, start_bin + stride, ... (last centre
    excluded); each bin centre c is fake-quantized (scale = qmax/amax, rne, clamp to +-qmax, / scale,
    float32) and the candidate with the least sum_k count_k * (fq(c_k) - c_k)^2 wins; the first
    minimum wins.
  - "entropy": candidate i (i = start_bin, start_bin + stride, ..., number of bins) keeps the first i
    bins, with bin 0's count replaced by bin 1's (zeros dominate activations) and every count beyond
    bin i-1 added to bin i-1: that is P. Q merges the first i bins into 2^(num_bits-1) equal levels
    (bin j < i belongs to level floor(j * levels / i)) and spreads each level's total uniformly over
    its non-empty bins (empty bins stay empty). The candidate with the least KL(P || Q) (both
    normalized) wins, and amax is the right edge of bin i-1, i.e. `edges[i]`. The last minimum wins.

All three are vectorized with torch over candidates x bins (chunked to bound memory).

`smoothquant_factors` / `apply_smoothquant` implement SmoothQuant's migration of activation outliers
into the weights: s_j = max|X_j|^alpha / max|W_{:,j}|^(1-alpha), X' = X / s, W' = W * s, folded in place
into the module that produces X so the floating-point function is unchanged.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._validation import FLOAT_DTYPES, check_tensor

__all__ = [
    "MaxCalibrator",
    "HistogramCalibrator",
    "histogram_amax_percentile",
    "histogram_amax_mse",
    "histogram_amax_entropy",
    "smoothquant_factors",
    "apply_smoothquant",
]

# Bound on the elements of one candidates x bins block in the vectorized searches (float64: 32 MiB).
_BLOCK_ELEMENTS = 1 << 22
# Calibration and SmoothQuant also accept float64 (handy for exact tests and offline statistics).
_CALIB_DTYPES = FLOAT_DTYPES + (torch.float64,)
# pytorch-quantization treats an amax at or below the smallest fp16 subnormal as zero.
_TINY_AMAX = 1.0 / (1 << 24)


def _check_finite_floats(name: str, x) -> None:
    check_tensor(name, x, _CALIB_DTYPES)
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name}: expected finite values, got {bad} NaN/Inf of {x.numel()} elements")


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------------
# Max calibration
# ----------------------------------------------------------------------------------------------------
class MaxCalibrator:
    """Running max |x| over batches.

    `axis=None`: one value for the whole tensor (a 0-dim float32 tensor). `axis=int` (or a tuple of
    ints): one value per index of those dims, reducing every other dim, e.g. `axis=-1` on [..., K]
    activations gives the per-input-channel amax [K] that SmoothQuant needs. The kept dims must keep
    their sizes across batches; the reduced ones may vary (sequence lengths, batch sizes).
    """

    def __init__(self, axis: Union[None, int, Sequence[int]] = None):
        if axis is not None:
            axes = (axis,) if isinstance(axis, int) else tuple(axis)
            if not axes or any(not isinstance(a, int) or isinstance(a, bool) for a in axes):
                raise TypeError(f"axis: expected None, an int or a non-empty tuple of ints, got {axis!r}")
            if len(set(axes)) != len(axes):
                raise ValueError(f"axis: expected distinct dims, got {axis!r}")
        self.axis = axis
        self._amax: Optional[torch.Tensor] = None

    def _kept_dims(self, x: torch.Tensor) -> Tuple[int, ...]:
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        kept = []
        for a in axes:
            if not -x.dim() <= a < x.dim():
                raise ValueError(f"axis: {a} is out of range for x of shape {tuple(x.shape)}")
            kept.append(a % x.dim())
        if len(set(kept)) != len(kept):
            raise ValueError(f"axis: {self.axis!r} names one dim twice for x of shape {tuple(x.shape)}")
        return tuple(sorted(kept))

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Fold one batch into the running max: amax = max(amax, max |x| over the reduced dims)."""
        _check_finite_floats("x", x)
        if self.axis is None:
            if x.numel() == 0:
                return
            local = x.detach().abs().amax().float()
        else:
            kept = self._kept_dims(x)
            reduced = [d for d in range(x.dim()) if d not in kept]
            if x.numel() == 0:
                return
            local = x.detach().abs().float()
            if reduced:
                local = local.amax(dim=reduced)
        if self._amax is None:
            self._amax = local.clone()
            return
        if local.shape != self._amax.shape:
            raise ValueError(
                f"x: expected the channel shape {tuple(self._amax.shape)} of earlier batches along axis "
                f"{self.axis!r}, got {tuple(local.shape)} (x shape {tuple(x.shape)})"
            )
        self._amax = torch.maximum(self._amax, local.to(self._amax.device))

    def compute_amax(self) -> torch.Tensor:
        """The max |x| seen so far (float32; 0-dim, or the kept dims' shape with `axis`)."""
        if self._amax is None:
            raise RuntimeError("MaxCalibrator.compute_amax: no data collected yet (call collect(x) first)")
        return self._amax.clone()

    def reset(self) -> None:
        self._amax = None

    def __repr__(self) -> str:
        return f"MaxCalibrator(axis={self.axis!r})"


# ----------------------------------------------------------------------------------------------------
# Histogram calibration
# ----------------------------------------------------------------------------------------------------
def _bin_edges(num_bins: int, width: float, device=None) -> torch.Tensor:
    # Edge k is fl(k * width) in float64 on every device, so bins never drift when the histogram grows.
    return torch.arange(num_bins + 1, dtype=torch.float64, device=device) * width


class HistogramCalibrator:
    """Histogram of |x| from 0 with constant bin width, growing with more bins when a later batch
    exceeds its range (see the module docstring), and `compute_amax` by percentile, MSE or entropy.

    `num_bits`/`unsigned` set the integer grid the mse and entropy searches assume (8-bit signed:
    qmax 127, 128 levels), as in pytorch-quantization. Per-tensor only (as there).
    """

    def __init__(self, num_bins: int = 2048, *, num_bits: int = 8, unsigned: bool = False):
        _check_int("num_bins", num_bins, 2)
        _check_int("num_bits", num_bits, 2)
        self.num_bins = num_bins
        self.num_bits = num_bits
        self.unsigned = bool(unsigned)
        self.reset()

    def reset(self) -> None:
        self._counts: Optional[torch.Tensor] = None
        self._width: Optional[float] = None
        # Zeros seen before any non-zero value: no bin width exists yet, they land in bin 0 later.
        self._pending_zeros = 0

    @property
    def bin_width(self) -> Optional[float]:
        return self._width

    @property
    def histogram(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(counts int64 [n], edges float64 [n + 1]) on the CPU, or None before any non-zero value."""
        if self._counts is None:
            return None
        return self._counts.cpu().clone(), _bin_edges(self._counts.numel(), self._width)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add |x| of one batch to the histogram, appending bins of the same width when needed."""
        _check_finite_floats("x", x)
        if x.numel() == 0:
            return
        values = x.detach().reshape(-1).abs().to(torch.float64)  # float16/bf16/fp32 -> fp64 is exact
        batch_max = float(values.max())
        if self._counts is None:
            if batch_max == 0.0:
                self._pending_zeros += values.numel()
                return
            width = batch_max / self.num_bins
            while self.num_bins * width < batch_max:  # the last edge must hold the max
                width = math.nextafter(width, math.inf)
            self._width = width
            self._counts = torch.zeros(self.num_bins, dtype=torch.int64, device=values.device)
            self._counts[0] += self._pending_zeros
            self._pending_zeros = 0
        n = self._counts.numel()
        if batch_max > n * self._width:
            grown = max(n, math.ceil(batch_max / self._width))
            while grown * self._width < batch_max:
                grown += 1
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grown - n)])
            n = grown
        counts = self._counts.to(values.device)
        edges = _bin_edges(n, self._width, values.device)
        # bin k holds edges[k] <= v < edges[k + 1]; v == edges[n] (the top) joins the last bin
        index = (torch.searchsorted(edges, values, right=True) - 1).clamp_(0, n - 1)
        self._counts = counts + torch.bincount(index, minlength=n)

    def compute_amax(
        self,
        method: str = "percentile",
        *,
        percentile: float = 99.99,
        start_bin: int = 128,
        stride: int = 1,
    ) -> torch.Tensor:
        """amax (0-dim float32 tensor) by "percentile", "mse" or "entropy" (module docstring).

        A histogram that saw only zeros gives amax 0."""
        if method not in ("percentile", "mse", "entropy"):
            raise ValueError(f"method: expected 'percentile', 'mse' or 'entropy', got {method!r}")
        if self._counts is None:
            if self._pending_zeros:
                return torch.tensor(0.0, dtype=torch.float32)
            raise RuntimeError("HistogramCalibrator.compute_amax: no data collected yet (call collect(x) first)")
        counts, edges = self.histogram
        if method == "percentile":
            return histogram_amax_percentile(counts, edges, percentile)
        if method == "mse":
            return histogram_amax_mse(
                counts, edges, num_bits=self.num_bits, unsigned=self.unsigned, start_bin=start_bin, stride=stride
            )
        return histogram_amax_entropy(
            counts, edges, num_bits=self.num_bits, unsigned=self.unsigned, start_bin=start_bin, stride=stride
        )

    def __repr__(self) -> str:
        bins = None if self._counts is None else self._counts.numel()
        return f"HistogramCalibrator(num_bins={self.num_bins}, bins_now={bins}, bin_width={self._width})"


def _check_histogram(counts, edges) -> Tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() < 1:
        raise ValueError(f"counts: expected a 1-D tensor with at least one bin, got {counts!r:.80}")
    if not isinstance(edges, torch.Tensor) or edges.shape != (counts.numel() + 1,):
        got = tuple(edges.shape) if isinstance(edges, torch.Tensor) else type(edges).__name__
        raise ValueError(f"edges: expected shape ({counts.numel() + 1},) (bins + 1), got {got}")
    counts = counts.detach().cpu()
    if counts.is_floating_point():
        if not bool((counts == counts.round()).all()):
            raise ValueError("counts: expected integer counts")
        counts = counts.to(torch.int64)
    else:
        counts = counts.to(torch.int64)
    if bool((counts < 0).any()):
        raise ValueError("counts: expected non-negative counts")
    return counts, edges.detach().cpu().to(torch.float64)


def histogram_amax_percentile(counts: torch.Tensor, edges: torch.Tensor, percentile: float = 99.99) -> torch.Tensor:
    """Left edge of the first bin k whose CDF reaches the percentile: sum(counts[:k+1]) / total >= p/100.

    The comparison is exact (rational), so e.g. 99.99 % of 10000 values is exactly 9999 of them."""
    counts, edges = _check_histogram(counts, edges)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 <= percentile <= 100:
        raise ValueError(f"percentile: expected a number in [0, 100], got {percentile!r}")
    total = int(counts.sum())
    if total == 0:
        return torch.tensor(0.0, dtype=torch.float32)
    # smallest integer count c with c / total >= p / 100, exactly
    needed = math.ceil(Fraction(percentile) * total / 100)
    cumulative = torch.cumsum(counts, 0)
    index = int(torch.searchsorted(cumulative, torch.tensor([needed], dtype=torch.int64)))
    index = min(index, counts.numel() - 1)
    return edges[index].to(torch.float32)


def _qmax(num_bits: int, unsigned: bool) -> int:
    return (1 << (num_bits - 1 + int(unsigned))) - 1


def _check_search(start_bin, stride, num_bits, limit: int, what: str) -> None:
    _check_int("start_bin", start_bin, 0)
    _check_int("stride", stride, 1)
    _check_int("num_bits", num_bits, 2)
    if start_bin > limit:
        raise ValueError(f"start_bin: expected at most {limit} ({what}), got {start_bin}")


def histogram_amax_mse(
    counts: torch.Tensor,
    edges: torch.Tensor,
    *,
    num_bits: int = 8,
    unsigned: bool = False,
    start_bin: int = 128,
    stride: int = 1,
) -> torch.Tensor:
    """The bin centre c_i (i = start_bin, start_bin + stride, ..., at most bins - 2: the last centre is
    not a candidate) minimizing sum_k counts_k * (fakequant(c_k; amax=c_i) - c_k)^2; the first minimum wins.

    fakequant(c; a) = clamp(rne(c * s), -qmax, qmax) / s with s = qmax / a in float32 (0 when
    a <= 2^-24), as pytorch-quantization's fake_tensor_quant with narrow range; (unsigned: clamp to
    [0, qmax]). The weighted squared errors are summed in float64."""
    counts, edges = _check_histogram(counts, edges)
    n = counts.numel()
    _check_search(start_bin, stride, num_bits, n - 1, "the last centre is never a candidate")
    edges32 = edges.to(torch.float32)
    centers = (edges32[1:] + edges32[:-1]) / 2
    weights = counts.to(torch.float64)
    candidates = torch.arange(start_bin, n, stride)
    qmax = float(_qmax(num_bits, unsigned))
    lower = 0.0 if unsigned else -qmax
    rows = max(1, _BLOCK_ELEMENTS // n)
    errors = []
    for first in range(0, candidates.numel(), rows):
        amax = centers[candidates[first : first + rows]]
        scale = torch.tensor(qmax, dtype=torch.float32) / amax
        tiny = amax <= _TINY_AMAX
        scale = torch.where(tiny, torch.zeros_like(scale), scale)
        codes = torch.clamp(torch.round(centers[None, :] * scale[:, None]), lower, qmax)
        fake = codes / torch.where(tiny, torch.ones_like(scale), scale)[:, None]
        diff = (fake - centers[None, :]).to(torch.float64)
        errors.append((diff * diff * weights[None, :]).sum(dim=1))
    errors = torch.cat(errors)
    best = int(torch.argmin(errors))  # first minimum
    return centers[candidates[best]].clone()


def histogram_amax_entropy(
    counts: torch.Tensor,
    edges: torch.Tensor,
    *,
    num_bits: int = 8,
    unsigned: bool = False,
    start_bin: int = 128,
    stride: int = 1,
) -> torch.Tensor:
    """edges[i] for the candidate i in start_bin, start_bin + stride, ... <= bins minimizing KL(P_i || Q_i)
    (module docstring); the last minimum wins.

    A candidate whose first i bins are all empty (Q has no mass) scores +inf, as does one where P has
    mass on an empty bin of Q (the tail folded onto an empty bin i-1)."""
    counts, edges = _check_histogram(counts, edges)
    n = counts.numel()
    _check_search(start_bin, stride, num_bits, n, "the number of bins")
    if start_bin < 1:
        raise ValueError(f"start_bin: expected at least 1 for the entropy method, got {start_bin}")
    levels = 1 << (num_bits - 1 + int(unsigned))

    bins = counts.to(torch.float64)  # integer counts below 2^53 stay exact
    if n > 1:
        bins[0] = bins[1]
    total = float(bins.sum())
    nonzero = bins > 0
    log_bins = torch.where(nonzero, torch.log(bins), 0.0)
    prefix = torch.cat([bins.new_zeros(1), torch.cumsum(bins, 0)])
    prefix_nonzero = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(nonzero.to(torch.int64), 0)])
    candidates = torch.arange(start_bin, n + 1, stride)
    level_ids = torch.arange(levels)

    # With p = P / T, q = Q / S (T: all counts, S = counts of the first i bins = mass of Q) and
    # D_g = level total / non-empty bins of level g, every bin j < i-1 with b_j > 0 contributes
    # (b_j / T) * (log b_j - log D_g + log(S / T)), the last bin (b_{i-1} + tail) likewise. Written as
    # log differences, P == Q gives exact zeros, so exact ties stay exact and "last minimum" is
    # well defined. The per-bin terms are summed explicitly (no prefix sums of logs) for the same reason.
    divergences = []
    rows = max(1, _BLOCK_ELEMENTS // 4 // max(n, levels))
    for first in range(0, candidates.numel(), rows):
        cand = candidates[first : first + rows]
        i = cand[:, None]
        # level g of candidate i spans bins [ceil(g*i/levels), ceil((g+1)*i/levels))
        lo = (level_ids[None, :] * i + levels - 1) // levels
        hi = ((level_ids[None, :] + 1) * i + levels - 1) // levels
        level_sum = prefix[hi] - prefix[lo]
        level_nonzero = (prefix_nonzero[hi] - prefix_nonzero[lo]).to(torch.float64)
        log_density = torch.where(level_nonzero > 0, torch.log(level_sum / level_nonzero.clamp(min=1)), 0.0)

        inner = int(cand.max()) - 1  # bins 0 .. i-2 of the longest candidate
        mass_inner = prefix[cand - 1]  # sum of b_j, j < i-1
        body = bins.new_zeros(cand.numel())
        if inner > 0:
            j = torch.arange(inner, dtype=torch.float64)[None, :]
            # floor(j * levels / i) in float64 is exact: j*levels is an integer, and a non-integer
            # quotient lies at least 1/i away from the next integer
            level_of_bin = torch.floor(j * levels / i.to(torch.float64)).to(torch.int64).clamp_(max=levels - 1)
            per_bin = bins[None, :inner] * (log_bins[None, :inner] - torch.gather(log_density, 1, level_of_bin))
            body = torch.where(j < (i - 1), per_bin, 0.0).sum(dim=1)

        q_mass = prefix[cand]
        log_ratio_masses = torch.log(q_mass / total)  # log(S / T); -inf when Q is empty (handled below)
        last_bin = cand - 1
        p_last = bins[last_bin] + (total - q_mass)
        last_level = (last_bin * levels) // cand
        log_q_last = log_density[torch.arange(cand.numel()), last_level]
        last = torch.where(
            p_last > 0,
            torch.where(
                nonzero[last_bin],
                p_last * (torch.log(p_last) - log_q_last + log_ratio_masses),
                math.inf,
            ),
            0.0,
        )
        kl = (body + mass_inner * log_ratio_masses + last) / total
        kl = torch.where(q_mass > 0, kl, math.inf)
        divergences.append(kl)
    divergences = torch.cat(divergences)
    smallest = divergences.min()
    best = int(torch.nonzero(divergences == smallest).max())  # last minimum
    return edges[int(candidates[best])].to(torch.float32)


# ----------------------------------------------------------------------------------------------------
# SmoothQuant
# ----------------------------------------------------------------------------------------------------
def _as_weight_list(weight) -> list:
    if isinstance(weight, torch.Tensor):
        return [weight]
    if isinstance(weight, nn.Linear):
        return [weight.weight]
    if isinstance(weight, (list, tuple)) and weight:
        return [w.weight if isinstance(w, nn.Linear) else w for w in weight]
    raise TypeError(
        f"weight: expected a [N, K] tensor, an nn.Linear or a non-empty list of them, got {type(weight).__name__}"
    )


@torch.no_grad()
def smoothquant_factors(act_amax_per_channel: torch.Tensor, weight, alpha: float = 0.5) -> torch.Tensor:
    """Per-input-channel migration factors s_j = max|X_j|^alpha / max|W_{:,j}|^(1-alpha) (float32 [K]).

    `weight`: the [N, K] weight of the Linear that consumes X, or a list of them sharing X (e.g. q, k,
    v); max|W_{:,j}| is then taken over all of them. Zero maxima are clamped to 1e-5 (as SmoothQuant
    does) so a dead channel gives a finite positive factor, never 0, inf or NaN."""
    check_tensor("act_amax_per_channel", act_amax_per_channel, _CALIB_DTYPES)
    if act_amax_per_channel.dim() != 1:
        raise ValueError(
            f"act_amax_per_channel: expected a 1-D tensor [K], got shape {tuple(act_amax_per_channel.shape)}"
        )
    k = act_amax_per_channel.numel()
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a number in [0, 1], got {alpha!r}")
    weight_amax = None
    for idx, w in enumerate(_as_weight_list(weight)):
        check_tensor(f"weight[{idx}]", w, _CALIB_DTYPES)
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"weight[{idx}]: expected shape [N, {k}] (K from act_amax_per_channel), "
                             f"got {tuple(w.shape)}")
        col = w.detach().abs().amax(dim=0).to(device=act_amax_per_channel.device, dtype=torch.float32)
        weight_amax = col if weight_amax is None else torch.maximum(weight_amax, col)
    act = act_amax_per_channel.detach().to(torch.float32)
    if not bool(torch.isfinite(act).all()) or bool((act < 0).any()):
        raise ValueError("act_amax_per_channel: expected finite, non-negative maxima")
    if not bool(torch.isfinite(weight_amax).all()):
        raise ValueError("weight: expected finite values")
    act = act.clamp(min=1e-5).to(torch.float64)
    weight_amax = weight_amax.clamp(min=1e-5).to(torch.float64)
    return (act.pow(alpha) / weight_amax.pow(1.0 - alpha)).to(torch.float32)


def _scale_param_(param: torch.Tensor, factor: torch.Tensor) -> None:
    # at least float32 math (float64 for float64 parameters), one rounding back to the parameter's dtype
    work = torch.float64 if param.dtype == torch.float64 else torch.float32
    param.copy_((param.detach().to(work) * factor.to(device=param.device, dtype=work)).to(param.dtype))


@torch.no_grad()
def apply_smoothquant(norm_or_linear: nn.Module, linears: Iterable[nn.Linear], factors: torch.Tensor) -> None:
    """Fold SmoothQuant factors in place: X' = X / s in the module producing X, W' = W * s in its consumers.

    `norm_or_linear` produces X ([..., K]) and must feed only `linears`:
    * a norm computing normalize(x) * weight (+ bias) (nn.LayerNorm, nn.RMSNorm, Llama-style RMSNorm):
      weight /= s, bias /= s. A probe checks the module really scales with its weight (a norm that
      computes `* (1 + weight)` is refused, unchanged);
    * an nn.Linear (e.g. a value projection feeding the output projection): output rows weight[j, :] /= s_j,
      bias[j] /= s_j.
    Each consumer nn.Linear [N, K]: weight[:, j] *= s_j. So consumer(X') == consumer(X) up to rounding.
    A post-LN residual that also reads X (BERT) is not a valid target: its input would change too.
    """
    consumers = list(linears)
    if not consumers:
        raise ValueError("linears: expected at least one nn.Linear consuming the smoothed activation, got none")
    check_tensor("factors", factors, _CALIB_DTYPES)
    if factors.dim() != 1:
        raise ValueError(f"factors: expected a 1-D tensor [K], got shape {tuple(factors.shape)}")
    k = factors.numel()
    if not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
        raise ValueError("factors: expected finite, positive values")
    for idx, lin in enumerate(consumers):
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"linears[{idx}]: expected nn.Linear, got {type(lin).__name__}")
        if lin.in_features != k:
            raise ValueError(f"linears[{idx}]: expected in_features {k} (len(factors)), got {lin.in_features}")
    factors = factors.detach().to(torch.float64)
    inverse = 1.0 / factors

    if isinstance(norm_or_linear, nn.Linear):
        if norm_or_linear.out_features != k:
            raise ValueError(
                f"norm_or_linear: expected out_features {k} (len(factors)), got {norm_or_linear.out_features}"
            )
        _scale_param_(norm_or_linear.weight, inverse[:, None])
        if norm_or_linear.bias is not None:
            _scale_param_(norm_or_linear.bias, inverse)
    elif isinstance(norm_or_linear, nn.Module):
        weight = getattr(norm_or_linear, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() != k:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            raise ValueError(
                f"norm_or_linear: expected nn.Linear or a norm with a weight of shape ({k},), "
                f"got {type(norm_or_linear).__name__} with weight {got}"
            )
        bias = getattr(norm_or_linear, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) else None
        saved = (weight.detach().clone(), None if bias is None else bias.detach().clone())
        probe = torch.randn(4, k, device=weight.device, dtype=torch.float32).to(weight.dtype)
        before = norm_or_linear(probe).float()
        _scale_param_(weight, inverse)
        if bias is not None:
            _scale_param_(bias, inverse)
        after = norm_or_linear(probe).float()
        expected = before * inverse.to(device=before.device, dtype=before.dtype)
        tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
        if not torch.allclose(after, expected, rtol=tol, atol=tol * float(expected.abs().max().clamp(min=1e-6))):
            weight.copy_(saved[0])
            if bias is not None:
                bias.copy_(saved[1])
            raise TypeError(
                f"norm_or_linear: {type(norm_or_linear).__name__} does not scale its output by its weight "
                "(normalize(x) * weight + bias), so 1/s cannot be folded into it; left unchanged"
            )
    else:
        raise TypeError(f"norm_or_linear: expected an nn.Module, got {type(norm_or_linear).__name__}")

    for lin in consumers:
        _scale_param_(lin.weight, factors[None, :])
