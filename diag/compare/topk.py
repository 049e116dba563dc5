"""Top-k (exact and approximate): judged by structure, recall by value and "wrong" rows, so tie,
NaN and signed-zero order are reported as semantics, not errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag.compare.topk_rows import rank_keys, row_misses, row_recall, structure_problems
from diag.compare.verdict import Mismatch, Verdict, format_mismatch
from diag.status import Status
from diag.tolerance import TOPK_EXACT_RECALL


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


@dataclass
class _Tally:
    """`check_top_k`'s findings, counted row by row against the exact top-k (canon_v, canon_i)."""

    k: int
    returned: int
    recall_target: float | None
    need_sorted: bool
    canon_v: np.ndarray
    canon_i: np.ndarray
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("out_of_range", "duplicate", "value_mismatch", "unsorted"), 0
        )
    )
    invalid_rows: int = 0
    misses_larger: int = 0
    misses_max: int = 0
    wrong: int = 0
    below: int = 0
    semantic_rows: int = 0
    invalid_examples: list[dict] = field(default_factory=list)
    wrong_examples: list[dict] = field(default_factory=list)
    worst: int | None = None

    def __post_init__(self) -> None:
        self.recalls = np.ones(self.canon_v.shape[0])

    def add_row(self, r: int, xr: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> None:
        """Check output row `r` (values `vals` at indices `idx`) of input row `xr`."""
        k, approx = self.k, self.recall_target is not None
        problems = structure_problems(xr, vals, idx, self.need_sorted)
        self._add_problems(r, problems)
        # Recall and wrongness use the distinct in-range indices actually selected.
        cand = np.unique(idx[(idx >= 0) & (idx < xr.shape[0])])
        best = row_recall(xr, cand, k)
        self.recalls[r] = best
        self.below += self.recall_target is not None and best < self.recall_target
        larger, row_max_missed = row_misses(xr, cand, k)
        is_wrong = row_max_missed or (larger and not approx)
        self.misses_larger += larger
        self.misses_max += int(row_max_missed)
        self.wrong += int(is_wrong)
        if is_wrong and len(self.wrong_examples) < 10:
            self.wrong_examples.append(
                {
                    "row": r,
                    "expected": _vals(self.canon_v[r]),
                    "returned": _vals(np.sort(xr.astype(np.float64)[cand])[::-1]),
                    "missed_max": row_max_missed,
                }
            )
        if self.worst is None or best < self.recalls[self.worst]:
            self.worst = r
        if not problems and not is_wrong and best == 1.0 and self.returned == k and not approx:
            self.semantic_rows += not np.array_equal(idx, self.canon_i[r])

    def _add_problems(self, row: int, problems: list[tuple[str, str]]) -> None:
        for kind, _ in problems:
            self.counts[kind] += 1
        if problems:
            self.invalid_rows += 1
            if len(self.invalid_examples) < 10:
                text = "; ".join(t for _, t in problems)
                self.invalid_examples.append({"row": row, "problem": text})

    def metrics(self, semantics: list[str], values: np.ndarray) -> dict[str, Any]:
        """The metrics of `check_top_k`; `values` [rows, returned] name the worst row's."""
        rows = self.canon_v.shape[0]
        metrics: dict[str, Any] = {
            "rows": int(rows),
            "k": int(self.k),
            "returned": int(self.returned),
            "mode": "exact" if self.recall_target is None else "approx",
            "invalid_rows": self.invalid_rows,
            **{f"{key}_rows": v for key, v in self.counts.items()},
            "invalid_examples": self.invalid_examples,
            "misses_larger_rows": int(self.misses_larger),
            "misses_max_rows": int(self.misses_max),
            "wrong_rows": int(self.wrong),
            "wrong_examples": self.wrong_examples,
            "recall_min": float(self.recalls.min()) if rows else 1.0,
            "recall_mean": float(self.recalls.mean()) if rows else 1.0,
            "recall_target": self.recall_target,
            "rows_below_target": int(self.below),
            "semantic_diff_rows": int(self.semantic_rows),
            "semantics": semantics,
        }
        if self.worst is not None:
            worst = self.worst
            metrics["worst_row"] = {
                "row": int(worst),
                "recall": float(self.recalls[worst]),
                "expected": _vals(self.canon_v[worst]),
                "returned": _vals(np.sort(values[worst].astype(np.float64))[::-1]),
            }
        return metrics


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
    rows = x2.shape[0]
    L = v2.shape[1]
    if L < k:
        raise UsageError(f"check_top_k: the output has {L} columns, fewer than k = {k}")
    need_sorted = (L == k) if sorted_output is None else bool(sorted_output)
    if truth is None:
        from diag.oracle import top_k as exact_top_k

        truth = exact_top_k(x2, k)
    canon_v, canon_i = (np.asarray(t).reshape(rows, k) for t in truth)
    tally = _Tally(k, L, recall_target, need_sorted, canon_v, canon_i)
    for r in range(rows):
        tally.add_row(r, x2[r], v2[r], i2[r].astype(np.int64))
    semantics = describe_topk_semantics(x2, v2, i2) if need_sorted else []
    return tally.metrics(semantics, v2)


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
        return Status.FAIL, (
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
        return Status.FAIL, (
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
            return Status.FAIL, f"top-k recall below 1: {worst}"
        sem = metrics["semantics"]
        note = f"; order semantics: {', '.join(sem)}" if sem else ""
        if metrics["semantic_diff_rows"]:
            note += (
                f"; {metrics['semantic_diff_rows']} / {rows} rows choose or order equal "
                f"values differently from diag's order (not an error)"
            )
        return Status.PASS, f"exact top-k in all {rows} rows{note}"
    target = (
        recall_target
        if recall_target is not None
        else metrics.get("recall_target") or TOPK_EXACT_RECALL
    )
    mean = metrics["recall_mean"]
    if mean < target:
        # A mean below the target puts at least one row below it: m counts them.
        assert m is not None
        return Status.FAIL, (
            f"approximate top-k mean recall {mean:.4g} is below the promised "
            f"{target:g}; {format_mismatch(m)} below; {worst}"
        )
    if m is not None:
        return Status.WARN, (
            f"approximate top-k mean recall {mean:.4g} meets the promised {target:g} "
            f"but {format_mismatch(m)} fall below it; {worst}"
        )
    return Status.PASS, (
        f"approximate top-k recall >= {target:g} in every row (mean {mean:.4g}, "
        f"min {metrics['recall_min']:.4g})"
    )


def agree_top_k(x: np.ndarray, a: tuple, b: tuple, k: int, names: tuple[str, str]) -> Verdict:
    """Do two backends' top-k outputs select the same VALUES per row (ties may pick different
    indices, and bf16 logits have many)? Returns the pair's verdict; differing values
    -> warn (each output is judged against the exact top-k on its own)."""
    x2, va, _ = _rows3(x, *a)
    _, vb, _ = _rows3(x, *b)
    rows = x2.shape[0]
    differ = []
    same_idx = 0
    for r in range(rows):
        # The best k of each side's candidates (approx_max_k may return more than k).
        ka = np.sort(rank_keys(va[r], True))[::-1][:k]
        kb = np.sort(rank_keys(vb[r], True))[::-1][:k]
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
        return Verdict(
            Status.PASS,
            f"{names[0]} and {names[1]} select the same values in all {rows} rows" + extra,
            metrics,
        )
    differ_rows = Mismatch(len(differ), rows, "rows", share=False)
    return Verdict(
        Status.WARN,
        (
            f"{names[0]} and {names[1]} select different values in "
            f"{format_mismatch(differ_rows)} (first: row {differ[0]})"
        ),
        metrics,
        mismatch=differ_rows,
    )
