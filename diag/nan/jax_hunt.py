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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diag.interp.jax_compile import persistent_cache
from diag.interp.jax_program import Program, is_array
from diag.interp.jax_source import Literal, inner_source, jcore, library_line, source
from diag.interp.jaxpr import Evaluator, Value, flags, wrap_value
from diag.nan.report import NanHuntError, NanReport
from diag.nan.summary import first_bad_index, summarize, values_at


class Birth:
    """An equation whose outputs hold a NaN no input held, or an Inf from finite inputs."""

    __slots__ = ("eqn", "ins", "outs", "path", "backward", "kind", "outer")

    def __init__(self, eqn, ins, outs, path, backward, kind, outer=()):
        self.eqn, self.ins, self.outs, self.path = eqn, ins, outs, path
        self.backward, self.kind, self.outer = backward, kind, outer


class BirthHunt(Evaluator):
    """The NaN policy on the evaluator: each value carries its non-finite flags and the birth
    they descend from; `births` in the order they happened."""

    def __init__(self):
        super().__init__()
        self.births: list[Birth] = []

    def observe(self, e, ins: list[Value], outs: list[Value], path: str, backward: bool) -> None:
        """Record a birth when the outputs hold a NaN no input held, or an Inf from finite
        inputs. The non-finite outputs descend from the earliest birth among the inputs' (an
        Inf born earlier that now gives inf - inf), else from this one; values that came in
        non-finite from an argument or a constant carry no birth."""
        if not any(o.bad for o in outs):
            return
        in_nan = any(i.nan for i in ins)
        in_bad = any(i.bad for i in ins)
        out_nan = any(o.nan for o in outs)
        out_inf = any(o.inf for o in outs)
        inherited = [i.taint for i in ins if i.bad and i.taint is not None]
        taint = min(inherited) if inherited else None
        if (out_nan and not in_nan) or (out_inf and not in_bad):
            kind = "NaN" if out_nan and not in_nan else "Inf"
            self.births.append(Birth(e, ins, outs, path, backward, kind, tuple(self.outer)))
            if taint is None:
                taint = len(self.births) - 1
        for o in outs:
            if o.bad:
                o.taint = taint


def _foreign(leaf: Any) -> Any:
    """Another framework's tensor (torch) as a float64 numpy array, else None: a result is
    checked whatever computed it, so that a function is never called clean unread."""
    if hasattr(leaf, "detach") and hasattr(leaf, "double"):
        try:
            return leaf.detach().cpu().double().numpy()
        except Exception:  # noqa: BLE001 - not a float tensor
            return None
    return None


def _nonfinite_leaves(tree: Any) -> list[tuple[str, str]]:
    """(path, "NaN"/"Inf") of every non-finite array leaf in `tree`."""
    found = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf) and not isinstance(leaf, float):
            leaf = _foreign(leaf)
            if leaf is None:
                continue
        nan, inf = flags(leaf)
        if nan or inf:
            found.append((jax.tree_util.keystr(keypath), "NaN" if nan else "Inf"))
    return found


def _report(birth: Birth, n_births: int) -> NanReport:
    e = birth.eqn
    src, file, line, func = source(e)
    note = ""
    if not src:
        src, file, line, func = inner_source(e)
    if not src:
        for outer in reversed(birth.outer):
            src, file, line, func = source(outer)
            if src:
                lib = library_line(e)
                note = (
                    f"the op is JAX library code ({lib}) called from this line"
                    if lib
                    else "the op is JAX library code called from this line"
                )
                break
    ins = [np.asarray(i.val) for i in birth.ins]
    bad_out = next(o for o in birth.outs if o.bad)
    out = np.asarray(bad_out.val)
    idx = first_bad_index(out, birth.kind)
    return NanReport(
        framework="jax",
        primitive=e.primitive.name,
        kind=birth.kind,
        source=src,
        path=birth.path,
        phase="backward" if birth.backward else "forward",
        inputs=tuple(summarize(a) for a in ins),
        output=summarize(out),
        file=file,
        line=line,
        function=func,
        bad_index=idx,
        inputs_at_index=(
            values_at(ins, out.shape, idx) if e.primitive.name in _ELEMENTWISE else None
        ),
        births=n_births,
        note=note,
    )


# Primitives whose output element i depends on input element i alone: only for them do "the
# inputs at the first bad element" mean anything (a square matmul has matching shapes too).
_ELEMENTWISE = frozenset(
    """
abs acos acosh add add_any asin asinh atan atan2 atanh cbrt clamp convert_element_type cos cosh
digamma div erf erf_inv erfc exp exp2 expm1 igamma igammac integer_pow is_finite lgamma log
log1p logistic max min mul ne neg nextafter pow reduce_precision rem round rsqrt select_n sign
sin sinh sqrt square sub tan tanh copy copy_p
""".split()
)


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _donated(closed) -> set[int]:
    """Indices of the jaxpr's inputs that a top-level jit donates (``donate_argnums``)."""
    pos = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    found: set[int] = set()
    for e in closed.jaxpr.eqns:
        for v, d in zip(e.invars, e.params.get("donated_invars", ()) or ()):
            if d and not isinstance(v, Literal) and v in pos:
                found.add(pos[v])
    return found


def _donated_consts(closed) -> bool:
    """Whether a top-level jit donates one of the jaxpr's constants: the arrays a function
    reaches through its globals (a step that donates its own module-level state)."""
    consts = set(closed.jaxpr.constvars)
    return any(
        d and not isinstance(v, Literal) and v in consts
        for e in closed.jaxpr.eqns
        for v, d in zip(e.invars, e.params.get("donated_invars", ()) or ())
    )


def _run_whole(closed, arrays: list, private: bool = False) -> list:
    """Evaluate a jaxpr's top-level equations as JAX would (a jit is one compiled call); with
    `private`, on copies of its constants (a jit that donates them would delete the buffers
    the hunt evaluates next)."""
    if private:
        consts = [jnp.array(c, copy=True) if is_array(c) else c for c in closed.consts]
        closed = jcore.ClosedJaxpr(closed.jaxpr, consts)
    return jcore.jaxpr_as_fun(closed)(*arrays)


def _names_of_results(out_tree, n_state: int, state_names: list[str]) -> list[str]:
    n_out = out_tree.num_leaves - n_state
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(out_tree, list(range(out_tree.num_leaves)))
    )[0]
    names = []
    for k, (p, _) in enumerate(paths):
        if k < n_out:
            names.append("result" + jax.tree_util.keystr(p)[3:])
        else:
            names.append(f"state written to {state_names[k - n_out]}")
    return names


def locate(fn: Callable, args: tuple, kwargs: dict, result: Any = None) -> NanReport | None:
    """See `diag.nan.locate`; `result`: see `diag.nan.hunt`."""
    name = _fn_name(fn)
    prog = Program(fn, args, kwargs)
    clean, screened = _screen(fn, args, kwargs, name, prog, result)
    if clean:
        return None
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
    private = _donated_consts(closed)
    if screened is not None and len(screened) != len(jax.tree_util.tree_leaves(shapes)) - n_state:
        screened = None  # a result of another structure is no screen: call the function
    try:
        if screened is not None:
            result_leaves = screened
        elif prog.nnx is None and not donated and not private:
            # Nothing to protect: the user's own call (the fast, cached path) is the screen.
            result_leaves = jax.tree_util.tree_leaves(jax.block_until_ready(fn(*args, **kwargs)))
        else:
            # Donated inputs get copies: the hunt needs the originals afterwards.
            inputs = [jnp.copy(a) if i in donated else a for i, a in enumerate(prog.arrays)]
            result_leaves = jax.block_until_ready(_run_whole(closed, inputs, private))
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e
    names = _names_of_results(out_tree, n_state, prog.state_names)
    judged = [
        (names[k], *_kind(x))
        for k, x in enumerate(result_leaves)
        if is_array(x) or isinstance(x, float)
    ]
    bad_results = [(w, k) for w, k, bad in judged if bad]
    if prog.nnx is not None:
        prog.write_back(list(result_leaves[len(result_leaves) - n_state :]))
    if not bad_results:
        return None
    hunt = BirthHunt()
    out_bwd = tuple(False for _ in closed.jaxpr.outvars)
    try:
        with persistent_cache():
            outs = hunt.eval(
                closed.jaxpr, hunt.consts(closed), [wrap_value(a) for a in prog.arrays], "", out_bwd
            )
    except NanHuntError:
        raise
    except Exception as e:  # noqa: BLE001
        raise NanHuntError(
            f"evaluating {name} equation by equation failed "
            f"({type(e).__name__}: {e}); rerun with --debug and report it"
        ) from e
    roots = [o.taint for o in outs if o.bad and o.taint is not None]
    if roots:
        return _report(hunt.births[min(roots)], len(hunt.births))
    if any(o.bad for o in outs):
        return _input_report(prog, outs, len(hunt.births))
    where, kind = bad_results[0]
    return NanReport(
        framework="jax",
        primitive="jit",
        kind=kind,
        source="",
        path="",
        phase="forward",
        births=len(hunt.births),
        note=f"the compiled call returned {kind} in {where} but evaluating {name} "
        f"op by op did not: the compiler changed the arithmetic (fusion, excess precision, "
        f"fast math); compare XLA flags with `diag run`",
    )


def _screen(fn, args, kwargs, name, prog, result) -> tuple[bool, list | None]:
    """(clean, the results' leaves) from a call that needs no protection, before tracing:
    the caller's own (diag run's worker judged this result), else the user's jitted function
    when it donates nothing (the fast, cached path; a clean function costs one call).
    (False, None) when neither applies: the hunt screens after tracing."""
    if prog.nnx is not None:
        return False, None
    if result is None:
        if not _jit_without_donation(fn):
            return False, None
        result = _call(fn, args, kwargs, name)
    if not _nonfinite_leaves(result):
        return True, None
    return False, jax.tree_util.tree_leaves(result)


def _jit_without_donation(fn: Callable) -> bool:
    """A `jax.jit` function that donates nothing (read from its jit info; private, guarded)."""
    info = getattr(fn, "_jit_info", None)
    try:
        return info is not None and not info.donate_argnums and not info.donate_argnames
    except AttributeError:  # pragma: no cover - another JAX
        return False


def _kind(x) -> tuple[str, bool]:
    nan, inf = flags(x)
    return ("NaN" if nan else "Inf"), (nan or inf)


def _call(fn, args, kwargs, name):
    """One plain call of the user's function, finished; what it raises is a NanHuntError."""
    try:
        return jax.block_until_ready(fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e


def _untraceable(fn, args, kwargs, name, prog, error) -> NanReport | None:
    """A function JAX cannot trace is still screened by one call; only a bad one is an error."""
    if not _nonfinite_leaves(_call(fn, args, kwargs, name)):
        return None
    raise NanHuntError(
        f"{name} returned NaN/Inf but could not be traced to a jaxpr "
        f"({type(error).__name__}: {error}); diag nan needs a function jax.jit "
        f"(or, for Flax NNX modules, nnx.jit) could compile"
    ) from error


def _input_report(prog: Program, outs, n_births: int) -> NanReport:
    """A non-finite result that no op gave birth to: it was passed in (or was a constant)."""
    kind = "NaN" if any(o.nan for o in outs) else "Inf"
    where = "a constant in the function"
    for n, a in zip(prog.names, prog.arrays):
        got, bad = _kind(a)
        if bad:
            where, kind = n, got
            break
    return NanReport(
        framework="jax",
        primitive="input",
        kind=kind,
        source="",
        path=where,
        phase="input",
        births=n_births,
        note="no op produced it: the non-finite value reached the results from "
        f"{where}, which held it on arrival",
    )
