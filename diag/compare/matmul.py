"""Matmul: one backend's product against the bound of float32 accumulation
(`tolerance.matmul_bound`), and two backends against `AGREEMENT_FACTOR` times it.
"""

from __future__ import annotations

from diag.compare.elementwise import agreement, compare, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome, _only_output
from diag.tolerance import tolerance

#: The claim every framework documents for matmul, also for bf16/fp16 inputs; the reason names it.
CLAIM = "float32 accumulation"


def evaluate(o: Outcome) -> Evaluation:
    """One backend's product against the correctly rounded truth; the bound is the context
    the agreement check reuses."""
    expected = o.truth.value
    output = _only_output(o, expected)
    tol = tolerance("matmul", expected.dtype)

    def bound_of_case():
        return tol.bound(o.inputs, expected, o.params)

    # The bound depends on the case alone (inputs, truth, claim): once per case, not per backend
    # (and, where it is slow to compute, once per cache: the name keys the stored copy).
    bound = o.shared(f"bound-{tol.claim}", bound_of_case) if o.shared else bound_of_case()
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim=CLAIM, setting=o.setting,
                           promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    """Two backends' products of one case, against what two backends keeping the bound may
    differ by. Returns (status, reason, metrics)."""
    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, CLAIM)
    return status, reason, metrics
