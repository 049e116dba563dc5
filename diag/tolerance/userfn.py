"""What a user's function may differ by from its float64 evaluation (`diag.userfn`).

A user's function has no textbook error bound: diag does not know its condition number. What
it knows is the dtype each output is computed in, and one fact about floating point: a chain
of k correctly rounded ops on well-conditioned data carries a normwise error of about k*u
(u the unit roundoff). The allowance is the same threshold `diag.diverge` applies to the
error a value carries (`diverge_carried_threshold`), so a failing output and the first
divergent op `diag.diverge.shadow` names are decided by one rule.
"""

from __future__ import annotations

from diag.numerics import DTypeLike
from diag.tolerance import AGREEMENT_FACTOR
from diag.tolerance.diverge import diverge_carried_threshold

__all__ = ["userfn_agreement_allowance", "userfn_output_allowance"]


def userfn_output_allowance(dtype: DTypeLike) -> float:
    """sqrt(u) of the output's dtype: the normwise relative error (max |y - r| / max |r|)
    an output of a user's function may carry against its float64 evaluation r.

    Derivation: k correctly rounded ops carry at most about k*u on well-conditioned data, so
    sqrt(u) admits u^(-1/2) of them in the worst case (4096 in float32, 16 in bfloat16, 45 in
    float16; errors of independent roundings grow like sqrt(k)*u in practice, so far more). Only
    an ill-conditioned step crosses it: a cancellation (a variance as E[x^2] - E[x]^2 on offset
    data), a small addend lost to a large sum, an accumulation done in a narrower dtype than the
    output's. A half-lost significand is what a user asks diag to catch; a function whose math
    is itself ill-conditioned fails too, and the reason names the op where it happens.
    """
    return diverge_carried_threshold(dtype)


def userfn_agreement_allowance(dtype: DTypeLike) -> float:
    """What two backends' outputs may differ by, normwise: each is within
    `userfn_output_allowance` of the float64 evaluation, so the two within twice that
    (`AGREEMENT_FACTOR`)."""
    return AGREEMENT_FACTOR * userfn_output_allowance(dtype)
