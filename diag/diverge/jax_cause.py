"""The JAX re-runner of the cause search: the jaxpr evaluated with chosen ops promoted.

The function is traced once (`jax.make_jaxpr`, in the user's settings) and evaluated
equation by equation by diag's evaluator (`diag.interp.jaxpr`) as many times as the search
asks, each time with a set of *sites* (an equation's primitive, user line, library line and
phase: every equation a line wrote, in every layer and loop iteration) computed in a wider
dtype: float32 for bf16/fp16, float64 for float32. Everything else runs as written, except
that a value already wider than the jaxpr declares (it came from a promoted op) keeps its
width into the equations that read it, as type promotion would carry it, for `MAX_HOPS` ops
that compute with it (ops that only move values do not count), or until a cast in the code
narrows it; then it is rounded to the dtype the jaxpr gives it. So promoting an op early in a
float32 model does not compute the rest of the model in float64: only what the changed line
feeds directly is wider. A narrowing cast promoted is a cast the user would drop: the wider
value is then the program's own from there on. A literal the tracer
rounded into a promoted equation (an ``eps = 1e-8`` that became 0 in float16) takes the
value written on the user's line. The first run as written keeps its values, and a promoted
run starts downstream, at the first equation holding a promoted op (`diag.diverge.jax_restart`).
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diag import numerics
from diag.diverge.cause import MAX_HOPS, package_of, wider
from diag.diverge.decisions import written_literal
from diag.diverge.jax_restart import Kept
from diag.diverge.rules import op_class
from diag.interp.jax_compile import bind, bind_params
from diag.interp.jax_program import Program
from diag.interp.jax_source import MACHINERY, PLUMBING, Literal, source
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


def _as(v: Any, dtype: Any) -> Any:
    """`v` as a JAX array of `dtype` (itself when it is one already: a scan's hundreds of
    iterations would otherwise copy each value again)."""
    if isinstance(v, jax.Array) and v.dtype == dtype:
        return v
    return jnp.asarray(v, dtype)


def _widen_params(params: Any, to: Any) -> Any:
    """Parameters with every float dtype narrower than `to` widened to it."""
    if isinstance(params, dict):
        return {k: _widen_params(v, to) for k, v in params.items()}
    if isinstance(params, np.dtype) and _float(params) and _bits(params) < _bits(to):
        return np.dtype(to)
    return params


class _PV(Value):
    """A value, and how many more ops its promoted width lasts (None: it is at the dtype the
    program gives it, or a cast the code would drop made that dtype wider for good)."""

    __slots__ = ("budget",)

    def __init__(self, val: Any, budget: int | None = None):
        super().__init__(val)
        self.budget = budget


def _budget_after(e, ins: list, declared: list) -> int | None:
    """The width budget of an unpromoted equation's outputs: one op less than its inputs'
    largest (ops that only move values or change dtype cost nothing); None when no input
    descends from a promoted op, or one is wider than declared for good (a dropped cast)."""
    for i, d in zip(ins, declared):
        dtype = getattr(i.val, "dtype", None)
        if i.budget is None and _float(dtype) and _float(d) and _bits(dtype) > _bits(d):
            return None
    kept = [i.budget for i in ins if i.budget is not None]
    if not kept:
        return None
    name = e.primitive.name
    free = op_class(name) == "structural" or name == "convert_element_type"
    return max(kept) - (0 if free else 1)


class _Promote(Evaluator):
    """One evaluation with `sites` promoted (see the module docstring)."""

    def __init__(
        self,
        sites: frozenset,
        packages: dict,
        literals: dict,
        kept: Kept | None = None,
        starts: dict[int, int] | None = None,
        keys: dict | None = None,
    ):
        super().__init__()
        self.sites = sites
        self.names = {k[0] for k in sites}
        self.packages = packages
        self.literals = literals  # id(eqn) -> [(position, written value)]
        # (id(eqn), ids of the equations it is in, backward) -> its site key: the same in
        # every iteration of a loop and every re-run (the jaxpr is kept, so ids stay unique)
        self.keys: dict = {} if keys is None else keys
        self.kept = kept  # the baseline's values: kept here (no `starts`), or read
        self.starts = starts or {}  # id(jaxpr) -> the equation a re-run starts at

    def eval(self, jaxpr, consts, args, path, out_bwd, ctx_bwd=False, ctx_diff=False):
        """`Evaluator.eval`; the baseline keeps its values, a re-run starts downstream
        (`diag.diverge.jax_restart`)."""
        rest = (path, out_bwd, ctx_bwd, ctx_diff)
        kept = self.kept
        if kept is not None and not self.starts and kept.on_path(jaxpr, self.outer):
            return kept.record(super().eval, jaxpr, consts, args, *rest)
        start = self.starts.get(id(jaxpr))
        if kept is not None and start is not None:
            return kept.resume(super().eval, jaxpr, start, consts, args, *rest)
        return super().eval(jaxpr, consts, args, *rest)

    def wrap(self, val: Any) -> Value:
        return _PV(val)

    def index(self, v: Value, i: int) -> Value:
        return _PV(v.val[i], getattr(v, "budget", None))

    def stack(self, vs: list, aval) -> Value:
        if not vs:
            return _PV(jnp.zeros(aval.shape, aval.dtype))
        dtype = _widest([np.dtype(v.val.dtype) for v in vs])
        budgets = [getattr(v, "budget", None) for v in vs]
        kept = [b for b in budgets if b is not None]
        return _PV(
            jnp.stack([_as(v.val, dtype) for v in vs]),
            None if len(kept) < len(budgets) or not kept else max(kept),
        )

    def _key(self, e, backward: bool) -> tuple[str, str, str, str]:
        return site_key(self.keys, e, self.outer, backward)

    def apply(self, e, ins: list, path: str, backward: bool) -> list:
        if self.kept is not None and not self.starts:
            self.kept.note(e, self.outer, backward)
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
        narrowing = _narrowing(e, declared)
        if promote:
            target = _target(e, declared, narrowing)
            if target is not None:
                up = target if up is None or _bits(target) > _bits(up) else up
                vals = self._written(e, vals)
        if promote:
            budget = None if narrowing else MAX_HOPS
        else:
            budget = _budget_after(e, ins, declared)
        if narrowing and not promote and budget is not None and budget > 0 and _plumbing(e):
            return [_PV(vals[0], budget)]  # jnp's cast back after its sum: kept wide
        if up is None:
            kept = budget if budget is None or budget > 0 else None
            return [_PV(v, kept) for v in bind(e, vals, bucket=True)]
        try:
            outs = self._wide(e, vals, declared, up, promote)
        except Exception:  # noqa: BLE001 - an equation that cannot take wider operands
            outs, budget = bind(e, _declared(vals, declared)), None
        if budget is not None and budget <= 0:  # the promoted width has run out
            outs = _declared(outs, [v.aval.dtype for v in e.outvars])
            budget = None
        return [_PV(v, budget) for v in outs]

    def _wide(self, e, vals: list, declared: list, up: Any, promote: bool) -> list:
        _, params = bind_params(e)
        if e.primitive.name == "convert_element_type" and not promote:
            if _narrowing(e, declared):
                return bind(e, vals)  # a cast the code wrote narrows, as written
            return bind(e, vals, _widen_params(params, up))
        cast = [
            _as(v, up) if _float(getattr(v, "dtype", None)) or isinstance(v, float) else v
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


def site_key(memo: dict, e, outer, backward: bool) -> tuple[str, str, str, str]:
    """The site of equation `e` inside the equations `outer` (`cause.Site.key`), kept in
    `memo` by the equations' ids: the same in every iteration of a loop and every re-run."""
    at = (id(e), *map(id, outer), backward)
    got = memo.get(at)
    if got is None:
        src, lib = source_and_library(e, tuple(outer))
        got = memo[at] = (e.primitive.name, src, lib, "backward" if backward else "forward")
    return got


def _plumbing(e) -> bool:
    """Whether jnp's own code wrote the equation (the cast back after a float16 sum that jnp
    accumulates in float32): a promoted value passes it at its width."""
    try:
        frames = e.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return False
    for f in frames:
        if not MACHINERY.search(f.file_name):
            return bool(PLUMBING.search(f.file_name))
    return False


def _narrowing(e, declared: list) -> bool:
    """Whether `e` is a cast to a narrower float dtype."""
    if e.primitive.name != "convert_element_type" or not _float(declared[0]):
        return False
    new = e.params.get("new_dtype")
    return _float(new) and _bits(new) < _bits(declared[0])


def _target(e, declared: list, narrowing: bool) -> Any:
    """The dtype a promoted equation computes in: a narrowing cast keeps its input's (the
    cast dropped); anything else the wider of its widest float dtype (`cause.wider`)."""
    if narrowing:
        return np.dtype(declared[0])
    floats = [np.dtype(d) for d in declared if _float(d)]
    floats += [np.dtype(v.aval.dtype) for v in e.outvars if _float(v.aval.dtype)]
    base = _widest(floats)
    if base is None:
        return None
    return np.dtype(numerics.as_dtype(wider(numerics.dtype_name(base))))


def _declared(vals: list, dtypes: list) -> list:
    """`vals` rounded to the dtypes the jaxpr declares for them (floats only)."""
    return [
        jnp.asarray(v, d) if _float(d) and _float(getattr(v, "dtype", None)) else v
        for v, d in zip(vals, dtypes)
    ]


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


def _package(e) -> tuple[str, str, str]:
    """(the installed package whose code wrote the equation: ``flax``, ``optax``, ``jax``;
    the user's line that called it, ``file.py:LINE (function)``; that line's code), each
    ``""`` if none.

    JAX counts any file outside JAX as the user's, so a Flax cast is named at Flax's line:
    the user's line is the innermost frame outside every installed package."""
    try:
        frames = e.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return "", "", ""
    package = ""
    for f in frames:
        if MACHINERY.search(f.file_name):
            continue
        got = package_of(f.file_name)
        if got:
            package = package or got
            continue
        func = f.function_name.rsplit(".", 1)[-1]  # a qualname on Python >= 3.11
        code = linecache.getline(f.file_name, f.line_num).strip()
        return package, f"{os.path.basename(f.file_name)}:{f.line_num} ({func})", code
    return package, "", ""


def _host(x: Any) -> Any:
    """A value as numpy; a PRNG key as its key data (a key is no number to measure)."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


class Rerun:
    """The function traced once; `__call__(sites)` evaluates it with `sites` promoted and
    returns its output leaves (``leaves`` turns the result into (path, array) pairs).

    The first run as written keeps its values; a promoted run then starts at the first
    equation holding an op of a promoted site (`diag.diverge.jax_restart`), and
    ``skipped_s`` says how long the part it skipped took in that first run (0 for a whole
    run); `whole(sites)` always runs the whole function."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, leaves: Callable):
        self.prog = Program(fn, args, kwargs)
        self.closed, self.shape = jax.make_jaxpr(self.prog.flat, return_shape=True)(
            *self.prog.arrays
        )
        self.leaves = leaves
        self.packages: dict = {}  # site key -> (package, the user's line, its code)
        self._literals: dict = {}
        self._keys: dict = {}
        self.kept: Kept | None = None
        self.skipped_s = 0.0
        self.runs = 0

    def __call__(self, sites: frozenset) -> list[tuple[str, Any]]:
        self.skipped_s = 0.0
        if self.kept is None and not sites:  # the run as written: keep its values
            kept = Kept()
            try:
                got = self._run(
                    _Promote(sites, self.packages, self._literals, kept, None, self._keys)
                )
            except Exception:  # noqa: BLE001 - a whole run says what the function does
                return self.whole(sites)
            self.kept = kept
            return got
        if self.kept is not None and sites:
            starts, skipped = self.kept.plan(sites, self.site_of)
            if starts:
                h = _Promote(sites, self.packages, self._literals, self.kept, starts, self._keys)
                try:
                    got = self._run(h)
                except Exception:  # noqa: BLE001 - a whole run says what the function does
                    pass
                else:
                    self.skipped_s = skipped
                    return got
        return self.whole(sites)

    def site_of(self, e, outer: tuple, backward: bool) -> tuple[str, str, str, str]:
        """The site key of equation `e` inside the equations `outer` (`site_key`)."""
        return site_key(self._keys, e, outer, backward)

    def whole(self, sites: frozenset) -> list[tuple[str, Any]]:
        """The whole function evaluated with `sites` promoted (the repair's timed runs)."""
        self.skipped_s = 0.0
        return self._run(_Promote(sites, self.packages, self._literals, keys=self._keys))

    def _run(self, h: _Promote) -> list[tuple[str, Any]]:
        with jax.enable_x64(True), np.errstate(all="ignore"):
            outs = h.eval(
                self.closed.jaxpr,
                h.consts(self.closed),
                [_PV(a) for a in self.prog.arrays],
                "",
                tuple(False for _ in self.closed.jaxpr.outvars),
            )
            tree = jax.tree_util.tree_structure(self.shape)
            result = jax.tree_util.tree_unflatten(tree, [_host(o.val) for o in outs])[0]
            self.runs += 1
            return self.leaves(result)
