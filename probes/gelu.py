"""gelu (tanh approximation), a bf16 elementwise chain (a transformer MLP's activation):
where XLA may keep intermediates in float32 or round each one
(--xla_allow_excess_precision). Truth: `diag.oracle.gelu_result`, correctly rounded.

One backend's output against the bound of float32 arithmetic
(`tolerance.gelu_error_bound`), and two backends against `AGREEMENT_FACTOR` times it.

Between the float32 bound and the same bound with every intermediate stored in the input
dtype (`Tolerance.loose_bound`) a result is a `warn`: what a bf16 chain computes when each op
is rounded to bf16 (XLA with --xla_allow_excess_precision=false), less precise than claimed
but not broken. Beyond both it is a `fail`.
"""

from __future__ import annotations

import math

import numpy as np

from diag import oracle
from diag.compare.elementwise import agreement, compare, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome, only_output
from diag.compare.verdict import Verdict
from diag.plan.probe import FLOATS, Probe, rows_bytes, rows_label, rows_shapes
from diag.status import Status
from diag.tolerance import tolerance

CLAIM = "float32 arithmetic"


def evaluate(o: Outcome) -> Evaluation:
    """One backend's GELU against the correctly rounded truth; the bound is the context the
    agreement check reuses."""
    expected = o.truth.value
    output = only_output(o, expected)
    tol = tolerance("gelu", expected.dtype)
    assert tol.bound is not None  # the op's row sets it
    bound = tol.bound(o.inputs[0], expected)
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim=CLAIM, setting=o.setting, promised=o.promised)
    if status == Status.FAIL and not metrics["unexpected_nonfinite"]:
        assert tol.loose_bound is not None  # the op's row sets it
        loose = tol.loose_bound(o.inputs[0], expected)
        narrow = np.dtype(expected.dtype).name
        loose_ratio = float(
            np.max(np.abs(output.astype(np.float64) - expected.astype(np.float64)) / loose)
        )
        metrics["narrow_bound_ratio"] = loose_ratio
        if loose_ratio <= 1.0:
            status, reason = (
                Status.WARN,
                (
                    f"{reason}; consistent with every intermediate rounded "
                    f"to {narrow} (worst {loose_ratio:.2g}x that bound): less "
                    f"precise than {CLAIM}"
                ),
            )
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' GELU of one case, against what two backends keeping the bound may differ
    by."""
    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, CLAIM)
    return Verdict(status, reason, metrics)


def truth(inputs: list, params: dict, cache):
    return oracle.gelu_result(*inputs, cache=cache)


def on_jax(backend):
    """`jax.nn.gelu(approximate=True)`: the tanh approximation, in the input dtype."""
    import jax

    return lambda x: jax.nn.gelu(x, approximate=True)


def on_torch(backend):
    """The tanh-approximate GELU written out op by op, as models write it (Hugging Face's
    `NewGELUActivation`, GPT-2's MLP), in the input dtype: eager torch rounds each op's result
    to it; a compiler (torch_xla) may keep the chain in float32. (torch's fused
    `F.gelu(approximate='tanh')` computes in float32 on CPU and, under torch_xla 2.9 on CPU,
    is unchanged by --xla_allow_excess_precision=false: measured.)"""
    import torch

    k = math.sqrt(2.0 / math.pi)
    return lambda x: 0.5 * x * (1.0 + torch.tanh(k * (x + 0.044715 * torch.pow(x, 3.0))))


PROBE = Probe(
    op="gelu",
    dims=("rows", "n"),
    params={},
    op_args=(),
    dtypes=FLOATS,
    inputs=("normal", "normal5", "uniform"),
    input_shapes=rows_shapes,
    truth=truth,
    evaluate=evaluate,
    agree=agree,
    label=rows_label(),
    input_family="rows",
    host_bytes=rows_bytes,
    implementations={"jax": on_jax, "torch": on_torch},
)
