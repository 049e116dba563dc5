"""Find the op that first produced a NaN or Inf in a user's function, and where it was written.

"Random NaN loss" ends training runs, and the frameworks' own tools each answer part of the
question: `jax_debug_nans` names the primitive but no source line and stops at pmap/shard_map;
checkify names only the primitive; `torch.autograd.detect_anomaly` watches the backward pass
only. `locate` gives one answer for JAX and PyTorch: which op, where in the user's code, forward
or backward, inside which jit/scan/custom_jvp, and what its inputs looked like.

What "first" means: an op *gives birth* to a non-finite value when its output holds a NaN while
no input does, or an Inf while every input is finite. Births can be harmless (a NaN that a
`where` masks away), so `locate` reports the earliest birth whose non-finite values reach what
the function hands back (its outputs; for PyTorch also the gradients it accumulates and the
tensors it updates in place). A function whose outputs are all finite is clean: `None`.

Neither framework is imported here; the one the function uses is imported on first call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from diag.interp import names_framework, values_framework
from diag.nan.report import PHASES, NanHuntError, NanReport, TensorSummary

__all__ = [
    "PHASES",
    "NanHuntError",
    "NanReport",
    "TensorSummary",
    "hunt",
    "load_target",
    "locate",
    "reason",
]


def reason(report: NanReport | None) -> str:
    """One line for a record's ``reason`` field, e.g. from a training-step probe.

    Example: ``NaN born in log at model.py:42 (loss) [jit[step]/scan[3]], forward; input 0:
    f32[8] min -1 max 3``.
    """
    if report is None:
        return "no NaN/Inf produced"
    where = report.source or "an unknown line"
    if report.library and report.library != report.source:
        where = f"{where} via {report.library}"
    path = f" [{report.path}]" if report.path else ""
    if report.phase == "input":
        facts = list(report.arrived[:3])
        if len(report.arrived) > 3:
            facts.append(f"{len(report.arrived) - 3} more")
        given = f" ({'; '.join(facts)})" if facts else ""
        line = (
            f"{report.kind} passed in{given}, reaching {report.path or 'the results'}; "
            f"no op produced it"
        )
        return f"{line}; {report.raised}" if report.raised else line
    head = f"{report.kind} born in {report.primitive} at {where}{path}, {report.phase}"
    ins = "; ".join(f"input {i}: {s.short()}" for i, s in enumerate(report.inputs))
    line = f"{head}; {ins}" if ins else head
    return f"{line}; {report.raised}" if report.raised else line


def hunt(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    framework: str | None = None,
    result: Any = None,
) -> NanReport | None:
    """`locate` with the framework chosen explicitly (``jax`` or ``torch``) instead of guessed.

    Args:
        fn: the function to run; for JAX it must be traceable (`jax.make_jaxpr`).
        args, kwargs: what to call it with.
        framework: ``jax``, ``torch`` or None to tell it from the values the function is
            given, else from the names its code uses, else by running it once under the
            torch hunt (a function that runs no torch op is then hunted as JAX).
        result: JAX: what a call the caller already made returned (``jax.jit(fn)`` on the
            same arguments, as `diag run`'s worker does): it is the screen, and the function
            is not called again before the hunt. None: the function is called once.

    Returns:
        The report of the earliest NaN/Inf birth that reaches the function's results, or None
        when every result is finite.

    Raises:
        NanHuntError: the function raised or could not be traced.
    """
    kwargs = dict(kwargs or {})
    framework = framework or values_framework(fn, args, kwargs) or names_framework(fn)
    if framework is None and "torch" in sys.modules:
        # Neither what it is given nor the names its code uses tell (a module importing
        # jax.numpy whose function imports torch inside): run it once under the torch hunt,
        # which sees torch's ops only. A function that ran none is JAX's and runs again.
        from diag.nan import torch_hunt

        handled, report = torch_hunt.locate_if_torch(fn, args, kwargs)
        if handled:
            return report
    framework = framework or "jax"
    if framework == "jax":
        from diag.nan import jax_hunt
        from diag.userfn.lift import lifted

        # The hunt calls and traces the function more than once: the arrays it reaches
        # through its globals are copied first (a step that donates its own module-level
        # state deletes their buffers; one that rebinds ``global params`` would hand the
        # trace its own output, or leak a tracer), and the globals are the user's again after.
        # NNX objects stay: the hunt splits them itself and updates them once at the end, as
        # one call would have left them (docs/nan.md).
        with lifted(fn, args, kwargs, "jax", widen=False, graph_nodes=False):
            return jax_hunt.locate(fn, args, kwargs, result=result)
    if framework == "torch":
        from diag.nan import torch_hunt

        return torch_hunt.locate(fn, args, kwargs)
    raise NanHuntError(f"unknown framework {framework!r}; use 'jax' or 'torch'")


def locate(fn: Callable, *args: Any, **kwargs: Any) -> NanReport | None:
    """Run ``fn(*args, **kwargs)``; say which op first made a NaN/Inf that reaches its results.

    JAX: the function is run once as given; if every output is finite it is clean and nothing
    more runs. Otherwise it is traced to a jaxpr and evaluated equation by equation, descending
    into jit, custom_jvp/custom_vjp, scan/while (iteration by iteration), cond and remat; when
    the function takes gradients, transposed equations are the backward pass and keep the
    forward line they differentiate. PyTorch: the function runs once under a dispatch mode that
    sees every aten op, forward and backward (the backward's forward line comes from autograd's
    anomaly metadata). A PyTorch step that updates parameters in place runs exactly once.

    Args:
        fn: the function (a jitted JAX function, a plain function, an `nn.Module`, ...).
        *args, **kwargs: passed to `fn` unchanged.

    Returns:
        A `NanReport`, or None when the function's results are all finite.

    Raises:
        NanHuntError: `fn` raised, or (JAX) could not be traced.
    """
    return hunt(fn, args, kwargs)


def load_target(spec: str) -> tuple[Callable, tuple, dict]:
    """``FILE.py:FUNCTION`` (or ``pkg.module:function``) -> (fn, args, kwargs) to hunt.

    FUNCTION is called with no arguments. If it returns ``(fn, args)`` or ``(fn, args,
    kwargs)``, that is what is hunted; otherwise FUNCTION itself is, and so runs a second time
    (return ``(step, args)`` from a PyTorch step that updates parameters in place). One loader
    for every command that takes a user's function: `diag.userfn.load_target`.

    Raises:
        DiagError: bad spec, missing file or function, or the file raised.
        NanHuntError: FUNCTION raised.
    """
    from diag.userfn import load_target as load

    return load(spec, NanHuntError)
