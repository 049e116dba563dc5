"""One row of a top-k output: is it a valid output, how much of the exact top-k it holds,
and what it left out.

Structure (indices in range and unique, values bitwise x[index], sorted with NaNs together at
one end), recall by value (which of several equal values was chosen never lowers it; -0 equals
+0), and the misses that make a row wrong. `diag.compare.topk` tallies these over the rows.
"""

from __future__ import annotations

import numpy as np

from diag import numerics

_NAN_KEY = np.iinfo(np.int64).max


def rank_keys(row: np.ndarray, nan_largest: bool) -> np.ndarray:
    """The oracle's order keys of `row`, NaN largest or (nan_largest=False) smallest."""
    from diag.oracle import rank_key

    k = rank_key(row)
    if not nan_largest:
        k = np.where(k == _NAN_KEY, np.iinfo(np.int64).min + 1, k)
    return k


def _topk_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """The multiset of the k highest keys (descending)."""
    if k == 0:
        return keys[:0]
    top = -np.partition(-keys, k - 1)[:k]
    return np.sort(top)[::-1]


def _multiset_hits(got: np.ndarray, want: np.ndarray) -> int:
    gv, gc = np.unique(got, return_counts=True)
    wv, wc = np.unique(want, return_counts=True)
    _, gi, wi = np.intersect1d(gv, wv, assume_unique=True, return_indices=True)
    return int(np.minimum(gc[gi], wc[wi]).sum())


def _index_problems(idx: np.ndarray, n: int) -> list[tuple[str, str]]:
    """(kind, text) for indices out of range and indices returned twice."""
    problems = []
    inr = (idx >= 0) & (idx < n)
    if not inr.all():
        problems.append(("out_of_range", f"index {int(idx[~inr][0])} out of range 0..{n - 1}"))
    uniq, first = np.unique(idx, return_index=True)
    if uniq.size != idx.size:
        dup = np.setdiff1d(np.arange(idx.size), first)
        problems.append(("duplicate", f"index {int(idx[dup[0]])} returned twice"))
    return problems


def _value_problem(xr: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> str | None:
    """A returned value that is not bitwise x[index] (any NaN matches any NaN), or None."""
    n = xr.shape[0]
    inr = (idx >= 0) & (idx < n)
    safe = np.where(inr, idx, 0)
    got = xr[safe]
    vb = (
        numerics.bits_view(vals.astype(xr.dtype))
        if vals.dtype != xr.dtype
        else numerics.bits_view(vals)
    )
    v64 = vals.astype(np.float64)
    same = (vb == numerics.bits_view(got)) | (np.isnan(v64) & np.isnan(got.astype(np.float64)))
    same &= inr
    if same.all():
        return None
    j = int(np.flatnonzero(~same)[0])
    return f"value {float(v64[j])!r} at position {j} is not x[{int(idx[j])}]" + (
        f" = {float(got[j].astype(np.float64))!r}" if inr[j] else ""
    )


def _order_problem(v64: np.ndarray) -> str | None:
    """Values not sorted descending, or NaNs not together at one end; None when in order."""
    L = v64.size
    isn = np.isnan(v64)
    num = v64[~isn]
    nan_block = not isn.any() or isn[: int(isn.sum())].all() or isn[L - int(isn.sum()) :].all()
    with np.errstate(invalid="ignore"):  # inf - inf between equal infinities
        rising = np.flatnonzero(np.diff(num) > 0) if num.size > 1 else np.array([], int)
    if rising.size:
        j = int(rising[0])
        return f"values not sorted descending ({float(num[j])!r} before {float(num[j + 1])!r})"
    if nan_block:
        return None
    # The first NaN outside a leading or trailing block of NaNs.
    lead = int(np.argmin(isn)) if not isn.all() else L
    trail = int(np.argmin(isn[::-1])) if not isn.all() else L
    where = next(int(p) for p in np.flatnonzero(isn) if lead <= p < L - trail)
    return (
        f"values not sorted: NaN at position {where} between numbers (NaN must come first or last)"
    )


def structure_problems(
    xr: np.ndarray, vals: np.ndarray, idx: np.ndarray, need_sorted: bool
) -> list[tuple[str, str]]:
    """(kind, text) for each way one output row is not a valid top-k output."""
    problems = _index_problems(idx, xr.shape[0])
    value = _value_problem(xr, vals, idx)
    if value:
        problems.append(("value_mismatch", value))
    order = _order_problem(vals.astype(np.float64)) if need_sorted else None
    if order:
        problems.append(("unsorted", order))
    return problems


def row_recall(xr: np.ndarray, cand: np.ndarray, k: int) -> float:
    """Recall by value of the candidates `cand`, under the better of the two NaN orders."""
    best = 0.0
    for nan_largest in (True, False):
        keys = rank_keys(xr, nan_largest)
        want = _topk_keys(keys, k)
        got_k = _topk_keys(keys[cand], min(k, cand.size))
        rec = _multiset_hits(got_k, want) / k if k else 1.0
        best = max(best, rec)
    return best


def row_misses(xr: np.ndarray, cand: np.ndarray, k: int) -> tuple[bool, bool | np.bool_]:
    """(misses_larger, misses_max) of one row (NaN aside): an element left out is strictly
    larger than one returned; the row maximum is not returned although a number was."""
    keys = rank_keys(xr, True)
    notnan = ~np.isnan(xr.astype(np.float64))
    ret = np.zeros(xr.shape[0], bool)
    ret[cand] = True
    ret_num = ret & notnan
    left_num = ~ret & notnan
    larger = bool(ret_num.any() and left_num.any() and keys[left_num].max() > keys[ret_num].min())
    row_max_missed: bool | np.bool_ = False
    if notnan.any():
        top = keys[notnan].max()
        has_max = bool((keys[ret_num] == top).any())
        nans = int((~notnan).sum())
        row_max_missed = not has_max and (ret_num.any() or nans < k)
    return larger, row_max_missed
