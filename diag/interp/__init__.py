"""One instrumentation kernel for the hunts that watch a computation op by op.

`diag.nan` (the first non-finite birth) and `diag.diverge` (the first value that leaves its
float64 shadow) are two *policies* over the same machinery, which lives here:

* `diag.interp.jaxpr`: a jaxpr evaluated equation by equation on concrete values, descending
  into jit, custom_jvp/custom_vjp, remat, cond and scan/while (iteration by iteration), telling
  forward from backward equations. A policy subclasses `Evaluator` and overrides how a value is
  made (`wrap`, `index`, `stack`) and what happens at each equation (`apply`, or only
  `observe`, which sees each equation's inputs and outputs).
* `diag.interp.jax_program`: the user's call (Flax NNX state, RNG streams included) as a pure
  function of arrays.
* `diag.interp.jax_source`, `diag.interp.torch_source`: the user's line of an op, and the
  library line no user frame covers.
* `diag.interp.torch_ops`, `diag.interp.torch_mode`: the aten-level facts (what an op writes,
  views, fills) and the dispatch-mode skeleton (`OpMode`): module paths, the forward line a
  backward op differentiates, the context a function runs in.

Neither framework is imported here: each submodule imports the framework it instruments.
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Callable
from typing import Any

from diag.errors import DiagError

__all__ = [
    "DIAG_DIR",
    "InterpError",
    "SITE_PACKAGES",
    "framework_of",
    "installed_library",
    "leaves",
    "modules_seen",
    "names_framework",
    "values_framework",
]


class InterpError(DiagError):
    """The installed framework lacks something the kernel reads (private API that moved)."""


#: An installed library's file: under any site-packages/dist-packages folder (a venv's, or the
#: base interpreter's, which lies under its standard library while a venv's does not).
SITE_PACKAGES = re.compile(r"[/\\](site|dist)-packages[/\\]")
#: diag's own folder: its probe ops are the code a probe's hunt is about, wherever installed.
DIAG_DIR = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def installed_library(path: str) -> bool:
    """Whether `path` (absolute, case-normalised) is an installed library's file (transformers,
    optax, flax in any site-packages), never the user's line; diag's own files are not counted.
    Both frameworks' source maps use it, so a venv and a base interpreter name the same lines.
    """
    return bool(SITE_PACKAGES.search(path)) and not path.startswith(DIAG_DIR)


def leaves(tree: Any):
    """The leaves of nested lists, tuples and dicts (no framework's pytree needed)."""
    if isinstance(tree, (list, tuple)):
        for t in tree:
            yield from leaves(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from leaves(t)
    else:
        yield tree


def framework_of(fn: Callable, args: tuple, kwargs: dict) -> str:
    """Which framework `fn` computes with (``jax`` or ``torch``), as well as it can be told
    without running it: `values_framework`, else `names_framework`, else what is imported."""
    got = values_framework(fn, args, kwargs) or names_framework(fn)
    if got is not None:
        return got
    return "torch" if "torch" in sys.modules and "jax" not in sys.modules else "jax"


def values_framework(fn: Callable, args: tuple, kwargs: dict) -> str | None:
    """``torch`` or ``jax`` when the values the function is given (or the module it is)
    belong to one framework; None when they say nothing (no tensor, no array)."""
    torch = sys.modules.get("torch")
    got = list(leaves((args, kwargs)))
    if torch is not None:
        if isinstance(fn, torch.nn.Module) or any(isinstance(x, torch.Tensor) for x in got):
            return "torch"
        if isinstance(getattr(fn, "__self__", None), torch.nn.Module):
            return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and any(isinstance(x, jax.Array) for x in got):
        return "jax"
    return None


def names_framework(fn: Callable) -> str | None:
    """The one framework the function's code names (`modules_seen`); None for both or none
    (a module that imports ``jax.numpy`` while its function imports torch inside says
    nothing: only running it does)."""
    seen = modules_seen(fn)
    return next(iter(seen)) if len(seen) == 1 else None


_JAX_FAMILY = ("jax", "jaxlib", "flax", "optax", "equinox")


def modules_seen(fn: Callable) -> set[str]:
    """``{"jax", "torch"}``: the frameworks of the names a function's code refers to."""
    fn = getattr(fn, "__wrapped__", fn)
    code_fn = getattr(fn, "__func__", fn)
    # Only the globals the code names: a module that imports both frameworks says nothing.
    names = getattr(getattr(code_fn, "__code__", None), "co_names", ())
    glob = getattr(code_fn, "__globals__", {})
    values = [glob[n] for n in names if n in glob]
    for cell in getattr(code_fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    found = set()
    for value in values:
        mod = value if isinstance(value, types.ModuleType) else None
        name = mod.__name__ if mod else getattr(value, "__module__", None) or ""
        top = name.split(".", 1)[0]
        if top in _JAX_FAMILY:
            found.add("jax")
        elif top == "torch":
            found.add("torch")
    return found
