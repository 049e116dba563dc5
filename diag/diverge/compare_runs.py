"""`compare(run_a, run_b)`: two implementations tap the same names; which tap first differs?

Each run is called once under a recorder. Taps are paired by name (a name tapped k times is
``name``, ``name#1``, ... ``name#k-1``), run B's names first passed through the name map. Per
pair: the normwise relative difference ``max|a - b| / max|b|`` and the mean one, against what
two correct implementations in the tap's dtype may differ by: u^(2/3) of the narrower of the
two dtypes (`diag.tolerance.diverge.diverge_tap_allowance`, derived there: each correct
implementation
keeps about k*u of the truth after k well-conditioned ops, so two differ by at most about 2k*u,
far below a third of the significand bits unless one computes something else). `first` is the first
tap in run A's order
beyond it: the layer where the port broke (later taps inherit its difference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from diag.diverge.records import CompareReport, DivergeError, NothingCompared, TapRecord
from diag.diverge.rules import absdiff
from diag.diverge.taps import recording
from diag.tolerance.diverge import diverge_tap_allowance


def _run(fn: Callable[[], Any], label: str, modules: bool) -> list:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    try:
        with recording(modules) as rec:
            fn()
    except DivergeError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise DivergeError(f"run {label} ({name}) raised {type(e).__name__}: {e}") from e
    return rec.taps


def _numbered(taps: list, rename: Callable[[str], str | None]) -> dict[str, tuple]:
    """name (``#k`` for the k-th repetition) -> (order, value, dtype, shape)."""
    seen: dict[str, int] = {}
    out: dict[str, tuple] = {}
    for order, (name, value, dtype, shape) in enumerate(taps):
        name = rename(name)
        if name is None:
            continue
        k = seen.get(name, 0)
        seen[name] = k + 1
        out[name if k == 0 else f"{name}#{k}"] = (order, value, dtype, shape)
    return out


def _allowed(dtype_a: str, dtype_b: str) -> float:
    allowed = []
    for d in (dtype_a, dtype_b):
        try:
            allowed.append(diverge_tap_allowance(d))
        except Exception:  # noqa: BLE001 - an integer tap: must match exactly
            allowed.append(0.0)
    return max(allowed)


def _figures(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = absdiff(a, b)
    if d.size == 0:
        return 0.0, 0.0
    mag = np.abs(b[np.isfinite(b)])
    top, mean = (float(mag.max()), float(mag.mean())) if mag.size else (0.0, 0.0)
    dmax, dmean = float(d.max()), float(d.mean())

    def rel(num: float, den: float) -> float:
        if num == 0.0:
            return 0.0
        return num / den if den > 0 and math.isfinite(num) else math.inf

    return rel(dmax, top), rel(dmean, mean)


def _nothing_shared(taps_a: dict, taps_b: dict, shown: int = 8) -> str:
    """The names each run tapped, when they share none (or one run tapped nothing)."""

    def names(taps: dict) -> str:
        got = list(taps)
        more = f", ... ({len(got) - shown} more)" if len(got) > shown else ""
        return ", ".join(got[:shown]) + more if got else "no taps"

    return (
        f"nothing to compare: the two runs share no tap name (run A: {names(taps_a)}; "
        f"run B: {names(taps_b)}); tap the same names with diag.tap (or --modules, "
        f"with a name map for another framework's module paths)"
    )


def compare(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    *,
    modules: bool = False,
    name_map: dict[str, str] | Callable[[str], str | None] | None = None,
) -> CompareReport:
    """See `diag.diverge.compare`."""
    if isinstance(name_map, dict):
        mapping = dict(name_map)
        rename_b: Callable[[str], str | None] = lambda n: mapping.get(n, n)  # noqa: E731
    elif callable(name_map):
        rename_b = name_map
    else:
        rename_b = lambda n: n  # noqa: E731
    taps_a = _numbered(_run(run_a, "A", modules), lambda n: n)
    taps_b = _numbered(_run(run_b, "B", modules), rename_b)
    records: list[TapRecord] = []
    for name, (_order, a, dtype_a, shape_a) in sorted(taps_a.items(), key=lambda kv: kv[1][0]):
        if name not in taps_b:
            continue
        _, b, dtype_b, shape_b = taps_b[name]
        allowed = _allowed(dtype_a, dtype_b)
        note = ""
        if a.shape != b.shape:
            if a.size == b.size:
                note = f"shapes differ ({list(shape_a)} vs {list(shape_b)}); compared flat"
                a, b = a.reshape(-1), b.reshape(-1)
            else:
                note = f"shapes differ ({list(shape_a)} vs {list(shape_b)})"
        if note.startswith("shapes differ (") and a.shape != b.shape:
            max_rel = mean_rel = ratio = math.inf
        else:
            max_rel, mean_rel = _figures(a, b)
            ratio = max_rel / allowed if allowed > 0 else (0.0 if max_rel == 0 else math.inf)
        records.append(
            TapRecord(
                name=name,
                index=len(records),
                dtype=dtype_a,
                shape=tuple(shape_a),
                max_rel=max_rel,
                mean_rel=mean_rel,
                allowed=allowed,
                ratio=ratio,
                note=note,
            )
        )
    if not records:
        raise NothingCompared(_nothing_shared(taps_a, taps_b))
    first = next((r for r in records if r.beyond), None)
    return CompareReport(
        first=first,
        taps=tuple(records),
        only_a=tuple(n for n in taps_a if n not in taps_b),
        only_b=tuple(n for n in taps_b if n not in taps_a),
    )
