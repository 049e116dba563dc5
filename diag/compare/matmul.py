"""Matmul: one backend's product against the bound of float32 accumulation
(`tolerance.matmul_bound`), and two backends against `AGREEMENT_FACTOR` times it.
"""

from __future__ import annotations

import functools

from diag.compare.elementwise import agreement, compare, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome, _only_output
from diag.tolerance import tolerance

#: The claim every framework documents for matmul, also for bf16/fp16 inputs; the reason names it.
CLAIM = "float32 accumulation"


def evaluate(o: Outcome) -> Evaluation:
    """One backend's product against the correctly rounded truth; the context the agreement
    check reuses is the function that returns the bound (computed at most once)."""
    expected = o.truth.value
    output = _only_output(o, expected)
    tol = tolerance("matmul", expected.dtype)

    def bound_of_case():
        return tol.bound(o.inputs, expected, o.params)

    @functools.cache
    def bound():
        # The bound depends on the case alone (inputs, truth, claim): once per case, not per
        # backend (and, where it is slow to compute, once per cache: the name keys the stored
        # copy); not at all where every comparison that needs it is remembered.
        return o.shared(f"bound-{tol.claim}", bound_of_case) if o.shared else bound_of_case()

    metrics = o.remembered(f"compare-{tol.claim}", lambda: compare(output, expected, bound()))
    status, reason = judge(metrics, claim=CLAIM, setting=o.setting,
                           promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    """Two backends' products of one case, against what two backends keeping the bound may
    differ by (`context`: the bound, or the function `evaluate` gives that returns it).
    Returns (status, reason, metrics)."""
    def compute():
        return agreement(a.outputs[0], b.outputs[0], context() if callable(context) else context)

    claim = tolerance("matmul", a.truth.value.dtype).claim
    metrics = b.remembered(f"agreement-{claim}", compute, a)
    status, reason = judge_agreement(metrics, *names, CLAIM)
    return status, reason, metrics
