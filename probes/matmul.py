"""matmul: `a @ b` (batched), judged against the bound of float32 accumulation.

Row: dims m, k, n (and an optional batch), a precision setting given per op or by the
process-wide config. Truth: `diag.oracle.matmul_result`, the correctly rounded product.
Tolerance: `diag.tolerance`'s matmul row (`matmul_bound`: gamma_K of the claimed accumulation
dtype times |A||B|); two backends may differ by `AGREEMENT_FACTOR` times it. The arithmetic of
this op is what diag fingerprints (`fingerprint=True`).
"""

from __future__ import annotations

import functools
import math

from diag import oracle
from diag.compare.elementwise import agreement, compare, judge, judge_agreement, mismatch
from diag.compare.outcome import Evaluation, Outcome, only_output
from diag.compare.verdict import Verdict
from diag.plan.probe import F64, FLOATS, Probe
from diag.tolerance import tolerance

#: The claim every framework documents for matmul, also for bf16/fp16 inputs; the reason names it.
CLAIM = "float32 accumulation"
PRECISIONS = ("default", "high", "highest", "medium")
PRECISION_VIA = ("argument", "config")
# Peak host memory in float64 copies of the inputs and of the output, rounded up from measured
# peaks (numpy 2, float32, VmHWM): [16,32768,16] 4.0 and [64,65536,64] 2.7 input copies;
# [1024,4,1024] 3.2, [2048,4,2048] 2.3 and [4096,4,4096] 2.1 output copies since judging
# streams (12.7 before). The estimates are 1.1-2.9x those peaks; `tests/test_suite.py`
# checks that the estimate stays above a measured peak.
MATMUL_INPUT_COPIES = 6
MATMUL_OUTPUT_COPIES = 6


def input_shapes(params: dict) -> list[tuple[int, ...]]:
    batch = tuple(params.get("batch", ()))
    m, k, n = params["m"], params["k"], params["n"]
    return [batch + (m, k), batch + (k, n)]


def host_bytes(params: dict) -> int:
    # Inputs: float64 draws, the stored arrays and the oracle's/bound's float64 copies and
    # splits. Outputs: the truth, |A||B|, the bound, the loaded output and compare's arrays.
    batch = math.prod(params.get("batch", ()))
    m, k, n = params["m"], params["k"], params["n"]
    return F64 * batch * (MATMUL_INPUT_COPIES * (m * k + k * n) + MATMUL_OUTPUT_COPIES * m * n)


def label(params: dict) -> str:
    text = f"{params['m']}x{params['k']}x{params['n']} {params['dtype']}"
    if params.get("precision", "default") != "default":
        text += f" precision={params['precision']} via={params['precision_via']}"
    return text


def normalize(params: dict) -> dict:
    # 'default' touches no setting, so how it would be passed does not matter: one case.
    if params["precision"] == "default":
        params["precision_via"] = "none"
    return params


def truth(inputs: list, params: dict, cache):
    return oracle.matmul_result(*inputs, cache=cache)


def evaluate(o: Outcome) -> Evaluation:
    """One backend's product against the correctly rounded truth; the context the agreement
    check reuses is the function that returns the bound (computed at most once)."""
    expected = o.truth.value
    output = only_output(o, expected)
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
    status, reason = judge(metrics, claim=CLAIM, setting=o.setting, promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound, mismatch=mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' products of one case, against what two backends keeping the bound may
    differ by (`context`: the bound, or the function `evaluate` gives that returns it)."""

    def compute():
        return agreement(a.outputs[0], b.outputs[0], context() if callable(context) else context)

    claim = tolerance("matmul", a.truth.value.dtype).claim
    metrics = b.remembered(f"agreement-{claim}", compute, a)
    status, reason = judge_agreement(metrics, *names, CLAIM)
    return Verdict(status, reason, metrics)


# ---------------------------------------------------------------------------------------------
# Implementations (run in the worker; the framework is imported there)


def on_jax(backend, precision: str = "default", precision_via: str = "none"):
    """`jnp.matmul` under a precision level, given per op or by the process-wide config."""
    import jax.numpy as jnp

    if precision == "default":  # touch nothing: the framework's (or the user's) default
        return jnp.matmul
    if precision_via == "argument":
        prec = backend.precision_argument(precision)
        return lambda a, b: jnp.matmul(a, b, precision=prec)

    def f(a, b):
        with backend.precision_scope(precision):
            return jnp.matmul(a, b)

    return f


def on_torch(backend, precision: str = "default", precision_via: str = "none"):
    """`torch.matmul` under the backend's process-wide precision setting (torch's
    `set_float32_matmul_precision`; torch_xla's own `set_mat_mul_precision`)."""
    import torch

    def f(a, b):
        with backend.precision_scope(precision):
            return torch.matmul(a, b)

    return f


def on_numpy(backend, precision: str = "default", precision_via: str = "none"):
    """The emulated dot algorithm of an `emu-*` backend (`diag.arith.dot_algorithms.emulate`)."""
    from diag.arith.dot_algorithms import emulate

    algorithm = backend.algorithm(precision)
    return lambda a, b: emulate(algorithm, a, b)


PROBE = Probe(
    op="matmul",
    dims=("m", "k", "n"),
    params={
        "precision": (str, PRECISIONS, "default"),
        # Unset: both ways (collapsed to one case for 'default').
        "precision_via": (str, PRECISION_VIA + ("none",), list(PRECISION_VIA)),
    },
    op_args=("precision", "precision_via"),
    dtypes=FLOATS,
    inputs=("normal", "uniform", "positive", "wide"),
    input_shapes=input_shapes,
    truth=truth,
    evaluate=evaluate,
    agree=agree,
    normalize=normalize,
    label=label,
    host_bytes=host_bytes,
    fingerprint=True,
    implementations={"jax": on_jax, "torch": on_torch, "numpy": on_numpy},
)
