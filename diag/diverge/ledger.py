"""The shadow run's ledger: one entry per op, the `first` rule, and the report built from them.

Both evaluators (JAX and PyTorch) call `Ledger.measure` once per op with float64 copies of
the op's output, its float64 re-evaluation and its shadow; everything framework-specific (how
an op is run, where its line is) stays in the evaluators.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from diag import numerics
from diag.diverge import decisions
from diag.diverge.chunked import max_absdiff_parts, own_error_parts
from diag.diverge.decisions import DecisionRecord, LiteralRecord
from diag.diverge.onepass import Once, op_figures
from diag.diverge.records import OpRecord, ShadowReport
from diag.diverge.rules import carried_error_diff, op_class, ulp_of
from diag.tolerance.diverge import DIVERGE_LIBRARY_ULP, DIVERGE_ROUNDED_ULP

TOP = 10
#: Flipped decisions kept in a report (a loop may flip one per iteration).
MAX_DECISIONS = 100

# A caller's allowance (diag.testing: the output under test's) that lowers every op's
# carried-error threshold while `shadow` runs; None: each dtype's own sqrt(u).
_LIMIT: contextvars.ContextVar[float | None] = contextvars.ContextVar("diverge_limit", default=None)


@contextlib.contextmanager
def limit(allowance: float) -> Iterator[None]:
    """While active, an op is `first` also where its carried error passes `allowance` (and
    its inputs' did not), even if its dtype's threshold is looser: a float32 value cast to
    bfloat16 carries 2e-3, below bfloat16's sqrt(u) but far past what a float32 output may
    carry, so the cast is where the output under test lost its precision."""
    token = _LIMIT.set(allowance)
    try:
        yield
    finally:
        _LIMIT.reset(token)


@dataclasses.dataclass(slots=True, eq=False)
class _Entry:
    index: int
    primitive: str
    cls: str
    where: Callable[[], tuple[str, str]]
    path: str
    phase: str
    dtype: str
    shape: tuple[int, ...]
    own_ulps: float
    own_ratio: float
    carried_in: float
    carried: float
    carried_ulps: float
    threshold: float
    reason: str
    #: ledger indices of the ops whose outputs this op read (the dataflow the cause search
    #: walks back from a failing output); what the evaluator knew about the op (`TAGS`).
    producers: tuple[int, ...] = ()
    tags: frozenset[str] = frozenset()


#: What an evaluator may tag an op with: a cast to a narrower float dtype, an input literal
#: the tracer rounded to the op's dtype.
TAGS = ("narrowing", "literal")


class Ledger:
    """Collects per-op figures in execution order and decides `first` as they arrive."""

    def __init__(self):
        self.entries: list[_Entry] = []
        self.first: _Entry | None = None
        self.limit = _LIMIT.get()
        self.decisions: list[DecisionRecord] = []
        self.literals: list[LiteralRecord] = []
        #: max |y - r| of the last `measure` when it was finite (else None), and its max |y - s|
        #: (inf where not finite): the evaluators' origin rule reuses them instead of passes
        #: over the output.
        self.own_diff: float | None = None
        self.carried_diff = 0.0
        #: max |r - s| of the last `measure` when its one pass gave it (else None): the
        #: error that came in with the inputs, for the evaluators' origin rule.
        self.came_diff: float | None = None

    def decide(
        self,
        primitive: str,
        kind: str,
        low: np.ndarray,
        exact: np.ndarray,
        dtype,
        operands_low: list[np.ndarray],
        operands_exact: list[np.ndarray],
        where: Callable[[], tuple[str, str]],
        path: str,
        phase: str,
        *,
        cause_op: Callable[[], str] | str = "",
        exact_operands: tuple[int, ...] = (),
    ) -> DecisionRecord | None:
        """Judge one decision (`decisions.judge_decision`); record and return it when some
        element went the other way than float64, else None.

        Args:
            primitive, kind: what the report shows (``gt``, ``compare``; see `DecisionRecord`).
            low, exact: the decision as taken and as float64 takes it on the shadows.
            dtype: the dtype it was taken in.
            operands_low, operands_exact: its float operands and their float64 shadows
                (decided axis last for argmax/top_k/sort).
            where: returns (source, library line); called only for a flipped decision.
            path, phase: where it sits, ``forward``/``backward``.
            cause_op: the op that moved a value across (or a callable giving it, called only
                for a flip made by the computation), e.g. ``div at sampler.py:12``.
            exact_operands: comparison operands not rounded in the forced test (literals
                taken at their written value: `decisions.judge_decision`).
        """
        judged = decisions.judge_decision(
            kind,
            low,
            exact,
            dtype=dtype,
            operands_low=operands_low,
            operands_exact=operands_exact,
            exact_operands=exact_operands,
        )
        if judged[0] == 0:
            return None
        rec = decisions.record(
            len(self.entries), primitive, kind, judged, dtype, where, path, phase, cause_op
        )
        self.decisions.append(rec)
        return rec

    def measure(
        self,
        primitive: str,
        name: str,
        y: np.ndarray,
        r: np.ndarray | None,
        s: np.ndarray,
        dtype,
        carried_in: list[tuple[float, float]],
        threshold: float,
        where: Callable[[], tuple[str, str]],
        path: str,
        phase: str,
        *,
        facts=None,
        terms: float = 1,
        longest: int = 1,
        producers: tuple[int, ...] = (),
        tags: frozenset[str] = frozenset(),
    ) -> float:
        """Judge one op output; return its carried error (the evaluators keep it per value).

        Sets `own_diff`, `carried_diff` and `came_diff`.

        Args:
            primitive: what the report shows (``reduce_sum``, ``aten.exp``).
            name: the bare op name its class is looked up by (``exp``).
            y, r, s: the output, the float64 re-evaluation on the actual inputs (None when
                the op could not be re-evaluated), the float64 shadow; all float64.
            dtype: the output's dtype (a numpy/ml_dtypes dtype).
            carried_in: (carried error, threshold) of each float input.
            threshold: the output's carried-error threshold: that of its dtype, or the
                largest of its inputs' (a value upcast from fp16 is only fp16-accurate).
            where: returns (source, library line); called only for reported ops.
            path, phase: where the op sits, ``forward``/``backward``.
            facts, terms, longest: the reduction/composite facts `own_error` needs.
            producers: ledger indices of the ops that made its inputs.
            tags: what the evaluator knew about the op (`TAGS`).
        """
        cls = op_class(name)
        lowered = self.limit is not None and self.limit < threshold
        if self.limit is not None:
            threshold = min(threshold, self.limit)
            carried_in = [(c, min(t, self.limit)) for c, t in carried_in]
        own_ulps, own_ratio, carried, carried_ulps = self._figures(
            y, r, s, dtype, cls, facts, terms, longest
        )
        cin = max((c for c, _ in carried_in), default=0.0)
        e = _Entry(
            index=len(self.entries),
            primitive=primitive,
            cls=cls,
            where=where,
            path=path,
            phase=phase,
            dtype=numerics.dtype_name(dtype),
            shape=tuple(int(d) for d in y.shape),
            own_ulps=own_ulps,
            own_ratio=own_ratio,
            carried_in=cin,
            carried=carried,
            carried_ulps=carried_ulps,
            threshold=threshold,
            reason="",
            producers=producers,
            tags=tags,
        )
        self.entries.append(e)
        if self.first is None:
            own_beyond = e.own_ratio > 1.0 and (
                r is None or _normwise_beyond(e, self.own_diff, r, dtype)
            )
            self._maybe_first(e, carried_in, lowered, own_beyond)
        return carried

    def _figures(self, y, r, s, dtype, cls, facts, terms, longest) -> tuple[float, ...]:
        """(own ULPs, own ratio, carried error, carried ULPs) of one output, in one pass over
        its arrays where `diag.diverge.onepass` takes them, else the numpy way; sets
        `own_diff`, `carried_diff` and `came_diff`."""
        facts = Once(facts) if facts is not None else None
        fig = (
            op_figures(y, r, s, dtype, cls, facts=facts, terms=terms, longest=longest)
            if r is not None
            else None
        )
        self.came_diff = None if fig is None else fig.came
        if fig is not None:
            own_ulps, own_ratio, self.own_diff = fig.ulps, fig.ratio, fig.own_diff
            carried, carried_ulps, self.carried_diff = carried_error_diff(
                y, s, dtype, fig.carried_diff, fig.shadow_max
            )
            return own_ulps, own_ratio, carried, carried_ulps
        if r is not None:
            own_ulps, own_ratio, self.own_diff = own_error_parts(
                y, r, dtype, cls, facts=facts, terms=terms, longest=longest
            )
        else:
            own_ulps, own_ratio, self.own_diff = math.nan, math.nan, None
        diff = self.own_diff if r is s else max_absdiff_parts(y, s)
        carried, carried_ulps, self.carried_diff = carried_error_diff(y, s, dtype, diff)
        return own_ulps, own_ratio, carried, carried_ulps

    def _maybe_first(
        self, e: _Entry, carried_in: list[tuple[float, float]], lowered: bool, own_beyond: bool
    ):
        """Make `e` the `first` divergent op if it broke its own bound (normwise too:
        `own_beyond`), or if its carried error passed its threshold while none of its inputs'
        did (the `first` rule)."""
        if own_beyond and e.cls != "composite":
            e.reason = (
                f"own error {e.own_ulps:.3g} ULP is {e.own_ratio:.3g}x its bound: it "
                f"computed with less precision than {e.dtype} claims"
            )
            self.first = e
        elif (
            e.cls != "structural" and e.carried > e.threshold and all(c <= t for c, t in carried_in)
        ):
            what = "the allowance" if lowered else f"the {e.dtype} threshold"
            e.reason = (
                f"carried error {_num(e.carried)} passed {what} "
                f"{e.threshold:.2g} here (inputs carried at most {_num(e.carried_in)})"
            )
            self.first = e

    def report(
        self,
        framework: str,
        function: str,
        result_error: float,
        note: str = "",
        result_threshold: float = math.inf,
    ) -> ShadowReport:
        """The `ShadowReport`: `first`, the top contributors, the curve."""
        ranked = sorted(
            (e for e in self.entries if e.cls != "structural"), key=lambda e: (-_score(e), e.index)
        )[:TOP]
        return ShadowReport(
            framework=framework,
            function=function,
            first=_record(self.first) if self.first is not None else None,
            ops=tuple(_record(e) for e in ranked),
            curve=tuple(e.carried for e in self.entries),
            n_ops=len(self.entries),
            result_error=result_error,
            note=note,
            decisions=tuple(self.decisions[:MAX_DECISIONS]),
            first_decision=self.decisions[0] if self.decisions else None,
            literals=tuple(dict.fromkeys(self.literals)),
            result_threshold=result_threshold,
        )


def _normwise_beyond(e: _Entry, own_diff: float | None, r: np.ndarray, dtype) -> bool:
    """Whether an op whose own error passed its per-element bound is also past it normwise:
    max |y - r| beyond the bound's ULPs at the output's largest magnitude. torch's float32
    GELU is 14,000 ULP off at x = -4, where the output is 1e-4 of the largest: an element
    near zero is no evidence that the op computed with less precision than its dtype
    (the false lead of issue 42). A non-finite difference is always beyond."""
    if own_diff is None or e.cls not in ("rounded", "library"):
        return True
    finite = r[np.isfinite(r)]
    scale = float(np.abs(finite).max()) if finite.size else 0.0
    bound = DIVERGE_LIBRARY_ULP if e.cls == "library" else DIVERGE_ROUNDED_ULP
    one = float(ulp_of(np.asarray([scale]), dtype)[0])
    return own_diff > bound * one


def _amplification(e: _Entry) -> float:
    u = numerics.unit_roundoff(e.dtype)
    if e.carried == 0.0:
        return 0.0
    if math.isinf(e.carried_in):
        return 1.0  # it came in infinite and stayed so
    return e.carried / max(e.carried_in, u)


def _score(e: _Entry) -> float:
    own = e.own_ratio if e.own_ratio == e.own_ratio else 0.0
    return max(_amplification(e), own)


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _record(e: _Entry) -> OpRecord:
    source, library = e.where()
    return OpRecord(
        index=e.index,
        primitive=e.primitive,
        op_class=e.cls,
        source=source,
        path=e.path,
        phase=e.phase,
        dtype=e.dtype,
        shape=e.shape,
        own_ulps=e.own_ulps,
        own_ratio=e.own_ratio,
        carried_in=e.carried_in,
        carried=e.carried,
        carried_ulps=e.carried_ulps,
        amplification=_amplification(e),
        threshold=e.threshold,
        reason=e.reason,
        library=library,
    )
