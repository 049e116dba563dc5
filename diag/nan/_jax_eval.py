"""The JAX hunt's evaluator: a jaxpr run equation by equation on concrete values.

Each value carries whether it holds a NaN or Inf and the birth its non-finite elements descend
from; jit, custom_jvp/custom_vjp, remat, cond and scan/while bodies are descended into.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp

from diag.nan._jax_source import _Literal, _ns

class _V:
    """A concrete value with its non-finite state and the birth its NaN/Inf descend from."""

    __slots__ = ("val", "nan", "inf", "taint")

    def __init__(self, val: Any, nan: bool = False, inf: bool = False, taint: int | None = None):
        self.val, self.nan, self.inf, self.taint = val, nan, inf, taint

    @property
    def bad(self) -> bool:
        return self.nan or self.inf


_INEXACT: dict[Any, bool] = {}


def _is_inexact(dtype: Any) -> bool:
    r = _INEXACT.get(dtype)
    if r is None:
        try:
            r = bool(jnp.issubdtype(dtype, jnp.inexact))
        except TypeError:  # extended dtypes (PRNG keys), tokens
            r = False
        _INEXACT[dtype] = r
    return r


@jax.jit
def _device_flags(x):
    return jnp.stack([jnp.any(jnp.isnan(x)), jnp.any(jnp.isinf(x))])


def _flags(x: Any) -> tuple[bool, bool]:
    """(has NaN, has Inf). On CPU numpy reads the buffer in place; elsewhere one reduction."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, float):
            return x != x, x in (float("inf"), float("-inf"))
        return False, False
    if not _is_inexact(dtype):
        return False, False
    if _ON_CPU or not isinstance(x, jax.Array):
        a = np.asarray(x)
        if a.dtype.kind not in "fc":
            a = a.astype(np.float32)
        if np.isfinite(a).all():
            return False, False
        return bool(np.isnan(a).any()), bool(np.isinf(a).any())
    f = np.asarray(_device_flags(x))
    return bool(f[0]), bool(f[1])


_ON_CPU = jax.default_backend() == "cpu"


def _wrap(val: Any) -> _V:
    nan, inf = _flags(val)
    return _V(val, nan, inf)

class _Birth:
    __slots__ = ("eqn", "ins", "outs", "path", "backward", "kind", "outer")

    def __init__(self, eqn, ins, outs, path, backward, kind, outer=()):
        self.eqn, self.ins, self.outs, self.path = eqn, ins, outs, path
        self.backward, self.kind, self.outer = backward, kind, outer


class _Hunt:
    """One equation-by-equation evaluation; `births` in the order they happened."""

    def __init__(self):
        self.births: list[_Birth] = []
        self._phase_cache: dict[tuple, tuple[list[bool], list[tuple[bool, ...]]]] = {}
        self._const_cache: dict[int, list[_V]] = {}
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
            if not isinstance(v, _Literal) and not b:
                primal_use[v] = True
        n = len(jaxpr.eqns)
        bwd, only_bwd_outs = [False] * n, [()] * n
        for k in range(n - 1, -1, -1):
            e = jaxpr.eqns[k]
            ns = _ns(e)
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
                    if not isinstance(v, _Literal):
                        primal_use[v] = True
        self._phase_cache[key] = (bwd, only_bwd_outs)
        return bwd, only_bwd_outs

    # -- evaluation -----------------------------------------------------------------------
    # How a value is made, sliced out of a scan's operand and stacked into its result: methods,
    # so that an evaluator carrying more per value (diag.diverge's float64 shadow) keeps it
    # through literals, constants and loops.
    def wrap(self, val: Any) -> _V:
        return _wrap(val)

    def index(self, v: _V, i: int) -> _V:
        return _index(v, i)

    def stack(self, vs: list[_V], aval) -> _V:
        return _stack(vs, aval)

    def consts(self, closed) -> list[_V]:
        got = self._const_cache.get(id(closed))
        if got is None:
            got = self._const_cache[id(closed)] = [self.wrap(c) for c in closed.consts]
        return got

    def eval(self, jaxpr, consts: list[_V], args: list[_V], path: str,
             out_bwd: tuple[bool, ...], ctx_bwd: bool = False, ctx_diff: bool = False):
        env: dict[Any, _V] = {}

        def read(v) -> _V:
            if isinstance(v, _Literal):
                return self.wrap(v.val)
            return env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        bwd, only_bwd_outs = self._phases(jaxpr, out_bwd, ctx_bwd, ctx_diff)
        for k, e in enumerate(jaxpr.eqns):
            ins = [read(v) for v in e.invars]
            handler = _HIGHER_ORDER.get(e.primitive.name)
            if handler is not None:
                ns = _ns(e)
                child = (only_bwd_outs[k], bwd[k],
                         ctx_diff or "jvp(" in ns or "transpose(" in ns)
                self.outer.append(e)
                try:
                    outs = handler(self, e, ins, path, child)
                finally:
                    self.outer.pop()
            else:
                outs = self.apply(e, ins, path, bwd[k])
            for v, o in zip(e.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def apply(self, e, ins: list[_V], path: str, backward: bool) -> list[_V]:
        """Bind one equation on concrete values and judge its outputs."""
        try:
            params = e.primitive.get_bind_params(e.params)
        except AttributeError:  # pragma: no cover - older JAX
            params = e.params
        if isinstance(params, tuple):  # (subfuns, params) in some JAX versions
            subfuns, params = params
            vals = e.primitive.bind(*subfuns, *(i.val for i in ins), **params)
        else:
            vals = e.primitive.bind(*(i.val for i in ins), **params)
        if not e.primitive.multiple_results:
            vals = [vals]
        outs = [_wrap(v) for v in vals]
        if any(o.bad for o in outs):
            self.judge(e, ins, outs, path, backward)
        return outs

    def judge(self, e, ins: list[_V], outs: list[_V], path: str, backward: bool) -> None:
        """Record a birth when the outputs hold a NaN no input held, or an Inf from finite inputs.

        The non-finite outputs descend from the earliest birth among the inputs' (an Inf born
        earlier that now gives inf - inf), else from this one; values that came in non-finite
        from an argument or a constant carry no birth.
        """
        in_nan = any(i.nan for i in ins)
        in_bad = any(i.bad for i in ins)
        out_nan = any(o.nan for o in outs)
        out_inf = any(o.inf for o in outs)
        inherited = [i.taint for i in ins if i.bad and i.taint is not None]
        taint = min(inherited) if inherited else None
        if (out_nan and not in_nan) or (out_inf and not in_bad):
            kind = "NaN" if out_nan and not in_nan else "Inf"
            self.births.append(_Birth(e, ins, outs, path, backward, kind, tuple(self.outer)))
            if taint is None:
                taint = len(self.births) - 1
        for o in outs:
            if o.bad:
                o.taint = taint


def _join(path: str, part: str) -> str:
    return f"{path}/{part}" if path else part


def _call(jaxpr_param: str, label: Callable[[Any], str]):
    """Handler for call-like primitives whose body takes the equation's operands as they are."""

    def handler(h: _Hunt, e, ins, path, child):
        out_bwd, ctx_bwd, ctx_diff = child
        sub = e.params[jaxpr_param]
        if hasattr(sub, "consts"):  # ClosedJaxpr
            return h.eval(sub.jaxpr, h.consts(sub), ins, _join(path, label(e)), out_bwd,
                          ctx_bwd, ctx_diff)
        return h.eval(sub, [], ins, _join(path, label(e)), out_bwd, ctx_bwd, ctx_diff)

    return handler


def _index(v: _V, i: int) -> _V:
    x = v.val[i]
    if not v.bad:
        return _V(x)
    out = _wrap(x)
    out.taint = v.taint if out.bad else None
    return out


def _stack(vs: list[_V], aval) -> _V:
    if not vs:
        return _V(jnp.zeros(aval.shape, aval.dtype))
    bad = [v for v in vs if v.bad]
    taints = [v.taint for v in bad if v.taint is not None]
    return _V(jnp.stack([v.val for v in vs]), any(v.nan for v in vs), any(v.inf for v in vs),
              min(taints) if taints else None)


def _scan(h: _Hunt, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    p = e.params
    nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    ys: list[list[_V]] = [[] for _ in e.outvars[ncar:]]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for it in order:
        outs = h.eval(body.jaxpr, h.consts(body), consts + carry + [h.index(x, it) for x in xs],
                      _join(path, f"scan[{it}]"), out_bwd, ctx_bwd, ctx_diff)
        carry = outs[:ncar]
        for j, y in enumerate(outs[ncar:]):
            ys[j].append(y)
    if p["reverse"]:
        ys = [y[::-1] for y in ys]
    return carry + [h.stack(y, v.aval) for y, v in zip(ys, e.outvars[ncar:])]


def _while(h: _Hunt, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    p = e.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    if cond.jaxpr.outvars[0].aval.shape != ():  # a batched predicate (vmap): run it whole
        return h.apply(e, ins, path, ctx_bwd)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    it = 0
    while True:
        pred = h.eval(cond.jaxpr, h.consts(cond), cconsts + carry,
                      _join(path, f"while[{it}]/cond"), (False,), ctx_bwd, ctx_diff)[0]
        if not bool(pred.val):
            return carry
        carry = h.eval(body.jaxpr, h.consts(body), bconsts + carry,
                       _join(path, f"while[{it}]"), out_bwd, ctx_bwd, ctx_diff)
        it += 1


def _cond(h: _Hunt, e, ins, path, child):
    out_bwd, ctx_bwd, ctx_diff = child
    branches = e.params["branches"]
    k = int(np.clip(int(ins[0].val), 0, len(branches) - 1))
    br = branches[k]
    return h.eval(br.jaxpr, h.consts(br), ins[1:], _join(path, f"cond[{k}]"), out_bwd,
                  ctx_bwd, ctx_diff)


_HIGHER_ORDER: dict[str, Callable] = {
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
