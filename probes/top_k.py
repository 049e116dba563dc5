"""top_k: `jax.lax.top_k` / `torch.topk` over the last axis, against the exact top-k.

Row: [rows, n] logits and k. Truth: `diag.oracle.top_k_result`, the exact top-k in diag's
total order (NaN above +inf, -0 equal to +0, lower index first among equals). Tolerance:
`diag.tolerance`'s top_k row (recall `TOPK_EXACT_RECALL` in every row, by value). The
checking machinery is shared with approx_max_k (`diag.compare.topk`).
"""

from __future__ import annotations

import numpy as np

from diag import oracle
from diag.compare.outcome import Evaluation, MalformedOutput, Outcome
from diag.compare.topk import agree_top_k, check_top_k, judge_top_k, top_k_mismatch
from diag.compare.verdict import Verdict
from diag.plan.probe import (
    FLOATS,
    LOGIT_MAKERS,
    Probe,
    check_k,
    rows_bytes,
    rows_label,
    rows_shapes,
)


def truth(inputs: list, params: dict, cache):
    (x,) = inputs
    return oracle.top_k_result(x, params["k"], cache=cache)


def top_k_outputs(o: Outcome) -> tuple[np.ndarray, np.ndarray]:
    """`values` and `indices`, checked for shape and dtype before they are judged.

    Raises:
      MalformedOutput: a missing output, or shapes that are not [rows..., k] (with
        `aggregate_to_topk=False` the candidate count is the implementation's, so only the
        leading dimensions are checked), or values of another dtype than the input.
    """
    from diag import numerics

    out = o.named
    missing = [n for n in ("values", "indices") if n not in out]
    if missing:
        raise MalformedOutput(
            f"no {' or '.join(missing)} output (got: {', '.join(o.names) or 'no outputs'})"
        )
    values, indices = out["values"], out["indices"]
    x, k = o.inputs[0], o.params["k"]
    want = list(x.shape[:-1]) + [k]
    exact = o.params.get("aggregate_to_topk", True)
    if (
        values.shape != indices.shape
        or list(values.shape[:-1]) != want[:-1]
        or (exact and values.shape[-1] != k)
        or values.shape[-1] < 1
    ):
        raise MalformedOutput(
            f"returned values{list(values.shape)} and indices"
            f"{list(indices.shape)}, expected {want} each"
        )
    if values.dtype != x.dtype:
        raise MalformedOutput(
            f"returned {numerics.dtype_name(values.dtype)} values for "
            f"{numerics.dtype_name(x.dtype)} inputs"
        )
    return values, indices


def evaluate(o: Outcome) -> Evaluation:
    """One backend's (approximate) top-k against the exact top-k the runner computed."""
    values, indices = top_k_outputs(o)
    target = o.params.get("recall_target")
    # The truth flows forward: the exact top-k the runner computed (and cached), never again.
    truth = (o.truth.value, o.truth.extra["indices"])
    metrics = check_top_k(
        o.inputs[0], values, indices, o.params["k"], recall_target=target, truth=truth
    )
    approx = target is not None
    status, reason = judge_top_k(metrics, approx=approx, recall_target=target)
    return Evaluation(status, reason, metrics, mismatch=top_k_mismatch(metrics, approx=approx))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' top-k of one case, by value."""
    return agree_top_k(a.inputs[0], top_k_outputs(a), top_k_outputs(b), a.params["k"], names)


def on_jax(backend, k: int):
    """`jax.lax.top_k`: the k largest along the last axis, values and indices."""
    import jax

    def f(x):
        values, indices = jax.lax.top_k(x, k)
        return {"values": values, "indices": indices}

    return f


def on_torch(backend, k: int):
    """`torch.topk`: the k largest along the last axis (sorted), values and indices."""
    import torch

    def f(x):
        values, indices = torch.topk(x, k, dim=-1)
        return {"values": values, "indices": indices}

    return f


PROBE = Probe(
    op="top_k",
    dims=("rows", "n"),
    params={"k": (int, None, 1)},
    op_args=("k",),
    dtypes=FLOATS,
    inputs=LOGIT_MAKERS,
    input_shapes=rows_shapes,
    truth=truth,
    truth_args=("k",),
    evaluate=evaluate,
    agree=agree,
    validate=check_k,
    label=rows_label("k"),
    input_family="rows",
    host_bytes=rows_bytes,
    report_section="top-k",
    implementations={"jax": on_jax, "torch": on_torch},
)
