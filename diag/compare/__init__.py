"""Compare a backend's output with the ground truth: metrics, a verdict and its reason.

One policy decides every verdict (`judge`): the error bound of the arithmetic the backend
claims decides pass/fail; ULP figures are reported but do not decide alone, because elements
that nearly cancel to zero give huge ULP and relative errors even for a correct float32 sum
(field notes: error / (u * sum|a*b|) stays ~3 while max ULP grows with d).

The sampling ops follow the same habit: softmax is judged by the worst-case bound of float32
arithmetic (`softmax_error_bound`); top-k by structure, recall by value and "wrong" rows
(`check_top_k`), so tie, NaN and signed-zero order are reported as semantics, not errors; greedy
tokens by agreement with the exact argmax (`check_greedy`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import numpy as np

from diag import numerics

__all__ = ["compare", "judge", "agreement", "judge_agreement", "format_index",
           "softmax_error_bound", "softmax_ulp_tolerance", "compare_softmax", "judge_softmax",
           "check_top_k", "judge_top_k", "describe_topk_semantics", "agree_top_k",
           "check_greedy", "judge_greedy", "agree_tokens", "agree_values"]


def format_index(flat: int, shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + ")"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


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

    ulp = numerics.ulp_distance(output, truth).ravel()
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


def judge(metrics: dict[str, Any], *, promised: bool, claim: str, setting: str) -> tuple[str, str]:
    """The verdict for one record's metrics: (status, one-line reason).

    Args:
      metrics: from `compare`.
      promised: whether the backend promises the claimed arithmetic under this setting
        (`diag.backends.promises_full_precision`); if not, a bound breach is `warn`.
      claim: the arithmetic the bound assumes (`float32 accumulation`).
      setting: the precision setting, for the reason.
    """
    n = metrics["elements"]
    if metrics["unexpected_nonfinite"]:
        k = metrics["unexpected_nonfinite"]
        return "fail", (f"{k} / {n} elements are NaN/Inf where the exact result is not "
                        f"(or the reverse)")
    k = metrics["bound_exceeded"]
    summary = (f"{metrics['frac_not_correctly_rounded']:.1%} not correctly rounded, "
               f"max {metrics['max_ulp']} ULP")
    if k:
        w = metrics["worst"]
        detail = (f"error exceeds the {claim} bound in {k} / {n} elements ({k / n:.2%}); "
                  f"worst {metrics['bound_ratio']:.3g}x the bound at {w['index']}: got "
                  f"{_fmt(w['got'])}, correctly rounded {_fmt(w['truth'])}, allowed "
                  f"±{_fmt(w['allowed'])}")
        if promised:
            return "fail", detail
        return "warn", (detail + f"; less precise than {claim}, which {setting} permits on "
                        f"this backend (use precision=highest where float32 is needed)")
    return "pass", f"within the {claim} bound (worst {metrics['bound_ratio']:.2g}x); {summary}"


def agreement(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> dict[str, Any]:
    """How far two backends' outputs for the same case are apart.

    Args:
      x, y: the two outputs (same shape and dtype).
      bound: the per-element bound each backend is judged by; two backends that both keep
        it can differ by up to twice it, so `bound_ratio` = max |x - y| / (2 * bound).
    """
    ulp = numerics.ulp_distance(x, y).ravel()
    n = int(ulp.size)
    mismatched = int(np.count_nonzero(ulp))
    x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    finite = np.isfinite(x64) & np.isfinite(y64)
    diff = np.abs(np.subtract(x64, y64, out=np.zeros(n), where=finite))
    ratio = np.divide(diff, 2 * bound.ravel(), out=np.zeros(n), where=finite)
    metrics: dict[str, Any] = {"elements": n, "mismatched": mismatched,
                               "max_ulp_between": int(ulp.max()) if n else 0,
                               "max_abs_diff": float(diff.max()) if n else 0.0,
                               "bound_ratio": float(ratio.max()) if n else 0.0}
    if mismatched:
        w = int(ulp.argmax())
        metrics["worst"] = {"index": format_index(w, x.shape), "a": float(x64[w]),
                            "b": float(y64[w])}
    return metrics


def judge_agreement(metrics: dict[str, Any], a: str, b: str, claim: str) -> tuple[str, str]:
    """pass: identical, or apart by no more than two correct backends may be; else warn."""
    n, k = metrics["elements"], metrics["mismatched"]
    if not k:
        return "pass", f"{a} and {b} agree bit for bit"
    detail = (f"{a} and {b} differ in {k} / {n} elements ({k / n:.2%}), up to "
              f"{metrics['max_ulp_between']} ULP at {metrics['worst']['index']}")
    if metrics["bound_ratio"] <= 1.0:
        return "pass", f"{detail}; within what two backends keeping the {claim} bound may differ"
    return "warn", (f"{detail}; {metrics['bound_ratio']:.3g}x what two backends keeping the "
                    f"{claim} bound may differ")


# ---------------------------------------------------------------------------------------------
# Sampling ops: softmax, top-k, greedy tokens (issue 4). The policies for these ops live here,
# next to the matmul policy above, so a verdict means the same thing wherever it is shown.

#: Assumed worst error of a backend's float32 exp, in ulp: XLA's and Sleef's vectorised exp are
#: documented/measured at about 1 ulp; 4 leaves room without hiding a real defect.
SOFTMAX_EXP_ULP = 4


def _u(dtype) -> float:
    return numerics.unit_roundoff(dtype)


def _smallest_normal(dtype) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(numerics.as_dtype(dtype)).smallest_normal)


def _half_subnormal_step(dtype) -> float:
    import ml_dtypes

    fi = ml_dtypes.finfo(numerics.as_dtype(dtype))
    return float(fi.smallest_subnormal) / 2


def _softmax_sum_error(n: int, compute_dtype) -> float:
    """Relative error bound of the row sum: gamma_{n-1} of the compute dtype (any order)."""
    return float(numerics.gamma(max(n - 1, 0), compute_dtype))


def softmax_error_bound(x: np.ndarray, truth: np.ndarray, *, compute_dtype="float32",
                        elementwise_dtype=None) -> np.ndarray:
    """Per-element bound on |softmax(x) - truth| for ANY correct implementation of the claimed
    arithmetic.

    A backend computes ``y_i = fl(fl(exp(fl(x_i - m))) / fl(sum_j ...))``: the row sum in
    `compute_dtype` (unit roundoff u), the subtraction, exp and division in `elementwise_dtype`
    (u_e; default the compute dtype), then rounds y_i to the output dtype (u_o). Worst case,
    first order, summation in ANY order (Higham):

    * x_i - m rounds: exp's argument is off by u_e |d_i|, so e_i by a factor exp(u_e |d_i|);
    * exp: `SOFTMAX_EXP_ULP` ulp of the compute dtype (2 * SOFTMAX_EXP_ULP * u relative), plus
      u_e when its result is stored in a narrower elementwise dtype;
    * the sum S of n terms: gamma_{n-1}(u) S, plus the terms' own errors, weighted:
      sum_j e_j u_e |d_j| <= u_e min(n / e, S max|d|) since |d| e**d <= 1/e;
    * the division: u_e; the final rounding to the output dtype: u_o (none when the output IS
      the dtype of the division: that rounding is the final one).

    rel_i = 1.01 (eps_i + rel_S + u_e) / (1 - rel_S); the bound is rel_i |y_i| + u_o |y_i| plus
    an absolute term: the compute dtype's smallest normal, because accelerators flush subnormal
    results to zero (TPU does), and half the output dtype's subnormal step; plus the truth's
    own rounding to the output dtype (u_o |y_i| and another half subnormal step), since the
    backend is compared with the rounded truth, not the exact value. For float32 rows of
    32768 the sum term dominates (gamma ~ 2e-3, ~16k ulp): the bound says what float32
    arithmetic cannot explain at all (a bf16 sum, a wrong normaliser), not how good a backend
    is; the ULP figures next to it say that.

    Args:
        x: [..., n] inputs as given to the backend.
        truth: the correctly rounded softmax (same shape).
        compute_dtype: the dtype the row sum is claimed to accumulate in.
        elementwise_dtype: the dtype of x - max, exp and the division (default compute_dtype).

    Returns:
        float64 array of truth's shape (inf where rel_S >= 1: the claim bounds nothing).
    """
    x64 = np.asarray(x).astype(np.float64)
    n = x64.shape[-1]
    u = _u(compute_dtype)
    ew = numerics.as_dtype(elementwise_dtype if elementwise_dtype is not None else compute_dtype)
    u_e = _u(ew)
    exp_err = 2 * SOFTMAX_EXP_ULP * u + (u_e if u_e > u else 0.0)
    out_dt = numerics.as_dtype(truth.dtype)
    u_o = 0.0 if out_dt == ew else _u(out_dt)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        m = np.max(np.where(np.isnan(x64), -np.inf, x64), axis=-1, keepdims=True)
        d = np.where(np.isfinite(x64), x64 - m, 0.0)
        d = np.where(np.isfinite(d), np.abs(d), 0.0)
        s = np.where(x64 == -np.inf, 0.0, np.exp(-d)).sum(axis=-1, keepdims=True)
        s = np.maximum(s, 1.0)
        dmax = d.max(axis=-1, keepdims=True) if n else np.zeros(d.shape[:-1] + (1,))
        weighted = u_e * np.minimum(n / math.e, s * dmax) / s
        rel_s = _softmax_sum_error(n, compute_dtype) + exp_err + weighted
        eps = u_e * d + exp_err
        rel = np.where(rel_s < 1.0, 1.01 * (eps + rel_s + u_e) / np.maximum(1.0 - rel_s, 1e-300),
                       np.inf)
        y = np.abs(truth.astype(np.float64)) * (1 + 2 * _u(out_dt))
        y = np.where(np.isfinite(y), y, 0.0)
        # The truth is itself the exact value rounded once to the output dtype: another
        # u_o |y| + half a subnormal step between it and the exact result.
        return ((rel + u_o + _u(out_dt)) * y + _smallest_normal(compute_dtype)
                + 2 * _half_subnormal_step(out_dt))


def softmax_ulp_tolerance(dtype, n: int, *, spread: float = 64.0,
                          compute_dtype="float32") -> float:
    """ULPs of `dtype` a correct softmax over rows of n may be off, by the same worst case as
    `softmax_error_bound` for rows whose values span at most `spread` (|x_i - max| <= spread).

    In the normal range an error of relative size r is at most r / u_o ulp of the output dtype.
    """
    u = _u(compute_dtype)
    dt = numerics.as_dtype(dtype)
    rel_s = _softmax_sum_error(n, compute_dtype) + 2 * SOFTMAX_EXP_ULP * u + u * min(n / math.e,
                                                                                    spread)
    if rel_s >= 1.0:
        return math.inf
    rel = 1.01 * (u * spread + 2 * SOFTMAX_EXP_ULP * u + rel_s + u) / (1.0 - rel_s)
    final = 0.0 if dt == numerics.as_dtype(compute_dtype) else 1.0
    return float(math.ceil(rel / _u(dt)) + final)


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
    bound = softmax_error_bound(xd, td, compute_dtype=compute_dtype)
    metrics = compare(od, td, bound)
    if "worst" in metrics:
        r, c = (int(v) for v in metrics["worst"]["index"].strip("()").split(","))
        metrics["worst"]["index"] = f"(row {int(rows_def[r])}, {c})"
    # The looser claim: x - max, exp and the division in the input dtype, only the sum in
    # compute_dtype (jax's bf16 softmax on CPU measures like this). Beyond the strict bound but
    # within this one is a warn, not a fail.
    in_dt = numerics.as_dtype(x.dtype)
    if _u(in_dt) > _u(compute_dtype):
        loose = softmax_error_bound(xd, td, compute_dtype=compute_dtype, elementwise_dtype=in_dt)
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
    n = metrics["elements"]
    summary = (f"max {metrics['max_ulp']} ULP, {metrics['frac_not_correctly_rounded']:.1%} not "
               f"correctly rounded, max sum-to-one error {metrics['sum_to_one_max_err']:.3g}")
    hazard = ""
    if metrics.get("hazard"):
        parts = []
        for what, h in metrics["hazard"].items():
            got = ", ".join(f"{kind} in {k}" for kind, k in sorted(h["returned"].items()))
            parts.append(f"{h['rows']} rows {what} have no defined softmax; this backend "
                         f"returns {got} (first: row {h['first_row']})")
        hazard = "hazard: " + "; ".join(parts)
    if metrics["unexpected_nonfinite"]:
        k = metrics["unexpected_nonfinite"]
        return "fail", (f"{name} softmax: {k} / {n} elements of defined rows are NaN/Inf where "
                        f"the exact result is finite (or the reverse)")
    k = metrics["bound_exceeded"]
    if k:
        w = metrics["worst"]
        detail = (f"{name} softmax error exceeds the {claim} bound in {k} / {n} elements "
                  f"({k / max(n, 1):.2%}); worst {metrics['bound_ratio']:.3g}x the bound "
                  f"at {w['index']}: got {_fmt(w['got'])}, correctly rounded "
                  f"{_fmt(w['truth'])}, allowed ±{_fmt(w['allowed'])}; {summary}")
        narrow = metrics.get("narrow_dtype")
        if narrow and not metrics["narrow_bound_exceeded"]:
            return "warn", (f"{detail}; consistent with x - max, exp and the division done in "
                            f"{narrow} (worst {metrics['narrow_bound_ratio']:.2g}x that bound): "
                            f"less precise than {claim}" + (f"; {hazard}" if hazard else ""))
        return "fail", detail
    reason = f"within the {claim} bound (worst {metrics['bound_ratio']:.2g}x); {summary}"
    if hazard:
        return "warn", f"{reason}; {hazard}"
    return "pass", reason


# --- top-k ------------------------------------------------------------------------------------

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
        elif isn.sum() == max(0, k - (xr.size - row_nans)) and (not isn.any() or isn[-isn.sum():].all()):
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

        raise UsageError(f"top-k output shapes {values.shape} (values) and {indices.shape} "
                         f"(indices) do not fit an input of shape {x.shape}")
    L = values.shape[-1]
    return x2, values.reshape(-1, L), indices.reshape(-1, L)


def check_top_k(x: np.ndarray, values: np.ndarray, indices: np.ndarray, k: int, *,
                recall_target: Optional[float] = None,
                sorted_output: Optional[bool] = None) -> dict[str, Any]:
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
    from diag.oracle import top_k as exact_top_k

    canon_v, canon_i = exact_top_k(x2, k)
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
        vb = numerics.bits_view(vals.astype(xr.dtype)) if vals.dtype != xr.dtype else \
            numerics.bits_view(vals)
        v64 = vals.astype(np.float64)
        same = (vb == numerics.bits_view(got)) | (np.isnan(v64) & np.isnan(got.astype(np.float64)))
        same &= inr
        if not same.all():
            counts["value_mismatch"] += 1
            j = int(np.flatnonzero(~same)[0])
            problems.append(f"value {float(v64[j])!r} at position {j} is not x[{int(idx[j])}]"
                            + (f" = {float(got[j].astype(np.float64))!r}" if inr[j] else ""))
        if need_sorted:
            isn = np.isnan(v64)
            num = v64[~isn]
            nan_block = (not isn.any() or isn[:int(isn.sum())].all()
                         or isn[L - int(isn.sum()):].all())
            with np.errstate(invalid="ignore"):  # inf - inf between equal infinities
                rising = (np.flatnonzero(np.diff(num) > 0) if num.size > 1
                          else np.array([], int))
            if rising.size or not nan_block:
                counts["unsorted"] += 1
                if rising.size:
                    j = int(rising[0])
                    problems.append(f"values not sorted descending ({float(num[j])!r} before "
                                    f"{float(num[j + 1])!r})")
                else:
                    # The first NaN outside a leading or trailing block of NaNs.
                    lead = int(np.argmin(isn)) if not isn.all() else L
                    trail = int(np.argmin(isn[::-1])) if not isn.all() else L
                    where = next(int(p) for p in np.flatnonzero(isn)
                                 if lead <= p < L - trail)
                    problems.append(f"values not sorted: NaN at position {where} between "
                                    f"numbers (NaN must come first or last)")
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
        larger = bool(ret_num.any() and left_num.any()
                      and keys[left_num].max() > keys[ret_num].min())
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
            wrong_examples.append({"row": r, "expected": _vals(canon_v[r]),
                                   "returned": _vals(np.sort(x64[cand])[::-1]),
                                   "missed_max": row_max_missed})
        if worst is None or best < recalls[worst]:
            worst = r
        if not problems and not is_wrong and best == 1.0 and L == k and not approx:
            if not np.array_equal(idx, canon_i[r]):
                semantic_rows += 1
    metrics: dict[str, Any] = {
        "rows": int(rows), "k": int(k), "returned": int(L), "mode": "approx" if approx else "exact",
        "invalid_rows": invalid_rows,
        **{f"{key}_rows": v for key, v in counts.items()},
        "invalid_examples": invalid_examples,
        "misses_larger_rows": int(misses_larger), "misses_max_rows": int(misses_max),
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
        metrics["worst_row"] = {"row": int(worst), "recall": float(recalls[worst]),
                                "expected": _vals(canon_v[worst]),
                                "returned": _vals(np.sort(v2[worst].astype(np.float64))[::-1])}
    return metrics


def judge_top_k(metrics: dict[str, Any], *, approx: bool,
                recall_target: Optional[float] = None) -> tuple[str, str]:
    """Verdict for `check_top_k` metrics: (status, one-line reason).

    Exact top-k: any invalid or wrong row, or recall below 1 -> fail; differences in tie,
    NaN or signed-zero order alone -> pass, named in the reason. Approximate: invalid rows or
    rows missing their maximum -> fail; mean recall below the target -> fail; mean recall met
    but some rows below it -> warn (the per-row minimum is given).
    """
    rows = metrics["rows"]
    what = "approximate top-k" if approx else "top-k"
    if metrics["invalid_rows"]:
        ex = metrics["invalid_examples"][0]
        return "fail", (f"{what}: {metrics['invalid_rows']} / {rows} rows are not a valid "
                        f"top-k (first: row {ex['row']}: {ex['problem']})")
    wrong = metrics["misses_max_rows"] if approx else metrics["wrong_rows"]
    if wrong:
        ex = metrics["wrong_examples"][0]
        why = ("misses the row maximum" if ex["missed_max"]
               else "leaves out a value larger than one it returned")
        return "fail", (f"{what}: {wrong} / {rows} rows are wrong (row {ex['row']} {why}: "
                        f"expected {ex['expected']}, returned {ex['returned']})")
    w = metrics.get("worst_row", {})
    worst = (f"min recall {metrics['recall_min']:.4g} at row {w.get('row')} (expected "
             f"{w.get('expected')}, returned {w.get('returned')})")
    if not approx:
        if metrics["recall_min"] < 1.0:
            return "fail", f"top-k recall below 1: {worst}"
        sem = metrics["semantics"]
        note = f"; order semantics: {', '.join(sem)}" if sem else ""
        if metrics["semantic_diff_rows"]:
            note += (f"; {metrics['semantic_diff_rows']} / {rows} rows choose or order equal "
                     f"values differently from diag's order (not an error)")
        return "pass", f"exact top-k in all {rows} rows{note}"
    target = recall_target if recall_target is not None else metrics.get("recall_target") or 1.0
    mean = metrics["recall_mean"]
    if mean < target:
        return "fail", (f"approximate top-k mean recall {mean:.4g} is below the promised "
                        f"{target:g}; {metrics['rows_below_target']} / {rows} rows below; {worst}")
    if metrics["rows_below_target"]:
        return "warn", (f"approximate top-k mean recall {mean:.4g} meets the promised {target:g} "
                        f"but {metrics['rows_below_target']} / {rows} rows fall below it; {worst}")
    return "pass", (f"approximate top-k recall >= {target:g} in every row (mean {mean:.4g}, "
                    f"min {metrics['recall_min']:.4g})")


def agree_top_k(x: np.ndarray, a: tuple, b: tuple, k: int,
                names: tuple[str, str]) -> tuple[str, str, dict[str, Any]]:
    """Do two backends' top-k outputs select the same VALUES per row (ties may pick different
    indices, field notes: bf16 has many)? Returns (status, reason, metrics); differing values
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
    metrics = {"rows": rows, "value_differ_rows": len(differ), "same_index_rows": same_idx,
               "differ_examples": [{"row": r, names[0]: _vals(np.sort(va[r, :k].astype(
                   np.float64))[::-1]), names[1]: _vals(np.sort(vb[r, :k].astype(
                       np.float64))[::-1])} for r in differ[:5]]}
    if not differ:
        extra = "" if same_idx == rows else (f" ({rows - same_idx} rows pick different indices "
                                             f"among equal values)")
        return "pass", f"{names[0]} and {names[1]} select the same values in all {rows} rows" \
            + extra, metrics
    return "warn", (f"{names[0]} and {names[1]} select different values in {len(differ)} / "
                    f"{rows} rows (first: row {differ[0]})"), metrics


# --- greedy tokens ----------------------------------------------------------------------------

_BATCH_LABEL = re.compile(r"^batch\d+$")


def _hex(v: np.generic) -> str:
    b = int(numerics.bits_view(np.asarray(v)))
    return f"0x{b:0{2 * np.asarray(v).dtype.itemsize}x}"


def _top3(row: np.ndarray) -> list[dict]:
    r64 = row.astype(np.float64)
    r64 = np.where(np.isnan(r64), -np.inf, r64)
    top = np.argsort(-r64, kind="stable")[:3]
    return [{"index": int(i), "logit": float(r64[i]), "bits": _hex(row[i])} for i in top]


def check_greedy(logits: np.ndarray, tokens: dict[str, np.ndarray], *,
                 rounded_probs: np.ndarray | None = None) -> dict[str, Any]:
    """Does every sampler path pick the token the exact math picks (the incident's check)?

    The exact greedy token of a row is the index of its maximum logit, where that maximum occurs
    once; rows whose maximum is exactly tied are excluded from agreement (counted), but a path
    that picks a non-maximal token there is still wrong. Rows holding NaN are counted apart.
    Batch dependence: paths whose names differ only in a ``batchN`` component (e.g.
    "jit/batch1/argmax" and "jit/batch64/argmax", and "jit/argmax" on all rows at once) must
    choose the same token in every row.

    A path through the probabilities (its name holds ``softmax``) is held to what the
    correctly rounded probabilities allow: where rounding to the dtype makes the top two equal
    (`rounded_probs`), no implementation can tell them apart and an argmax takes the lower
    index. Such rows are counted as ``rounding_tie`` (a hazard of sampling from rounded
    probabilities, the incident's mechanism), not as the backend's error.

    Args:
        logits: [rows, vocab] logits as the backend received them (bf16, ...).
        tokens: path name -> [rows] chosen token per row.
        rounded_probs: the correctly rounded softmax of `logits` (diag.oracle.softmax), or
            None to hold softmax paths to the exact argmax like every other path.

    Returns:
        Metrics: rows, vocab, unique_rows, tied_rows, nan_rows, paths (per path: disagree,
        wrong_on_tie, tie_lowest_index, examples with row, expected, chosen, chosen logit and
        the top-3 logits as floats and bit patterns), disagreeing_paths, batch_dependence
        (per path group: the paths, rows_differ, examples).
    """
    from diag.errors import UsageError

    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise UsageError(f"check_greedy: logits must be [rows, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    x64 = logits.astype(np.float64)
    nan_row = np.isnan(x64).any(axis=1)
    xm = np.where(np.isnan(x64), -np.inf, x64)
    mx = xm.max(axis=1) if vocab else np.zeros(rows)
    n_max = (xm == mx[:, None]).sum(axis=1)
    unique = (n_max == 1) & ~nan_row
    tied = (n_max > 1) & ~nan_row
    expected = xm.argmax(axis=1) if vocab else np.zeros(rows, np.int64)
    paths: dict[str, Any] = {}
    chosen_all: dict[str, np.ndarray] = {}
    for name, tok in tokens.items():
        tok = np.asarray(tok).reshape(-1)
        if tok.shape[0] != rows:
            raise UsageError(f"check_greedy: path {name!r} gives {tok.shape[0]} tokens for "
                             f"{rows} rows")
        tok = tok.astype(np.int64)
        chosen_all[name] = tok
        inr = (tok >= 0) & (tok < vocab)
        picked = np.where(inr, xm[np.arange(rows), np.where(inr, tok, 0)], np.nan)
        disagree = unique & (tok != expected)
        rounding_tie = np.zeros(rows, bool)
        if rounded_probs is not None and "softmax" in name:
            probs = np.asarray(rounded_probs).astype(np.float64)
            top = np.nanmax(np.where(np.isnan(probs), -np.inf, probs), axis=1)
            safe = np.where(inr, tok, 0)
            rounding_tie = disagree & inr & (probs[np.arange(rows), safe] == top)
            disagree &= ~rounding_tie
        wrong_tie = tied & ~(picked == mx)
        lowest = tied & (tok == expected)
        bad = np.flatnonzero(disagree | wrong_tie | rounding_tie)
        examples = []
        for r in bad[:10]:
            examples.append({"row": int(r), "expected": int(expected[r]), "chosen": int(tok[r]),
                             "tied_max": bool(tied[r]), "rounding_tie": bool(rounding_tie[r]),
                             "chosen_logit": (float(picked[r]) if inr[r] else None),
                             "top3": _top3(logits[r])})
        paths[name] = {"disagree": int(disagree.sum()), "wrong_on_tie": int(wrong_tie.sum()),
                       "rounding_tie": int(rounding_tie.sum()),
                       "tie_lowest_index": int(lowest.sum()), "examples": examples}
    groups: dict[str, list[str]] = {}
    for name in tokens:
        parts = name.split("/")
        if any(_BATCH_LABEL.match(p) for p in parts):
            key = "/".join(p for p in parts if not _BATCH_LABEL.match(p))
            groups.setdefault(key, []).append(name)
    batch: dict[str, Any] = {}
    for key, names in groups.items():
        if key in tokens:  # the same path on all rows at once is one more batch size
            names = [key] + names
        if len(names) < 2:
            continue
        stack = np.stack([chosen_all[nm] for nm in names])
        differ = np.flatnonzero((stack != stack[0]).any(axis=0))
        batch[key] = {"paths": names, "rows_differ": int(differ.size),
                      "examples": [{"row": int(r), "tokens": {nm: int(chosen_all[nm][r])
                                                              for nm in names},
                                    "top3": _top3(logits[r])} for r in differ[:10]]}
    return {
        "rows": int(rows), "vocab": int(vocab), "unique_rows": int(unique.sum()),
        "tied_rows": int(tied.sum()), "nan_rows": int(nan_row.sum()), "paths": paths,
        "disagreeing_paths": sorted(nm for nm, p in paths.items()
                                    if p["disagree"] or p["wrong_on_tie"]),
        "rounding_tie_paths": sorted(nm for nm, p in paths.items() if p["rounding_tie"]),
        "batch_dependence": batch,
    }


def judge_greedy(metrics: dict[str, Any]) -> tuple[str, str]:
    """Verdict for `check_greedy` metrics: (status, one-line reason).

    fail: any path picks a token other than the unique exact maximum, or a non-maximal token on
    a tied row (beyond what rounding the probabilities forces). warn: a softmax path drops the
    most probable token only where the correctly rounded probabilities of the top two are
    equal (the dtype cannot separate them: sample from logits), or a path's choice depends on
    the batch size (possible only on tied or NaN rows). pass: otherwise.
    """
    rows, uniq = metrics["rows"], metrics["unique_rows"]
    bad = metrics["disagreeing_paths"]
    if bad:
        parts = []
        for name in bad:
            p = metrics["paths"][name]
            parts.append(f"{name} {p['disagree'] + p['wrong_on_tie']}")
        ex = next((e for e in metrics["paths"][bad[0]]["examples"] if not e.get("rounding_tie")),
                  metrics["paths"][bad[0]]["examples"][0])
        top = ", ".join(f"{t['index']}: {t['logit']:.6g} ({t['bits']})" for t in ex["top3"])
        return "fail", (f"greedy token differs from the exact argmax: {'; '.join(parts)} of "
                        f"{uniq} rows with a unique maximum disagree (first: {bad[0]} row "
                        f"{ex['row']} chose {ex['chosen']}, exact {ex['expected']}; top logits "
                        f"{top})")
    dep = {k: v for k, v in metrics["batch_dependence"].items() if v["rows_differ"]}
    tie_note = (f" ({metrics['tied_rows']} rows with an exactly tied maximum excluded)"
                if metrics["tied_rows"] else "")
    rounded = metrics.get("rounding_tie_paths") or []
    if rounded:
        p = metrics["paths"][rounded[0]]
        ex = next(e for e in p["examples"] if e.get("rounding_tie"))
        return "warn", (f"argmax over rounded probabilities drops the most probable token in "
                        f"{p['rounding_tie']} / {uniq} rows ({', '.join(rounded)}): the top two "
                        f"logits round to the same probability in this dtype (first: row "
                        f"{ex['row']} chose {ex['chosen']}, exact {ex['expected']}); sample "
                        f"from the logits or from float32 probabilities{tie_note}")
    if dep:
        key, v = next(iter(dep.items()))
        return "warn", (f"every path picks the exact greedy token, but {key} depends on the "
                        f"batch size in {v['rows_differ']} / {rows} rows "
                        f"({', '.join(v['paths'])}){tie_note}")
    return "pass", (f"all {len(metrics['paths'])} paths pick the exact greedy token in all "
                    f"{uniq} rows with a unique maximum{tie_note}")


def agree_tokens(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                 names: tuple[str, str]) -> tuple[str, str, dict[str, Any]]:
    """Do two backends pick the same token per row on every path they share? (status, reason,
    metrics); a difference is a warn (each is judged against the exact argmax on its own)."""
    shared = [p for p in a if p in b]
    differ = {p: int(np.count_nonzero(np.asarray(a[p]).reshape(-1) != np.asarray(b[p]).reshape(-1)))
              for p in shared}
    metrics = {"paths": shared, "rows_differ": differ}
    bad = {p: k for p, k in differ.items() if k}
    if not bad:
        return "pass", (f"{names[0]} and {names[1]} pick the same tokens on all "
                        f"{len(shared)} shared paths"), metrics
    first = next(iter(bad))
    return "warn", (f"{names[0]} and {names[1]} pick different tokens on {len(bad)} paths "
                    f"(first: {first}, {bad[first]} rows)"), metrics


def agree_values(x: np.ndarray, y: np.ndarray, names: tuple[str, str], *,
                 allowed_ulp: float) -> tuple[str, str, dict[str, Any]]:
    """Two backends' outputs of one case compared in ULPs: pass within `allowed_ulp` (what two
    correct implementations may differ by), warn beyond. Returns (status, reason, metrics)."""
    x, y = np.asarray(x), np.asarray(y)
    ulp = numerics.ulp_distance(x, y).ravel()
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
    detail = (f"{names[0]} and {names[1]} differ in {mism} / {n} elements ({mism / n:.2%}), up "
              f"to {metrics['max_ulp_between']} ULP at {metrics['worst']['index']}")
    if metrics["max_ulp_between"] <= allowed_ulp:
        return "pass", f"{detail}; within the {allowed_ulp:g} ULP two correct backends may differ", \
            metrics
    return "warn", f"{detail}; more than the {allowed_ulp:g} ULP two correct backends may differ", \
        metrics


# --- training step ---------------------------------------------------------------------------

# A screen, not a bound: no textbook bound covers a whole step (tanh, exp, log of sums of sums).
# Measured on CPU (64x256x16 MLP), jax and torch land 0 ULP from the float64 reference's loss
# in fp32, bf16 and fp16; 64 ULP is far outside that and far inside a broken step.
TRAIN_LOSS_ULP_SCREEN = 64


def compare_train_step(out: dict[str, np.ndarray], truth: dict[str, np.ndarray],
                       inputs: list[np.ndarray]) -> dict[str, Any]:
    """A training step's outputs (`loss`, `w1`, `w2`) against the float64 reference.

    Args:
      out: the backend's outputs by name.
      truth: the reference by name, rounded to the same dtype (`diag.oracle.train_step_result`).
      inputs: x, w1, w2 as given; the weights' update is `new - old`.

    Returns:
      unexpected_nonfinite (NaN/Inf where the reference is finite, or the reverse, or a
      different non-finite value), reference_nonfinite (elements where the float64 step
      itself overflows the dtype), nan_count, loss / loss_ref / loss_ulp / loss_rel_err, and per weight its max and p99
      ULP and `update_err`: max |w'_backend - w'_ref| over the largest reference update (ULPs
      of the new weights alone mislead where an update nearly cancels a weight).
    """
    metrics: dict[str, Any] = {"unexpected_nonfinite": 0, "nan_count": 0,
                               "reference_nonfinite": 0}
    old = {"w1": inputs[1], "w2": inputs[2]}
    for name in ("loss", "w1", "w2"):
        got, ref = np.asarray(out[name]), np.asarray(truth[name])
        if got.shape != ref.shape:
            raise ValueError(f"train_step output {name}: shape {got.shape}, expected {ref.shape}")
        got = got.astype(ref.dtype)
        g64, r64 = got.astype(np.float64), ref.astype(np.float64)
        fin_g, fin_r = np.isfinite(g64), np.isfinite(r64)
        same_nonfinite = (np.isnan(g64) & np.isnan(r64)) | (~fin_g & ~fin_r & (g64 == r64))
        metrics["unexpected_nonfinite"] += int(np.count_nonzero((~fin_g | ~fin_r)
                                                                & ~same_nonfinite))
        metrics["nan_count"] += int(np.count_nonzero(np.isnan(g64)))
        # The float64 step overflows this dtype here: no backend can return it finite.
        metrics["reference_nonfinite"] += int(np.count_nonzero(~fin_r))
        ulp = numerics.ulp_distance(got, ref).ravel()
        comparable = ulp[ulp < numerics.NAN_ULP]
        if name == "loss":
            metrics.update(loss=float(g64), loss_ref=float(r64),
                           loss_ulp=int(ulp[0]) if ulp[0] < numerics.NAN_ULP else None,
                           loss_rel_err=(float(abs(g64 - r64) / abs(r64))
                                         if np.isfinite(g64) and np.isfinite(r64) and r64 != 0
                                         else None))
            continue
        both = fin_g & fin_r
        err = np.abs(np.where(both, g64 - r64, 0.0))
        step = np.abs(np.where(fin_r, r64 - old[name].astype(np.float64), 0.0))
        scale = float(step.max()) if step.size else 0.0
        metrics[name] = {
            "max_ulp": int(comparable.max()) if comparable.size else None,
            "p99_ulp": float(np.percentile(comparable, 99)) if comparable.size else None,
            "update_err": float(err.max() / scale) if scale > 0 else 0.0,
            "max_update": scale,
        }
    return metrics


def judge_train_step(metrics: dict[str, Any], *, nan_reason: str | None = None
                     ) -> tuple[str, str]:
    """fail: NaN/Inf where the float64 reference is finite (with where it was born, from the
    NaN hunt); warn: the loss is more than `TRAIN_LOSS_ULP_SCREEN` ULP from the reference;
    pass: otherwise."""
    k = metrics["unexpected_nonfinite"]
    if k:
        where = f"; {nan_reason}" if nan_reason else ""
        fits = ""
        if metrics.get("reference_nonfinite"):
            fits = (f"; the step does not fit this dtype: even the float64 reference overflows "
                    f"it in {metrics['reference_nonfinite']} elements (use a wider dtype or "
                    f"loss scaling)")
        return "fail", (f"the step went non-finite: {k} output elements are NaN/Inf where the "
                        f"float64 reference is finite or a different value (loss "
                        f"{_fmt(metrics['loss'])}, reference {_fmt(metrics['loss_ref'])})"
                        f"{fits}{where}")
    updates = ", ".join(f"{n} {metrics[n]['update_err']:.2%}" for n in ("w1", "w2"))
    summary = (f"loss {_fmt(metrics['loss'])} is {metrics['loss_ulp']} ULP from the float64 "
               f"reference; weight update error (of the largest update): {updates}")
    if metrics["loss_ulp"] is not None and metrics["loss_ulp"] > TRAIN_LOSS_ULP_SCREEN:
        return "warn", f"{summary}: more than the {TRAIN_LOSS_ULP_SCREEN} ULP screen"
    return "pass", f"finite step; {summary}"


def agree_train_step(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                     names: tuple[str, str]) -> tuple[str, str, dict[str, Any]]:
    """Two backends' training steps: `warn` when one goes non-finite where the other does not
    (the "which hosts give NaN losses" question), else `pass` with how far apart they are."""
    x, y = names
    metrics: dict[str, Any] = {}
    split = []
    for name in ("loss", "w1", "w2"):
        u, v = np.asarray(a[name]), np.asarray(b[name]).astype(np.asarray(a[name]).dtype)
        fu, fv = np.isfinite(u.astype(np.float64)), np.isfinite(v.astype(np.float64))
        ulp = numerics.ulp_distance(u, v).ravel()
        metrics[name] = {"mismatched": int(np.count_nonzero(ulp)),
                         "nonfinite_split": int(np.count_nonzero(fu != fv))}
        if metrics[name]["nonfinite_split"]:
            split.append(name)
    if split:
        return "warn", (f"{x} and {y} disagree on finiteness: {', '.join(split)} is NaN/Inf on "
                        f"one and finite on the other"), metrics
    diff = ", ".join(f"{n} {metrics[n]['mismatched']}" for n in ("loss", "w1", "w2"))
    if not any(metrics[n]["mismatched"] for n in metrics):
        return "pass", f"{x} and {y} agree bit for bit", metrics
    return "pass", f"{x} and {y} both finite; elements that differ: {diff}", metrics
