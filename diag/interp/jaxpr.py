"""A jaxpr run equation by equation on concrete values: the JAX half of diag's kernel.

`Evaluator.eval` walks a jaxpr, descending into jit, custom_jvp/custom_vjp, remat, cond
branches and scan/while bodies (iteration by iteration, so the iteration index is known), and
tells the equations that exist only for a gradient (backward) from the primal ones. A policy
(`diag.nan`, `diag.diverge`) subclasses it: `wrap`/`index`/`stack` say what a value carries
(non-finite flags and the birth they descend from; a float64 shadow), `apply` runs one
first-order equation, and `observe(e, ins, outs, path, backward)` is called with every
first-order equation's inputs and outputs after it ran (the policy callback).

Equations run through `diag.interp.jax_compile.bind`: one compiled program per signature,
reused across equations and kept in JAX's persistent compilation cache. A variable is dropped
once no later equation reads it, so what a policy keeps per value lives only as long as needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diag.interp.jax_compile import bind
from diag.interp.jax_source import Literal, name_stack


class Value:
    """A concrete value, whether it holds a NaN or an Inf, and (for `diag.nan`) the birth its
    non-finite elements descend from (`taint`)."""

    __slots__ = ("val", "nan", "inf", "taint")

    def __init__(self, val: Any, nan: bool = False, inf: bool = False, taint: int | None = None):
        self.val, self.nan, self.inf, self.taint = val, nan, inf, taint

    @property
    def bad(self) -> bool:
        return self.nan or self.inf


INEXACT_CACHE: dict[Any, bool] = {}


def is_inexact(dtype: Any) -> bool:
    r = INEXACT_CACHE.get(dtype)
    if r is None:
        try:
            r = bool(jnp.issubdtype(dtype, jnp.inexact))
        except TypeError:  # extended dtypes (PRNG keys), tokens
            r = False
        INEXACT_CACHE[dtype] = r
    return r


@jax.jit
def device_flags(x):
    return jnp.stack([jnp.any(jnp.isnan(x)), jnp.any(jnp.isinf(x))])


def flags(x: Any) -> tuple[bool, bool]:
    """(has NaN, has Inf). On CPU numpy reads the buffer in place; elsewhere one reduction."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, float):
            return x != x, x in (float("inf"), float("-inf"))
        return False, False
    if not is_inexact(dtype):
        return False, False
    if ON_CPU or not isinstance(x, jax.Array):
        a = np.asarray(x)
        if a.dtype.kind not in "fc":
            a = a.astype(np.float32)
        if np.isfinite(a).all():
            return False, False
        return bool(np.isnan(a).any()), bool(np.isinf(a).any())
    f = np.asarray(device_flags(x))
    return bool(f[0]), bool(f[1])


ON_CPU = jax.default_backend() == "cpu"


def wrap_value(val: Any) -> Value:
    nan, inf = flags(val)
    return Value(val, nan, inf)


class Evaluator:
    """One equation-by-equation evaluation of a jaxpr, with a policy's hooks."""

    def __init__(self):
        self._phase_cache: dict[tuple, tuple[list[bool], list[tuple[bool, ...]]]] = {}
        self._const_cache: dict[int, list[Value]] = {}
        self._dead_cache: dict[int, list[list]] = {}
        # The higher-order equations being descended, outermost first: their user lines name
        # an equation whose own traceback stops inside a library (a derivative rule of a
        # jitted library function is traced with a truncated stack).
        self.outer: list = []

    # -- phases ---------------------------------------------------------------------------
    def _phases(self, jaxpr, out_bwd: tuple[bool, ...], ctx_bwd: bool, ctx_diff: bool):
        """Per equation: does it exist only for a gradient? And per output: is it used only so?

        Transposed equations (name stack ``transpose(...)``) are backward. An equation under
        ``jvp(...)`` is backward when every use of its outputs is backward: that is how the
        derivative rule's own arithmetic (``0.5 / sqrt(x)``) differs from the primal op.
        """
        key = (id(jaxpr), out_bwd, ctx_bwd, ctx_diff)
        hit = self._phase_cache.get(key)
        if hit is not None:
            return hit
        primal_use: dict[Any, bool] = {}
        for v, b in zip(jaxpr.outvars, out_bwd):
            if not isinstance(v, Literal) and not b:
                primal_use[v] = True
        n = len(jaxpr.eqns)
        bwd = [False] * n
        only_bwd_outs: list[tuple[bool, ...]] = [()] * n
        for k in range(n - 1, -1, -1):
            e = jaxpr.eqns[k]
            ns = name_stack(e)
            outs_only = tuple(not primal_use.get(v, False) for v in e.outvars)
            if ctx_bwd or "transpose(" in ns:
                b = True
            elif ctx_diff or "jvp(" in ns:
                b = all(outs_only)
            else:
                b = False
            bwd[k], only_bwd_outs[k] = b, outs_only
            if not b:
                for v in e.invars:
                    if not isinstance(v, Literal):
                        primal_use[v] = True
        self._phase_cache[key] = (bwd, only_bwd_outs)
        return bwd, only_bwd_outs

    # -- evaluation -----------------------------------------------------------------------
    # How a value is made, sliced out of a scan's operand and stacked into its result: methods,
    # so that an evaluator carrying more per value (diag.diverge's float64 shadow) keeps it
    # through literals, constants and loops.
    def wrap(self, val: Any) -> Value:
        return wrap_value(val)

    def index(self, v: Value, i: int) -> Value:
        return index_value(v, i)

    def stack(self, vs: list[Value], aval) -> Value:
        return stack_values(vs, aval)

    def consts(self, closed) -> list[Value]:
        got = self._const_cache.get(id(closed))
        if got is None:
            got = self._const_cache[id(closed)] = [self.wrap(c) for c in closed.consts]
        return got

    def eval(
        self,
        jaxpr,
        consts: list[Value],
        args: list[Value],
        path: str,
        out_bwd: tuple[bool, ...],
        ctx_bwd: bool = False,
        ctx_diff: bool = False,
    ):
        env: dict[Any, Value] = {}

        def read(v) -> Value:
            if isinstance(v, Literal):
                return self.wrap(v.val)
            return env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        bwd, only_bwd_outs = self._phases(jaxpr, out_bwd, ctx_bwd, ctx_diff)
        dead = self._dead(jaxpr)
        for k, e in enumerate(jaxpr.eqns):
            ins = [read(v) for v in e.invars]
            handler = HIGHER_ORDER.get(e.primitive.name)
            if handler is not None:
                ns = name_stack(e)
                child = (only_bwd_outs[k], bwd[k], ctx_diff or "jvp(" in ns or "transpose(" in ns)
                self.outer.append(e)
                try:
                    outs = handler(self, e, ins, path, child)
                finally:
                    self.outer.pop()
            else:
                outs = self.apply(e, ins, path, bwd[k])
            for v, o in zip(e.outvars, outs):
                env[v] = o
            for v in dead[k]:
                del env[v]
        return [read(v) for v in jaxpr.outvars]

    def _dead(self, jaxpr) -> list[list]:
        """Per equation, the variables no later equation reads and the jaxpr does not return:
        `eval` drops them once it ran, so a value (and what a policy keeps on it: a float64
        shadow and copy) lives only as long as it is read."""
        got = self._dead_cache.get(id(jaxpr))
        if got is not None:
            return got
        kept = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        last: dict[Any, int] = {}
        for k, e in enumerate(jaxpr.eqns):
            for v in e.outvars:
                last[v] = k  # an output nothing reads dies where it is made
            for v in e.invars:
                if not isinstance(v, Literal):
                    last[v] = k
        dead: list[list] = [[] for _ in jaxpr.eqns]
        for v, k in last.items():
            if v not in kept:
                dead[k].append(v)
        self._dead_cache[id(jaxpr)] = dead
        return dead

    #: Run elementwise equations on flat, padded copies (`jax_compile.bind`): fewer
    #: programs to compile; a policy that measures errors bit for bit may turn it off.
    bucket = True

    def apply(self, e, ins: list[Value], path: str, backward: bool) -> list[Value]:
        """Bind one first-order equation on concrete values; hand it to `observe`."""
        outs = [self.wrap(v) for v in bind(e, [i.val for i in ins], bucket=self.bucket)]
        self.observe(e, ins, outs, path, backward)
        return outs

    def observe(self, e, ins: list, outs: list, path: str, backward: bool) -> None:
        """The policy callback: one equation's inputs and outputs, after it ran. `path` is
        where it sits (``jit[step]/scan[3]``), `backward` whether it exists for a gradient;
        `self.outer` holds the enclosing higher-order equations. Does nothing here."""


def join_path(path: str, part: str) -> str:
    return f"{path}/{part}" if path else part


def _call(jaxpr_param: str, label: Callable[[Any], str]):
    """Handler for call-like primitives whose body takes the equation's operands as they are."""

    def handler(h: Evaluator, e, ins, path, child):
        out_bwd, ctx_bwd, ctx_diff = child
        sub = e.params[jaxpr_param]
        if hasattr(sub, "consts"):  # ClosedJaxpr
            return h.eval(
                sub.jaxpr, h.consts(sub), ins, join_path(path, label(e)), out_bwd, ctx_bwd, ctx_diff
            )
        return h.eval(sub, [], ins, join_path(path, label(e)), out_bwd, ctx_bwd, ctx_diff)

    return handler


def index_value(v: Value, i: int) -> Value:
    x = v.val[i]
    if not v.bad:
        return Value(x)
    out = wrap_value(x)
    out.taint = v.taint if out.bad else None
    return out


def stack_values(vs: list[Value], aval) -> Value:
    if not vs:
        return Value(jnp.zeros(aval.shape, aval.dtype))
    bad = [v for v in vs if v.bad]
    taints = [v.taint for v in bad if v.taint is not None]
    return Value(
        jnp.stack([v.val for v in vs]),
        any(v.nan for v in vs),
        any(v.inf for v in vs),
        min(taints) if taints else None,
    )


def _scan(h: Evaluator, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    p = e.params
    nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
    ys: list[list[Value]] = [[] for _ in e.outvars[ncar:]]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for it in order:
        outs = h.eval(
            body.jaxpr,
            h.consts(body),
            consts + carry + [h.index(x, it) for x in xs],
            join_path(path, f"scan[{it}]"),
            out_bwd,
            ctx_bwd,
            ctx_diff,
        )
        carry = outs[:ncar]
        for j, y in enumerate(outs[ncar:]):
            ys[j].append(y)
    if p["reverse"]:
        ys = [y[::-1] for y in ys]
    return carry + [h.stack(y, v.aval) for y, v in zip(ys, e.outvars[ncar:])]


def _while(h: Evaluator, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    p = e.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    if cond.jaxpr.outvars[0].aval.shape != ():  # a batched predicate (vmap): run it whole
        return h.apply(e, ins, path, ctx_bwd)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    it = 0
    while True:
        pred = h.eval(
            cond.jaxpr,
            h.consts(cond),
            cconsts + carry,
            join_path(path, f"while[{it}]/cond"),
            (False,),
            ctx_bwd,
            ctx_diff,
        )[0]
        if not bool(pred.val):
            return carry
        carry = h.eval(
            body.jaxpr,
            h.consts(body),
            bconsts + carry,
            join_path(path, f"while[{it}]"),
            out_bwd,
            ctx_bwd,
            ctx_diff,
        )
        it += 1


def _cond(h: Evaluator, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    branches = e.params["branches"]
    k = int(np.clip(int(ins[0].val), 0, len(branches) - 1))
    br = branches[k]
    return h.eval(
        br.jaxpr, h.consts(br), ins[1:], join_path(path, f"cond[{k}]"), out_bwd, ctx_bwd, ctx_diff
    )


HIGHER_ORDER: dict[str, Callable] = {
    "jit": _call("jaxpr", lambda e: f"jit[{e.params.get('name', '?')}]"),
    "pjit": _call("jaxpr", lambda e: f"jit[{e.params.get('name', '?')}]"),
    "closed_call": _call("call_jaxpr", lambda e: "call"),
    "core_call": _call("call_jaxpr", lambda e: "call"),
    "custom_jvp_call": _call("call_jaxpr", lambda e: "custom_jvp"),
    "custom_vjp_call": _call("call_jaxpr", lambda e: "custom_vjp"),
    "custom_vjp_call_jaxpr": _call("fun_jaxpr", lambda e: "custom_vjp"),
    "remat2": _call("jaxpr", lambda e: "remat"),
    "checkpoint": _call("jaxpr", lambda e: "remat"),
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
