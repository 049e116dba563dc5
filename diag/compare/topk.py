"""Top-k (exact and approximate): judged by structure, recall by value and "wrong" rows, so tie,
NaN and signed-zero order are reported as semantics, not errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diag import numerics
from diag.compare.verdict import Mismatch, format_mismatch
from diag.tolerance import TOPK_EXACT_RECALL

_NAN_KEY = np.iinfo(np.int64).max


def _keys(row: np.ndarray, nan_largest: bool) -> np.ndarray:
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


def _vals(v: np.ndarray) -> list:
    return [float(t) for t in np.asarray(v).astype(np.float64)[:8]]


def _row_semantics(xr: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> dict[str, str]:
    """What one valid output row shows about the implementation's order (observed only)."""
    obs: dict[str, str] = {}
    v64 = vals.astype(np.float64)
    isn = np.isnan(v64)
    row_nans = int(np.isnan(xr.astype(np.float64)).sum())
    k = v64.size
    if row_nans:
        want = min(row_nans, k)
        if isn[:want].all() and isn.sum() == want:
            obs["nan"] = "NaN ranked largest"
        elif isn.sum() == max(0, k - (xr.size - row_nans)) and (
            not isn.any() or isn[-isn.sum() :].all()
        ):
            obs["nan"] = "NaN ranked smallest"
        else:
            obs["nan"] = "NaN placed inconsistently"
    sign = np.signbit(v64)
    for a in range(k - 1):
        b = a + 1
        if isn[a] or isn[b] or v64[a] != v64[b]:
            continue
        if v64[a] == 0 and sign[a] != sign[b]:
            if not sign[a] and idx[a] > idx[b]:
                obs["zero"] = "+0 ranked above -0"
            elif sign[a] and idx[a] > idx[b]:
                obs["zero"] = "-0 ranked above +0"
            else:
                obs.setdefault("zero", "-0 and +0 ranked equal (index order)")
            continue
        order = "lowest index first" if idx[a] < idx[b] else "highest index first"
        if obs.get("ties", order) != order:
            order = "no consistent index order"
        obs["ties"] = order
    return obs


def describe_topk_semantics(x: np.ndarray, values: np.ndarray, indices: np.ndarray) -> list[str]:
    """What a top-k output shows about its implementation's order, over all rows (observed).

    Only what the output evidences is said: "NaN ranked largest" needs a row with a NaN,
    "ties: lowest index first" needs equal values next to each other in a row.

    Args:
        x: [..., n] inputs; values, indices: [..., k] a backend returned (sorted output).

    Returns:
        Sorted list of observations, e.g. ["NaN ranked largest", "ties: lowest index first"].
    """
    x2, v2, i2 = _rows3(x, values, indices)
    seen: dict[str, set] = {}
    for r in range(x2.shape[0]):
        for key, what in _row_semantics(x2[r], v2[r], i2[r]).items():
            seen.setdefault(key, set()).add(what)
    out = []
    for key, whats in seen.items():
        if key == "ties":
            if len(whats) > 1:
                whats = {"no consistent index order"}
            out += [f"ties: {w}" for w in whats]
        elif len(whats) > 1:
            out.append(f"{key}: varies between rows ({'; '.join(sorted(whats))})")
        else:
            out += list(whats)
    return sorted(out)


def _rows3(x, values, indices):
    x = np.asarray(x)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    values, indices = np.asarray(values), np.asarray(indices)
    if values.shape != indices.shape or values.shape[:-1] != x.shape[:-1]:
        from diag.errors import UsageError

        raise UsageError(
            f"top-k output shapes {values.shape} (values) and {indices.shape} "
            f"(indices) do not fit an input of shape {x.shape}"
        )
    L = values.shape[-1]
    return x2, values.reshape(-1, L), indices.reshape(-1, L)


def check_top_k(
    x: np.ndarray,
    values: np.ndarray,
    indices: np.ndarray,
    k: int,
    *,
    recall_target: float | None = None,
    sorted_output: bool | None = None,
    truth: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Check a (possibly approximate) top-k output row by row against the exact top-k.

    Per row: structural validity (indices in range and unique, values bitwise equal to
    x[indices] with any NaN matching any NaN, values sorted descending with NaNs together at
    one end), recall by VALUE (a returned element counts while the exact top-k still holds an
    element of that value: which of several equal values was chosen never lowers recall; -0
    equals +0), the better of the two NaN conventions (NaN largest / NaN smallest) so that NaN
    order is semantics, not error; `misses_larger`: an element left out is strictly larger than
    one returned (NaN aside); `misses_max`: the row maximum (NaN aside) is not returned although a
    non-NaN value was. With L > k columns (approx_max_k, aggregate_to_topk=False) the best k of
    the returned candidates are judged and order is not required.

    Args:
        x: [..., n] inputs.
        values, indices: [..., L] the backend's output, L >= k.
        k: the k asked for.
        recall_target: the recall the approximate op promised; None for an exact top-k.
        sorted_output: whether sorted order is required; default L == k.
        truth: the exact top-k (values, indices), each [..., k], as the runner computed and
          cached it (`diag.oracle.top_k_result`); the examples and the semantic comparison
          use it as given. None only for direct calls with no oracle result at hand: then it
          is computed here.

    Returns:
        JSON-serialisable metrics: rows, k, returned, invalid_rows (+ out_of_range_rows,
        duplicate_rows, value_mismatch_rows, unsorted_rows, invalid_examples), misses_larger_rows,
        misses_max_rows, wrong_rows (misses_max, plus misses_larger for an exact top-k),
        wrong_examples, recall_min/mean, rows_below_target, worst_row (row, recall, expected and
        returned values), semantic_diff_rows and semantics (`describe_topk_semantics`).
    """
    from diag.errors import UsageError

    x2, v2, i2 = _rows3(x, values, indices)
    rows, n = x2.shape
    L = v2.shape[1]
    if L < k:
        raise UsageError(f"check_top_k: the output has {L} columns, fewer than k = {k}")
    need_sorted = (L == k) if sorted_output is None else bool(sorted_output)
    approx = recall_target is not None
    counts = {"out_of_range": 0, "duplicate": 0, "value_mismatch": 0, "unsorted": 0}
    invalid_rows = misses_larger = misses_max = semantic_rows = below = wrong = 0
    invalid_examples: list[dict] = []
    wrong_examples: list[dict] = []
    recalls = np.ones(rows)
    worst = None
    if truth is None:
        from diag.oracle import top_k as exact_top_k

        truth = exact_top_k(x2, k)
    canon_v, canon_i = (np.asarray(t).reshape(rows, k) for t in truth)
    for r in range(rows):
        xr = x2[r]
        x64 = xr.astype(np.float64)
        idx = i2[r].astype(np.int64)
        vals = v2[r]
        problems = []
        inr = (idx >= 0) & (idx < n)
        if not inr.all():
            counts["out_of_range"] += 1
            problems.append(f"index {int(idx[~inr][0])} out of range 0..{n - 1}")
        uniq, first = np.unique(idx, return_index=True)
        if uniq.size != idx.size:
            counts["duplicate"] += 1
            dup = np.setdiff1d(np.arange(idx.size), first)
            problems.append(f"index {int(idx[dup[0]])} returned twice")
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
        if not same.all():
            counts["value_mismatch"] += 1
            j = int(np.flatnonzero(~same)[0])
            problems.append(
                f"value {float(v64[j])!r} at position {j} is not x[{int(idx[j])}]"
                + (f" = {float(got[j].astype(np.float64))!r}" if inr[j] else "")
            )
        if need_sorted:
            isn = np.isnan(v64)
            num = v64[~isn]
            nan_block = (
                not isn.any() or isn[: int(isn.sum())].all() or isn[L - int(isn.sum()) :].all()
            )
            with np.errstate(invalid="ignore"):  # inf - inf between equal infinities
                rising = np.flatnonzero(np.diff(num) > 0) if num.size > 1 else np.array([], int)
            if rising.size or not nan_block:
                counts["unsorted"] += 1
                if rising.size:
                    j = int(rising[0])
                    problems.append(
                        f"values not sorted descending ({float(num[j])!r} before "
                        f"{float(num[j + 1])!r})"
                    )
                else:
                    # The first NaN outside a leading or trailing block of NaNs.
                    lead = int(np.argmin(isn)) if not isn.all() else L
                    trail = int(np.argmin(isn[::-1])) if not isn.all() else L
                    where = next(int(p) for p in np.flatnonzero(isn) if lead <= p < L - trail)
                    problems.append(
                        f"values not sorted: NaN at position {where} between "
                        f"numbers (NaN must come first or last)"
                    )
        if problems:
            invalid_rows += 1
            if len(invalid_examples) < 10:
                invalid_examples.append({"row": r, "problem": "; ".join(problems)})
        # Recall and wrongness use the distinct in-range indices actually selected.
        cand = np.unique(idx[inr])
        best = 0.0
        for nan_largest in (True, False):
            keys = _keys(xr, nan_largest)
            want = _topk_keys(keys, k)
            got_k = _topk_keys(keys[cand], min(k, cand.size))
            rec = _multiset_hits(got_k, want) / k if k else 1.0
            best = max(best, rec)
        recalls[r] = best
        if recall_target is not None and best < recall_target:
            below += 1
        keys = _keys(xr, True)
        notnan = ~np.isnan(x64)
        ret = np.zeros(n, bool)
        ret[cand] = True
        ret_num = ret & notnan
        left_num = ~ret & notnan
        larger = bool(
            ret_num.any() and left_num.any() and keys[left_num].max() > keys[ret_num].min()
        )
        row_max_missed = False
        if notnan.any():
            top = keys[notnan].max()
            has_max = bool((keys[ret_num] == top).any())
            nans = int((~notnan).sum())
            row_max_missed = not has_max and (ret_num.any() or nans < k)
        misses_larger += larger
        misses_max += row_max_missed
        is_wrong = row_max_missed or (larger and not approx)
        wrong += is_wrong
        if is_wrong and len(wrong_examples) < 10:
            wrong_examples.append(
                {
                    "row": r,
                    "expected": _vals(canon_v[r]),
                    "returned": _vals(np.sort(x64[cand])[::-1]),
                    "missed_max": row_max_missed,
                }
            )
        if worst is None or best < recalls[worst]:
            worst = r
        if not problems and not is_wrong and best == 1.0 and L == k and not approx:
            if not np.array_equal(idx, canon_i[r]):
                semantic_rows += 1
    metrics: dict[str, Any] = {
        "rows": int(rows),
        "k": int(k),
        "returned": int(L),
        "mode": "approx" if approx else "exact",
        "invalid_rows": invalid_rows,
        **{f"{key}_rows": v for key, v in counts.items()},
        "invalid_examples": invalid_examples,
        "misses_larger_rows": int(misses_larger),
        "misses_max_rows": int(misses_max),
        "wrong_rows": int(wrong),
        "wrong_examples": wrong_examples,
        "recall_min": float(recalls.min()) if rows else 1.0,
        "recall_mean": float(recalls.mean()) if rows else 1.0,
        "recall_target": recall_target,
        "rows_below_target": int(below),
        "semantic_diff_rows": int(semantic_rows),
        "semantics": describe_topk_semantics(x2, v2, i2) if need_sorted else [],
    }
    if worst is not None:
        metrics["worst_row"] = {
            "row": int(worst),
            "recall": float(recalls[worst]),
            "expected": _vals(canon_v[worst]),
            "returned": _vals(np.sort(v2[worst].astype(np.float64))[::-1]),
        }
    return metrics


def top_k_mismatch(metrics: dict[str, Any], *, approx: bool) -> Mismatch | None:
    """The rows that break the rule in `check_top_k`'s metrics, or None.

    In the order `judge_top_k` decides: invalid rows, wrong rows (for an approximate top-k only
    those missing their maximum), then rows below the promised recall.
    """
    rows = metrics["rows"]
    if metrics["invalid_rows"]:
        return Mismatch(
            metrics["invalid_rows"],
            rows,
            "rows",
            share=False,
            where=f"row {metrics['invalid_examples'][0]['row']}",
        )
    wrong = metrics["misses_max_rows"] if approx else metrics["wrong_rows"]
    if wrong:
        return Mismatch(
            wrong, rows, "rows", share=False, where=f"row {metrics['wrong_examples'][0]['row']}"
        )
    if approx and metrics["rows_below_target"]:
        return Mismatch(
            metrics["rows_below_target"],
            rows,
            "rows",
            share=False,
            where=f"row {metrics.get('worst_row', {}).get('row')}",
        )
    return None


def judge_top_k(
    metrics: dict[str, Any], *, approx: bool, recall_target: float | None = None
) -> tuple[str, str]:
    """Verdict for `check_top_k` metrics: (status, one-line reason).

    Exact top-k: any invalid or wrong row, or recall below 1 -> fail; differences in tie,
    NaN or signed-zero order alone -> pass, named in the reason. Approximate: invalid rows or
    rows missing their maximum -> fail; mean recall below the target -> fail; mean recall met
    but some rows below it -> warn (the per-row minimum is given).
    """
    rows = metrics["rows"]
    what = "approximate top-k" if approx else "top-k"
    m = top_k_mismatch(metrics, approx=approx)
    if metrics["invalid_rows"]:
        assert m is not None  # top_k_mismatch counts the invalid rows first
        ex = metrics["invalid_examples"][0]
        return "fail", (
            f"{what}: {format_mismatch(m)} are not a valid top-k (first: row "
            f"{ex['row']}: {ex['problem']})"
        )
    wrong = metrics["misses_max_rows"] if approx else metrics["wrong_rows"]
    if wrong:
        assert m is not None  # top_k_mismatch counts the wrong rows next
        ex = metrics["wrong_examples"][0]
        why = (
            "misses the row maximum"
            if ex["missed_max"]
            else "leaves out a value larger than one it returned"
        )
        return "fail", (
            f"{what}: {format_mismatch(m)} are wrong (row {ex['row']} {why}: "
            f"expected {ex['expected']}, returned {ex['returned']})"
        )
    w = metrics.get("worst_row", {})
    worst = (
        f"min recall {metrics['recall_min']:.4g} at row {w.get('row')} (expected "
        f"{w.get('expected')}, returned {w.get('returned')})"
    )
    if not approx:
        if metrics["recall_min"] < TOPK_EXACT_RECALL:
            return "fail", f"top-k recall below 1: {worst}"
        sem = metrics["semantics"]
        note = f"; order semantics: {', '.join(sem)}" if sem else ""
        if metrics["semantic_diff_rows"]:
            note += (
                f"; {metrics['semantic_diff_rows']} / {rows} rows choose or order equal "
                f"values differently from diag's order (not an error)"
            )
        return "pass", f"exact top-k in all {rows} rows{note}"
    target = (
        recall_target
        if recall_target is not None
        else metrics.get("recall_target") or TOPK_EXACT_RECALL
    )
    mean = metrics["recall_mean"]
    if mean < target:
        # A mean below the target puts at least one row below it: m counts them.
        assert m is not None
        return "fail", (
            f"approximate top-k mean recall {mean:.4g} is below the promised "
            f"{target:g}; {format_mismatch(m)} below; {worst}"
        )
    if m is not None:
        return "warn", (
            f"approximate top-k mean recall {mean:.4g} meets the promised {target:g} "
            f"but {format_mismatch(m)} fall below it; {worst}"
        )
    return "pass", (
        f"approximate top-k recall >= {target:g} in every row (mean {mean:.4g}, "
        f"min {metrics['recall_min']:.4g})"
    )


def agree_top_k(
    x: np.ndarray, a: tuple, b: tuple, k: int, names: tuple[str, str]
) -> tuple[str, str, dict[str, Any]]:
    """Do two backends' top-k outputs select the same VALUES per row (ties may pick different
    indices, and bf16 logits have many)? Returns (status, reason, metrics); differing values
    -> warn (each output is judged against the exact top-k on its own)."""
    x2, va, _ = _rows3(x, *a)
    _, vb, _ = _rows3(x, *b)
    rows = x2.shape[0]
    differ = []
    same_idx = 0
    for r in range(rows):
        # The best k of each side's candidates (approx_max_k may return more than k).
        ka = np.sort(_keys(va[r], True))[::-1][:k]
        kb = np.sort(_keys(vb[r], True))[::-1][:k]
        if not np.array_equal(ka, kb):
            differ.append(r)
    ia, ib = np.asarray(a[1]).reshape(rows, -1), np.asarray(b[1]).reshape(rows, -1)
    same_idx = int(sum(np.array_equal(ia[r, :k], ib[r, :k]) for r in range(rows)))
    metrics = {
        "rows": rows,
        "value_differ_rows": len(differ),
        "same_index_rows": same_idx,
        "differ_examples": [
            {
                "row": r,
                names[0]: _vals(np.sort(va[r, :k].astype(np.float64))[::-1]),
                names[1]: _vals(np.sort(vb[r, :k].astype(np.float64))[::-1]),
            }
            for r in differ[:5]
        ],
    }
    if not differ:
        extra = (
            ""
            if same_idx == rows
            else (f" ({rows - same_idx} rows pick different indices among equal values)")
        )
        return (
            "pass",
            f"{names[0]} and {names[1]} select the same values in all {rows} rows" + extra,
            metrics,
        )
    differ_rows = Mismatch(len(differ), rows, "rows", share=False)
    return (
        "warn",
        (
            f"{names[0]} and {names[1]} select different values in "
            f"{format_mismatch(differ_rows)} (first: row {differ[0]})"
        ),
        metrics,
    )
