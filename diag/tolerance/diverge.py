"""diag.diverge's bounds and thresholds: what its verdicts are decided by (docs/diverge.md;
the rules that apply them are in diag/diverge/rules.py). Beside the op rows in `diag.tolerance`.
"""

from __future__ import annotations

import math

from diag import numerics
from diag.numerics import DTypeLike
from diag.tolerance import SOFTMAX_EXP_ULP

__all__ = [
    "DIVERGE_COMPOSITE_EXTRA_STEPS",
    "DIVERGE_LIBRARY_ULP",
    "DIVERGE_ROUNDED_ULP",
    "diverge_carried_threshold",
    "diverge_tap_allowance",
]

#: Own-error bound of a ``rounded`` op (add, mul, div, sqrt, casts), in ULPs of its output
#: dtype. IEEE 754 asks for 0.5 ULP; XLA rewrites a division by a broadcast value as a
#: multiplication by its reciprocal (two roundings, up to 1.5 ULP; 1.41 measured on XLA CPU),
#: and a bf16/fp16 op computed in float32 and rounded once more can land one neighbour away.
DIVERGE_ROUNDED_ULP = 2.0

#: Own-error bound of a ``library`` op (exp, log, tanh, erf, GELU), in ULPs. Measured on jax
#: 0.10.2 (XLA CPU), float32, 1e5 N(0, 3^2) inputs: erf 4.9 ULP, tanh 4.0, logistic 2.0, log
#: 1.1, exp 1.0 (bf16/fp16 are computed in float32 and rounded: <= 0.5). No library documents
#: a bound; 16 ULP (four times softmax's exp allowance) covers these with room for other CPUs.
DIVERGE_LIBRARY_ULP = max(16.0, 4.0 * SOFTMAX_EXP_ULP)

#: A ``composite`` op (a fused softmax or layer norm) may do as many steps as its longest
#: input axis plus this many elementwise steps around it: gamma_(m + 4) * max|r|.
DIVERGE_COMPOSITE_EXTRA_STEPS = 4


def diverge_carried_threshold(dtype: DTypeLike) -> float:
    """sqrt(u) of `dtype`: past it a value has lost half of its significand bits.

    A well-conditioned chain of k correctly rounded ops carries at most about k*u, so this
    allows u^(-1/2) such ops (4096 in float32, 16 in bfloat16, 45 in float16) in the worst case:
    only an ill-conditioned step (cancellation, overflow, a lost small addend) crosses it.
    """
    return math.sqrt(numerics.unit_roundoff(dtype))


def diverge_tap_allowance(dtype: DTypeLike) -> float:
    """u^(2/3) of `dtype` (float32 1.5e-5): what two correct implementations of one tap may
    differ by, normwise. Each is within about k*u of the truth, so the two within 2k*u: this
    allows u^(-1/3)/2 worst-case ops between them (128 in float32)."""
    return numerics.unit_roundoff(dtype) ** (2.0 / 3.0)
