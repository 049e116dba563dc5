"""The shadow run and the cause search together: what `diag run`, `diag diverge` and
`diag.testing` call when an output fails (`diag.diverge.cause` says how a cause is found)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from diag import numerics
from diag.diverge.cause import MAX_RERUNS, TIMINGS, Cause, Failing, Rerun, errors, search
from diag.diverge.ledger import limit
from diag.diverge.ranking import candidates
from diag.diverge.records import ShadowReport
from diag.interp import framework_of
from diag.tolerance.diverge import diverge_carried_threshold


def _runner(fn: Callable, args: tuple, kwargs: dict, framework: str, leaves: Callable):
    """(the framework's shadow function, its re-runner, or the exception that prevented one);
    the re-runner copies a PyTorch function's arguments before the shadow run can update
    them. A re-runner that cannot be made (a target the deep copy or the tracer refuses)
    leaves the shadow's finding without a cause, never without the finding."""
    make: Callable
    if framework == "torch":
        from diag.diverge import torch_cause, torch_shadow

        shadow, make = torch_shadow.shadow, torch_cause.Rerun
    else:
        from diag.diverge import jax_cause, jax_shadow

        shadow, make = jax_shadow.shadow, jax_cause.Rerun
    try:
        return shadow, make(fn, args, kwargs, leaves)
    except Exception as e:  # noqa: BLE001 - the user's function may hold anything
        return shadow, e


def explain(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    failing: Sequence[Failing],
    leaves: Callable[[Any], list[tuple[str, Any]]],
    *,
    allowance: float = 0.0,
    framework: str | None = None,
) -> tuple[ShadowReport, Cause | None]:
    """The shadow report of ``fn(*args, **kwargs)`` (every op's threshold lowered to
    `allowance` when it is above 0) and the cause of the `failing` outputs.

    Args:
        fn, args, kwargs: the function as the user calls it (PyTorch: not updated here).
        failing: the failing float outputs, each with its reference and allowance.
        leaves: turns the function's result into (path, array) pairs, the paths of `failing`.
        allowance: lowers every op's carried-error threshold (`diag.diverge.shadow_within`).
        framework: ``jax`` or ``torch`` (default: told from the function).

    Raises:
        DivergeError: the function could not be run op by op.
    """
    framework = framework or framework_of(fn, args, kwargs)
    shadow, rerun = _runner(fn, args, kwargs, framework, leaves)
    keep: dict = {}
    f, a, k = copy.deepcopy((fn, args, kwargs)) if framework == "torch" else (fn, args, kwargs)
    if allowance > 0:
        with limit(allowance):
            report = shadow(f, a, k, keep=keep)
    else:
        report = shadow(f, a, k, keep=keep)
    if not failing:
        return report, None
    return report, _find(keep, rerun, failing)


def _find(keep: dict, rerun: Any, failing: Sequence[Failing]) -> Cause:
    """`find`; a re-runner that could not be made, or a baseline re-run that raises, ends the
    search with a sentence saying so (the shadow's finding stands without a cause)."""
    try:
        if isinstance(rerun, Exception):
            raise rerun
        return find(keep, rerun, failing)
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        f = failing[0]
        text = f"no cause: the function could not be re-run op by op ({type(e).__name__}: {e})"
        return Cause("", (), "", math.nan, math.nan, f.allowance, f.path, False, 0, text)


def positional(result: Any) -> list[tuple[str, Any]]:
    """A result's array leaves as (path, numpy array), in the order the shadow keeps its
    outputs: JAX's tree leaves (``['logits']``), PyTorch's tensors (``[i]``, nested lists and
    dicts in order)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        from diag.interp.torch_ops import flat_args

        got = [t for t in flat_args(result, []) if isinstance(t, torch.Tensor)]
        if got:
            return [(f"[{i}]", _np(t)) for i, t in enumerate(got)]
    import jax

    flat = jax.tree_util.tree_flatten_with_path(result)[0]
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in flat]


def _np(t: Any) -> np.ndarray:
    """A tensor as numpy in its own dtype (bfloat16 through ml_dtypes)."""
    t = t.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
        return t.float().numpy().astype(numerics.as_dtype("bfloat16"))
    return t.numpy()


def diagnose(fn: Callable, args: tuple, kwargs: dict) -> tuple[ShadowReport, Cause | None]:
    """`diag diverge`'s run: the shadow, and when it fails, the cause of the outputs that
    carry more than sqrt(u) of their dtype against their float64 shadow (None when none
    does: a flipped decision whose output is an index has no float output to repair)."""
    framework = framework_of(fn, args, kwargs)
    shadow, rerun = _runner(fn, args, kwargs, framework, positional)
    keep: dict = {}
    outputs: list = []
    f, a, k = copy.deepcopy((fn, args, kwargs)) if framework == "torch" else (fn, args, kwargs)
    report = shadow(f, a, k, outputs, keep)
    if not report.failed or isinstance(rerun, Exception):
        return report, None
    try:
        base = rerun(frozenset())
    except Exception:  # noqa: BLE001 - the user's function may raise anything
        return report, None
    cands = []
    for (path, y), s in zip(base, outputs):
        if s is None or not numerics.is_supported(np.asarray(y).dtype):
            continue
        allowed = diverge_carried_threshold(np.asarray(y).dtype)
        cands.append(Failing(path, s, allowed))
    failing = [c for c, e in zip(cands, errors(base, cands)) if e > c.allowance]
    if not failing:
        return report, None
    return report, _find(keep, rerun, failing)


def find(
    keep: dict,
    rerun: Rerun,
    failing: Sequence[Failing],
    max_reruns: int = MAX_RERUNS,
) -> Cause:
    """`candidates` from a shadow run's `keep` (ledger and output sources), then `search`."""
    ledger = keep["ledger"]
    starts = sorted({i for s in keep.get("sources", ()) for i in s})
    # what the ops may carry: the smallest float allowance (integer outputs: float32's)
    allowance = min((f.allowance for f in failing if f.allowance > 0), default=2.0**-12)
    sites, readers = candidates(ledger.entries, starts, allowance)
    return search(rerun, sites, failing, readers, max_reruns, TIMINGS)
