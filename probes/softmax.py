"""softmax over the last axis: judged by the worst-case bound of float32 arithmetic
(`diag.tolerance`'s softmax row, `softmax_error_bound`), with undefined rows (all -inf)
reported as hazards, not errors.

Row: [rows, n] logits from the logit makers. Truth: `diag.oracle.softmax_result`, correctly
rounded (proof: diag/oracle/_softmax.py). Two backends: in ULPs, `AGREEMENT_FACTOR` times the
row's ULP form (`softmax_ulp_tolerance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from diag import numerics, oracle
from diag.compare.elementwise import agree_values, compare, mismatch
from diag.compare.outcome import Evaluation, Outcome, only_output
from diag.compare.verdict import Mismatch, Verdict, format_mismatch
from diag.plan.probe import FLOATS, LOGIT_MAKERS, Probe, rows_bytes, rows_label, rows_shapes
from diag.status import Status
from diag.tolerance import tolerance


def _row_kind(row: np.ndarray) -> str:
    """What a backend returned in a row whose softmax is undefined: nan, zeros, uniform, other."""
    r = row.astype(np.float64)
    if np.isnan(r).all():
        return "nan"
    if np.isnan(r).any():
        return "partly nan"
    if (r == 0).all():
        return "zeros"
    if r.size and np.all(r == r[0]) and abs(r[0] * r.size - 1.0) < 0.01:
        return "uniform"
    return "other"


def _sum_minus_one(row: np.ndarray) -> float:
    """``math.fsum(row.tolist() + [-1.0])`` of a finite row, bit for bit, without a Python
    float per element.

    Every value of a p-bit format is M * 2**(e - p) with M an integer below 2**p
    (`np.frexp`, subnormals included), so the M of one exponent sum exactly in float64 while
    n * 2**p < 2**53 (p = 24: 2**29 elements); each exponent's sum times its power of two is
    exact too, and fsum, correctly rounded, gives the same float for these few exact terms as
    for the elements themselves.
    """
    p = numerics.precision_bits(row.dtype)
    if row.size << p >= 1 << 53:
        return math.fsum(row.astype(np.float64).tolist() + [-1.0])
    m, e = np.frexp(row.astype(np.float64))
    lo = int(e.min()) if e.size else 0
    sums = np.bincount(e - lo, weights=np.ldexp(m, p))
    exps = np.flatnonzero(sums)
    return math.fsum(np.ldexp(sums[exps], exps + lo - p).tolist() + [-1.0])


def _sum_to_one(
    o2: np.ndarray, t2: np.ndarray, rows_def: np.ndarray, once: Callable
) -> tuple[float, int, float]:
    """(largest |sum - 1| of the output's defined rows, its row, the truth's own largest over
    the same rows); rows where the output is not finite are left out (counted elsewhere)."""
    worst_sum, worst_row = 0.0, -1
    finite_rows = []
    for r in rows_def:
        if not np.isfinite(o2[r]).all():
            continue  # counted by unexpected_nonfinite
        finite_rows.append(int(r))
        err = abs(_sum_minus_one(o2[r]))
        if err > worst_sum or worst_row < 0:
            worst_sum, worst_row = err, int(r)
    # The truth's own error over the same rows (those this backend returned finite).
    truth_errs = once(
        "truth_sum_errors",
        lambda: np.array([abs(_sum_minus_one(t2[r])) for r in rows_def], np.float64),
    )
    finite_at = np.isin(rows_def, finite_rows)
    truth_sum = max([0.0, *truth_errs[finite_at].tolist()])
    return worst_sum, worst_row, truth_sum


def _hazard(
    o2: np.ndarray, undefined: np.ndarray, nonfinite_in: np.ndarray
) -> dict[str, Any] | None:
    """What the output holds in the rows the math leaves undefined, by kind; None if none."""
    hazard = None
    for name, mask in (
        ("fully masked (all -inf)", undefined),
        ("holding NaN or +inf", nonfinite_in),
    ):
        idx = np.flatnonzero(mask)
        if not idx.size:
            continue
        kinds: dict[str, int] = {}
        for r in idx:
            kind = _row_kind(o2[r])
            kinds[kind] = kinds.get(kind, 0) + 1
        hazard = hazard or {}
        hazard[name] = {"rows": int(idx.size), "returned": kinds, "first_row": int(idx[0])}
    return hazard


def compare_softmax(
    output: np.ndarray,
    truth: np.ndarray,
    x: np.ndarray,
    *,
    compute_dtype="float32",
    shared: Callable[[str, Callable[[], Any]], Any] | None = None,
) -> dict[str, Any]:
    """Metrics of a backend's softmax over the last axis against the correctly rounded truth.

    Rows are split by what the math says about them. Defined rows (finite or -inf entries, at
    least one finite) are compared element by element with `compare` against
    `softmax_error_bound`, and their sum-to-one error is taken exactly (math.fsum). Rows that are
    all -inf (0/0: no defined result) and rows holding NaN or +inf (the IEEE computation gives
    NaN) are never judged as errors: what the backend returned there is reported as a `hazard`
    (a sampler that reads NaN or zeros there samples garbage or token 0).

    Args:
        output: the backend's softmax, [..., n].
        truth: `diag.oracle.softmax` of the same input (same shape and dtype).
        x: the input, [..., n].
        compute_dtype: the arithmetic the backend claims (float32 for every dtype diag runs).
        shared: the run's per-case memo (`Outcome.shared`): the bounds and the truth's own
            sum-to-one error depend on the case alone, so every backend after the first
            reuses them. None: compute them here.

    Returns:
        `compare`'s metrics over the defined rows plus: rows, defined_rows, max_rel_err,
        sum_to_one_max_err and its row, truth_sum_to_one_max_err (what correct rounding alone
        gives), and hazard (None or {"rows", "returned": {kind: count}, "kind": ...}).
    """
    output, truth, x = np.asarray(output), np.asarray(truth), np.asarray(x)
    n = x.shape[-1]
    x2 = x.reshape(-1, n).astype(np.float64)
    o2, t2 = output.reshape(-1, n), truth.reshape(-1, n)
    undefined = (x2 == -np.inf).all(axis=1)
    nonfinite_in = (np.isnan(x2) | (x2 == np.inf)).any(axis=1) & ~undefined
    defined = ~(undefined | nonfinite_in)
    rows_def = np.flatnonzero(defined)
    xd, od, td = x2[rows_def], o2[rows_def], t2[rows_def]
    tol = tolerance("softmax", x.dtype, compute_dtype)
    bound_of, loose_bound_of = tol.bound, tol.loose_bound
    assert bound_of is not None and loose_bound_of is not None  # softmax's row sets both

    def once(name, compute):
        return (
            shared(f"{name}-{numerics.dtype_name(compute_dtype)}", compute) if shared else compute()
        )

    bound = once("bound", lambda: bound_of(xd, td))
    metrics = compare(od, td, bound)
    if "worst" in metrics:
        wr, wc = (int(v) for v in metrics["worst"]["index"].strip("()").split(","))
        metrics["worst"]["index"] = f"(row {int(rows_def[wr])}, {wc})"
    # The looser claim: x - max, exp and the division in the input dtype, only the sum in
    # compute_dtype (jax's bf16 softmax on CPU measures like this). Beyond the strict bound but
    # within this one is a warn, not a fail.
    in_dt = numerics.as_dtype(x.dtype)
    if numerics.unit_roundoff(in_dt) > numerics.unit_roundoff(compute_dtype):
        loose = once("loose_bound", lambda: loose_bound_of(xd, td))
        abs_err = np.abs(od.astype(np.float64) - td.astype(np.float64))
        ok = np.isfinite(abs_err)
        ratio = np.divide(abs_err, loose, out=np.zeros(abs_err.shape), where=ok)
        metrics["narrow_dtype"] = numerics.dtype_name(in_dt)
        metrics["narrow_bound_ratio"] = float(ratio.max()) if ratio.size else 0.0
        metrics["narrow_bound_exceeded"] = int(np.count_nonzero(ratio > 1.0))
    metrics["rows"] = int(x2.shape[0])
    metrics["defined_rows"] = int(rows_def.size)
    metrics["compute_dtype"] = numerics.dtype_name(compute_dtype)
    worst_sum, worst_row, truth_sum = _sum_to_one(o2, t2, rows_def, once)
    metrics["sum_to_one_max_err"] = worst_sum
    metrics["sum_to_one_worst_row"] = worst_row
    metrics["truth_sum_to_one_max_err"] = truth_sum
    metrics["hazard"] = _hazard(o2, undefined, nonfinite_in)
    return metrics


def softmax_mismatch(metrics: dict[str, Any]) -> Mismatch | None:
    """What broke the rule in `compare_softmax`'s metrics (defined rows only), or None."""
    return mismatch(metrics, nonfinite_unit="elements of defined rows")


def judge_softmax(metrics: dict[str, Any], dtype) -> tuple[str, str]:
    """Verdict for `compare_softmax` metrics: (status, one-line reason).

    fail: a defined row has NaN/Inf where the exact result is finite (or the reverse), or an
    element is off by more than `softmax_error_bound` allows (no correct implementation in the
    claimed arithmetic can do that) and, for bf16/fp16 inputs, also more than the looser bound
    of elementwise work in the input dtype with a float32 sum. warn: beyond the strict bound
    but within that looser one (less precision than claimed, as jax's bf16 softmax on CPU), or
    when undefined rows exist (a hazard, not an error: the reason says what this backend
    returns there). pass: otherwise.
    """
    name = numerics.dtype_name(dtype)
    claim = f"{metrics.get('compute_dtype', 'float32')} arithmetic"
    summary = (
        f"max {metrics['max_ulp']} ULP, {metrics['frac_not_correctly_rounded']:.1%} not "
        f"correctly rounded, max sum-to-one error {metrics['sum_to_one_max_err']:.3g}"
    )
    hazard = ""
    if metrics.get("hazard"):
        parts = []
        for what, h in metrics["hazard"].items():
            got = ", ".join(f"{kind} in {k}" for kind, k in sorted(h["returned"].items()))
            parts.append(
                f"{h['rows']} rows {what} have no defined softmax; this backend "
                f"returns {got} (first: row {h['first_row']})"
            )
        hazard = "hazard: " + "; ".join(parts)
    m = softmax_mismatch(metrics)
    if metrics["unexpected_nonfinite"]:
        assert m is not None  # softmax_mismatch counts these first
        return Status.FAIL, (
            f"{name} softmax: {format_mismatch(m)} are NaN/Inf where the exact "
            f"result is finite (or the reverse)"
        )
    if m is not None:
        detail = (
            f"{name} softmax error exceeds the {claim} bound in {format_mismatch(m)}; {summary}"
        )
        narrow = metrics.get("narrow_dtype")
        if narrow and not metrics["narrow_bound_exceeded"]:
            return Status.WARN, (
                f"{detail}; consistent with x - max, exp and the division done in "
                f"{narrow} (worst {metrics['narrow_bound_ratio']:.2g}x that bound): "
                f"less precise than {claim}" + (f"; {hazard}" if hazard else "")
            )
        return Status.FAIL, detail
    reason = f"within the {claim} bound (worst {metrics['bound_ratio']:.2g}x); {summary}"
    if hazard:
        return Status.WARN, f"{reason}; {hazard}"
    return Status.PASS, reason


def evaluate(o: Outcome) -> Evaluation:
    """One backend's softmax against the correctly rounded truth."""
    expected = o.truth.value
    output = only_output(o, expected)
    metrics = compare_softmax(output, expected, o.inputs[0], shared=o.shared)
    status, reason = judge_softmax(metrics, o.params["dtype"])
    return Evaluation(status, reason, metrics, mismatch=softmax_mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' softmax of one case, in ULPs."""
    # Two backends each within the tolerance of the truth may be AGREEMENT_FACTOR times it apart.
    allowed = tolerance("softmax", a.params["dtype"]).agreement_ulp(a.params)
    return agree_values(a.outputs[0], b.outputs[0], names, allowed_ulp=allowed)


def truth(inputs: list, params: dict, cache):
    return oracle.softmax_result(*inputs, cache=cache)


def on_jax(backend):
    """`jax.nn.softmax` over the last axis, in the input dtype."""
    import jax

    return lambda x: jax.nn.softmax(x, axis=-1)


def on_torch(backend):
    """`torch.softmax` over the last axis, in the input dtype."""
    import torch

    return lambda x: torch.softmax(x, dim=-1)


PROBE = Probe(
    op="softmax",
    dims=("rows", "n"),
    params={},
    op_args=(),
    dtypes=FLOATS,
    inputs=LOGIT_MAKERS,
    input_shapes=rows_shapes,
    truth=truth,
    evaluate=evaluate,
    agree=agree,
    label=rows_label(),
    input_family="rows",
    host_bytes=rows_bytes,
    implementations={"jax": on_jax, "torch": on_torch},
)
