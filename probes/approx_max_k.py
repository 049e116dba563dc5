"""approx_max_k: `jax.lax.approx_max_k` (JAX only), against the exact top-k at the recall the
caller promised.

On TPU it is approximate and was seen to return completely wrong results depending on
unrelated surrounding ops; elsewhere XLA's fallback is exact. Judged by top_k's code and truth
(`diag.probes.top_k`) with the promised `recall_target` as a mean over rows (a row below it
is a warn, a row missing its maximum a fail: `diag.tolerance`'s approx_max_k row).
"""

from __future__ import annotations

import math

from diag.plan.probe import (
    FLOATS,
    LOGIT_MAKERS,
    Probe,
    check_k,
    rows_bytes,
    rows_label,
    rows_shapes,
)
from diag.probes.top_k import agree, evaluate, truth


def validate(params: dict) -> str | None:
    bad_k = check_k(params)
    if bad_k:
        return bad_k
    target = params["recall_target"]
    if not math.isfinite(target) or not 0.0 < target <= 1.0:
        return f"recall_target must be a finite number in (0, 1], got {target}"
    override = params["reduction_input_size_override"]
    if override != -1 and override < params["n"]:
        return (
            f"reduction_input_size_override must be -1 (none) or >= n (n = {params['n']}), "
            f"got {override}"
        )
    return None


def on_jax(
    backend,
    k: int,
    recall_target: float = 0.95,
    aggregate_to_topk: bool = True,
    reduction_input_size_override: int = -1,
):
    """`jax.lax.approx_max_k`: approximate on TPU; elsewhere XLA's fallback (measured,
    jax 0.10.2: on CPU float32 the same TopK as `lax.top_k`, other dtypes a sort). With
    `aggregate_to_topk=False` it returns an implementation-defined number of candidates."""
    import jax

    def f(x):
        values, indices = jax.lax.approx_max_k(
            x,
            k,
            recall_target=recall_target,
            aggregate_to_topk=aggregate_to_topk,
            reduction_input_size_override=reduction_input_size_override,
        )
        return {"values": values, "indices": indices}

    return f


PROBE = Probe(
    op="approx_max_k",
    dims=("rows", "n"),
    params={
        "k": (int, None, 1),
        "recall_target": (float, None, 0.95),
        "aggregate_to_topk": (bool, None, True),
        "reduction_input_size_override": (int, None, -1),
    },
    op_args=("k", "recall_target", "aggregate_to_topk", "reduction_input_size_override"),
    dtypes=FLOATS,
    inputs=LOGIT_MAKERS,
    input_shapes=rows_shapes,
    truth=truth,
    truth_args=("k",),
    evaluate=evaluate,
    agree=agree,
    validate=validate,
    label=rows_label(
        "k",
        "recall_target",
        "aggregate_to_topk",
        "reduction_input_size_override",
        quiet={"reduction_input_size_override": -1},
    ),
    input_family="rows",
    host_bytes=rows_bytes,
    report_section="top-k",
    implementations={"jax": on_jax},
)
