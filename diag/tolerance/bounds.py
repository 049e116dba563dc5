"""The error bounds the op rows of `diag.tolerance` hold outputs to, each with its derivation.

Where theory gives a bound, the bound decides and no constant is tuned: matmul's gamma_K
bound, softmax's and gelu's worst cases of their arithmetic (with the one measured constant
each, the ULPs allowed to exp and tanh, next to it). `diag.tolerance` names them in its rows.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from diag import numerics
from diag.errors import UsageError
from diag.numerics import DTypeLike, gamma

__all__ = [
    "GELU_TANH_ULP",
    "SOFTMAX_EXP_ULP",
    "gelu_error_bound",
    "matmul_bound",
    "matmul_error_bound",
    "softmax_error_bound",
    "softmax_ulp_tolerance",
]


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
        raise UsageError(
            f"matmul_error_bound: shapes {a64.shape} and {b64.shape} do not "
            "multiply; expected [..., M, K] and [..., K, N]"
        )
    k = a64.shape[-1]
    bound = a64 @ b64
    bound *= gamma(k, compute_dtype) * (1.0 + gamma(k + 1, np.float64))  # in place: no copy
    return bound


def matmul_bound(
    inputs: list[np.ndarray],
    truth: np.ndarray,
    params: dict | None = None,
    *,
    compute_dtype: DTypeLike = "float32",
) -> np.ndarray:
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
    floor = k * float(ml_dtypes.finfo(numerics.as_dtype(compute_dtype)).smallest_subnormal)
    out = truth.dtype
    u = numerics.unit_roundoff(out)
    eta_out = float(ml_dtypes.finfo(out).smallest_subnormal)
    narrow = u > numerics.unit_roundoff(compute_dtype)  # a final rounding to a narrower output
    # The same operations, in the same order, as on whole arrays, a cache-sized chunk at a
    # time and in place: the bound of a 16.7M-element product is one float64 array, not five.
    flat, t_flat = bound.reshape(-1), np.asarray(truth).reshape(-1)
    step = 1 << 15
    with np.errstate(invalid="ignore"):
        for start in range(0, flat.size, step):
            chunk = flat[start : start + step]
            chunk += floor
            exact_mag = np.abs(t_flat[start : start + step].astype(np.float64))
            exact_mag /= 1 - u
            exact_mag *= u
            exact_mag += eta_out / 2
            if narrow:
                chunk *= 1 + u
                chunk += exact_mag
            chunk += exact_mag  # the truth's own rounding
    return bound


#: Assumed worst error of a backend's float32 exp, in ulp: XLA's and Sleef's vectorised exp are
#: documented/measured at about 1 ulp; 4 leaves room without hiding a real defect.
SOFTMAX_EXP_ULP = 4


def _u(dtype) -> float:
    return numerics.unit_roundoff(dtype)


def _smallest_normal(dtype) -> float:
    return float(ml_dtypes.finfo(numerics.as_dtype(dtype)).smallest_normal)


def _half_subnormal_step(dtype) -> float:
    fi = ml_dtypes.finfo(numerics.as_dtype(dtype))
    return float(fi.smallest_subnormal) / 2


def _softmax_sum_error(n: int, compute_dtype) -> float:
    """Relative error bound of the row sum: gamma_{n-1} of the compute dtype (any order)."""
    return float(numerics.gamma(max(n - 1, 0), compute_dtype))


def softmax_error_bound(
    x: np.ndarray, truth: np.ndarray, *, compute_dtype="float32", elementwise_dtype=None
) -> np.ndarray:
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
        rel = np.where(
            rel_s < 1.0, 1.01 * (eps + rel_s + u_e) / np.maximum(1.0 - rel_s, 1e-300), np.inf
        )
        y = np.abs(truth.astype(np.float64)) * (1 + 2 * _u(out_dt))
        y = np.where(np.isfinite(y), y, 0.0)
        # The truth is itself the exact value rounded once to the output dtype: another
        # u_o |y| + half a subnormal step between it and the exact result.
        return (
            (rel + u_o + _u(out_dt)) * y
            + _smallest_normal(compute_dtype)
            + 2 * _half_subnormal_step(out_dt)
        )


def softmax_ulp_tolerance(dtype, n: int, *, spread: float = 64.0, compute_dtype="float32") -> float:
    """ULPs of `dtype` a correct softmax over rows of n may be off, by the same worst case as
    `softmax_error_bound` for rows whose values span at most `spread` (|x_i - max| <= spread).

    In the normal range an error of relative size r is at most r / u_o ulp of the output dtype.
    """
    u = _u(compute_dtype)
    dt = numerics.as_dtype(dtype)
    rel_s = (
        _softmax_sum_error(n, compute_dtype) + 2 * SOFTMAX_EXP_ULP * u + u * min(n / math.e, spread)
    )
    if rel_s >= 1.0:
        return math.inf
    rel = 1.01 * (u * spread + 2 * SOFTMAX_EXP_ULP * u + rel_s + u) / (1.0 - rel_s)
    final = 0.0 if dt == numerics.as_dtype(compute_dtype) else 1.0
    return float(math.ceil(rel / _u(dt)) + final)


#: Assumed worst error of a backend's tanh in its compute dtype, in ulp (Sleef's and XLA's
#: vectorised float32 tanh are about 1 ulp; as for exp, 4 leaves room without hiding a defect).
GELU_TANH_ULP = 4


def gelu_error_bound(
    x: np.ndarray, truth: np.ndarray, *, compute_dtype="float32", elementwise_dtype=None
) -> np.ndarray:
    """Per-element bound on |gelu(x) - truth| for any implementation of the tanh-approximate
    GELU ``0.5 x (1 + tanh(z))``, z = k (x + a x^3), in the claimed arithmetic.

    Every op of the chain rounds in the compute dtype (unit roundoff u; `elementwise_dtype`,
    when given, is a narrower dtype every intermediate is stored in, as XLA does for a bf16
    chain with --xla_allow_excess_precision=false). First order, worst case:

    * z: x^2, x^3, a x^3, the sum, k (...), and the constants k and a: relative error
      th <= gamma_8(u);
    * t = tanh(z): `GELU_TANH_ULP` ulp (2 GELU_TANH_ULP u |t|), plus the error of z carried
      through: |z| th sech^2(|z| (1 - th)) (sech^2 is decreasing, so its value at the smaller
      end bounds the derivative over the interval);
    * s = 1 + t: u |s| more (no cancellation matters: the absolute error is what counts);
    * g = 0.5 x s: 0.5 |x| |error of s| + u |g|.

    The bound is 1.25 times that, plus the output's and the truth's roundings (one ulp of the
    output dtype at |truth| + bound), plus the compute dtype's smallest normal (flushed
    subnormals) and half the output dtype's subnormal step.

    Returns:
        float64 array of truth's shape.
    """
    x64 = np.abs(np.asarray(x).astype(np.float64))
    u = max(_u(compute_dtype), _u(elementwise_dtype) if elementwise_dtype is not None else 0.0)
    out_dt = numerics.as_dtype(truth.dtype)
    th = 8 * u / (1 - 8 * u)  # gamma_8(u)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        z = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
        t = np.tanh(z)
        sech2 = 1.0 / np.cosh(z * (1 - th)) ** 2
        e_t = 2 * GELU_TANH_ULP * u * t + z * th * sech2
        e_s = e_t + u * (1 + t + e_t)
        g = np.abs(truth.astype(np.float64))
        chain = 1.25 * (0.5 * x64 * e_s * (1 + u) + u * g)
        chain = np.where(np.isfinite(chain), chain, np.inf)
        top = np.where(np.isfinite(g), g, 0.0) + chain
        fi = ml_dtypes.finfo(out_dt)
        exponent = np.floor(np.log2(np.maximum(top, float(fi.smallest_normal))))
        ulp_out = np.exp2(exponent - int(fi.nmant))
        return chain + ulp_out + _smallest_normal(compute_dtype) + 2 * _half_subnormal_step(out_dt)
