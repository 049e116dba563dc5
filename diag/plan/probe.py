"""The `Probe` record: one op as data, and what the rows of several ops share.

Each op lives in one module under `probes/` (installed as `diag.probes`): its `PROBE` row
(built from the record below), its ground truth (the call into `diag.oracle`), its tolerance
(a row of `diag.tolerance`), `evaluate` and `agree`, and its implementation per framework
(`on_jax`, `on_torch`, ...: the framework is imported inside them, in the worker).
`diag.plan.registry` finds the modules; nothing else names an op. Quirks live in the row, never
in `if op == ...` in the runner or the tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag import numerics
from diag.compare.outcome import Evaluation, Outcome
from diag.compare.verdict import Verdict
from diag.status import Status
from diag.tolerance import Tolerance, tolerance

__all__ = [
    "Probe",
    "EXPECTATIONS",
    "expected_outcome",
    "FLOATS",
    "LOGIT_MAKERS",
    "F64",
    "ROWS_COPIES",
    "rows_shapes",
    "rows_bytes",
    "rows_label",
    "check_k",
    "no_check",
    "same",
]

#: The float dtypes diag's probes take.
FLOATS = ("float32", "bfloat16", "float16")
#: The input makers (`diag.plan.makers.INPUT_MAKERS`) of a row of logits.
LOGIT_MAKERS = (
    "normal",
    "normal5",
    "near_1e4",
    "masked_half",
    "fully_masked",
    "ties",
    "special",
    "all_equal",
    "near_ties",
    "uniform",
    "wide",
)

# Bytes per element the host holds at once while a case is drawn, its ground truth computed
# and an output judged, in float64-sized units (8 bytes): see `Probe.host_bytes`.
F64 = 8
# Peak host memory of an op over rows, in float64 copies of its input (measured: softmax
# [4,65536] 22 and [8,131072] 18 copies; numpy 2, float32, VmHWM). `tests/test_suite.py`
# checks that the estimate stays above a measured peak.
ROWS_COPIES = 24


def rows_shapes(params: dict) -> list[tuple[int, ...]]:
    """The one [rows, n] input of an op over the last axis."""
    return [(params["rows"], params["n"])]


def rows_bytes(params: dict) -> int:
    """Rows ops hold the inputs, the float64 truth and its error terms, and the outputs."""
    return F64 * ROWS_COPIES * params["rows"] * params["n"]


def rows_label(*extra: str, quiet: dict | None = None) -> Callable[[dict], str]:
    """Labels like `16x32768 bfloat16 ties k=64`; parameters in `quiet` are left out while
    they hold the value given there (the op's own default)."""
    quiet = quiet or {}

    def label(params: dict) -> str:
        text = f"{params['rows']}x{params['n']} {params['dtype']} {params['inputs']}"
        for name in extra:
            value = params[name]
            if name in quiet and value == quiet[name]:
                continue
            text += f" {name}={json.dumps(value) if isinstance(value, bool) else value}"
        return text

    return label


def check_k(params: dict) -> str | None:
    """k of a top-k must be in 1 ... n."""
    k, n = params["k"], params["n"]
    if not 1 <= k <= n:
        return f"k must be in 1 ... n (n = {n}), got k = {k}"
    return None


def no_check(params: dict) -> str | None:
    return None


def same(params: dict) -> dict:
    return params


@dataclass(frozen=True)
class Probe:
    """One op as data.

    Attributes:
      op: the op name (its module's name under `probes/`).
      dims: the names of the suite's `shape` dimensions (matmul: m, k, n).
      params: grid parameters a suite entry may set: name -> (type, allowed values or None,
        default: one value, or a list of them for a grid). Each may be given as one value or
        a list (the grid is their product).
      op_args: the parameters forwarded to the op's implementation (the rest shape the inputs).
      dtypes: dtypes this probe supports.
      inputs: input makers (`diag.plan.makers.INPUT_MAKERS`) that make sense for it.
      input_shapes: case params -> the shapes of the op's inputs.
      truth: (inputs, params, cache) -> the oracle's result for the case. Ops with the same
        truth function (module and name) share a case's truth.
      evaluate: `Outcome` -> `Evaluation`: one backend's output against the truth.
      agree: (Outcome a, Outcome b, (name a, name b), context) -> `Verdict`: two backends'
        outputs for the same case against each other.
      host_bytes: params -> an estimate of the host memory one case needs at its peak
        (inputs drawn, ground truth computed, an output judged); the suite loader refuses a
        case above the memory limit before anything runs.
      implementations: framework (`jax`, `torch`, `numpy`) -> a builder
        `(backend, **op_args) -> function of device arrays`, run in that framework's worker;
        `backend` is the set-up backend module (its device, its precision knobs). A backend
        runs the ops that have an implementation for its framework (torch-xla: torch's).
      truth_args: the parameters the ground truth depends on besides the inputs.
      validate: params -> a message when the values are invalid together (k > n, ...).
      label: params -> the case label records carry.
      normalize: params -> params, merging grid points that mean the same case.
      input_family: cases of probes with the same family, inputs maker, dtype and shape
        share their input arrays (and so their ground truth).

    Quirks (so that the runner, the worker and the report never test an op's name):
      fingerprint: the worker measures this op's arithmetic (`diag.arith.precision.fingerprint`)
        under each (`precision`, `precision_via`) setting its cases use, and `diag env`
        measures it under every setting a backend can express.
      fixed_args: op arguments the probe fixes for every case (not case parameters, not in
        records), e.g. the batch sizes a sampler's rows are also run in.
      hunt_nans: a non-finite output is hunted to the op that produced it (`diag.nan`) in
        the worker, and the record's reason names it.
      report_section: the report section that shows this op's rows (`diag.report.sections`;
        run.json's `report_sections`), '' for none.
      make_inputs: (rng, params, dtype) -> the case's input arrays, for ops whose inputs are
        not one maker per shape (a model's initial weights and batches); None: `inputs`.
      tolerance: (dtype, claim) -> the op's `diag.tolerance.Tolerance`, for an op whose bound
        lives in its own module; None: its row of `diag.tolerance` (`tolerance_of`).
      user_function: the op runs a user's function (`fn = ...` in a suite, `diag run
        FILE.py:FUNCTION`; `diag.plan.suite_fn`): its case parameters name the function.
    """

    op: str
    dims: tuple[str, ...]
    params: dict
    op_args: tuple[str, ...]
    dtypes: tuple[str, ...]
    inputs: tuple[str, ...]
    input_shapes: Callable[[dict], list[tuple[int, ...]]]
    truth: Callable[[list, dict, Any], Any]
    evaluate: Callable[[Outcome], Evaluation]
    agree: Callable[..., Verdict]
    host_bytes: Callable[[dict], int]
    label: Callable[[dict], str]
    implementations: Mapping[str, Callable[..., Callable]] = field(default_factory=dict)
    truth_args: tuple[str, ...] = ()
    validate: Callable[[dict], str | None] = no_check
    normalize: Callable[[dict], dict] = same
    input_family: str = ""
    fingerprint: bool = False
    fixed_args: dict = field(default_factory=dict)
    hunt_nans: bool = False
    report_section: str = ""
    make_inputs: Callable[..., list] | None = None
    tolerance: Callable[[str, str], Tolerance] | None = None
    user_function: bool = False

    def tolerance_of(self, dtype, claim="float32") -> Tolerance:
        """What this op on `dtype` is allowed when the backend claims `claim` arithmetic."""
        if self.tolerance is not None:
            return self.tolerance(numerics.dtype_name(dtype), numerics.dtype_name(claim))
        return tolerance(self.op, dtype, claim)

    @property
    def family(self) -> str:
        return self.input_family or self.op

    @property
    def truth_name(self) -> str:
        """What identifies the truth function (ops that share it share a case's truth)."""
        return f"{self.truth.__module__}.{self.truth.__qualname__}"


# ---------------------------------------------------------------------------------------------
# Planted outcomes (a suite entry's `expect`)

# Outcomes a suite entry may declare it plants, so that the entry checks diag itself: the
# record passes when diag reports the planted outcome and fails when it does not.
EXPECTATIONS: dict[str, str] = {
    "nonfinite": "the inputs make the op overflow to NaN/Inf where the exact result is finite",
}


def _nonfinite_count(outputs: list) -> int:
    return sum(
        int(np.count_nonzero(~np.isfinite(np.asarray(a).astype(np.float64))))
        for a in outputs
        if numerics.is_supported(np.asarray(a).dtype)
    )


def expected_outcome(expect: str | None, ev: Evaluation, o: Outcome) -> Evaluation:
    """The verdict of a case whose suite entry plants an outcome (`expect`).

    A planted overflow is caught when the probe's own verdict is `fail` with NaN/Inf in the
    outputs: then the record passes, saying so. It fails when the outputs stay finite (the
    planted fault did not happen, so the case tested nothing) or when NaN/Inf went unflagged.

    Args:
      expect: the entry's `expect` (a key of `EXPECTATIONS`), or None for an ordinary case.
      ev: the probe's verdict as if nothing were planted.
      o: what the backend returned.
    """
    if expect is None:
        return ev
    nonfinite = _nonfinite_count(o.outputs)
    caught = ev.status == Status.FAIL and nonfinite > 0
    metrics = {**ev.metrics, "expect": expect, "expect_caught": caught}
    if caught:
        return Evaluation(
            Status.PASS,
            f'planted NaN/Inf caught, as the suite expects (expect = "{expect}"): {ev.reason}',
            metrics,
            ev.context,
        )
    if nonfinite == 0:
        why = (
            "every output is finite: the planted overflow did not happen, so this case "
            "checked nothing"
        )
    else:
        why = f"{nonfinite} output elements are NaN/Inf but the verdict did not flag them"
    return Evaluation(
        Status.FAIL,
        f'the suite plants NaN/Inf here (expect = "{expect}") but '
        f"{why}; verdict without the plant: {ev.status}: {ev.reason}",
        metrics,
        ev.context,
    )
