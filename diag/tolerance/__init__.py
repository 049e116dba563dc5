"""Every bound, ULP screen and agreement factor diag judges by, in one place.

A verdict is only as good as the tolerance behind it, so each number here carries its
derivation (a textbook bound, Higham's gamma_k) or the measurement that set it, next to it.
Where theory gives a bound, the bound decides and no constant is tuned; where it does not (a
whole training step), the number is a screen and says so. `tolerance(op, dtype, claim)` looks
them up by op, as JAX's test utilities look up theirs by dtype; the comparison code in
`diag.compare` takes its numbers from here and defines none of its own.

The table, one line per op (the bounds, derived, in `diag.tolerance.bounds`; docs/oracle.md):

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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from diag import numerics
from diag.errors import UsageError
from diag.numerics import DTypeLike
from diag.tolerance.bounds import (
    GELU_TANH_ULP,
    SOFTMAX_EXP_ULP,
    gelu_error_bound,
    matmul_bound,
    matmul_error_bound,
    softmax_error_bound,
    softmax_ulp_tolerance,
)

__all__ = [
    "AGREEMENT_FACTOR",
    "GELU_TANH_ULP",
    "SOFTMAX_EXP_ULP",
    "TOPK_EXACT_RECALL",
    "TRAIN_LOSS_ULP_SCREEN",
    "TRAIN_RUN_RTOL",
    "TRAIN_REFERENCE_ERROR_FACTOR",
    "train_run_allowed",
    "Tolerance",
    "tolerance",
    "matmul_error_bound",
    "matmul_bound",
    "softmax_error_bound",
    "softmax_ulp_tolerance",
    "gelu_error_bound",
]

#: Two backends that each keep a bound b of the same truth differ by at most 2 b (triangle
#: inequality: |x - y| <= |x - t| + |t - y|). Agreement checks allow this factor, never more.
AGREEMENT_FACTOR = 2

#: An exact top-k returns the k largest values: recall 1 in every row. Recall counts VALUES
#: (which of several equal values was chosen never lowers it; -0 equals +0), so ties in bf16
#: logits, which are common, are not errors.
TOPK_EXACT_RECALL = 1.0


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
            raise UsageError(
                f"{self.op} has no ULP tolerance; it is judged by "
                f"{'its bound' if self.bound else 'structure'}"
            )
        return self.agreement_factor * self.ulp(params)


def _matmul(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "matmul",
        dtype,
        claim,
        why=f"gamma_K({claim}) |A||B| + the output's and the truth's roundings",
        bound=partial(matmul_bound, compute_dtype=claim),
    )


def _softmax(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "softmax",
        dtype,
        claim,
        why=(
            f"worst case of {claim} arithmetic in any summation order, exp within "
            f"{SOFTMAX_EXP_ULP} ulp"
        ),
        bound=partial(softmax_error_bound, compute_dtype=claim),
        loose_bound=partial(softmax_error_bound, compute_dtype=claim, elementwise_dtype=dtype),
        ulp=lambda params: softmax_ulp_tolerance(dtype, params["n"], compute_dtype=claim),
    )


def _gelu(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "gelu",
        dtype,
        claim,
        why=(
            f"worst case of the chain's roundings in {claim}, tanh within {GELU_TANH_ULP} "
            f"ulp, carried through tanh's slope; + the output's and the truth's roundings"
        ),
        bound=partial(gelu_error_bound, compute_dtype=claim),
        loose_bound=partial(gelu_error_bound, compute_dtype=claim, elementwise_dtype=dtype),
    )


def _top_k(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "top_k",
        dtype,
        claim,
        recall=TOPK_EXACT_RECALL,
        why="exact: the k largest values in every row (ties by value)",
    )


def _approx_max_k(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "approx_max_k",
        dtype,
        claim,
        why="the recall_target the caller promised, as a mean over rows; "
        "a row below it is a warn, a row missing its maximum a fail",
    )


def _greedy(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "greedy_token",
        dtype,
        claim,
        why="the exact argmax, except where the correctly rounded "
        "probabilities of the top two are equal",
    )


def _train(dtype: str, claim: str) -> Tolerance:
    return Tolerance(
        "train_step",
        dtype,
        claim,
        why=f"finite where the float64 reference is; loss within "
        f"{TRAIN_LOSS_ULP_SCREEN} ULP (a measured screen, not a bound)",
        ulp=lambda params: float(TRAIN_LOSS_ULP_SCREEN),
    )


def _train_run(dtype: str, claim: str) -> Tolerance:
    # `claim` is the compute dtype of the run (bf16 mixed precision: bfloat16).
    rtol = TRAIN_RUN_RTOL.get(claim, TRAIN_RUN_RTOL["float32"])
    kind = "derived and measured" if claim == "float32" else "a measured drift screen"
    return Tolerance(
        "train",
        dtype,
        claim,
        why=(
            f"per step and tensor, relative to the float64 reference: loss "
            f"{rtol['loss']:g}, gradients {rtol['grad']:g}, parameter updates "
            f"{rtol['update']:g} ({kind})"
        ),
    )


_TABLE: dict[str, Callable[[str, str], Tolerance]] = {
    "matmul": _matmul,
    "softmax": _softmax,
    "gelu": _gelu,
    "top_k": _top_k,
    "approx_max_k": _approx_max_k,
    "greedy_token": _greedy,
    "train_step": _train,
    "train": _train_run,
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
