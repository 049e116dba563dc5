"""Element-wise comparison against a per-element bound: metrics, verdict and agreement.

One policy decides every verdict (`judge`): the error bound of the arithmetic the backend
claims decides pass/fail; ULP figures are reported but do not decide alone, because elements
that nearly cancel to zero give huge ULP and relative errors even for a correct float32 sum
(field notes: error / (u * sum|a*b|) stays ~3 while max ULP grows with d).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from diag import numerics
from diag.compare.verdict import Mismatch, format_index, format_mismatch
from diag.tolerance import AGREEMENT_FACTOR


#: ULP distances below this are counted in a histogram; the (rare) larger ones are counted, and
#: gathered only when an order statistic falls among them. Together they give exact order
#: statistics without sorting the distances.
_HIST_CAP = 1 << 12

#: Elements per pass where distances are gathered again (`_comparable_ulps`): a chunk's int64
#: distances stay in cache instead of one whole-array copy.
CHUNK = 1 << 18


def _kernels():
    """The compiled loops (`diag.compare._kernel`), imported on first use: numba is not
    imported by `import diag`."""
    from diag.compare import _kernel

    return _kernel


def _flat(x) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def _first_max(values: np.ndarray, at: np.ndarray, nan: np.ndarray) -> tuple[float, int]:
    """The max of blocks' maxima and its index as `ndarray.max` / `argmax` of the whole array
    give them: the first block's NaN wins, ties keep the earliest block (and index)."""
    if nan.any():
        b = int(np.argmax(nan))
    else:
        b = int(np.argmax(values))  # the first block holding the largest value
    return float(values[b]), int(at[b])


def _comparable_ulps(x: np.ndarray, y: np.ndarray, keep) -> np.ndarray:
    """The ULP distances of x and y that are not NaN mismatches and that `keep` selects,
    in element order, gathered a chunk at a time."""
    parts = []
    for start in range(0, x.size, CHUNK):
        u = numerics.ulp_distance(x[start:start + CHUNK], y[start:start + CHUNK])
        parts.append(u[keep(u) & (u < numerics.NAN_ULP)])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class _UlpStats:
    """Count, exact sum, max and exact order statistics of non-negative integer ULP distances:
    a histogram of those below `_HIST_CAP`, and the larger ones from `tail()` when needed."""

    def __init__(self, hist: np.ndarray, count: int, total: int, top: int, tail):
        self.hist, self.count, self.total, self.max = hist, count, total, top
        self._tail = tail

    def kth(self, k: int) -> int:
        """The k-th smallest value (0-based; negative counts from the end, as indexing)."""
        k = k % self.count
        cum = np.cumsum(self.hist)
        if k < cum[-1]:
            return int(np.searchsorted(cum, k, side="right"))
        if callable(self._tail):
            self._tail = self._tail()
        j = k - int(cum[-1])
        return int(np.partition(self._tail, j)[j])

    def mean(self) -> float | None:
        """`ndarray.mean` of the values, or None when it cannot be had without them: numpy
        sums int64 as float64, exact (whatever the order) while the total is below 2**53."""
        if self.total is None or self.total >= 2**53:
            return None
        return float(self.total) / self.count

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


def compare(output: np.ndarray, truth: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """Element-wise metrics of `output` against the correctly rounded `truth`.

    One fused pass (`diag.compare._kernel.compare_blocks`): no float64 copy of the output,
    the truth or the errors, and the ULP quantile from a histogram (exact) instead of a
    partition of every distance. The metrics are those of the whole-array formulas (kept in
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
    k = _kernels()
    n = int(truth.size)
    out_f, tru_f = _flat(output), _flat(truth)
    bnd_f = np.ascontiguousarray(bound, dtype=np.float64).reshape(-1)
    blocks = k.blocks(n)
    counts = np.zeros((blocks, k.RATIO_NAN + 1), np.int64)
    peaks = np.zeros((blocks, k.RATIO + 1))
    hist = np.zeros((blocks, _HIST_CAP), np.int64)
    with np.errstate(invalid="ignore"):  # the NaN patterns of the 8- and 16-bit tables
        operands = k.pair(out_f, tru_f)
    k.compare_blocks(*operands, bnd_f, _HIST_CAP, counts, peaks, hist)
    summed = counts.sum(axis=0)  # exact: every column is a count, or small block sums
    top = int(counts[:, k.ULP_MAX].max()) if n else 0
    # A block's total is exact while its distances stay below 2**40 (float64 only).
    total = sum(int(t) for t in counts[:, k.ULP_TOTAL]) if top < 2**40 else None
    stats = _UlpStats(hist.sum(axis=0), int(summed[k.ULP_COUNT]), total, top,
                      lambda: _comparable_ulps(out_f, tru_f, lambda u: u >= _HIST_CAP))
    mean = stats.mean() if stats.count else 0.0
    if mean is None:  # a total past 2**53: numpy's own float64 sum of every distance
        mean = float(_comparable_ulps(out_f, tru_f, lambda u: True).mean())
    ratio, w = (_first_max(peaks[:, k.RATIO], counts[:, k.RATIO_AT], counts[:, k.RATIO_NAN])
                if n else (0.0, 0))
    metrics: dict[str, Any] = {
        "elements": n,
        "nan_count": int(summed[k.NAN]),
        "inf_count": int(summed[k.INF]),
        "unexpected_nonfinite": int(summed[k.UNEXPECTED]),
        "max_ulp": stats.max,
        "mean_ulp": mean,
        "p99_ulp": stats.percentile(99) if stats.count else 0.0,
        "frac_not_correctly_rounded": float(int(summed[k.NOT_ROUNDED])) / max(n, 1),
        "max_abs_err": float(peaks[:, k.MAX_ERR].max()) if n else 0.0,
        "max_rel_err": float(peaks[:, k.MAX_REL].max()) if n else 0.0,
        "bound_ratio": ratio,
        "bound_exceeded": int(summed[k.EXCEEDED]),
    }
    if n:
        at = slice(w, w + 1)
        metrics["worst"] = {"index": format_index(w, truth.shape),
                            "got": float(out_f[at].astype(np.float64)[0]),
                            "truth": float(tru_f[at].astype(np.float64)[0]),
                            "allowed": float(bnd_f[w]),
                            "ulp": int(numerics.ulp_distance(out_f[at], tru_f[at])[0])}
    return metrics


def _agree(x: np.ndarray, y: np.ndarray, bound: np.ndarray | None) -> tuple:
    """`_kernel.agree_blocks` over two flat arrays, merged: (mismatched, max ULP, its first
    index, max |x - y| over finite pairs, max ratio to AGREEMENT_FACTOR * bound or None)."""
    k = _kernels()
    n = int(x.size)
    blocks = k.blocks(n)
    counts = np.zeros((blocks, k.AGREE_RATIO_NAN + 1), np.int64)
    ulp_max = np.zeros(blocks, np.int64)
    peaks = np.zeros((blocks, k.AGREE_RATIO + 1))
    bnd = (np.ascontiguousarray(bound, dtype=np.float64).reshape(-1) if bound is not None
           else k.EMPTY)
    with np.errstate(invalid="ignore"):
        operands = k.pair(x, y)
    k.agree_blocks(*operands, bnd, float(AGREEMENT_FACTOR), counts, ulp_max, peaks)
    if not n:
        return 0, 0, 0, 0.0, 0.0
    b = int(np.argmax(ulp_max))  # the first block with the largest distance
    ratio = None
    if bound is not None:
        ratio, _ = _first_max(peaks[:, k.AGREE_RATIO], counts[:, k.ULP_AT],
                              counts[:, k.AGREE_RATIO_NAN])
    return (int(counts[:, k.MISMATCHED].sum()), int(ulp_max[b]), int(counts[b, k.ULP_AT]),
            float(peaks[:, k.DIFF].max()), ratio)


def mismatch(metrics: dict[str, Any], *, nonfinite_unit: str = "elements"
             ) -> Optional[Mismatch]:
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
        return Mismatch(metrics["bound_exceeded"], n, where=w["index"],
                        ratio=metrics["bound_ratio"], got=w["got"], expected=w["truth"],
                        allowed=w["allowed"], ulp=w.get("ulp"))
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
        return "fail", (f"{format_mismatch(m)} are NaN/Inf where the exact result is not "
                        f"(or the reverse)")
    summary = (f"{metrics['frac_not_correctly_rounded']:.1%} not correctly rounded, "
               f"max {metrics['max_ulp']} ULP")
    if m is not None:
        detail = f"error exceeds the {claim} bound in {format_mismatch(m)}"
        if promised:
            return "fail", detail
        return "warn", (detail + f"; less precise than {claim}, which {setting} permits on "
                        f"this backend (use precision=highest where float32 is needed)")
    return "pass", f"within the {claim} bound (worst {metrics['bound_ratio']:.2g}x); {summary}"


def agreement(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """How far two backends' outputs for the same case are apart (one fused pass).

    Args:
      x, y: the two outputs (same shape and dtype).
      bound: the per-element bound each backend is judged by; two backends that both keep
        it can differ by up to `AGREEMENT_FACTOR` times it, so `bound_ratio` =
        max |x - y| / (AGREEMENT_FACTOR * bound).
    """
    xf, yf = _flat(x), _flat(y)
    mismatched, top, w, diff, ratio = _agree(xf, yf, bound)
    metrics: dict[str, Any] = {"elements": int(xf.size), "mismatched": mismatched,
                               "max_ulp_between": top, "max_abs_diff": diff,
                               "bound_ratio": ratio}
    if mismatched:
        metrics["worst"] = {"index": format_index(w, np.shape(x)),
                            "a": float(xf[w:w + 1].astype(np.float64)[0]),
                            "b": float(yf[w:w + 1].astype(np.float64)[0])}
    return metrics


def agreement_mismatch(metrics: dict[str, Any]) -> Optional[Mismatch]:
    """The elements where two outputs differ (`agreement`/`agree_values` metrics), or None."""
    if not metrics["mismatched"]:
        return None
    return Mismatch(metrics["mismatched"], metrics["elements"], where=metrics["worst"]["index"],
                    ulp=metrics["max_ulp_between"])


def judge_agreement(metrics: dict[str, Any], a: str, b: str, claim: str) -> tuple[str, str]:
    """pass: identical, or apart by no more than two correct backends may be; else warn."""
    m = agreement_mismatch(metrics)
    if m is None:
        return "pass", f"{a} and {b} agree bit for bit"
    detail = f"{a} and {b} differ in {format_mismatch(m)}"
    if metrics["bound_ratio"] <= 1.0:
        return "pass", f"{detail}; within what two backends keeping the {claim} bound may differ"
    return "warn", (f"{detail}; {metrics['bound_ratio']:.3g}x what two backends keeping the "
                    f"{claim} bound may differ")


def agree_values(x: np.ndarray, y: np.ndarray, names: tuple[str, str], *,
                 allowed_ulp: float) -> tuple[str, str, dict[str, Any]]:
    """Two backends' outputs of one case compared in ULPs: pass within `allowed_ulp` (what two
    correct implementations may differ by), warn beyond. Returns (status, reason, metrics)."""
    x, y = np.asarray(x), np.asarray(y)
    xf, yf = x.reshape(-1), y.reshape(-1)
    mism, top, w, _, _ = _agree(xf, yf, None)
    metrics: dict[str, Any] = {"elements": int(xf.size), "mismatched": mism,
                               "max_ulp_between": top, "allowed_ulp": float(allowed_ulp)}
    if not mism:
        return "pass", f"{names[0]} and {names[1]} agree bit for bit", metrics
    metrics["worst"] = {"index": format_index(w, x.shape), "a": float(xf[w]),
                        "b": float(yf[w])}
    detail = f"{names[0]} and {names[1]} differ in {format_mismatch(agreement_mismatch(metrics))}"
    if metrics["max_ulp_between"] <= allowed_ulp:
        return "pass", f"{detail}; within the {allowed_ulp:g} ULP two correct backends may differ", \
            metrics
    return "warn", f"{detail}; more than the {allowed_ulp:g} ULP two correct backends may differ", \
        metrics
