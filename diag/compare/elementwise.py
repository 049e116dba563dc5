"""Element-wise comparison against a per-element bound: metrics, verdict and agreement.

One policy decides every verdict (`judge`): the error bound of the arithmetic the backend
claims decides pass/fail; ULP figures are reported but do not decide alone, because elements
that nearly cancel to zero give huge ULP and relative errors even for a correct float32 sum
(field notes: error / (u * sum|a*b|) stays ~3 while max ULP grows with d).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from diag import numerics
from diag.compare.verdict import Mismatch, format_index, format_mismatch
from diag.tolerance import AGREEMENT_FACTOR


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


def mismatch(metrics: dict[str, Any], *, nonfinite_unit: str = "elements"
             ) -> Optional[Mismatch]:
    """What broke the rule in `compare`'s metrics: NaN/Inf where the truth is finite (or the
    reverse) first, then elements beyond the bound; None when nothing did.

    Args:
      metrics: from `compare`.
      nonfinite_unit: what the non-finite count counts (softmax: `elements of defined rows`).
    """
    n = metrics["elements"]
    if metrics["unexpected_nonfinite"]:
        return Mismatch(metrics["unexpected_nonfinite"], n, nonfinite_unit, share=False)
    if metrics["bound_exceeded"]:
        w = metrics["worst"]
        return Mismatch(metrics["bound_exceeded"], n, where=w["index"],
                        ratio=metrics["bound_ratio"], got=w["got"], expected=w["truth"],
                        allowed=w["allowed"], ulp=w.get("ulp"))
    return None


def judge(metrics: dict[str, Any], *, promised: bool, claim: str, setting: str) -> tuple[str, str]:
    """The verdict for one record's metrics: (status, one-line reason).

    Args:
      metrics: from `compare`.
      promised: whether the backend promises the claimed arithmetic under this setting
        (`diag.backends.promises_full_precision`); if not, a bound breach is `warn`.
      claim: the arithmetic the bound assumes (`float32 accumulation`).
      setting: the precision setting, for the reason.
    """
    m = mismatch(metrics)
    if metrics["unexpected_nonfinite"]:
        return "fail", (f"{format_mismatch(m)} are NaN/Inf where the exact result is not "
                        f"(or the reverse)")
    summary = (f"{metrics['frac_not_correctly_rounded']:.1%} not correctly rounded, "
               f"max {metrics['max_ulp']} ULP")
    if m is not None:
        detail = f"error exceeds the {claim} bound in {format_mismatch(m)}"
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
        it can differ by up to `AGREEMENT_FACTOR` times it, so `bound_ratio` =
        max |x - y| / (AGREEMENT_FACTOR * bound).
    """
    ulp = numerics.ulp_distance(x, y).ravel()
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


def agreement_mismatch(metrics: dict[str, Any]) -> Optional[Mismatch]:
    """The elements where two outputs differ (`agreement`/`agree_values` metrics), or None."""
    if not metrics["mismatched"]:
        return None
    return Mismatch(metrics["mismatched"], metrics["elements"], where=metrics["worst"]["index"],
                    ulp=metrics["max_ulp_between"])


def judge_agreement(metrics: dict[str, Any], a: str, b: str, claim: str) -> tuple[str, str]:
    """pass: identical, or apart by no more than two correct backends may be; else warn."""
    m = agreement_mismatch(metrics)
    if m is None:
        return "pass", f"{a} and {b} agree bit for bit"
    detail = f"{a} and {b} differ in {format_mismatch(m)}"
    if metrics["bound_ratio"] <= 1.0:
        return "pass", f"{detail}; within what two backends keeping the {claim} bound may differ"
    return "warn", (f"{detail}; {metrics['bound_ratio']:.3g}x what two backends keeping the "
                    f"{claim} bound may differ")


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
    detail = f"{names[0]} and {names[1]} differ in {format_mismatch(agreement_mismatch(metrics))}"
    if metrics["max_ulp_between"] <= allowed_ulp:
        return "pass", f"{detail}; within the {allowed_ulp:g} ULP two correct backends may differ", \
            metrics
    return "warn", f"{detail}; more than the {allowed_ulp:g} ULP two correct backends may differ", \
        metrics
