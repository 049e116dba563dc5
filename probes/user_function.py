"""user_function: a user's own function (``FILE.py:FUNCTION``, ``pkg.module:function``) as an
op, so that a team's model, sampler or training step runs through the same pipeline as diag's
own probes: every backend of its framework, the drift gate, the report, `--ab`, `--trace`.

Its inputs are the arrays the function is called with (and, for PyTorch, its modules' state),
taken on the host and shipped bit-identical to every backend (`diag.userfn.bind`). The truth is
not exact: it is the float64 evaluation of the same function on the host, or, where the
function hard-codes a narrower dtype, the float64 shadow of `diag.diverge`
(`diag.userfn.reference`); each record says which. Tolerance: `diag.tolerance.userfn` (sqrt(u)
of each output's dtype, normwise); integer outputs must equal the reference's, except where
rounding the inputs moves the reference's own choice (a warn). A failing record's reason names
the first op of the function that leaves the float64 shadow, and its line, then the cause: the
op whose computation in a wider dtype brings the failing outputs within their allowance, proven
by re-running the function with it promoted (`diag.diverge.explain`; the record's metrics carry
`cause`, `cause_ops`, `repair`, `error_before`, `error_after`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from diag.compare.outcome import Evaluation, Outcome
from diag.compare.verdict import Verdict
from diag.plan.probe import FLOATS, Probe
from diag.status import Status
from diag.tolerance import Tolerance
from diag.userfn import agreement, judge, leaf_name
from diag.userfn.bind import bind
from diag.userfn.host import Prepared, failing_outputs, prepare
from diag.userfn.standin import JAX_MODULES, TORCH_MODULES

_STATUS_ORDER = (Status.PASS, Status.WARN, Status.FAIL, Status.ERROR)


@dataclasses.dataclass(frozen=True)
class Truth:
    """The case's reference (`diag.userfn.Reference`) as the run's truth store holds it."""

    prepared: Prepared
    method: str
    seconds: float
    fallbacks: int = 0
    cache_hit: bool = False
    value: Any = None  # nothing for the truth store's memory count: the reference is small


def truth(inputs: list, params: dict, cache) -> Truth:
    """The float64 reference of the function (computed once per process, on the host)."""
    t0 = time.perf_counter()
    prepared = prepare(
        params["fn"], ref_spec=params.get("reference", ""), draw=params.get("draw", "")
    )
    return Truth(prepared, prepared.reference.description, time.perf_counter() - t0)


def _paths(o: Outcome) -> list[tuple[str, Any]]:
    """The outputs as (path, array): the worker named each `leaf_name(path)`."""
    return [(name.removeprefix(leaf_name("")), a) for name, a in o.named.items()]


def evaluate(o: Outcome) -> Evaluation:
    """Each output against the float64 reference; a failing record names the first
    divergent op of the function (`diag.diverge.shadow`, run on the host)."""
    prepared: Prepared = o.truth.prepared
    ref = prepared.reference
    verdicts = judge(_paths(o), ref)
    status = max((v.status for v in verdicts), key=_STATUS_ORDER.index, default=Status.ERROR)
    floats = [v.error / v.allowed for v in verdicts if v.allowed > 0 and not math.isnan(v.error)]
    wrong = [v for v in verdicts if v.allowed == 0 and v.status == Status.FAIL]
    metrics: dict[str, Any] = {
        "reference": ref.description,
        "reference_kind": ref.kind,
        "source_hash": prepared.function.source_hash,
        "outputs": [dataclasses.asdict(v) for v in verdicts],
        "bound_ratio": max(floats, default=0.0),
        "wrong_rows": sum(1 for _ in wrong),
    }
    if ref.note:
        metrics["reference_note"] = ref.note
    if ref.lifted:  # the globals and closure cells widened with the arguments
        metrics["reference_lifted"] = list(ref.lifted)
    worst = next((v for v in verdicts if v.status == status), None)
    if ref.left_out:  # None outputs (a model output's absent field): nothing to judge
        metrics["outputs_left_out"] = list(ref.left_out)
    if status == Status.PASS:
        reason = f"all {len(verdicts)} outputs within their allowance of the {ref.description}"
        if ref.left_out:
            names = ", ".join(leaf_name(p) for p in ref.left_out)
            reason += f"; {names} (None) left out"
    elif status == Status.FAIL:
        allowed = min((v.allowed for v in verdicts if v.allowed), default=0.0)
        failing = failing_outputs(verdicts, ref)
        if failing:
            op, cause = prepared.diagnose(allowed, failing)
        else:
            op, cause = prepared.first_divergent_op(allowed), None
        metrics["first_divergent_op"] = op
        reason = f"{worst.reason if worst else ''}; {op}"
        if cause is not None:
            metrics.update(cause.fields())
            reason += f"; {cause.text}"
    else:
        reason = worst.reason if worst else "no output to judge"
    return Evaluation(status, reason, metrics)


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' outputs against each other (each is judged against the reference on its
    own, so a difference is a warn)."""
    status, reason, metrics = agreement(_paths(a), _paths(b))
    return Verdict(status, f"{names[0]} and {names[1]}: {reason}", metrics)


def make_inputs(rng, params: dict, dtype) -> list:
    """The function's inputs as the host loaded them (the seed does not enter: the user's
    FUNCTION makes them)."""
    return [
        a
        for _, a in prepare(
            params["fn"], ref_spec=params.get("reference", ""), draw=params.get("draw", "")
        ).inputs
    ]


def _tolerance(dtype: str, claim: str) -> Tolerance:
    """The op's row: each output's allowance comes from its own dtype (`diag.tolerance.userfn`)."""
    return Tolerance(
        "user_function",
        dtype,
        claim,
        why="each float output within sqrt(u) of its dtype, normwise, of the float64 "
        "evaluation of the same function; integer outputs equal to its, except where one "
        "rounding of the inputs moves its choice (diag.tolerance.userfn)",
    )


def _builder(fn: str, framework: str, absent: frozenset[str], draw: str):
    """The user's function on the worker's `framework`, bound to the shipped inputs (loaded
    in the worker; the other framework's imports get stand-ins where it is not installed, as
    in torch_xla's own environment, which has no JAX)."""
    from diag.userfn import load

    u = load(fn, absent, draw)
    return bind(u.fn, u.args, u.kwargs, framework)


def _on_jax(backend, fn: str, draw: str = ""):
    return _builder(fn, "jax", TORCH_MODULES, draw)


def _on_torch(backend, fn: str, draw: str = ""):
    return _builder(fn, "torch", JAX_MODULES, draw)


PROBE = Probe(
    op="user_function",
    dims=(),
    params={},
    op_args=("fn",),
    dtypes=FLOATS + ("float64",),
    inputs=("function",),
    input_shapes=lambda params: [],
    truth=truth,
    evaluate=evaluate,
    agree=agree,
    host_bytes=lambda params: int(params.get("input_bytes", 0)) * 16,
    label=lambda params: str(params["function"]),
    truth_args=("fn", "source_hash", "reference", "draw"),
    make_inputs=make_inputs,
    implementations={"jax": _on_jax, "torch": _on_torch},
    tolerance=_tolerance,
    user_function=True,
)
