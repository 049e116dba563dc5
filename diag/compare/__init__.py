"""Compare a backend's output with the ground truth: metrics, a verdict and its reason.

One module per op family (`matmul`, `softmax`, `topk`, `greedy`, `train`), each with the
probe table's `evaluate(outcome)` and `agree(a, b, names, context)`; `elementwise` holds the
bound-based comparison matmul and softmax share; `verdict` the one result type (`Verdict`,
with the `Mismatch` that broke the rule) and the one formatter of a mismatch that every
family's reason uses; the bounds themselves live in `diag.tolerance`. The truth is always an
argument: nothing here recomputes it.
"""

from diag.compare.elementwise import agree_values, agreement, compare, judge, judge_agreement
from diag.compare.greedy import agree_tokens, check_greedy, judge_greedy
from diag.compare.outcome import Evaluation, MalformedOutput, Outcome
from diag.compare.softmax import compare_softmax, judge_softmax
from diag.compare.topk import agree_top_k, check_top_k, describe_topk_semantics, judge_top_k
from diag.compare.train import agree_train_step, compare_train_step, judge_train_step
from diag.compare.verdict import Mismatch, Verdict, format_index, format_mismatch

__all__ = [
    "Evaluation",
    "MalformedOutput",
    "Mismatch",
    "Outcome",
    "Verdict",
    "agree_tokens",
    "agree_top_k",
    "agree_train_step",
    "agree_values",
    "agreement",
    "check_greedy",
    "check_top_k",
    "compare",
    "compare_softmax",
    "compare_train_step",
    "describe_topk_semantics",
    "format_index",
    "format_mismatch",
    "judge",
    "judge_agreement",
    "judge_greedy",
    "judge_softmax",
    "judge_top_k",
    "judge_train_step",
]
