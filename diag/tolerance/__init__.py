"""Every bound, ULP screen and agreement factor diag judges by, in one place.

A verdict is only as good as the tolerance behind it, so each number here carries its
derivation (a textbook bound, Higham's gamma_k) or the measurement that set it, next to it.
Where theory gives a bound, the bound decides and no constant is tuned; where it does not (a
whole training step), the number is a screen and says so. `tolerance(op, dtype, claim)` looks
them up by op, as JAX's test utilities look up theirs by dtype; the comparison code in
`diag.compare` takes its numbers from here and defines none of its own.

The table, one line per op (details in the functions and in docs/oracle.md):

* matmul: `matmul_bound`: gamma_K of the claimed accumulation dtype times |A||B| (the bound
  `matmul_error_bound` that tests/test_numerics.py proves), plus float32 underflow and the
  output's and the truth's roundings.
* softmax: `softmax_error_bound` (worst case of float32 arithmetic in any summation order,
  exp within `SOFTMAX_EXP_ULP`), and its ULP form `softmax_ulp_tolerance` for agreement.
* gelu (tanh approximation): `gelu_error_bound`, the chain's roundings in float32 with tanh
  within `GELU_TANH_ULP` ulp; its bf16-intermediates form is the loose bound (a warn).
* top_k: recall `TOPK_EXACT_RECALL` (1, by value) in every row; approx_max_k: the recall the
  caller promised, as a mean over rows (rows below it are a warn).
* greedy_token: the exact argmax, except where the correctly rounded probabilities of the top
  two are equal (no implementation can tell them apart).
* train_step: the loss within `TRAIN_LOSS_ULP_SCREEN` ULP of the float64 reference (a screen).
* train: per step, the loss, each gradient and each parameter update within `TRAIN_RUN_RTOL`
  of the float64 reference (relative, per tensor): derived for float32, measured for bf16.
* every pair of backends: `AGREEMENT_FACTOR` times what one backend is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import ml_dtypes
import numpy as np

from diag import numerics
from diag.errors import UsageError
from diag.numerics import DTypeLike, gamma

__all__ = ["AGREEMENT_FACTOR", "GELU_TANH_ULP", "SOFTMAX_EXP_ULP", "TOPK_EXACT_RECALL",
           "TRAIN_LOSS_ULP_SCREEN", "TRAIN_RUN_RTOL", "TRAIN_REFERENCE_ERROR_FACTOR",
           "train_run_allowed",
           "Tolerance", "tolerance", "matmul_error_bound", "matmul_bound",
           "softmax_error_bound", "softmax_ulp_tolerance", "gelu_error_bound"]

#: Two backends that each keep a bound b of the same truth differ by at most 2 b (triangle
#: inequality: |x - y| <= |x - t| + |t - y|). Agreement checks allow this factor, never more.
AGREEMENT_FACTOR = 2

#: An exact top-k returns the k largest values: recall 1 in every row. Recall counts VALUES
#: (which of several equal values was chosen never lowers it; -0 equals +0), so ties in bf16
#: logits, which are common, are not errors.
TOPK_EXACT_RECALL = 1.0


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
    bound = a64 @ b64
    bound *= gamma(k, compute_dtype) * (1.0 + gamma(k + 1, np.float64))  # in place: no copy
    return bound


def matmul_bound(inputs: list[np.ndarray], truth: np.ndarray, params: dict | None = None,
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
            chunk = flat[start:start + step]
            chunk += floor
            exact_mag = np.abs(t_flat[start:start + step].astype(np.float64))
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


#: Assumed worst error of a backend's tanh in its compute dtype, in ulp (Sleef's and XLA's
#: vectorised float32 tanh are about 1 ulp; as for exp, 4 leaves room without hiding a defect).
GELU_TANH_ULP = 4


def gelu_error_bound(x: np.ndarray, truth: np.ndarray, *, compute_dtype="float32",
                     elementwise_dtype=None) -> np.ndarray:
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
        z = 0.7978845608028654 * (x64 + 0.044715 * x64 ** 3)
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
        return (chain + ulp_out + _smallest_normal(compute_dtype)
                + 2 * _half_subnormal_step(out_dt))


#: A screen, not a bound: no textbook bound covers a whole step (tanh, exp, log of sums of
#: sums). Measured on CPU (64x256x16 MLP), jax and torch land 0 ULP from the float64
#: reference's loss in fp32, bf16 and fp16; 64 ULP is far outside that and far inside a broken
#: step.
TRAIN_LOSS_ULP_SCREEN = 64


#: The `train` probe (N AdamW steps of a small transformer, `diag.train`): per step and per
#: tensor, how far from the float64 reference (relative: |x - ref| / |ref| for the loss,
#: ||g - g_ref|| / ||g_ref|| per gradient tensor, ||p - p_ref|| / ||p_ref - p_0|| per
#: parameter tensor, i.e. of the distance the parameters travelled). Keys: compute dtype,
#: then `loss`, `grad`, `update`.
#: float32: first-order error analysis gives ~ c * u32 (u32 = 6e-8) with c of the order of the
#: longest dot product (K = 4 * width = 256) times a condition number of a few: ~1e-5 for a
#: gradient; the loss is a mean of B * S terms, so ~1e-6. Measured (2 layers, width 64,
#: 8-32 steps, two seeds, jax-cpu and torch-cpu, against the reference and each other):
#: loss <= 5e-7, grads <= 1.6e-5: the rows give 20x and 6x (x2 between backends). Updates have no
#: such bound: Adam's first update is lr * g / (|g| + eps)
#: per element, whose sensitivity to a gradient error reaches 1 / (4 eps) for |g| near eps,
#: so elements with tiny gradients turn their rounding into update error; measured <= 6e-4
#: (at step 0, seed and init dependent), the row gives ~15x. The planted porting bugs move step 0's
#: loss, gradients or updates by 10x or more beyond these rows (tests/test_train_ports.py).
#: bfloat16 (bf16 compute, float32 master weights): no useful bound (u_bf16 = 3.9e-3 and
#: errors compound through the run); a measured screen. Measured as above: loss <= 6e-4,
#: grads <= 0.13, updates <= 0.35 (both frameworks); the screen is ~3x that. A bf16 record
#: inside it passes with its drift in the reason; outside, it warns (drift larger than two
#: correct bf16 runs show here), never fails: bf16 is expected to drift.
TRAIN_RUN_RTOL: dict[str, dict[str, float]] = {
    "float32": {"loss": 1e-5, "grad": 1e-4, "update": 1e-2},
    "bfloat16": {"loss": 2e-3, "grad": 0.5, "update": 1.0},
}

#: The float64 reference's own error in a `train` run, estimated per step from a float32
#: run's: the same dynamics amplify float64's rounding, 2**-29 (= u64 / u32) times float32's
#: (docs/train.md).
TRAIN_REFERENCE_ERROR_FACTOR = 2.0**-29


def train_run_allowed(compute: str, factor: float = 1.0) -> dict[str, float]:
    """What a `train` run in `compute` may differ by, per stage (`TRAIN_RUN_RTOL`; a compute
    dtype without a row is held to float32's), times `factor` (`AGREEMENT_FACTOR` for two
    backends)."""
    rtol = TRAIN_RUN_RTOL.get(compute, TRAIN_RUN_RTOL["float32"])
    return {k: factor * v for k, v in rtol.items()}


# ---------------------------------------------------------------------------------------------
# The lookup


@dataclass(frozen=True)
class Tolerance:
    """What one op's output is allowed, for one dtype and one claimed arithmetic.

    Attributes:
      op: the probe's op name.
      dtype: the input/output dtype (canonical name).
      claim: the arithmetic the backend claims: its accumulation / compute dtype.
      bound: per-element bound on |output - truth| (matmul: (inputs, truth); softmax:
        (x, truth)), or None where the op is judged by structure, not by size.
      loose_bound: softmax only: the bound when x - max, exp and the division run in the input
        dtype (between it and `bound` a result is a warn: less precise than claimed).
      ulp: ULPs allowed as a function of the case parameters (softmax: of the row length;
        train_step: the loss screen), or None.
      recall: the recall every row must reach (exact top-k: 1), or None where the caller's
        promised recall applies (approx_max_k) or recall does not apply.
      agreement_factor: how many times one backend's allowance two backends may differ by.
      why: the derivation or measured cause, in a line.
    """

    op: str
    dtype: str
    claim: str
    why: str
    bound: Callable[..., np.ndarray] | None = None
    loose_bound: Callable[..., np.ndarray] | None = None
    ulp: Callable[[dict], float] | None = None
    recall: float | None = None
    agreement_factor: float = AGREEMENT_FACTOR

    def agreement_ulp(self, params: dict) -> float:
        """ULPs two correct backends may differ by: `agreement_factor` times `ulp`."""
        if self.ulp is None:
            raise UsageError(f"{self.op} has no ULP tolerance; it is judged by "
                             f"{'its bound' if self.bound else 'structure'}")
        return self.agreement_factor * self.ulp(params)


def _matmul(dtype: str, claim: str) -> Tolerance:
    return Tolerance("matmul", dtype, claim,
                     why=f"gamma_K({claim}) |A||B| + the output's and the truth's roundings",
                     bound=partial(matmul_bound, compute_dtype=claim))


def _softmax(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "softmax", dtype, claim,
        why=(f"worst case of {claim} arithmetic in any summation order, exp within "
             f"{SOFTMAX_EXP_ULP} ulp"),
        bound=partial(softmax_error_bound, compute_dtype=claim),
        loose_bound=partial(softmax_error_bound, compute_dtype=claim, elementwise_dtype=dtype),
        ulp=lambda params: softmax_ulp_tolerance(dtype, params["n"], compute_dtype=claim))


def _gelu(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "gelu", dtype, claim,
        why=(f"worst case of the chain's roundings in {claim}, tanh within {GELU_TANH_ULP} "
             f"ulp, carried through tanh's slope; + the output's and the truth's roundings"),
        bound=partial(gelu_error_bound, compute_dtype=claim),
        loose_bound=partial(gelu_error_bound, compute_dtype=claim, elementwise_dtype=dtype))


def _top_k(dtype: str, claim: str) -> Tolerance:
    return Tolerance("top_k", dtype, claim, recall=TOPK_EXACT_RECALL,
                     why="exact: the k largest values in every row (ties by value)")


def _approx_max_k(dtype: str, claim: str) -> Tolerance:
    return Tolerance("approx_max_k", dtype, claim,
                     why="the recall_target the caller promised, as a mean over rows; "
                         "a row below it is a warn, a row missing its maximum a fail")


def _greedy(dtype: str, claim: str) -> Tolerance:
    return Tolerance("greedy_token", dtype, claim,
                     why="the exact argmax, except where the correctly rounded "
                         "probabilities of the top two are equal")


def _train(dtype: str, claim: str) -> Tolerance:
    return Tolerance("train_step", dtype, claim,
                     why=f"finite where the float64 reference is; loss within "
                         f"{TRAIN_LOSS_ULP_SCREEN} ULP (a measured screen, not a bound)",
                     ulp=lambda params: float(TRAIN_LOSS_ULP_SCREEN))


def _train_run(dtype: str, claim: str) -> Tolerance:
    # `claim` is the compute dtype of the run (bf16 mixed precision: bfloat16).
    rtol = TRAIN_RUN_RTOL.get(claim, TRAIN_RUN_RTOL["float32"])
    kind = "derived and measured" if claim == "float32" else "a measured drift screen"
    return Tolerance("train", dtype, claim,
                     why=(f"per step and tensor, relative to the float64 reference: loss "
                          f"{rtol['loss']:g}, gradients {rtol['grad']:g}, parameter updates "
                          f"{rtol['update']:g} ({kind})"))


_TABLE: dict[str, Callable[[str, str], Tolerance]] = {
    "matmul": _matmul, "softmax": _softmax, "gelu": _gelu, "top_k": _top_k,
    "approx_max_k": _approx_max_k,
    "greedy_token": _greedy, "train_step": _train, "train": _train_run,
}


def tolerance(op: str, dtype: DTypeLike, claim: DTypeLike = "float32") -> Tolerance:
    """What `op` on `dtype` is allowed when the backend claims `claim` arithmetic.

    Args:
      op: a probe's op name (`matmul`, `softmax`, `top_k`, `approx_max_k`, `greedy_token`,
        `train_step`).
      dtype: the dtype of the op's inputs and outputs.
      claim: the accumulation / compute dtype the backend claims (float32 for every dtype
        diag runs, as every framework documents).

    Returns:
      The op's `Tolerance`.

    Raises:
      UsageError: an op without a tolerance, or a dtype diag does not handle.
    """
    if op not in _TABLE:
        raise UsageError(f"no tolerance for op {op!r}; expected one of {', '.join(_TABLE)}")
    return _TABLE[op](numerics.dtype_name(dtype), numerics.dtype_name(claim))
