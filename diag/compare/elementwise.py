"""Element-wise comparison against a per-element bound: metrics, verdict and agreement.

One policy decides every verdict (`judge`): the error bound of the arithmetic the backend
claims decides pass/fail; ULP figures are reported but do not decide alone, because elements
that nearly cancel to zero give huge ULP and relative errors even for a correct float32 sum
(measured on CPU for the [d,4]x[4,d] sweep: error / (u * sum|a*b|) stays ~3 while max ULP
grows with d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diag import numerics
from diag.compare.verdict import Mismatch, Verdict, format_index, format_mismatch
from diag.status import Status
from diag.tolerance import AGREEMENT_FACTOR

#: Elements per pass of the streaming comparisons: a few float64 and int64 temporaries of this
#: length stay in the core's cache, where whole-array temporaries (hundreds of MB for a 16.7M
#: element product) would stream through memory once per operation.
CHUNK = 1 << 15

#: ULP distances below this are counted in a histogram; the (rare) larger ones are kept as
#: values. Together they give exact order statistics without sorting the distances.
_HIST_CAP = 1 << 12


def _chunks(n: int):
    for start in range(0, n, CHUNK):
        yield start, slice(start, min(n, start + CHUNK))


def _finite_ulp_distance(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`numerics.ulp_distance` of 1-d arrays known to hold no NaN (their dtypes checked by
    `_same_float_dtype`): no NaN screens."""
    if x.dtype.itemsize <= 4:
        return numerics.ordered_distance(x, y)
    return numerics.ulp_distance(x, y)


def _same_float_dtype(x: np.ndarray, y: np.ndarray) -> None:
    """Raises `ulp_distance`'s UsageError where x and y differ in dtype or are not floats
    diag knows (on empty slices: no work)."""
    numerics.ulp_distance(x[:0], y[:0])


class _Max:
    """Running max and first argmax over chunks, as `ndarray.max` / `argmax` of the whole
    array give them: NaN wins (the first NaN's index), ties keep the earliest index."""

    def __init__(self):
        self.value, self.index, self._nan = 0.0, 0, False

    def add(self, start: int, chunk: np.ndarray) -> Any:
        """Takes in a chunk starting at element `start`; returns the chunk's own max (0 if
        it is empty)."""
        if not chunk.size:
            return 0.0
        i = int(chunk.argmax())
        v = chunk[i]
        if self._nan:
            return v
        if np.isnan(v):
            self._nan, self.value, self.index = True, float(v), start + i
        elif start == 0 or v > self.value:
            self.value, self.index = v.item(), start + i
        return v


class _UlpStats:
    """Count, exact sum, max and exact order statistics of non-negative integer ULP distances
    fed chunk by chunk: a histogram below `_HIST_CAP`, the values themselves above it."""

    def __init__(self):
        self.hist = np.zeros(_HIST_CAP, np.int64)
        self.tail: list[np.ndarray] = []
        self.count, self.max = 0, 0
        self._tail_total: int | None = 0  # None: a distance reached 2**40

    def add(self, ulp: np.ndarray) -> int:
        """Takes in a chunk of distances; returns how many of them are 0."""
        if not ulp.size:
            return 0
        top = int(ulp.max())
        self.count += int(ulp.size)
        self.max = max(self.max, top)
        if top >= _HIST_CAP:
            big = ulp >= _HIST_CAP
            tail = ulp[big]
            self.tail.append(tail)
            # Exact while the distances stay below 2**40 (a chunk then sums to < 2**55);
            # float64 distances reach 2**62, whose int64 sum wraps: then the total is unknown.
            if top >= 2**40:
                self._tail_total = None
            elif self._tail_total is not None:
                self._tail_total += int(tail.sum())
            ulp = ulp[~big]
        counts = np.bincount(ulp, minlength=_HIST_CAP)
        self.hist += counts
        return int(counts[0])

    @property
    def total(self) -> int | None:
        """The exact sum of the distances (from the histogram), or None past 2**40 each."""
        if self._tail_total is None:
            return None
        return int(self.hist @ np.arange(_HIST_CAP, dtype=np.int64)) + self._tail_total

    def kth(self, k: int) -> int:
        """The k-th smallest value (0-based; negative counts from the end, as indexing)."""
        k = k % self.count
        cum = np.cumsum(self.hist)
        if k < cum[-1]:
            return int(np.searchsorted(cum, k, side="right"))
        tail = np.concatenate(self.tail)
        j = k - int(cum[-1])
        return int(np.partition(tail, j)[j])

    def mean(self) -> float | None:
        """`ndarray.mean` of the values, or None when it cannot be had without them: numpy
        sums int64 as float64, exact (whatever the order) while the total is below 2**53."""
        total = self.total
        if total is None or total >= 2**53:
            return None
        return float(total) / self.count

    def percentile(self, q: float) -> float:
        """`np.percentile(values, q)` (method `linear`), bit for bit, from two order statistics."""
        n = self.count
        virtual = (n - 1) * (q / 100)
        lo = np.floor(virtual)
        if virtual >= n - 1:
            return float(np.float64(self.kth(-1)))
        t = virtual - lo
        a, b = self.kth(int(lo)), self.kth(int(lo) + 1)
        diff = np.int64(b) - np.int64(a)
        # numpy's _lerp: a + (b - a) t, or b - (b - a)(1 - t) for t >= 0.5 (monotone rounding)
        if t >= 0.5:
            return float(np.int64(b) - diff * (1 - t))
        return float(np.int64(a) + diff * t)


@dataclass
class _Totals:
    """What `compare`'s streaming pass counted and kept over every chunk."""

    stats: _UlpStats
    ratio_max: _Max
    nan_count: int
    inf_count: int
    unexpected: int
    not_rounded: int
    exceeded: int
    max_err: float
    max_rel: float


def _stream(out_f: np.ndarray, tru_f: np.ndarray, bnd_f: np.ndarray, n: int) -> _Totals:
    """One pass over the flat output, truth and bound in chunks of `CHUNK` elements.

    One loop in one frame, on purpose: each chunk's temporaries stay alive until the next
    chunk replaces them. Freed together between chunks (as returning from a per-chunk
    function does), they let glibc give the heap's top back to the system, and every chunk
    faults its pages in again (measured: 4M float32 elements took 2-4x as long).
    """
    nan_count = inf_count = unexpected = not_rounded = exceeded = 0
    stats = _UlpStats()
    max_err = max_rel = 0.0
    ratio_max = _Max()
    for start, sl in _chunks(n):
        o, t = out_f[sl], tru_f[sl]
        o64, t64 = o.astype(np.float64), t.astype(np.float64)
        with np.errstate(invalid="ignore"):  # Inf - Inf is NaN here, handled below
            err = np.subtract(o64, t64)
        np.abs(err, out=err)
        top = err.max() if err.size else 0.0
        # The common case: every element finite on both sides, which a finite largest error
        # says (NaN and Inf propagate through the difference, and that of two float32 or
        # narrower values cannot overflow in float64; a float64 one that does takes the
        # general path below, which gives the same numbers). No masks, no NaN screens.
        if np.isfinite(top):
            ulp = _finite_ulp_distance(o, t)
            not_rounded += ulp.size - stats.add(ulp)
            max_err = max(max_err, float(top))
            # err / |t| is |err / t| (a sign is all that dividing by -|t| changes); a zero
            # truth (0/0, x/0) makes it non-finite, and then the masked form decides.
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.divide(err, t64, out=t64)
            lo, hi = rel.min(), rel.max()
            if np.isfinite(lo) and np.isfinite(hi):
                max_rel = max(max_rel, float(max(hi, -lo)))
            else:
                abs_t = np.abs(t.astype(np.float64))
                rel = np.divide(err, abs_t, out=np.zeros(err.size), where=abs_t > 0)
                max_rel = max(max_rel, float(rel.max()))
            ratio = np.divide(err, bnd_f[sl], out=err)
        else:
            finite = np.isfinite(o64)
            finite &= np.isfinite(t64)
            o_nan, t_nan = np.isnan(o64), np.isnan(t64)
            o_inf, t_inf = np.isinf(o64), np.isinf(t64)
            nan_count += int(np.count_nonzero(o_nan))
            inf_count += int(np.count_nonzero(o_inf))
            # Non-finite where the truth is finite, or not the same non-finite value.
            same = (o_nan & t_nan) | (o_inf & t_inf & (o64 == t64))
            unexpected += int(np.count_nonzero(~finite & ~same))
            ulp = numerics.ulp_distance(o, t)
            not_rounded += ulp.size - stats.add(ulp[ulp < numerics.NAN_ULP])
            err = np.zeros(o64.size)
            np.subtract(o64, t64, out=err, where=finite)
            np.abs(err, out=err)
            abs_t = np.abs(t64)
            rel = np.divide(err, abs_t, out=np.zeros(o64.size), where=finite & (abs_t > 0))
            max_err = max(max_err, float(err.max()))  # no NaN in err or rel: masked
            max_rel = max(max_rel, float(rel.max()))
            ratio = np.divide(err, bnd_f[sl], out=np.zeros(o64.size), where=finite)
        if not ratio_max.add(start, ratio) <= 1.0:  # counted only where some element is over
            exceeded += int(np.count_nonzero(ratio > 1.0))
    return _Totals(
        stats, ratio_max, nan_count, inf_count, unexpected, not_rounded, exceeded, max_err, max_rel
    )


def _mean_ulp(stats: _UlpStats, out_f: np.ndarray, tru_f: np.ndarray, n: int) -> float:
    """The mean ULP distance; past a total of 2**53, numpy's own float64 sum of every one."""
    mean = stats.mean() if stats.count else 0.0
    if mean is None:
        every = np.concatenate(
            [
                u[u < numerics.NAN_ULP]
                for u in (numerics.ulp_distance(out_f[sl], tru_f[sl]) for _, sl in _chunks(n))
            ]
        )
        mean = float(every.mean())
    return mean


def compare(output: np.ndarray, truth: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """Element-wise metrics of `output` against the correctly rounded `truth`.

    One streaming pass in chunks of `CHUNK` elements: no whole-array float64 copy of the
    output, the truth or the errors, and the ULP quantile from a histogram (exact) instead of
    a partition of every distance. The metrics are those of the whole-array formulas (kept in
    tests/legacy_judge.py, which tests/test_judge_legacy.py checks them against bit for bit).

    Args:
      output: what the backend returned.
      truth: the correctly rounded result, same shape and dtype.
      bound: per-element float64 bound on |output - truth| for the claimed arithmetic.

    Returns:
      A metrics dict: elements, nan_count, inf_count, unexpected_nonfinite, max/mean/p99 ULP,
      frac_not_correctly_rounded, max_abs_err, max_rel_err, bound_ratio, bound_exceeded, and
      `worst` (index, got, truth, allowed) for the element with the largest bound ratio.
    """
    n = int(truth.size)
    out_f, tru_f = np.asarray(output).reshape(-1), np.asarray(truth).reshape(-1)
    bnd_f = np.asarray(bound).reshape(-1)
    _same_float_dtype(out_f, tru_f)
    tot = _stream(out_f, tru_f, bnd_f, n)
    stats = tot.stats
    metrics: dict[str, Any] = {
        "elements": n,
        "nan_count": tot.nan_count,
        "inf_count": tot.inf_count,
        "unexpected_nonfinite": tot.unexpected,
        "max_ulp": stats.max,
        "mean_ulp": _mean_ulp(stats, out_f, tru_f, n),
        "p99_ulp": stats.percentile(99) if stats.count else 0.0,
        "frac_not_correctly_rounded": float(tot.not_rounded) / max(n, 1),
        "max_abs_err": tot.max_err,
        "max_rel_err": tot.max_rel,
        "bound_ratio": float(tot.ratio_max.value),
        "bound_exceeded": tot.exceeded,
    }
    if n:
        w = tot.ratio_max.index
        at = slice(w, w + 1)
        metrics["worst"] = {
            "index": format_index(w, truth.shape),
            "got": float(out_f[at].astype(np.float64)[0]),
            "truth": float(tru_f[at].astype(np.float64)[0]),
            "allowed": float(bnd_f[w]),
            "ulp": int(numerics.ulp_distance(out_f[at], tru_f[at])[0]),
        }
    return metrics


def mismatch(metrics: dict[str, Any], *, nonfinite_unit: str = "elements") -> Mismatch | None:
    """What broke the rule in `compare`'s metrics: NaN/Inf where the truth is finite (or the
    reverse) first, then elements beyond the bound; None when nothing did.

    Args:
      metrics: from `compare`.
      nonfinite_unit: what the non-finite count counts (softmax: `elements of defined rows`).
    """
    n = metrics["elements"]
    if metrics["unexpected_nonfinite"]:
        return Mismatch(metrics["unexpected_nonfinite"], n, nonfinite_unit, share=False)
    if metrics["bound_exceeded"]:
        w = metrics["worst"]
        return Mismatch(
            metrics["bound_exceeded"],
            n,
            where=w["index"],
            ratio=metrics["bound_ratio"],
            got=w["got"],
            expected=w["truth"],
            allowed=w["allowed"],
            ulp=w.get("ulp"),
        )
    return None


def judge(metrics: dict[str, Any], *, promised: bool, claim: str, setting: str) -> tuple[str, str]:
    """The verdict for one record's metrics: (status, one-line reason).

    Args:
      metrics: from `compare`.
      promised: whether the backend promises the claimed arithmetic under this setting
        (`diag.backends.promises_full_precision`); if not, a bound breach is `warn`.
      claim: the arithmetic the bound assumes (`float32 accumulation`).
      setting: the precision setting, for the reason.
    """
    m = mismatch(metrics)
    if metrics["unexpected_nonfinite"]:
        assert m is not None  # mismatch() reports the non-finite elements first
        return Status.FAIL, (
            f"{format_mismatch(m)} are NaN/Inf where the exact result is not (or the reverse)"
        )
    summary = (
        f"{metrics['frac_not_correctly_rounded']:.1%} not correctly rounded, "
        f"max {metrics['max_ulp']} ULP"
    )
    if m is not None:
        detail = f"error exceeds the {claim} bound in {format_mismatch(m)}"
        if promised:
            return Status.FAIL, detail
        return Status.WARN, (
            detail + f"; less precise than {claim}, which {setting} permits on "
            f"this backend (use precision=highest where float32 is needed)"
        )
    return Status.PASS, f"within the {claim} bound (worst {metrics['bound_ratio']:.2g}x); {summary}"


def agreement(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """How far two backends' outputs for the same case are apart (streamed in chunks).

    Args:
      x, y: the two outputs (same shape and dtype).
      bound: the per-element bound each backend is judged by; two backends that both keep
        it can differ by up to `AGREEMENT_FACTOR` times it, so `bound_ratio` =
        max |x - y| / (AGREEMENT_FACTOR * bound).
    """
    xf, yf, bf = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1), np.asarray(bound).reshape(-1)
    n = int(xf.size)
    _same_float_dtype(xf, yf)
    mismatched = 0
    ulp_max, diff_max, ratio_max = _Max(), _Max(), _Max()
    for start, sl in _chunks(n):
        xs, ys = xf[sl], yf[sl]
        x64, y64 = xs.astype(np.float64), ys.astype(np.float64)
        with np.errstate(invalid="ignore"):  # Inf - Inf is NaN here, handled below
            diff = np.subtract(x64, y64)
        np.abs(diff, out=diff)
        if np.isfinite(diff.max()):  # both finite everywhere (as in `compare`): no masks
            ulp = _finite_ulp_distance(xs, ys)
            ratio = np.divide(diff, AGREEMENT_FACTOR * bf[sl])
        else:
            ulp = numerics.ulp_distance(xs, ys)
            finite = np.isfinite(x64) & np.isfinite(y64)
            diff = np.abs(np.subtract(x64, y64, out=np.zeros(x64.size), where=finite))
            ratio = np.divide(diff, AGREEMENT_FACTOR * bf[sl], out=np.zeros(x64.size), where=finite)
        mismatched += int(np.count_nonzero(ulp))
        ulp_max.add(start, ulp)
        diff_max.add(start, diff)
        ratio_max.add(start, ratio)
    metrics: dict[str, Any] = {
        "elements": n,
        "mismatched": mismatched,
        "max_ulp_between": int(ulp_max.value),
        "max_abs_diff": float(diff_max.value),
        "bound_ratio": float(ratio_max.value),
    }
    if mismatched:
        w = ulp_max.index
        metrics["worst"] = {
            "index": format_index(w, np.shape(x)),
            "a": float(xf[w : w + 1].astype(np.float64)[0]),
            "b": float(yf[w : w + 1].astype(np.float64)[0]),
        }
    return metrics


def agreement_mismatch(metrics: dict[str, Any]) -> Mismatch | None:
    """The elements where two outputs differ (`agreement`/`agree_values` metrics), or None."""
    if not metrics["mismatched"]:
        return None
    return Mismatch(
        metrics["mismatched"],
        metrics["elements"],
        where=metrics["worst"]["index"],
        ulp=metrics["max_ulp_between"],
    )


def judge_agreement(metrics: dict[str, Any], a: str, b: str, claim: str) -> tuple[str, str]:
    """pass: identical, or apart by no more than two correct backends may be; else warn."""
    m = agreement_mismatch(metrics)
    if m is None:
        return Status.PASS, f"{a} and {b} agree bit for bit"
    detail = f"{a} and {b} differ in {format_mismatch(m)}"
    if metrics["bound_ratio"] <= 1.0:
        return (
            Status.PASS,
            f"{detail}; within what two backends keeping the {claim} bound may differ",
        )
    return Status.WARN, (
        f"{detail}; {metrics['bound_ratio']:.3g}x what two backends keeping the "
        f"{claim} bound may differ"
    )


def agree_values(
    x: np.ndarray, y: np.ndarray, names: tuple[str, str], *, allowed_ulp: float
) -> Verdict:
    """Two backends' outputs of one case compared in ULPs: pass within `allowed_ulp` (what two
    correct implementations may differ by), warn beyond. Returns the pair's verdict."""
    x, y = np.asarray(x), np.asarray(y)
    xf, yf = x.reshape(-1), y.reshape(-1)
    n = int(xf.size)
    mism = 0
    ulp_max = _Max()
    for start, sl in _chunks(n):
        ulp = numerics.ulp_distance(xf[sl], yf[sl])
        mism += int(np.count_nonzero(ulp))
        ulp_max.add(start, ulp)
    metrics: dict[str, Any] = {
        "elements": n,
        "mismatched": mism,
        "max_ulp_between": int(ulp_max.value),
        "allowed_ulp": float(allowed_ulp),
    }
    if not mism:
        return Verdict(Status.PASS, f"{names[0]} and {names[1]} agree bit for bit", metrics)
    w = ulp_max.index
    metrics["worst"] = {"index": format_index(w, x.shape), "a": float(xf[w]), "b": float(yf[w])}
    differ = agreement_mismatch(metrics)
    assert differ is not None  # metrics["mismatched"] is mism, nonzero here
    detail = f"{names[0]} and {names[1]} differ in {format_mismatch(differ)}"
    if metrics["max_ulp_between"] <= allowed_ulp:
        return Verdict(
            Status.PASS,
            f"{detail}; within the {allowed_ulp:g} ULP two correct backends may differ",
            metrics,
            mismatch=differ,
        )
    return Verdict(
        Status.WARN,
        f"{detail}; more than the {allowed_ulp:g} ULP two correct backends may differ",
        metrics,
        mismatch=differ,
    )
