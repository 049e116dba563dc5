"""Matmul: one backend's product against the bound of float32 accumulation, and two backends
against twice it.
"""

from __future__ import annotations

from diag.compare.outcome import Evaluation, Outcome, _only_output
from diag.tolerance import tolerance
from diag.compare.elementwise import agreement, compare, judge, judge_agreement


def evaluate(o: Outcome) -> Evaluation:
    expected = o.truth.value
    output = _only_output(o, expected)
    bound = tolerance("matmul", expected.dtype).bound(o.inputs, expected, o.params)
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim="float32 accumulation", setting=o.setting,
                           promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound)


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, "float32 accumulation")
    return status, reason, metrics
