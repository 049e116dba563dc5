"""The fused loops of element-wise judging, compiled by numba: one pass over the data.

diag judges outputs of up to hundreds of MB against the truth, a per-element bound and other
backends' outputs. Whole-array numpy expressions need a dozen passes and temporaries per
metric; these loops read each element once and keep every figure in registers.

The figures are those of numpy's whole-array formulas (tests/legacy_judge.py, which
tests/test_judge_legacy.py and tests/test_compare_kernel.py check bit for bit), by these rules:
  * values are widened to float64 exactly (a table of every bit pattern for 8- and 16-bit
    dtypes, built by numpy's own `astype`), and each error is the same IEEE operations in the
    same order as the numpy formula (numba keeps strict IEEE semantics without `fastmath`);
  * `compare_blocks` and `agree_blocks` run in blocks (`BLOCK` elements, in parallel where
    numba has threads); every block writes its own partial results, and `elementwise` merges them in block order: counts
    and integer sums are exact whatever the order, a max keeps its earliest index, and a NaN
    wins as in `ndarray.max` / `argmax` (the first NaN's index). No float is ever summed.

Imported on first use only (`diag.compare.elementwise`, `diag.numerics.ulp_distance`): numba
takes a good part of a second to import, which `import diag` must not pay. Compiled code is
cached on disk (`cache=True`: next to this file, or where the package directory is read-only
in numba's user-wide cache directory; NUMBA_CACHE_DIR overrides both). A process pays the
import and loading the cache (benchmarks/bench_judge.py prints both); the first process after
an install or a change of this file compiles, a few seconds per kernel and dtype width.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from diag import numerics

#: Elements per block: a block's partial results are a few numbers and a histogram row.
BLOCK = 1 << 16

#: Frozen into the compiled code as a constant (numba reads globals at compile time).
NAN_ULP = numerics.NAN_ULP

# Indices of a block's integer partial results in `compare`'s `counts` rows.
NAN, INF, UNEXPECTED, NOT_ROUNDED, EXCEEDED, ULP_COUNT, ULP_TOTAL, ULP_MAX, ULP_TAIL, \
    RATIO_AT, RATIO_NAN = range(11)
# ... and of its float partial results in `peaks` rows.
MAX_ERR, MAX_REL, RATIO = range(3)


@njit(inline="always")
def _value(bits, vals, table, i):
    """Element i widened to float64: from the dtype's table of every bit pattern (8 and 16
    bits) or the array itself (float32, float64)."""
    if table.size:
        return table[bits[i]]
    return np.float64(vals[i])


@njit(inline="always")
def _ulp(bx, by, shift, x_nan, y_nan):
    """`diag.numerics.ulp_distance` of one pair from its bits; NaN as documented there.

    Up to 32 bits: the distance of the ordered integers (the magnitude bits, negated for a
    negative sign; below 2**33 apart). float64: |mx - my| for equal signs, mx + my across zero
    (both < 2**63, so the uint64 sum does not wrap), saturated below NAN_ULP. No branch
    depends on the data (which of two neighbours is larger is a coin toss the processor would
    mispredict half the time); the width's is the same for every element.
    """
    bx, by = np.uint64(bx), np.uint64(by)
    mask = (np.uint64(1) << np.uint64(shift)) - np.uint64(1)
    mx, my = bx & mask, by & mask
    if shift < 63:
        ox = -np.int64(mx) if bx >> np.uint64(shift) else np.int64(mx)
        oy = -np.int64(my) if by >> np.uint64(shift) else np.int64(my)
        d = abs(ox - oy)
    else:
        w = max(mx, my) - min(mx, my)
        if (bx ^ by) >> np.uint64(shift):  # opposite signs: the path crosses zero
            w = mx + my
        d = np.int64(min(w, np.uint64(NAN_ULP - 1)))
    if x_nan or y_nan:
        d = 0 if x_nan and y_nan else NAN_ULP
    return d


#: Just below 1: `_below`'s margin for the roundings of its product (2**-50 >> 2 * 2**-53).
_SHRINK = 1.0 - 2.0**-50


@njit(inline="always")
def _below(num, limit, den):
    """Whether num / den, rounded, is certainly neither above `limit` nor NaN, told by a
    multiplication instead of the division (several times slower, and needed rarely: the
    largest ratio is soon found). True only where limit * den, with a margin for its
    rounding, is a normal float that num lies below; then num / den < limit exactly, so its
    rounding is <= limit. Any NaN, a zero or subnormal product says False: divide."""
    bar = limit * den * _SHRINK
    return num < bar and bar >= 2.0**-1000


@njit(cache=True, error_model="numpy")
def ulp_into(xb, xv, yb, yv, table, shift, out):
    """`out[i]` = the ULP distance of element i (all arrays 1-d, of one length, indexed from
    0, so that LLVM knows no index is negative: numba wraps those). One thread: its callers
    pass small arrays (a worst element, a training step's tensors), for which waking numba's
    threads would cost more than the loop."""
    for i in range(out.size):
        x, y = _value(xb, xv, table, i), _value(yb, yv, table, i)
        out[i] = _ulp(xb[i], yb[i], shift, x != x, y != y)


@njit(inline="always")
def _part(a, lo, hi):
    """a[lo:hi], or a itself where it is an empty placeholder (the values of table dtypes)."""
    return a[lo:hi] if a.size else a


@njit(cache=True, parallel=True, error_model="numpy")
def compare_blocks(ob, ov, tb, tv, table, shift, bound, hist_cap, counts, peaks, hist):
    """Partial results of `elementwise.compare`, one row per block of `counts` (int64, the
    indices above), `peaks` (float64) and `hist` (int64 counts of ULP distances below
    `hist_cap`; larger ones are counted in ULP_TAIL)."""
    n = bound.size
    for b in prange(counts.shape[0]):
        # Slices indexed from 0: LLVM then knows no index is negative (numba wraps those).
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        obs, ovs, tbs, tvs, bnd, h = _part(ob, lo, hi), _part(ov, lo, hi), _part(tb, lo, hi), \
            _part(tv, lo, hi), bound[lo:hi], hist[b]
        nan = inf = unexpected = not_rounded = exceeded = mismatched_nan = total = top = 0
        at = ratio_nan = 0
        max_err = max_rel = worst = 0.0
        # Four interleaved histograms and a last bin for the tail: runs of equal distances
        # (most are 0 or 1) would otherwise wait on the previous increment of the same bin.
        local = np.zeros((4, hist_cap + 1), np.int64)
        for i in range(hi - lo):
            o, t = _value(obs, ovs, table, i), _value(tbs, tvs, table, i)
            o_nan, t_nan = o != o, t != t
            o_inf, t_inf = np.isinf(o), np.isinf(t)
            finite = not (o_nan or t_nan or o_inf or t_inf)
            u = _ulp(obs[i], tbs[i], shift, o_nan, t_nan)
            if not finite:
                nan += o_nan
                inf += o_inf
                if not ((o_nan and t_nan) or (o_inf and t_inf and o == t)):
                    unexpected += 1
                mismatched_nan += u == NAN_ULP  # in no ULP statistic but the count
            not_rounded += u != 0
            comparable = u < NAN_ULP
            total += u if comparable else 0
            top = max(top, u if comparable else 0)
            local[i & 3, min(u, hist_cap)] += comparable
            if not finite:  # error, relative error and ratio 0 (numpy's `where=finite`)
                continue
            err = abs(o - t)
            max_err = max(max_err, err)
            abs_t = abs(t)
            if abs_t > 0 and not _below(err, max_rel, abs_t):
                max_rel = max(max_rel, err / abs_t)
            # The ratio matters where it may pass 1 (`bound_exceeded`) or the block's max.
            if i == 0 or ratio_nan or not _below(err, min(worst, 1.0), bnd[i]):
                ratio = err / bnd[i]
                if ratio > 1.0:
                    exceeded += 1
                # The block's max ratio and its first index; the first NaN ends the search.
                if not ratio_nan:
                    if ratio != ratio:
                        ratio_nan, at, worst = 1, i, ratio
                    elif i == 0 or ratio > worst:
                        at, worst = i, ratio
        for j in range(hist_cap):
            h[j] = local[0, j] + local[1, j] + local[2, j] + local[3, j]
        c = counts[b]
        c[NAN], c[INF], c[UNEXPECTED], c[NOT_ROUNDED], c[EXCEEDED] = \
            nan, inf, unexpected, not_rounded, exceeded
        c[ULP_COUNT], c[ULP_TOTAL], c[ULP_MAX] = hi - lo - mismatched_nan, total, top
        c[ULP_TAIL] = local[:, hist_cap].sum()
        c[RATIO_AT], c[RATIO_NAN] = lo + at, ratio_nan
        peaks[b, MAX_ERR], peaks[b, MAX_REL], peaks[b, RATIO] = max_err, max_rel, worst


# Indices of `agree_blocks`' partial results.
MISMATCHED, ULP_AT, AGREE_RATIO_NAN = range(3)
DIFF, AGREE_RATIO = range(2)


@njit(cache=True, parallel=True, error_model="numpy")
def agree_blocks(xb, xv, yb, yv, table, shift, bound, factor, counts, ulp_max, peaks):
    """Partial results of `elementwise.agreement` and `agree_values` per block: the count of
    differing elements and the first index of the largest ULP distance (`counts`), that
    distance (`ulp_max`), max |x - y| over finite pairs and the max of
    |x - y| / (factor * bound), 0 where a value is not finite, NaN winning (`peaks`; the ratio
    only where `bound` is not empty)."""
    n = xb.size
    with_bound = bound.size > 0
    for b in prange(counts.shape[0]):
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        xbs, xvs, ybs, yvs, bnd = _part(xb, lo, hi), _part(xv, lo, hi), _part(yb, lo, hi), \
            _part(yv, lo, hi), _part(bound, lo, hi)
        mismatched = at = ratio_nan = 0
        top = np.int64(0)
        max_diff = worst = 0.0
        for i in range(hi - lo):
            x, y = _value(xbs, xvs, table, i), _value(ybs, yvs, table, i)
            x_nan, y_nan = x != x, y != y
            u = _ulp(xbs[i], ybs[i], shift, x_nan, y_nan)
            if u:
                mismatched += 1
            if u > top:
                top, at = u, i
            if x_nan or y_nan or np.isinf(x) or np.isinf(y):
                continue  # |x - y| and the ratio are 0 (numpy's `where=finite`)
            diff = abs(x - y)
            max_diff = max(max_diff, diff)
            if not with_bound or ratio_nan:
                continue
            allowed = factor * bnd[i]
            if i == 0 or not _below(diff, worst, allowed):
                ratio = diff / allowed
                if ratio != ratio:
                    ratio_nan, worst = 1, ratio
                elif i == 0 or ratio > worst:
                    worst = ratio
        counts[b, MISMATCHED], counts[b, ULP_AT], counts[b, AGREE_RATIO_NAN] = \
            mismatched, lo + at, ratio_nan
        ulp_max[b] = top
        peaks[b, DIFF], peaks[b, AGREE_RATIO] = max_diff, worst


_TABLES: dict[np.dtype, np.ndarray] = {}
EMPTY = np.zeros(0)


def operand(x: np.ndarray) -> tuple:
    """A 1-d array as the kernels read it: (bits, values, table, sign bit position).

    Values of 8- and 16-bit dtypes (bfloat16, float16, float8) come from a float64 table of
    every bit pattern, filled by numpy's `astype`, so the kernels widen them exactly as numpy
    does without knowing the formats; float32 and float64 are read as they are.
    """
    x = np.ascontiguousarray(x).reshape(-1)
    width = x.dtype.itemsize
    bits = numerics.bits_view(x)
    if width > 2:
        return bits, x, EMPTY, 8 * width - 1
    if x.dtype not in _TABLES:
        every = np.arange(1 << (8 * width), dtype=bits.dtype).view(x.dtype)
        with np.errstate(invalid="ignore"):
            _TABLES[x.dtype] = every.astype(np.float64)
    return bits, EMPTY, _TABLES[x.dtype], 8 * width - 1


def blocks(n: int) -> int:
    """How many blocks the kernels split n elements into."""
    return -(-n // BLOCK)


def pair(x: np.ndarray, y: np.ndarray) -> tuple:
    """The leading kernel arguments for two arrays of one dtype and size:
    (x bits, x values, y bits, y values, table, sign bit position).

    Raises:
      UsageError: the dtypes differ or are not ones diag handles.
    """
    numerics.check_same_dtype(x, y)
    if x.size != y.size:  # the loops do not check their indices
        raise ValueError(f"arrays of {x.size} and {y.size} elements compared element-wise")
    xb, xv, table, shift = operand(x)
    yb, yv, _, _ = operand(y)
    return xb, xv, yb, yv, table, shift
