"""Does a function hard-code a dtype narrower than float64? Then its float64 evaluation is not.

`diag.userfn.reference` evaluates a user's function with float64 inputs (and a `.double()`
module). A function that casts inside (``scores.to(torch.float16)`` in an attention, an
``.astype(jnp.bfloat16)`` in a sampler) and casts back still returns float64, yet its
"reference" went through the narrow dtype and carries the very error under test: judged
against it, the planted bug passes. Looking at the output dtypes cannot tell; looking at the
ops can. JAX: the function is traced (not compiled, not run) with float64 inputs under x64,
and any equation, at any depth (jit, scan, cond, custom_jvp/vjp), with a float16, bfloat16 or
float32 output hard-codes one. PyTorch: the float64 evaluation runs once under a dispatch mode
that notes each op's float output dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["NARROW", "jax_narrow", "torch_narrow"]

NARROW = ("float16", "bfloat16", "float32")


def _jaxprs(x: Any) -> Iterator[Any]:
    """The jaxprs held in an equation's parameter (a Jaxpr, a ClosedJaxpr, or tuples of them:
    cond's branches)."""
    if hasattr(x, "eqns"):
        yield x
    elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
        yield x.jaxpr
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _jaxprs(y)


def _walk(jaxpr: Any, found: set[str]) -> None:
    for e in jaxpr.eqns:
        for v in e.outvars:
            name = str(getattr(getattr(v, "aval", None), "dtype", ""))
            if name in NARROW:
                found.add(name)
        for p in e.params.values():
            for sub in _jaxprs(p):
                _walk(sub, found)


def jax_narrow(fn: Callable, args64: tuple, kwargs64: dict) -> set[str]:
    """The dtypes narrower than float64 among the outputs of any equation of ``fn`` traced on
    float64 inputs; empty when it computes in float64 (or cannot be traced: then diag.diverge
    cannot follow it either, and its float64 run is the best reference there is)."""
    import jax

    def arrays(a: tuple, k: dict) -> list:
        return [x for x in jax.tree_util.tree_leaves(fn(*a, **k)) if isinstance(x, jax.Array)]

    found: set[str] = set()
    with jax.enable_x64(True):
        try:
            closed = jax.make_jaxpr(arrays)(args64, kwargs64)
        except Exception:  # noqa: BLE001 - the function ran already; only tracing failed
            return found
    _walk(closed.jaxpr, found)
    return found


def torch_narrow(found: set[str]) -> Any:
    """A dispatch mode that adds to `found` the dtype of every float op output narrower than
    float64 (run the float64 evaluation inside it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Note(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    name = str(t.dtype).removeprefix("torch.")
                    if name in NARROW:
                        found.add(name)
            return out

    return Note()
