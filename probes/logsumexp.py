"""logsumexp over the last axis (`jax.nn.logsumexp`, `torch.logsumexp`): a sampler's and a
loss's normaliser, over vocabulary-sized rows with -inf masks and large logits.

Semantics (the truth, per row of x): ``m + log(sum_i exp(x_i - m))`` with m the row maximum,
rounded once (nearest-even) to x's dtype; -inf entries add nothing; a row of -inf only gives
-inf; a row holding NaN gives NaN; a row holding +inf (and no NaN) gives +inf.

Why the float64 fast path is correctly rounded (`truth`, per row with at least one finite x_i;
u = 2**-53):

1. m is exact. ``d_i = fl(x_i - m)`` errs by at most u |x_i - m|, so
   exp(d_i) = exp(x_i - m) (1 + a_i) with |a_i| <= 1.01 u |d_i| (|d_i| <= 745 where exp(d_i)
   is not 0 in float64; below, exp(x_i - m) < 2**-1074 and counts in the absolute term).
2. ``e_i = np.exp(d_i)``. ASSUMPTION, the one thing not proven here (the softmax oracle's,
   diag/oracle/_softmax.py): numpy's float64 exp errs by at most `EXP_ULP` ulp (so relative
   2 EXP_ULP u), and its log by at most `LOG_ULP` ulp; both are measured against mpmath in
   tests/test_logsumexp.py.
3. ``S = np.sum(e)``: n positive terms summed in any order err by at most (n - 1) u S.
   With S_exact >= 1 (the maximum contributes exp(0) = 1), the relative error of S is at most
   eps = 1.01 u max|d_i| + 2 EXP_ULP u + (n - 1) u + n 2**-1074, second order in the 1.01.
4. ``L = np.log(S)``: |L - log(S_exact)| <= 1.01 eps + 2 LOG_ULP u |L|.
5. ``y = m + L`` adds u |y|; the half-width is D = 1.25 (that sum) plus 2 ulp of y in float64
   (the roundings of y -+ D). If y - D and y + D round to the same value of the output dtype,
   so does the exact result (rounding is monotonic): decided.

A row with one finite element is exact (S = 1, y = m). Rows left undecided (D is ~1e-11
relative for n = 256k, so almost none) are COUNTED (`OracleResult.fallbacks`) and settled by
interval arithmetic (`mpmath.iv`) at rising precision until the enclosure lies strictly
between two rounding boundaries of the output dtype. That loop ends: the exact result is
never a boundary (a midpoint is rational; m + log(S) with S a sum of exponentials of
rationals, not all zero, is transcendental by Lindemann-Weierstrass, and S = 1 is the exact
case above).

Tolerance (`error_bound`): the worst case of any implementation in the claimed arithmetic
(float32: u = 2**-24, exp and log within `SOFTMAX_EXP_ULP` ulp, any summation order), plus
the output's and the truth's roundings; with the subtraction, exp, log and final add in the
input dtype instead (bf16 elementwise, a float32 sum) the `loose` bound: between the two a
result is a `warn`, beyond both a `fail`.
"""

from __future__ import annotations

import math
import time
from functools import partial

import ml_dtypes
import numpy as np

from diag import numerics
from diag.compare.elementwise import agreement, compare, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome, only_output
from diag.compare.verdict import Verdict
from diag.oracle import OracleResult
from diag.plan.probe import FLOATS, LOGIT_MAKERS, Probe, rows_bytes, rows_label, rows_shapes
from diag.status import Status
from diag.tolerance import SOFTMAX_EXP_ULP, Tolerance

CLAIM = "float32 arithmetic"
#: Assumed worst errors of numpy's float64 exp and log, in ulp (measured < 1: the tests).
EXP_ULP = 4
LOG_ULP = 4
_U = 2.0**-53
_TINY = 2.0**-1074


# ---------------------------------------------------------------------------------------------
# Ground truth


def _special(x64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(result, mask) of rows decided without arithmetic: NaN, +inf, all -inf, one finite."""
    out = np.full(x64.shape[0], np.nan)
    nan = np.isnan(x64).any(axis=1)
    pinf = (x64 == np.inf).any(axis=1) & ~nan
    finite = np.isfinite(x64)
    count = finite.sum(axis=1)
    none = (count == 0) & ~nan & ~pinf
    one = (count == 1) & ~nan & ~pinf
    out[pinf], out[none] = np.inf, -np.inf
    out[one] = np.max(np.where(finite[one], x64[one], -np.inf), axis=1)
    return out, nan | pinf | none | one


def _fast(x64: np.ndarray, slack: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's float64 result y and half-width D (steps 1-5 of the module docstring)."""
    n = x64.shape[1]
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        m = np.max(x64, axis=1, keepdims=True)
        d = x64 - m
        e = np.exp(d)
        dmax = np.max(np.where(e > 0, -d, 0.0), axis=1)
        s = np.sum(e, axis=1)
        eps = 1.01 * _U * dmax + 2 * EXP_ULP * _U + (n - 1) * _U + n * _TINY
        big_l = np.log(s)
        y = m[:, 0] + big_l
        half = 1.25 * (1.01 * eps + 2 * LOG_ULP * _U * np.abs(big_l) + _U * np.abs(y))
        half = slack * half + 2 * np.spacing(np.abs(y))
    return y, half


def _bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return numerics.bits_view(a) == numerics.bits_view(b)


def _boundaries(c, dt) -> tuple[float, float]:
    """The rounding boundaries around the output-dtype value c: the midpoints to its
    neighbours (for the largest finite value, the overflow threshold), exact in float64."""
    c = np.asarray(c, dt).reshape(1)
    bits = numerics.bits_view(c).astype(np.int64)
    width = 8 * dt.itemsize
    sign = 1 << (width - 1)
    mag = int(bits[0]) & (sign - 1)
    negative = bool(int(bits[0]) & sign)

    def value(magnitude: int, neg: bool) -> float:
        raw = np.array([magnitude | (sign if neg else 0)], np.int64)
        return float(numerics.from_bits(raw.astype(f"u{dt.itemsize}"), dt)[0])

    cf = float(c[0])
    if mag == 0:
        step = value(1, False)
        return -step / 2, step / 2
    toward_zero = value(mag - 1, negative)
    away = value(mag + 1, negative)
    if not math.isfinite(away):
        away = cf + (cf - toward_zero)
    lo, hi = sorted(((cf + toward_zero) / 2, (cf + away) / 2))
    return lo, hi


def _interval_row(row: np.ndarray, dt) -> float:
    """One row's correctly rounded result by `mpmath.iv` at rising precision (a Ziv loop)."""
    import mpmath

    finite = row[np.isfinite(row)]
    m = float(finite.max())
    iv = mpmath.iv
    for prec in (80, 160, 320, 640, 1280):
        iv.prec = prec
        s = iv.mpf(0)
        for v in finite:
            s += iv.exp(iv.mpf(float(v)) - m)
        y = iv.log(s) + m
        lo, hi = mpmath.mpf(y.a), mpmath.mpf(y.b)
        mid = float(mpmath.mpf((lo + hi) / 2))
        c = numerics.round_to_dtype(np.array([mid]), dt)[0]
        below, above = _boundaries(c, dt)
        if lo > below and hi < above:
            return float(c)
    raise ArithmeticError("logsumexp oracle: rounding undecided at 1280 bits")


def logsumexp_result(x, *, cache=None, _slack: float = 1.0) -> OracleResult:
    """Correctly rounded logsumexp over the last axis, with its provenance.

    Args:
      x: [..., n] float32, bfloat16 or float16 array.
      cache: optional `diag.oracle.GroundTruthCache`; a hit skips the computation.
      _slack: widens the fast path's half-width (tests: 2**52 sends every row to the
        interval path, which must give the same bits).

    Returns:
      `OracleResult` of shape [...] in x's dtype, method "f64-ball"; `fallbacks` counts the
      rows settled by interval arithmetic.
    """
    t0 = time.perf_counter()
    x = np.asarray(x)
    dt = numerics.as_dtype(x.dtype)
    key = cache.key("logsumexp", [x], dt) if cache is not None else None
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        return OracleResult(
            value=hit.value,
            method=str(hit.meta.get("method", "")),
            fallbacks=int(hit.meta.get("fallbacks", 0)),
            elements=int(hit.value.size),
            cache_hit=True,
            seconds=time.perf_counter() - t0,
        )
    x64 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out, done = _special(x64)
    y, half = _fast(x64, _slack)
    lo = numerics.round_to_dtype(y - half, dt)
    hi = numerics.round_to_dtype(y + half, dt)
    decided = _bits_equal(lo, hi) & ~done
    out[decided] = lo[decided].astype(np.float64)
    undecided = np.flatnonzero(~decided & ~done)
    for r in undecided:
        out[r] = _interval_row(x64[r], dt)
    value = numerics.round_to_dtype(out, dt).reshape(x.shape[:-1])
    if cache is not None:
        cache.put(
            key, value, {"op": "logsumexp", "method": "f64-ball", "fallbacks": int(undecided.size)}
        )
    return OracleResult(
        value=value,
        method="f64-ball",
        fallbacks=int(undecided.size),
        elements=int(value.size),
        cache_hit=False,
        seconds=time.perf_counter() - t0,
    )


def truth(inputs: list, params: dict, cache):
    return logsumexp_result(inputs[0], cache=cache)


# ---------------------------------------------------------------------------------------------
# Tolerance


def error_bound(
    x: np.ndarray, truth: np.ndarray, *, compute_dtype="float32", elementwise_dtype=None
) -> np.ndarray:
    """Per-row bound on |logsumexp(x) - truth| for any implementation in the claimed
    arithmetic: the module docstring's steps 1-5 with the compute dtype's unit roundoff u
    (`elementwise_dtype`, when given, is the dtype the subtraction, exp, log and final add
    round to; the sum stays in the compute dtype), exp and log within `SOFTMAX_EXP_ULP` ulp,
    any summation order ((n - 1) u), times 1.25; plus the output's and the truth's roundings
    (one ulp of the output dtype) and half its subnormal step. Non-finite truths get 0."""
    x64 = np.asarray(x).reshape(-1, x.shape[-1]).astype(np.float64)
    n = x64.shape[1]
    u_sum = float(ml_dtypes.finfo(numerics.as_dtype(compute_dtype)).eps) / 2
    u = max(
        u_sum,
        float(ml_dtypes.finfo(numerics.as_dtype(elementwise_dtype)).eps) / 2
        if elementwise_dtype is not None
        else 0.0,
    )
    t64 = np.asarray(truth).reshape(-1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        m = np.max(x64, axis=1, keepdims=True)
        d = np.where(np.isfinite(x64), x64 - m, -np.inf)
        e = np.exp(d)
        # Each term's error, weighted by the term: u |d_i| (the subtraction) and 2k u (exp).
        terms = np.sum(
            e * (u * np.abs(np.where(e > 0, d, 0.0)) + 2 * SOFTMAX_EXP_ULP * u), axis=1
        ) / np.sum(e, axis=1)
        eps = terms + (n - 1) * u_sum
        big_l = np.abs(t64 - m[:, 0])
        chain = 1.25 * (np.log1p(eps) + 2 * SOFTMAX_EXP_ULP * u * big_l + u * np.abs(t64))
        fi = ml_dtypes.finfo(numerics.as_dtype(truth.dtype))
        top = np.abs(t64) + chain
        ulp_out = np.exp2(
            np.floor(np.log2(np.maximum(top, float(fi.smallest_normal)))) - int(fi.nmant)
        )
        bound = chain + ulp_out + float(fi.smallest_subnormal) / 2
    return np.where(np.isfinite(t64), bound, 0.0).reshape(np.shape(truth))


def tolerance_row(dtype: str, claim: str) -> Tolerance:
    """The op's row of the tolerance policy (`Probe.tolerance`): `error_bound` in the claimed
    arithmetic, and in the input dtype's elementwise steps as the loose bound (a warn)."""
    return Tolerance(
        "logsumexp",
        dtype,
        claim,
        why=(
            f"worst case of {claim} arithmetic in any summation order, exp and log within "
            f"{SOFTMAX_EXP_ULP} ulp; + the output's and the truth's roundings"
        ),
        bound=partial(error_bound, compute_dtype=claim),
        loose_bound=partial(error_bound, compute_dtype=claim, elementwise_dtype=dtype),
    )


# ---------------------------------------------------------------------------------------------
# Judging


def evaluate(o: Outcome) -> Evaluation:
    """One backend's logsumexp against the correctly rounded truth; beyond the float32 bound
    but within the input-dtype (loose) bound it is a `warn`, beyond both a `fail`."""
    expected = o.truth.value
    output = only_output(o, expected)
    tol = tolerance_row(numerics.dtype_name(expected.dtype), "float32")
    assert tol.bound is not None  # the op's row sets it
    bound = tol.bound(o.inputs[0], expected)
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim=CLAIM, setting=o.setting, promised=o.promised)
    if status == Status.FAIL and not metrics["unexpected_nonfinite"]:
        narrow = numerics.dtype_name(expected.dtype)
        assert tol.loose_bound is not None  # the op's row sets it
        loose = tol.loose_bound(o.inputs[0], expected)
        err = np.abs(output.astype(np.float64) - expected.astype(np.float64))
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = float(np.nanmax(np.where(loose > 0, err / loose, 0.0)))
        metrics["narrow_bound_ratio"] = ratio
        if ratio <= 1.0:
            status, reason = (
                Status.WARN,
                (
                    f"{reason}; consistent with the elementwise steps "
                    f"rounded to {narrow} (worst {ratio:.2g}x that bound): "
                    f"less precise than {CLAIM}"
                ),
            )
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' logsumexp of one case, against what two backends keeping the bound may
    differ by."""
    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, CLAIM)
    return Verdict(status, reason, metrics)


# ---------------------------------------------------------------------------------------------
# Implementations (run in the worker)


def on_jax(backend):
    """`jax.nn.logsumexp` over the last axis, in the input dtype."""
    import jax

    return lambda x: jax.nn.logsumexp(x, axis=-1)


def on_torch(backend):
    """`torch.logsumexp` over the last axis, in the input dtype."""
    import torch

    return lambda x: torch.logsumexp(x, dim=-1)


PROBE = Probe(
    op="logsumexp",
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
    tolerance=tolerance_row,
)
