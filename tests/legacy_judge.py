"""diag's judging code as it was before it streamed (base commit 8e4fc41), for tests only.

tests/test_judge_legacy.py judges the shipped suites' cases with this code and with diag's
own and asserts identical metrics and verdicts: the streaming rewrite (chunked passes,
histogram quantiles, a bound shared by every backend) changed the speed, not one number.
Copied verbatim (they call each other, not diag's new versions); the glue is at the end.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Optional
from unittest import mock

import ml_dtypes
import numpy as np

from diag import numerics
from diag.compare.elementwise import agreement_mismatch, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome
from diag.compare.outcome import only_output as _only_output
from diag.probes.softmax import _row_kind, judge_softmax, softmax_mismatch
from diag.compare.verdict import format_index, format_mismatch
from diag.errors import UsageError
from diag.numerics import NAN_ULP, as_dtype, bits_view, gamma
from diag.tolerance import AGREEMENT_FACTOR, tolerance

DTypeLike = Any



def _magnitude_and_sign(x: np.ndarray):
    bits = bits_view(x).astype(np.uint64)
    width = 8 * x.dtype.itemsize
    sign_mask = np.uint64(1) << np.uint64(width - 1)
    return bits & (sign_mask - np.uint64(1)), (bits & sign_mask) != 0


def ulp_distance(x, y) -> np.ndarray:
    """Number of representable values between x and y, elementwise, in their common dtype.

    Works on the ordered-integer view of the bits: +0 and -0 are the same point, neighbours are 1
    apart, the distance across zero adds both sides, +-inf sit one step beyond the largest
    finite value. Both NaN -> 0 (agree); exactly one NaN -> `NAN_ULP`.

    Args:
        x: array of float32, bfloat16, float16, float8_* or float64.
        y: array of the same dtype, broadcastable against x.

    Returns:
        int64 array (float64 distances saturate at NAN_ULP - 1).

    Raises:
        UsageError: the dtypes differ or are not supported.
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype:
        raise UsageError(f"ulp_distance: dtypes differ ({x.dtype} vs {y.dtype}); cast one side "
                         "to the other's dtype first")
    as_dtype(x.dtype)
    x, y = np.broadcast_arrays(x, y)
    shape = x.shape
    # 1-d views: numpy scalars (0-d inputs) would warn on the uint64 wrap-around that
    # np.where's unused branch computes, and cannot take item assignment.
    x, y = x.reshape(-1), y.reshape(-1)
    mx, sx = _magnitude_and_sign(x)
    my, sy = _magnitude_and_sign(y)
    same = sx == sy
    # Same sign: |mx - my|. Opposite signs: the path crosses zero, mx + my (< 2**64 in uint64).
    dist = np.where(same, np.where(mx > my, mx - my, my - mx), mx + my)
    dist = np.minimum(dist, np.uint64(NAN_ULP - 1)).astype(np.int64)
    with np.errstate(invalid="ignore"):
        xn, yn = np.isnan(x.astype(np.float64)), np.isnan(y.astype(np.float64))
    dist[xn & yn] = 0
    dist[xn ^ yn] = NAN_ULP
    return dist.reshape(shape)


def matmul_error_bound(a, b, compute_dtype: DTypeLike) -> np.ndarray:
    """Textbook forward error bound gamma_K * (|A| |B|)_ij of a matmul done in `compute_dtype`.

    A backend whose error exceeds this bound used less precision than `compute_dtype` (for
    example one bf16 pass where float32 was claimed). |A||B| is computed in float64 and scaled
    up by (1 + gamma_{K+1}(float64)) so that its own rounding does not make the bound smaller.

    Args:
        a: [..., M, K] array (any float dtype diag knows).
        b: [..., K, N] array.
        compute_dtype: the dtype the backend claims to accumulate in.

    Returns:
        float64 array of shape [..., M, N].
    """
    a64 = np.abs(np.asarray(a).astype(np.float64))
    b64 = np.abs(np.asarray(b).astype(np.float64))
    if a64.ndim < 2 or b64.ndim < 2 or a64.shape[-1] != b64.shape[-2]:
        raise UsageError(f"matmul_error_bound: shapes {a64.shape} and {b64.shape} do not "
                         "multiply; expected [..., M, K] and [..., K, N]")
    k = a64.shape[-1]
    return (a64 @ b64) * (gamma(k, compute_dtype) * (1.0 + gamma(k + 1, np.float64)))


def matmul_bound(inputs: list[np.ndarray], truth: np.ndarray, params: Optional[dict] = None,
                 *, compute_dtype: DTypeLike = "float32") -> np.ndarray:
    """Largest |computed - truth| a backend may show if it computes as it claims.

    The claim: products of the given inputs summed in `compute_dtype` (float32, also for
    bf16/fp16 inputs, as every framework documents), then rounded once to the output dtype.
    With P = |A||B|, e the exact product and s the sum (the textbook bound
    |s - e| <= gamma_K P, which is `matmul_error_bound`, plus K * eta for underflow of the
    compute dtype in the partial sums):
      output in the compute dtype:  |s - e| <= gamma_K P
      narrower output:              |fl(s) - e| <= (1 + u) gamma_K P + u |e| + eta_out / 2
    and the truth itself is |truth - e| <= u |e| + eta_out / 2, with |e| <= t / (1 - u)
    for t = |truth| and u the output's unit roundoff, eta_out its least subnormal.

    Args:
      inputs: [a, b] as the backend received them.
      truth: the correctly rounded product (its dtype is the output dtype).
      params: the case parameters (unused: the bound depends on the arrays alone).
      compute_dtype: the accumulation dtype the backend claims.

    Returns:
      float64 array of truth's shape.
    """
    a, b = inputs
    k = np.shape(a)[-1]
    with np.errstate(invalid="ignore"):  # inf * 0: the truth is NaN there and not judged
        bound = matmul_error_bound(a, b, compute_dtype)
    bound = bound + k * float(ml_dtypes.finfo(numerics.as_dtype(compute_dtype)).smallest_subnormal)
    out = truth.dtype
    u = numerics.unit_roundoff(out)
    eta_out = float(ml_dtypes.finfo(out).smallest_subnormal)
    exact_mag = np.abs(truth.astype(np.float64)) / (1 - u)
    if u > numerics.unit_roundoff(compute_dtype):  # a final rounding to a narrower output
        bound *= 1 + u
        bound += u * exact_mag + eta_out / 2
    bound += u * exact_mag + eta_out / 2  # the truth's own rounding
    return bound


def compare(output: np.ndarray, truth: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """Element-wise metrics of `output` against the correctly rounded `truth`.

    Args:
      output: what the backend returned.
      truth: the correctly rounded result, same shape and dtype.
      bound: per-element float64 bound on |output - truth| for the claimed arithmetic.

    Returns:
      A metrics dict: elements, nan_count, inf_count, unexpected_nonfinite, max/mean/p99 ULP,
      frac_not_correctly_rounded, max_abs_err, max_rel_err, bound_ratio, bound_exceeded, and
      `worst` (index, got, truth, allowed) for the element with the largest bound ratio.
    """
    n = int(truth.size)
    o64 = output.astype(np.float64).ravel()
    t64 = truth.astype(np.float64).ravel()
    o_nan, t_nan = np.isnan(o64), np.isnan(t64)
    o_inf, t_inf = np.isinf(o64), np.isinf(t64)
    # Non-finite where the truth is finite, or not the same non-finite value as the truth.
    same_nonfinite = (o_nan & t_nan) | (o_inf & t_inf & (o64 == t64))
    unexpected = int(np.count_nonzero((o_nan | o_inf | t_nan | t_inf) & ~same_nonfinite))

    ulp = ulp_distance(output, truth).ravel()
    comparable = ulp < numerics.NAN_ULP
    ulp_ok = ulp[comparable]

    finite = np.isfinite(o64) & np.isfinite(t64)
    err = np.zeros(n)
    np.subtract(o64, t64, out=err, where=finite)
    np.abs(err, out=err)
    abs_t = np.abs(t64)
    rel = np.divide(err, abs_t, out=np.zeros(n), where=finite & (abs_t > 0))
    ratio = np.divide(err, bound.ravel(), out=np.zeros(n), where=finite)

    metrics: dict[str, Any] = {
        "elements": n,
        "nan_count": int(np.count_nonzero(o_nan)),
        "inf_count": int(np.count_nonzero(o_inf)),
        "unexpected_nonfinite": unexpected,
        "max_ulp": int(ulp_ok.max()) if ulp_ok.size else 0,
        "mean_ulp": float(ulp_ok.mean()) if ulp_ok.size else 0.0,
        "p99_ulp": float(np.percentile(ulp_ok, 99)) if ulp_ok.size else 0.0,
        "frac_not_correctly_rounded": float(np.count_nonzero(ulp != 0)) / max(n, 1),
        "max_abs_err": float(err.max()) if n else 0.0,
        "max_rel_err": float(rel.max()) if n else 0.0,
        "bound_ratio": float(ratio.max()) if n else 0.0,
        "bound_exceeded": int(np.count_nonzero(ratio > 1.0)),
    }
    if n:
        w = int(ratio.argmax())
        metrics["worst"] = {"index": format_index(w, truth.shape), "got": float(o64[w]),
                            "truth": float(t64[w]), "allowed": float(bound.ravel()[w]),
                            "ulp": int(ulp[w])}
    return metrics


def agreement(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """How far two backends' outputs for the same case are apart.

    Args:
      x, y: the two outputs (same shape and dtype).
      bound: the per-element bound each backend is judged by; two backends that both keep
        it can differ by up to `AGREEMENT_FACTOR` times it, so `bound_ratio` =
        max |x - y| / (AGREEMENT_FACTOR * bound).
    """
    ulp = ulp_distance(x, y).ravel()
    n = int(ulp.size)
    mismatched = int(np.count_nonzero(ulp))
    x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    finite = np.isfinite(x64) & np.isfinite(y64)
    diff = np.abs(np.subtract(x64, y64, out=np.zeros(n), where=finite))
    ratio = np.divide(diff, AGREEMENT_FACTOR * bound.ravel(), out=np.zeros(n), where=finite)
    metrics: dict[str, Any] = {"elements": n, "mismatched": mismatched,
                               "max_ulp_between": int(ulp.max()) if n else 0,
                               "max_abs_diff": float(diff.max()) if n else 0.0,
                               "bound_ratio": float(ratio.max()) if n else 0.0}
    if mismatched:
        w = int(ulp.argmax())
        metrics["worst"] = {"index": format_index(w, x.shape), "a": float(x64[w]),
                            "b": float(y64[w])}
    return metrics


def agree_values(x: np.ndarray, y: np.ndarray, names: tuple[str, str], *,
                 allowed_ulp: float) -> tuple[str, str, dict[str, Any]]:
    """Two backends' outputs of one case compared in ULPs: pass within `allowed_ulp` (what two
    correct implementations may differ by), warn beyond. Returns (status, reason, metrics)."""
    x, y = np.asarray(x), np.asarray(y)
    ulp = ulp_distance(x, y).ravel()
    n = int(ulp.size)
    mism = int(np.count_nonzero(ulp))
    metrics: dict[str, Any] = {"elements": n, "mismatched": mism,
                               "max_ulp_between": int(ulp.max()) if n else 0,
                               "allowed_ulp": float(allowed_ulp)}
    if not mism:
        return "pass", f"{names[0]} and {names[1]} agree bit for bit", metrics
    w = int(ulp.argmax())
    metrics["worst"] = {"index": format_index(w, x.shape), "a": float(x.ravel()[w]),
                        "b": float(y.ravel()[w])}
    detail = f"{names[0]} and {names[1]} differ in {format_mismatch(agreement_mismatch(metrics))}"
    if metrics["max_ulp_between"] <= allowed_ulp:
        return "pass", f"{detail}; within the {allowed_ulp:g} ULP two correct backends may differ", \
            metrics
    return "warn", f"{detail}; more than the {allowed_ulp:g} ULP two correct backends may differ", \
        metrics


def compare_softmax(output: np.ndarray, truth: np.ndarray, x: np.ndarray, *,
                    compute_dtype="float32") -> dict[str, Any]:
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
    bound = tol.bound(xd, td)
    metrics = compare(od, td, bound)
    if "worst" in metrics:
        r, c = (int(v) for v in metrics["worst"]["index"].strip("()").split(","))
        metrics["worst"]["index"] = f"(row {int(rows_def[r])}, {c})"
    # The looser claim: x - max, exp and the division in the input dtype, only the sum in
    # compute_dtype (jax's bf16 softmax on CPU measures like this). Beyond the strict bound but
    # within this one is a warn, not a fail.
    in_dt = numerics.as_dtype(x.dtype)
    if numerics.unit_roundoff(in_dt) > numerics.unit_roundoff(compute_dtype):
        loose = tol.loose_bound(xd, td)
        err = np.abs(od.astype(np.float64) - td.astype(np.float64))
        ok = np.isfinite(err)
        ratio = np.divide(err, loose, out=np.zeros(err.shape), where=ok)
        metrics["narrow_dtype"] = numerics.dtype_name(in_dt)
        metrics["narrow_bound_ratio"] = float(ratio.max()) if ratio.size else 0.0
        metrics["narrow_bound_exceeded"] = int(np.count_nonzero(ratio > 1.0))
    metrics["rows"] = int(x2.shape[0])
    metrics["defined_rows"] = int(rows_def.size)
    metrics["compute_dtype"] = numerics.dtype_name(compute_dtype)
    worst_sum, worst_row, truth_sum = 0.0, -1, 0.0
    for r in rows_def:
        ro = o2[r].astype(np.float64)
        if not np.isfinite(ro).all():
            continue  # counted by unexpected_nonfinite
        err = abs(math.fsum(ro.tolist() + [-1.0]))
        if err > worst_sum or worst_row < 0:
            worst_sum, worst_row = err, int(r)
        truth_sum = max(truth_sum, abs(math.fsum(t2[r].astype(np.float64).tolist() + [-1.0])))
    metrics["sum_to_one_max_err"] = worst_sum
    metrics["sum_to_one_worst_row"] = worst_row
    metrics["truth_sum_to_one_max_err"] = truth_sum
    hazard = None
    for name, mask in (("fully masked (all -inf)", undefined),
                       ("holding NaN or +inf", nonfinite_in)):
        idx = np.flatnonzero(mask)
        if not idx.size:
            continue
        kinds: dict[str, int] = {}
        for r in idx:
            kind = _row_kind(o2[r])
            kinds[kind] = kinds.get(kind, 0) + 1
        hazard = hazard or {}
        hazard[name] = {"rows": int(idx.size), "returned": kinds, "first_row": int(idx[0])}
    metrics["hazard"] = hazard
    return metrics


# ---------------------------------------------------------------------------------------------
# Glue: the probe table's evaluate/agree of the base commit, per op.


def _matmul_evaluate(o: Outcome) -> Evaluation:
    expected = o.truth.value
    output = _only_output(o, expected)
    bound = matmul_bound(o.inputs, expected, o.params)
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim="float32 accumulation", setting=o.setting,
                           promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def _matmul_agree(a: Outcome, b: Outcome, names, context) -> tuple:
    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, "float32 accumulation")
    return status, reason, metrics


def _softmax_evaluate(o: Outcome) -> Evaluation:
    expected = o.truth.value
    output = _only_output(o, expected)
    metrics = compare_softmax(output, expected, o.inputs[0])
    status, reason = judge_softmax(metrics, o.params["dtype"])
    return Evaluation(status, reason, metrics, mismatch=softmax_mismatch(metrics))


def _softmax_agree(a: Outcome, b: Outcome, names, context) -> tuple:
    allowed = tolerance("softmax", a.params["dtype"]).agreement_ulp(a.params)
    return agree_values(a.outputs[0], b.outputs[0], names, allowed_ulp=allowed)


_LEGACY = {"matmul": (_matmul_evaluate, _matmul_agree),
           "softmax": (_softmax_evaluate, _softmax_agree)}


@contextmanager
def _old_units():
    """The other op families' modules are unchanged but for the ULP distance they call."""
    with mock.patch.object(numerics, "ulp_distance", ulp_distance):
        yield


def evaluate(op: str, o: Outcome) -> Evaluation:
    """The base commit's verdict on one output (`diag.plan.registry.PROBES[op].evaluate` now)."""
    from diag.plan.registry import PROBES

    if op in _LEGACY:
        return _LEGACY[op][0](o)
    with _old_units():
        return PROBES[op].evaluate(o)


def agree(op: str, a: Outcome, b: Outcome, names, context) -> tuple:
    """The base commit's agreement record of two outputs (`PROBES[op].agree` then)."""
    from diag.plan.registry import PROBES

    if op in _LEGACY:
        return _LEGACY[op][1](a, b, names, context)
    with _old_units():
        v = PROBES[op].agree(a, b, names, context)  # a Verdict now, a tuple then
    return v.status, v.reason, v.metrics
