"""Decisions, not only values: a comparison, an argmax, a top-k cut that goes the other way.

In a sampler almost every op stays within its error bound; what goes wrong is a decision (a
greedy argmax, a top-k/top-p cut, a mask) taken the other way than the float64 computation
takes it. Both evaluators (JAX, PyTorch) hand each decision here with its low-precision output,
the same decision taken in float64 on the shadows, and the operands it was taken on; this
module (numpy only) counts the elements decided the other way and says why:

* **forced by rounding**: rounding the float64 operands *once* to the dtype already ties or
  reverses them (the float64 values are closer than the dtype can resolve). No implementation
  in that dtype can decide it: a warning, with the advice to decide in float32.
* **made by the computation**: the once-rounded float64 operands still decide as float64 does,
  so it is the error the computation carried into the operands (a temperature division in
  bf16, a bf16 cumsum, ``1 - top_p`` rounded to bf16) that moved a value across: a failure,
  naming the op that added the most carried error among the decision's ancestors.

Operands are passed with the decided axis last (argmax, top_k, sort); a comparison's two
operands broadcast against each other.
"""

from __future__ import annotations

import dataclasses
import io
import linecache
import math
import tokenize
from collections.abc import Callable

import numpy as np

from diag import numerics
from diag.errors import EXIT_OK, exit_code
from diag.status import Status

KINDS = ("compare", "argmax", "top_k", "sort", "select", "mask", "threshold")
#: The kinds that rank values along an axis (indices out), the others decide per element.
RANKINGS = frozenset(KINDS[1:4])
FORCED = "forced by rounding"
MADE = "made by the computation"


@dataclasses.dataclass(frozen=True)
class DecisionRecord:
    """One decision the low-precision run took differently from the float64 shadow.

    Attributes:
        index: position in execution order (the `OpRecord.index` of the next measured op).
        primitive: ``gt``, ``argmax``, ``top_k``, ``select_n``, ``aten.masked_fill``, ...
        kind: ``compare``, ``argmax``, ``top_k``, ``sort``, ``select``, ``mask`` or
            ``threshold`` (a comparison one of whose operands is a cumulative sum).
        source: the user's line ``file.py:LINE (function)``; `library` the library line
            (transformers' ``logits_process.py:NNN``), empty if none.
        path, phase: where it sits (``jit[f]/scan[3]``), ``forward``/``backward``.
        dtype: the dtype the decision was taken in.
        flipped: elements decided the other way than float64; `total` elements decided.
        margin_ulps: the smallest float64 margin among flipped elements (how far the float64
            operands are from the decision's edge), in ULPs of `dtype`.
        cause: ``forced by rounding`` or ``made by the computation``.
        cause_op: for a made flip, the op that moved a value across (``div at s.py:12``).
        verdict: ``warn`` (forced) or ``fail`` (made).
        reason: one line a user reads.
    """

    index: int
    primitive: str
    kind: str
    source: str
    library: str
    path: str
    phase: str
    dtype: str
    flipped: int
    total: int
    margin_ulps: float
    cause: str
    cause_op: str
    verdict: str
    reason: str


@dataclasses.dataclass(frozen=True)
class LiteralRecord:
    """A constant rounded to the dtype when the function was traced (0.9 -> 0.8984375 bf16).

    Attributes:
        source: the user's line that wrote it.
        written: the value as written (``0.9``); `used` the value the program computes with
            (``0.8984375``); `dtype` the dtype it was rounded to.
    """

    source: str
    written: str
    used: str
    dtype: str


def judge_decision(
    kind: str,
    low: np.ndarray,
    exact: np.ndarray,
    *,
    dtype,
    operands_low: list[np.ndarray],
    operands_exact: list[np.ndarray],
    exact_operands: tuple[int, ...] = (),
) -> tuple[int, int, float, bool]:
    """(flipped, total, margin_ulps, forced) of one decision.

    Args:
        kind: one of `KINDS`.
        low: the decision as the program took it (booleans for compare/threshold/select/mask,
            indices for argmax/top_k/sort).
        exact: the same decision taken in float64 on the shadows.
        dtype: the dtype the decision was taken in.
        operands_low: the float operands as the program had them (unused by the rule, kept
            for the record).
        operands_exact: the float64 shadows of the operands: two for a comparison, one (the
            decided axis last) for argmax/top_k/sort, none for a select/mask whose predicate
            came from elsewhere.
        exact_operands: positions of comparison operands taken as they are, not rounded: a
            literal the program rounded at trace time is compared with its written value (an
            implementation may compare with the exact value, so its rounding is no excuse).

    `forced` is True when rounding the float64 operands once to `dtype` and deciding on them
    does not reproduce the float64 decision for every flipped element (a tie or reversal after
    one rounding: no implementation in that dtype can decide it).
    """
    del operands_low
    low, exact = np.asarray(low), np.asarray(exact)
    if kind in RANKINGS:
        return _judge_ranking(kind, low, exact, dtype, operands_exact)
    low, exact = np.broadcast_arrays(low, exact)
    diff = low != exact
    flipped, total = int(diff.sum()), int(diff.size)
    if flipped == 0:
        return 0, total, math.nan, False
    if len(operands_exact) != 2:  # a predicate from elsewhere: nothing to round
        return flipped, total, math.nan, False
    a, b = (np.broadcast_to(np.asarray(o, np.float64), diff.shape) for o in operands_exact)
    a, b = a[diff], b[diff]
    ra, rb = (x if k in exact_operands else _round(x, dtype) for k, x in enumerate((a, b)))
    with np.errstate(invalid="ignore"):
        each = np.sign(ra - rb) != np.sign(a - b)
    return (flipped, total, *_margin_forced(a, b, each, dtype))


def _judge_ranking(kind, low, exact, dtype, operands_exact) -> tuple[int, int, float, bool]:
    x = np.asarray(operands_exact[0], np.float64)
    if kind == KINDS[1]:  # argmax
        li, ei = low[..., None].astype(np.int64), exact[..., None].astype(np.int64)
        lv, ev = np.take_along_axis(x, li, -1)[..., 0], np.take_along_axis(x, ei, -1)[..., 0]
        diff = lv != ev  # a float64 tie taken either way is no flip
        flipped, total = int(diff.sum()), int(diff.size)
        if not flipped:
            return 0, total, math.nan, False
        # rounding is elementwise: only the flipped elements are rounded
        lr, er = _round(lv[diff], dtype), _round(ev[diff], dtype)
        return (flipped, total, *_margin_forced(ev[diff], lv[diff], lr >= er, dtype))
    k = low.shape[-1]
    lv = np.take_along_axis(x, low.astype(np.int64), -1)
    ev = np.take_along_axis(x, exact.astype(np.int64), -1)
    if kind == KINDS[3]:  # sort: positions holding another float64 value (equal values may swap)
        diff = lv != ev
        flipped, total = int(diff.sum()), int(diff.size)
        if not flipped:
            return 0, total, math.nan, False
        lr, er = _round(lv[diff], dtype), _round(ev[diff], dtype)
        return (flipped, total, *_margin_forced(ev[diff], lv[diff], lr == er, dtype))
    # top_k: the kept sets per row; a kept element counts as flipped when its float64 value is
    # below the k-th largest float64 value (equal values may be kept either way).
    kth = ev.min(axis=-1, keepdims=True)
    miss = lv < kth
    flipped, total = int(miss.sum()), int(low.size)
    if not flipped:
        return 0, total, math.nan, False
    kb = np.broadcast_to(kth, lv.shape)[miss]
    each = _round(lv[miss], dtype) >= _round(kb, dtype)
    del k
    return (flipped, total, *_margin_forced(kb, lv[miss], each, dtype))


def _round(x: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return numerics.round_to_dtype(np.asarray(x, np.float64), dtype).astype(np.float64)


def _margin_forced(a: np.ndarray, b: np.ndarray, each: np.ndarray, dtype) -> tuple[float, bool]:
    """(margin, forced) over flipped elements with float64 operands a, b and per element
    whether one rounding forces it: forced when all are; the margin is that of the elements
    the computation moved when some are not (the forced ones say nothing of its error)."""
    if bool(np.all(each)):
        return _margin(a, b, dtype), True
    made = ~np.asarray(each, bool)
    return _margin(a[made], b[made], dtype), False


def _margin(a: np.ndarray, b: np.ndarray, dtype) -> float:
    """min |a - b| over the elements, in ULPs of `dtype` at the larger magnitude."""
    from diag.diverge.rules import ulp_of

    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a - b) / ulp_of(np.maximum(np.abs(a), np.abs(b)), dtype)
    d = d[~np.isnan(d)]
    return float(d.min()) if d.size else math.nan


def record(
    index: int,
    primitive: str,
    kind: str,
    judged: tuple[int, int, float, bool],
    dtype,
    where: Callable[[], tuple[str, str]],
    path: str,
    phase: str,
    cause_op: Callable[[], str] | str = "",
) -> DecisionRecord:
    """The `DecisionRecord` of a flipped decision (`judged` from `judge_decision`)."""
    flipped, total, margin, forced = judged
    source, library = where()
    name = numerics.dtype_name(dtype)
    what = _what(primitive, flipped, total)
    gap = "" if math.isnan(margin) else f" (float64 margin {margin:.3g} ULP of {name})"
    if forced:
        culprit = ""
        reason = (
            f"{what}{gap}: forced by rounding, the float64 values are closer than {name} "
            f"resolves and no {name} implementation can decide them; decide on float32 values"
        )
    else:
        culprit = cause_op() if callable(cause_op) else cause_op
        by = f": {culprit}, moved a value across" if culprit else ""
        reason = f"{what}{gap}; made by the computation{by}"
    return DecisionRecord(
        index=index,
        primitive=primitive,
        kind=kind,
        source=source,
        library=library,
        path=path,
        phase=phase,
        dtype=name,
        flipped=flipped,
        total=total,
        margin_ulps=margin,
        cause=FORCED if forced else MADE,
        cause_op=culprit,
        verdict=Status.WARN if forced else Status.FAIL,
        reason=reason,
    )


def _what(primitive: str, flipped: int, total: int) -> str:
    return f"{primitive} decided {flipped} of {total} elements the other way than float64"


def what(rec: DecisionRecord) -> str:
    """``gt decided 49 of 32000 elements the other way than float64``: a reason's opening."""
    return _what(rec.primitive, rec.flipped, rec.total)


def follows(rec: DecisionRecord, upstream: str, forced: bool) -> DecisionRecord:
    """`rec` as a flip whose operands differ because the shadow followed an earlier flip
    (`upstream`: ``the flipped gt at s.py:27``; `forced`: its verdict): it takes that flip's
    cause and verdict (the greedy pick after a top-p mask)."""
    cause = FORCED if forced else MADE
    return dataclasses.replace(
        rec,
        cause=cause,
        cause_op=f"follows {upstream}",
        verdict=Status.WARN if forced else Status.FAIL,
        reason=f"{what(rec)}: it follows {upstream}, {cause} there",
    )


def literal_moved(exact, flipped: np.ndarray, written: float, used: float, dtype) -> np.ndarray:
    """Per flipped element, whether the literal's rounding alone flipped it: the other
    operand's float64 value (`exact`, broadcast to `flipped`) rounded once decides against
    the `used` literal otherwise than the float64 value against the `written` one."""
    t = np.broadcast_to(np.asarray(exact, np.float64), flipped.shape)[flipped]
    with np.errstate(invalid="ignore"):
        return np.sign(_round(t, dtype) - used) != np.sign(t - written)


def written_literal(filename: str, line: int, used: float, dtype) -> str | None:
    """The float literal on the user's line that rounds to `used` in `dtype` but is not it
    (``0.9`` for ``0.8984375`` in bf16); None when the line has none."""
    text = linecache.getline(filename, line)
    if not text:
        return None
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    for t in toks:
        if t.type != tokenize.NUMBER or not any(c in t.string.lower() for c in ".e"):
            continue
        if t.string.lower().endswith("j"):
            continue
        v = float(t.string)
        for w in (v, -v):
            if w != used and float(_round(np.asarray(w), dtype)) == used:
                return t.string if w == v else f"-{t.string}"
    return None


def verdict(report) -> tuple[int, str]:
    """(exit status, verdict line) of a `ShadowReport` for `diag diverge` and its docs.

    1 when an op diverged (`first`), a decision was made by the computation, or the result
    carries more than its threshold with neither a divergent op nor a forced decision to
    explain it; 0 when nothing was found or every flipped decision was forced by rounding.
    """
    failed = exit_code(failed=True)  # the policy's code for a failed check
    first = report.first
    fails = [d for d in report.decisions if d.verdict == Status.FAIL]
    warns = [d for d in report.decisions if d.verdict == Status.WARN]
    over = report.result_error > report.result_threshold or math.isnan(report.result_error)
    if first is not None:
        return failed, first.reason
    if fails:
        d = fails[0]
        return failed, f"{d.primitive} at {d.source or 'an unknown line'}: {d.reason}"
    if warns:
        d = warns[0]
        carried = (
            f"; the result carries {report.result_error:.3g}, over the threshold "
            f"{report.result_threshold:.2g}, because of them"
            if over
            else ""
        )
        return EXIT_OK, (
            f"{len(warns)} decision(s) forced by rounding, none made by the computation "
            f"(exit 0, a warning): first {d.primitive} at {d.source or 'an unknown line'}: "
            f"{d.reason}{carried}"
        )
    if over:
        return failed, (
            f"the result carries {report.result_error:.3g}, over the threshold "
            f"{report.result_threshold:.2g}, though no single op crossed it"
        )
    return EXIT_OK, ""
