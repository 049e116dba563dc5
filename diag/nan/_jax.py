"""JAX NaN hunter: run once; if a result is non-finite, evaluate the jaxpr equation by equation.

Two stages keep the clean case cheap: the function is first called as the user calls it (a
jitted function hits its own compilation cache); if every output is finite the function is clean
and nothing else runs. Only then is it traced with `jax.make_jaxpr` and evaluated one equation at
a time on concrete values, descending into jit, custom_jvp/custom_vjp, remat, cond branches and
scan/while bodies (iteration by iteration, so the iteration index is known). Each value carries
whether it holds a NaN or Inf and which *birth* (see `diag.nan`) its non-finite elements descend
from; a `where` that masks a NaN clears it. The report is the earliest birth that reaches an
output.

The walk uses private JAX API (`jax._src.source_info_util`, `Primitive.get_bind_params`); it is
guarded and fails with a `NanHuntError` naming what changed.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

import numpy as np

from diag.nan import NanHuntError, NanReport
from diag.nan._summary import first_bad_index, summarize, values_at

import jax
import jax.numpy as jnp

try:
    from jax._src import source_info_util as _siu
    from jax.extend import core as _jcore
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise NanHuntError(f"this JAX ({jax.__version__}) lacks the internals diag's NaN hunt "
                       f"reads ({e}); use jax 0.4.30 or later") from e

_Literal = _jcore.Literal


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


def _source(eqn) -> tuple[str, str, int, str]:
    """("file.py:LINE (function)", full path, line, function) of the user's line for `eqn`."""
    try:
        frame = _siu.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - private API; an unknown line is not fatal
        frame = None
    if frame is None:
        return "", "", 0, ""
    base = os.path.basename(frame.file_name)
    func = frame.function_name.rsplit(".", 1)[-1]  # a qualname on Python >= 3.11
    return f"{base}:{frame.start_line} ({func})", frame.file_name, frame.start_line, func


def _inner_source(eqn) -> tuple[str, str, int, str]:
    """For an equation run whole (shard_map, pmap): the first user line inside its body."""
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
            jaxpr = getattr(sub, "jaxpr", sub)
            for inner in getattr(jaxpr, "eqns", ()):
                got = _source(inner)
                if got[0]:
                    return got
                got = _inner_source(inner)
                if got[0]:
                    return got
    return "", "", 0, ""


def _ns(eqn) -> str:
    return str(eqn.source_info.name_stack)


# JAX's tracing machinery: never the line a report should name, even as the library's line.
_MACHINERY = re.compile(r"jax[/\\]_src[/\\](interpreters[/\\]|core\.py|pjit\.py|api\.py|"
                        r"api_util\.py|linear_util\.py|source_info_util\.py|"
                        r"traceback_util\.py|dispatch\.py|custom_derivatives\.py|"
                        r"ad_checkpoint\.py|lax[/\\]control_flow)")


def _library_line(eqn) -> str:
    """``linalg.py:1234 (norm)``: the innermost frame of JAX's own library (not its tracing
    machinery) that wrote `eqn`, for equations no user frame is recorded for."""
    try:
        frames = eqn.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return ""
    for f in frames:
        if not _MACHINERY.search(f.file_name):
            return f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"
    return ""


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
    def consts(self, closed) -> list[_V]:
        got = self._const_cache.get(id(closed))
        if got is None:
            got = self._const_cache[id(closed)] = [_wrap(c) for c in closed.consts]
        return got

    def eval(self, jaxpr, consts: list[_V], args: list[_V], path: str,
             out_bwd: tuple[bool, ...], ctx_bwd: bool = False, ctx_diff: bool = False):
        env: dict[Any, _V] = {}

        def read(v) -> _V:
            if isinstance(v, _Literal):
                return _wrap(v.val)
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
        outs = h.eval(body.jaxpr, h.consts(body), consts + carry + [_index(x, it) for x in xs],
                      _join(path, f"scan[{it}]"), out_bwd, ctx_bwd, ctx_diff)
        carry = outs[:ncar]
        for j, y in enumerate(outs[ncar:]):
            ys[j].append(y)
    if p["reverse"]:
        ys = [y[::-1] for y in ys]
    return carry + [_stack(y, v.aval) for y, v in zip(ys, e.outvars[ncar:])]


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


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _nonfinite_leaves(tree: Any) -> list[tuple[str, str]]:
    """(path, "NaN"/"Inf") of every non-finite array leaf in `tree`."""
    found = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_array(leaf) and not isinstance(leaf, float):
            continue
        nan, inf = _flags(leaf)
        if nan or inf:
            found.append((jax.tree_util.keystr(keypath), "NaN" if nan else "Inf"))
    return found


def _report(birth: _Birth, n_births: int) -> NanReport:
    e = birth.eqn
    src, file, line, func = _source(e)
    note = ""
    if not src:
        src, file, line, func = _inner_source(e)
    if not src:
        for outer in reversed(birth.outer):
            src, file, line, func = _source(outer)
            if src:
                lib = _library_line(e)
                note = (f"the op is JAX library code ({lib}) called from this line"
                        if lib else "the op is JAX library code called from this line")
                break
    ins = [np.asarray(i.val) for i in birth.ins]
    bad_out = next(o for o in birth.outs if o.bad)
    out = np.asarray(bad_out.val)
    idx = first_bad_index(out, birth.kind)
    return NanReport(
        framework="jax", primitive=e.primitive.name, kind=birth.kind, source=src,
        path=birth.path, phase="backward" if birth.backward else "forward",
        inputs=tuple(summarize(a) for a in ins), output=summarize(out), file=file, line=line,
        function=func, bad_index=idx,
        inputs_at_index=(values_at(ins, out.shape, idx)
                         if e.primitive.name in _ELEMENTWISE else None),
        births=n_births, note=note)


# Primitives whose output element i depends on input element i alone: only for them do "the
# inputs at the first bad element" mean anything (a square matmul has matching shapes too).
_ELEMENTWISE = frozenset("""
abs acos acosh add add_any asin asinh atan atan2 atanh cbrt clamp convert_element_type cos cosh
digamma div erf erf_inv erfc exp exp2 expm1 igamma igammac integer_pow is_finite lgamma log
log1p logistic max min mul ne neg nextafter pow reduce_precision rem round rsqrt select_n sign
sin sinh sqrt square sub tan tanh copy copy_p
""".split())


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class _Program:
    """The user's call as a pure function of arrays: ``flat(*arrays) -> (result, new_state)``.

    JAX arrays are immutable, so a plain function's arguments are its own snapshot. Flax NNX
    modules, optimizers and RNG streams are not: their calls write new values into
    `nnx.Variable`s. Those are split (`nnx.split`) into a graph and a state of arrays before
    anything runs; `flat` merges a fresh copy from the state, calls the function, and returns
    the state it left behind, which counts as a result (a NaN written into a parameter is as
    bad as a NaN returned). The hunt therefore always starts from the state the user's call
    started from, and the user's objects are updated once at the end (`write_back`), as one
    call would have left them.
    """

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        nnx = sys.modules.get("flax.nnx")
        self.nnx = nnx if nnx is not None and _holds_nnx(nnx, fn, args, kwargs) else None
        if self.nnx is None:
            leaves, self._treedef = jax.tree_util.tree_flatten((args, kwargs))
            self._leaves = leaves
            self._dyn = [i for i, x in enumerate(leaves) if _is_array(x)]
            self.arrays = [jnp.asarray(leaves[i]) for i in self._dyn]
            paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
            self.names = [_arg_name(jax.tree_util.keystr(paths[i][0])) for i in self._dyn]
            self.state_names = []
            return
        # The callee is a module (or a bound method of one): its state is split with the rest.
        self_obj = fn if nnx.graph.is_graph_node(fn) else getattr(fn, "__self__", None)
        if self_obj is not None and not nnx.graph.is_graph_node(self_obj):
            self_obj = None
        self._method = None if self_obj is None or self_obj is fn else fn.__func__
        self._obj = (self_obj, args, kwargs)
        self._graph, state = nnx.split(self._obj)
        flat_state = jax.tree_util.tree_flatten_with_path(state)
        self._state_def = jax.tree_util.tree_structure(state)
        self.arrays = [x for _, x in flat_state[0]]
        self.names = [_state_name(jax.tree_util.keystr(p)) for p, _ in flat_state[0]]
        # Only Variables are state a call can write; raw arrays in the arguments are inputs.
        var_state = jax.tree_util.tree_flatten_with_path(nnx.state(self._obj, nnx.Variable))
        self._var_def = jax.tree_util.tree_structure(nnx.state(self._obj, nnx.Variable))
        self.state_names = [_state_name(jax.tree_util.keystr(p)) for p, _ in var_state[0]]

    def flat(self, *arrays):
        if self.nnx is None:
            full = list(self._leaves)
            for i, a in zip(self._dyn, arrays):
                full[i] = a
            a, k = jax.tree_util.tree_unflatten(self._treedef, full)
            return self.fn(*a, **k), ()
        nnx = self.nnx
        state = jax.tree_util.tree_unflatten(self._state_def, list(arrays))
        obj = nnx.merge(self._graph, state)
        self_obj, a, k = obj
        if self._method is not None:
            out = self._method(self_obj, *a, **k)
        elif self_obj is not None:
            out = self_obj(*a, **k)
        else:
            out = self.fn(*a, **k)
        return out, jax.tree_util.tree_leaves(nnx.state(obj, nnx.Variable))

    def write_back(self, new_state: list) -> None:
        """Leave the user's NNX objects as one call of the function would have left them."""
        if self.nnx is None or len(new_state) != self._var_def.num_leaves:
            return
        self.nnx.update(self._obj, jax.tree_util.tree_unflatten(self._var_def, new_state))


def _holds_nnx(nnx, fn, args, kwargs) -> bool:
    def is_node(x):
        return nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)

    cands = [fn, getattr(fn, "__self__", None)]
    cands += jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_node)
    return any(is_node(x) for x in cands if x is not None)


def _arg_name(keystr: str) -> str:
    """``[0][1]['w']`` (of the ``(args, kwargs)`` pair) -> ``args[1]['w']``."""
    if keystr.startswith("[0]"):
        return f"args{keystr[3:]}"
    if keystr.startswith("[1]"):
        return f"kwargs{keystr[3:]}"
    return keystr


def _state_name(keystr: str) -> str:
    """``[1][0]['l']['kernel'].value`` (of NNX's ``(self, args, kwargs)``) ->
    ``args[0].l.kernel``."""
    keystr = keystr.replace(".value", "")
    keystr = re.sub(r"\['([A-Za-z_][A-Za-z0-9_]*)'\]", r".\1", keystr)
    if keystr.startswith("[0]"):
        return f"the module{keystr[3:]}"
    if keystr.startswith("[1]"):
        return f"args{keystr[3:]}"
    if keystr.startswith("[2]"):
        return f"kwargs{keystr[3:]}"
    return keystr


def _donated(closed) -> set[int]:
    """Indices of the jaxpr's inputs that a top-level jit donates (``donate_argnums``)."""
    pos = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    found: set[int] = set()
    for e in closed.jaxpr.eqns:
        for v, d in zip(e.invars, e.params.get("donated_invars", ()) or ()):
            if d and not isinstance(v, _Literal) and v in pos:
                found.add(pos[v])
    return found


def _run_whole(closed, arrays: list) -> list:
    """Evaluate a jaxpr's top-level equations as JAX would (a jit is one compiled call)."""
    return _jcore.jaxpr_as_fun(closed)(*arrays)


def _names_of_results(out_tree, n_state: int, state_names: list[str]) -> list[str]:
    n_out = out_tree.num_leaves - n_state
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(out_tree, list(range(out_tree.num_leaves))))[0]
    names = []
    for k, (p, _) in enumerate(paths):
        if k < n_out:
            names.append("result" + jax.tree_util.keystr(p)[3:])
        else:
            names.append(f"state written to {state_names[k - n_out]}")
    return names


def locate(fn: Callable, args: tuple, kwargs: dict) -> NanReport | None:
    """See `diag.nan.locate`."""
    name = _fn_name(fn)
    prog = _Program(fn, args, kwargs)
    screened = None
    if prog.nnx is None and _jit_without_donation(fn):
        # Nothing to protect: the user's own call (the fast, cached path) is the screen, and
        # a clean function costs one call.
        try:
            result = jax.block_until_ready(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e
        if not _nonfinite_leaves(result):
            return None
        screened = jax.tree_util.tree_leaves(result)
    # Trace first: it runs nothing, so state cannot change and buffers cannot be donated
    # before the hunt has its starting point. A jitted function's trace is cached by JAX.
    try:
        closed, shapes = jax.make_jaxpr(prog.flat, return_shape=True)(*prog.arrays)
    except Exception as e:  # noqa: BLE001
        closed, trace_error = None, e
    if closed is None:
        return _untraceable(fn, args, kwargs, name, prog, trace_error)
    out_tree = jax.tree_util.tree_structure(shapes)
    n_state = len(jax.tree_util.tree_leaves(shapes[1]))
    donated = _donated(closed)
    try:
        if screened is not None:
            result_leaves = screened
        elif prog.nnx is None and not donated:
            # Nothing to protect: the user's own call (the fast, cached path) is the screen.
            result_leaves = jax.tree_util.tree_leaves(
                jax.block_until_ready(fn(*args, **kwargs)))
        else:
            # Donated inputs get copies: the hunt needs the originals afterwards.
            inputs = [jnp.copy(a) if i in donated else a for i, a in enumerate(prog.arrays)]
            result_leaves = jax.block_until_ready(_run_whole(closed, inputs))
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e
    names = _names_of_results(out_tree, n_state, prog.state_names)
    bad_results = [(names[k], *_kind(x)) for k, x in enumerate(result_leaves)
                   if _is_array(x) or isinstance(x, float)]
    bad_results = [(w, k) for w, k, bad in bad_results if bad]
    if prog.nnx is not None:
        prog.write_back(list(result_leaves[len(result_leaves) - n_state:]))
    if not bad_results:
        return None
    hunt = _Hunt()
    out_bwd = tuple(False for _ in closed.jaxpr.outvars)
    try:
        outs = hunt.eval(closed.jaxpr, hunt.consts(closed), [_wrap(a) for a in prog.arrays],
                         "", out_bwd)
    except NanHuntError:
        raise
    except Exception as e:  # noqa: BLE001
        raise NanHuntError(f"evaluating {name} equation by equation failed "
                           f"({type(e).__name__}: {e}); rerun with --debug and report it") from e
    roots = [o.taint for o in outs if o.bad and o.taint is not None]
    if roots:
        return _report(hunt.births[min(roots)], len(hunt.births))
    if any(o.bad for o in outs):
        return _input_report(prog, outs, len(hunt.births))
    where, kind = bad_results[0]
    return NanReport(
        framework="jax", primitive="jit", kind=kind, source="", path="", phase="forward",
        births=len(hunt.births),
        note=f"the compiled call returned {kind} in {where} but evaluating {name} "
             f"op by op did not: the compiler changed the arithmetic (fusion, excess precision, "
             f"fast math); compare XLA flags with `diag run`")


def _jit_without_donation(fn: Callable) -> bool:
    """A `jax.jit` function that donates nothing (read from its jit info; private, guarded)."""
    info = getattr(fn, "_jit_info", None)
    try:
        return info is not None and not info.donate_argnums and not info.donate_argnames
    except AttributeError:  # pragma: no cover - another JAX
        return False


def _kind(x) -> tuple[str, bool]:
    nan, inf = _flags(x)
    return ("NaN" if nan else "Inf"), (nan or inf)


def _untraceable(fn, args, kwargs, name, prog, error) -> NanReport | None:
    """A function JAX cannot trace is still screened by one call; only a bad one is an error."""
    try:
        result = jax.block_until_ready(fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e
    if not _nonfinite_leaves(result):
        return None
    raise NanHuntError(f"{name} returned NaN/Inf but could not be traced to a jaxpr "
                       f"({type(error).__name__}: {error}); diag nan needs a function jax.jit "
                       f"(or, for Flax NNX modules, nnx.jit) could compile") from error


def _input_report(prog: _Program, outs, n_births: int) -> NanReport:
    """A non-finite result that no op gave birth to: it was passed in (or was a constant)."""
    kind = "NaN" if any(o.nan for o in outs) else "Inf"
    where = "a constant in the function"
    for n, a in zip(prog.names, prog.arrays):
        got, bad = _kind(a)
        if bad:
            where, kind = n, got
            break
    return NanReport(framework="jax", primitive="input", kind=kind, source="", path=where,
                     phase="input", births=n_births,
                     note="no op produced it: the non-finite value reached the results from "
                          f"{where}, which held it on arrival")
