"""The JAX re-runner of the cause search: the jaxpr evaluated with chosen ops promoted.

The function is traced once (`jax.make_jaxpr`, in the user's settings) and evaluated
equation by equation by diag's evaluator (`diag.interp.jaxpr`) as many times as the search
asks, each time with a set of *sites* (an equation's primitive, user line, library line and
phase: every equation a line wrote, in every layer and loop iteration) computed in a wider
dtype: float32 for bf16/fp16, float64 for float32. Everything else runs as written, except
that a value already wider than the jaxpr declares (it came from a promoted op) keeps its
width into the equations that read it, as type promotion would carry it, until a cast in the
code narrows it: a narrowing `convert_element_type` still narrows. A literal the tracer
rounded into a promoted equation (an ``eps = 1e-8`` that became 0 in float16) takes the
value written on the user's line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diag import numerics
from diag.diverge.cause import package_of, wider
from diag.diverge.decisions import written_literal
from diag.interp.jax_compile import bind, bind_params
from diag.interp.jax_program import Program
from diag.interp.jax_source import MACHINERY, Literal, source
from diag.interp.jax_source import where as source_and_library
from diag.interp.jaxpr import Evaluator, Value, is_inexact


def _float(dtype: Any) -> bool:
    try:
        return dtype is not None and is_inexact(dtype) and np.dtype(dtype).kind != "c"
    except TypeError:
        return False


def _bits(dtype: Any) -> int:
    return numerics.precision_bits(np.dtype(dtype))


def _widest(dtypes: list) -> Any:
    return max(dtypes, key=_bits) if dtypes else None


def _widen_params(params: Any, to: Any) -> Any:
    """Parameters with every float dtype narrower than `to` widened to it."""
    if isinstance(params, dict):
        return {k: _widen_params(v, to) for k, v in params.items()}
    if isinstance(params, np.dtype) and _float(params) and _bits(params) < _bits(to):
        return np.dtype(to)
    return params


class _Promote(Evaluator):
    """One evaluation with `sites` promoted (see the module docstring)."""

    def __init__(self, sites: frozenset, packages: dict, literals: dict):
        super().__init__()
        self.sites = sites
        self.names = {k[0] for k in sites}
        self.packages = packages
        self.literals = literals  # id(eqn) -> [(position, written value)]

    def wrap(self, val: Any) -> Value:
        return Value(val)

    def _key(self, e, backward: bool) -> tuple[str, str, str, str]:
        src, lib = source_and_library(e, tuple(self.outer))
        return (e.primitive.name, src, lib, "backward" if backward else "forward")

    def apply(self, e, ins: list, path: str, backward: bool) -> list:
        vals = [i.val for i in ins]
        declared = [getattr(getattr(v, "aval", None), "dtype", None) for v in e.invars]
        promote = False
        if e.primitive.name in self.names:
            key = self._key(e, backward)
            promote = key in self.sites
            if promote and key not in self.packages:
                self.packages[key] = _package(e)
        up = _widest(
            [
                np.dtype(v.dtype)
                for v, d in zip(vals, declared)
                if _float(getattr(v, "dtype", None)) and _float(d) and _bits(v.dtype) > _bits(d)
            ]
        )
        if promote:
            floats = [np.dtype(d) for d in declared if _float(d)]
            floats += [np.dtype(v.aval.dtype) for v in e.outvars if _float(v.aval.dtype)]
            base = _widest(floats)
            if base is not None:
                target = np.dtype(numerics.as_dtype(wider(numerics.dtype_name(base))))
                up = target if up is None or _bits(target) > _bits(up) else up
                vals = self._written(e, vals)
        if up is None:
            return [Value(v) for v in bind(e, vals, bucket=True)]
        try:
            return [Value(v) for v in self._wide(e, vals, declared, up, promote)]
        except Exception:  # noqa: BLE001 - an equation that cannot take wider operands
            back = [
                jnp.asarray(v, d) if _float(d) and _float(getattr(v, "dtype", None)) else v
                for v, d in zip(vals, declared)
            ]
            return [Value(v) for v in bind(e, back)]

    def _wide(self, e, vals: list, declared: list, up: Any, promote: bool) -> list:
        _, params = bind_params(e)
        if e.primitive.name == "convert_element_type" and not promote:
            new = params.get("new_dtype")
            if _float(new) and _float(declared[0]) and _bits(new) < _bits(declared[0]):
                return bind(e, vals)  # a cast the code wrote narrows, as written
            return bind(e, vals, _widen_params(params, up))
        cast = [
            jnp.asarray(v, up) if _float(getattr(v, "dtype", None)) or isinstance(v, float) else v
            for v in vals
        ]
        return bind(e, cast, _widen_params(params, up))

    def _written(self, e, vals: list) -> list:
        """`vals` with each float literal the tracer rounded given its written value."""
        got = self.literals.get(id(e))
        if got is None:
            got = self.literals[id(e)] = _written_literals(e)
        if not got:
            return vals
        vals = list(vals)
        for k, w in got:
            vals[k] = w
        return vals


def _written_literals(e) -> list[tuple[int, float]]:
    found = []
    for k, var in enumerate(e.invars):
        if not isinstance(var, Literal):
            continue
        dtype = getattr(var.val, "dtype", None)
        if dtype is None or not _float(dtype) or np.ndim(var.val) != 0:
            continue
        used = float(np.asarray(var.val, np.float64))
        _, filename, line, _ = source(e)
        if not filename or not np.isfinite(used):
            continue
        text = written_literal(filename, line, used, np.dtype(dtype))
        if text is not None and float(text) != used:
            found.append((k, float(text)))
    return found


def _package(e) -> str:
    """The installed package whose code wrote the equation (flax, optax), or ``""``."""
    try:
        frames = e.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return ""
    for f in frames:
        if MACHINERY.search(f.file_name):
            continue
        got = package_of(f.file_name)
        if got and got != "jax":
            return got
    return ""


class Rerun:
    """The function traced once; `__call__(sites)` evaluates it with `sites` promoted and
    returns its output leaves (``leaves`` turns the result into (path, array) pairs)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, leaves: Callable):
        self.prog = Program(fn, args, kwargs)
        self.closed, self.shape = jax.make_jaxpr(self.prog.flat, return_shape=True)(
            *self.prog.arrays
        )
        self.leaves = leaves
        self.packages: dict = {}
        self._literals: dict = {}
        self.runs = 0

    def __call__(self, sites: frozenset) -> list[tuple[str, Any]]:
        h = _Promote(sites, self.packages, self._literals)
        with jax.enable_x64(True), np.errstate(all="ignore"):
            outs = h.eval(
                self.closed.jaxpr,
                h.consts(self.closed),
                [Value(a) for a in self.prog.arrays],
                "",
                tuple(False for _ in self.closed.jaxpr.outvars),
            )
            tree = jax.tree_util.tree_structure(self.shape)
            result = jax.tree_util.tree_unflatten(tree, [np.asarray(o.val) for o in outs])[0]
            self.runs += 1
            return self.leaves(result)
