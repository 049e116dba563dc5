"""The judging machinery every op shares: metrics, a verdict and its reason.

Each op's own `evaluate(outcome)` and `agree(a, b, names, context)` live in its module under
`probes/` (`diag.probes.<op>`); here is what several of them use: `elementwise` the
bound-based comparison (matmul, softmax, gelu), `topk` the top-k checks (top_k and
approx_max_k), `outcome` what a backend returned, `verdict` the one result type (`Verdict`,
with the `Mismatch` that broke the rule) and the one formatter of a mismatch that every
reason uses; the bounds themselves live in `diag.tolerance`. The truth is always an
argument: nothing here recomputes it.
"""

from diag.compare.elementwise import agree_values, agreement, compare, judge, judge_agreement
from diag.compare.outcome import Evaluation, MalformedOutput, Outcome
from diag.compare.topk import agree_top_k, check_top_k, describe_topk_semantics, judge_top_k
from diag.compare.verdict import Mismatch, Verdict, format_index, format_mismatch

__all__ = [
    "Evaluation",
    "MalformedOutput",
    "Mismatch",
    "Outcome",
    "Verdict",
    "agree_top_k",
    "agree_values",
    "agreement",
    "check_top_k",
    "compare",
    "describe_topk_semantics",
    "format_index",
    "format_mismatch",
    "judge",
    "judge_agreement",
    "judge_top_k",
]
