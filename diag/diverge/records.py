"""What `diag.diverge` reports: per-op figures of a shadow run, per-tap figures of a comparison."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from diag.diverge.decisions import DecisionRecord, LiteralRecord
from diag.errors import EXIT_USAGE, EXIT_WORKER_CRASH, DiagError


class DivergeError(DiagError):
    """The function could not be run op by op: it raised, or could not be traced."""

    exit_code = EXIT_WORKER_CRASH


class NothingCompared(DivergeError):
    """`compare`'s two runs tapped no name in common: no verdict can be given (bad input)."""

    exit_code = EXIT_USAGE


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op's figures, as `shadow` measured them.

    Attributes:
        index: position of the op in execution order (among ops with float outputs).
        primitive: the jaxpr primitive (``add``, ``reduce_sum``) or aten op (``aten.exp``).
        op_class: ``rounded``, ``library``, ``reduction``, ``structural`` or ``composite``:
            which own-error bound applies (docs/diverge.md).
        source: ``file.py:LINE (function)`` of the user's line; for a backward op the forward
            line it differentiates. ``library`` names the library line where it helps.
        path: where the op sits (``jit[f]/scan[273]``; torch: the module path).
        phase: ``forward`` or ``backward``.
        dtype, shape: of the op's (first float) output.
        own_ulps: the op's own error: max |y - f64(op)(inputs)| in ULPs of `dtype`.
        own_ratio: the same against the op's own bound (above 1: less precision than claimed).
        carried_in: largest normwise relative error (vs the float64 shadow) among its inputs.
        carried: normwise relative error of its output against the shadow.
        carried_ulps: the same in ULPs of `dtype` at the output's largest magnitude.
        amplification: carried / max(carried_in, u of `dtype`): how much the op grew the error.
        threshold: the carried-error threshold for `dtype` (sqrt(u)), or of the narrower dtype
            the value was computed from.
        reason: why this op is `first` (empty for the others).
        library: the library frame that wrote the op, when the user line is a caller of it.
    """

    index: int
    primitive: str
    op_class: str
    source: str
    path: str
    phase: str
    dtype: str
    shape: tuple[int, ...]
    own_ulps: float
    own_ratio: float
    carried_in: float
    carried: float
    carried_ulps: float
    amplification: float
    threshold: float
    reason: str = ""
    library: str = ""


@dataclasses.dataclass(frozen=True)
class ShadowReport:
    """What `shadow` found.

    Attributes:
        framework: ``jax`` or ``torch``.
        function: the function's name.
        first: the first divergent op, or None when the function stays within its bounds.
        ops: the top contributors, largest amplification (then own-error ratio) first.
        curve: carried error after each op, in execution order (the error along the program).
        n_ops: how many ops with float outputs were evaluated.
        result_error: carried error of the function's (first float) result.
        note: what the reader should know (ops the shadow could not follow, ...).
        decisions: the decisions (comparisons, argmax, top-k, masks) taken the other way
            than float64, in execution order (`diag.diverge.decisions`).
        first_decision: the first of them, or None.
        literals: constants rounded to the dtype at trace time (written vs used).
        result_threshold: the carried-error threshold of the result's dtype: a result past
            it is never reported clean (`diag.diverge.decisions.verdict`).
    """

    framework: str
    function: str
    first: OpRecord | None
    ops: tuple[OpRecord, ...]
    curve: tuple[float, ...]
    n_ops: int
    result_error: float
    note: str = ""
    decisions: tuple[DecisionRecord, ...] = ()
    first_decision: DecisionRecord | None = None
    literals: tuple[LiteralRecord, ...] = ()
    result_threshold: float = math.inf

    @property
    def failed(self) -> bool:
        """Whether `diag diverge` exits 1 on this report (`decisions.verdict`)."""
        from diag.diverge.decisions import verdict

        return verdict(self)[0] == 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: an infinite figure is the string ``inf``, a missing one None."""
        return jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class TapRecord:
    """One tapped name, compared between two runs.

    Attributes:
        name: the tap's name (``#k`` added for its k-th repetition); a module path for
            automatic taps.
        index: position in run A's execution order.
        dtype, shape: of run A's value.
        max_rel: max |a - b| / max |b| (normwise relative difference).
        mean_rel: mean |a - b| / mean |b|.
        allowed: what two correct implementations in `dtype` may differ by (u^(2/3)).
        ratio: max_rel / allowed; above 1 the tap is beyond it.
        note: e.g. shapes that differ.
    """

    name: str
    index: int
    dtype: str
    shape: tuple[int, ...]
    max_rel: float
    mean_rel: float
    allowed: float
    ratio: float
    note: str = ""

    @property
    def beyond(self) -> bool:
        return self.ratio > 1.0


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """What `compare` found: per tap in run A's order, and the first beyond what is allowed.

    Attributes:
        first: the first tap beyond its allowance, or None.
        taps: every tap both runs recorded, in run A's order.
        only_a, only_b: names one run tapped and the other did not.
    """

    first: TapRecord | None
    taps: tuple[TapRecord, ...]
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: an infinite figure is the string ``inf``, a missing one None."""
        return jsonable(dataclasses.asdict(self))


def jsonable(x: Any) -> Any:
    """Tuples to lists; inf/-inf to ``"inf"``/``"-inf"`` and NaN to None (JSON has neither)."""
    if isinstance(x, float):
        if x != x:
            return None
        return x if abs(x) != float("inf") else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
