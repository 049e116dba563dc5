"""The shadow run and the cause search together: what `diag run`, `diag diverge` and
`diag.testing` call when an output fails (`diag.diverge.cause` says how a cause is found)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from diag import numerics
from diag.diverge import repair_cost
from diag.diverge.cause import MAX_RERUNS, TIMINGS, Cause, Failing, Rerun, errors, search
from diag.diverge.ledger import limit
from diag.diverge.ranking import candidates
from diag.diverge.records import ShadowReport
from diag.interp import framework_of
from diag.status import Status
from diag.tolerance.diverge import diverge_carried_threshold


def _runner(fn: Callable, args: tuple, kwargs: dict, framework: str, leaves: Callable):
    """(the framework's shadow function, its re-runner, or the exception that prevented one);
    a PyTorch re-runner copies the arguments as given at each run, so the shadow runs on a
    copy of its own (a training step updates its model). A re-runner that cannot be made (a
    target the tracer refuses) leaves the shadow's finding without a cause, never without the
    finding."""
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


def _find(keep: dict, rerun: Any, failing: Sequence[Failing], first: Any = None) -> Cause:
    """`find`; a re-runner that could not be made, or a baseline re-run that raises, ends the
    search with a sentence saying so (the shadow's finding stands without a cause)."""
    try:
        if isinstance(rerun, Exception):
            raise rerun
        return find(keep, rerun, failing, first=first)
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


#: The float64 reference's integer outputs: (reference, forced or None) per integer leaf.
Exact = Callable[[], list[tuple[np.ndarray, np.ndarray | None]]]


def diagnose(
    fn: Callable, args: tuple, kwargs: dict, exact: Exact | None = None
) -> tuple[ShadowReport, Cause | None]:
    """`diag diverge`'s run: the shadow, and when it fails, the cause of the outputs that
    carry more than sqrt(u) of their dtype against their float64 shadow, and, when a
    decision was made by the computation, of the integer outputs (token ids, indices) that
    differ from the float64 reference's (None when no output fails).

    Args:
        fn, args, kwargs: the function as the user calls it.
        exact: the float64 reference's integer outputs, in the order the function returns
            them, each with where one rounding of the inputs already moves it (None: not
            forgiven); called only when a made decision flipped.
    """
    framework = framework_of(fn, args, kwargs)
    shadow, rerun = _runner(fn, args, kwargs, framework, positional)
    keep: dict = {}
    outputs: list = []
    f, a, k = copy.deepcopy((fn, args, kwargs)) if framework == "torch" else (fn, args, kwargs)
    report = shadow(f, a, k, outputs, keep)
    if not report.failed or isinstance(rerun, Exception):
        return report, None
    try:
        base, took = repair_cost.timed(rerun, frozenset())  # the search's baseline too
    except Exception:  # noqa: BLE001 - the user's function may raise anything
        return report, None
    cands = []
    for (path, y), s in zip(base, outputs):
        if s is None or not numerics.is_supported(np.asarray(y).dtype):
            continue
        allowed = diverge_carried_threshold(np.asarray(y).dtype)
        cands.append(Failing(path, s, allowed))
    failing = [c for c, e in zip(cands, errors(base, cands)) if e > c.allowance]
    made = any(d.verdict == Status.FAIL for d in report.decisions)
    if exact is not None and made and any(np.asarray(y).dtype.kind in "biu" for _, y in base):
        failing += decided(base, exact())
    if not failing:
        return report, None
    cause = _find(keep, rerun, failing, (base, took))
    return report, dataclasses.replace(cause, decided=tuple(f.path for f in failing if f.exact))


def decided(
    base: list[tuple[str, Any]], refs: list[tuple[np.ndarray, np.ndarray | None]]
) -> list[Failing]:
    """The integer outputs of the run as written that differ from the float64 reference's
    (matched in order, by shape), as failing outputs held to equality: a flipped argmax is
    repaired when every token equals the reference's, except where one rounding of the
    inputs already moves it (`forced`)."""
    ints = [(p, np.asarray(y)) for p, y in base if np.asarray(y).dtype.kind in "biu"]
    out = []
    for (path, y), (ref, forced) in zip(ints, refs):
        if y.shape != ref.shape:
            continue
        f = Failing(path, ref, 0.0, None if forced is None else forced.reshape(ref.shape))
        if errors([(path, y)], [f])[0] > 0:
            out.append(f)
    return out


def find(
    keep: dict,
    rerun: Rerun,
    failing: Sequence[Failing],
    max_reruns: int = MAX_RERUNS,
    first: tuple[list[tuple[str, Any]], float] | None = None,
) -> Cause:
    """`candidates` from a shadow run's `keep` (ledger and output sources), then `search`
    (`first`: the baseline run and its seconds, when the caller already ran it)."""
    ledger = keep["ledger"]
    starts = sorted({i for s in keep.get("sources", ()) for i in s})
    # what the ops may carry: the smallest float allowance (integer outputs: float32's)
    allowance = min((f.allowance for f in failing if f.allowance > 0), default=2.0**-12)
    sites, readers = candidates(ledger.entries, starts, allowance)
    return search(rerun, sites, failing, readers, max_reruns, TIMINGS, first)
