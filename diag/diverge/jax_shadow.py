"""JAX shadow execution: the jaxpr run equation by equation in its dtypes and in float64.

The function is traced once with `jax.make_jaxpr` (in the user's precision settings), then
evaluated by diag's equation-by-equation evaluator (`diag.interp.jaxpr`), which descends into jit,
custom_jvp/custom_vjp, remat, cond branches and scan/while bodies (iteration by iteration) and
tells forward from backward equations. Each value here carries, beside what the program
computes, its float64 shadow and its carried error. Per equation three evaluations run: the
equation as written, the same equation with float dtypes in its parameters widened to float64 on
the shadows, and that float64 equation on the actual inputs (the reference for the op's own
error). The float64 ones run under `jax.enable_x64`; an equation that cannot be re-bound in
float64 (a higher-order primitive the evaluator does not descend into, a custom call) keeps its
shadow equal to its output and is counted in the report's note. A run that is known is not
made (`_reference`): the reference is the shadows where every input equals its shadow, and
the widened output for a copy-only op (`EXACT`) on finite inputs; an integer or predicate
equation whose operands equal their shadows keeps its outputs as their shadows. Each value
keeps its float64 copy (`_wide_of`) and |copy| (`_mag_of`), so a value read by several
equations (a weight forward and backward) is widened once.

Decisions (comparisons, argmax/argmin, top_k, select_n) are judged against their float64
shadow by `diag.diverge.jax_decide`; since every equation also runs on the shadows, what comes
after a flipped decision follows the float64 one.

Equations are run one by one, not compiled together: what XLA's fusion or excess precision
changes in the compiled function is not seen (`diag run` compares settings for that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from diag import numerics
from diag.diverge import jax_decide
from diag.diverge.jax_decide import is_float
from diag.diverge.ledger import Ledger
from diag.diverge.records import DivergeError, ShadowReport
from diag.diverge.rules import release_scratch
from diag.interp.jax_compile import bind, bind_params
from diag.interp.jax_program import Program
from diag.interp.jax_source import where as source_and_library
from diag.interp.jaxpr import Evaluator, Value
from diag.tolerance.diverge import diverge_carried_threshold

_F64 = np.dtype(np.float64)


class _SV(Value):
    """A value, its float64 shadow, its carried error and the threshold of its dtype."""

    __slots__ = (
        "sh", "err", "thr", "cul", "cum", "dec", "lit", "flip", "perm", "srcs", "wide", "mag"
    )  # fmt: skip

    def __init__(self, val: Any, sh: Any, err: float = 0.0, thr: float = 0.0):
        super().__init__(val)
        self.sh, self.err = sh, err
        # What `jax_decide` judges a decision by: the op that added the most carried error
        # among the value's ancestors (added error, ledger entry or a label), whether it
        # descends from a cumulative sum, whether a recorded decision made it.
        self.cul: tuple | None = None  # (added error, entry or label, the one it grew)
        self.cum = self.dec = False
        self.lit: tuple[float, float] | None = None  # (written, used) of a rounded literal
        self.flip: Any = None  # the first flipped decision (DecisionRecord) it descends from
        self.perm: Any = None  # a ranking's permutation not yet reported (`jax_decide.Perm`)
        self.srcs: tuple[int, ...] = ()  # the ledger entries it came from (the cause search)
        # Its float64 copy and |that copy|, made when first needed and kept while the value
        # lives: a weight or an activation read forward and backward is widened once.
        self.wide: Any = None
        self.mag: Any = None
        dtype = getattr(val, "dtype", None)
        self.thr = (
            max(thr, diverge_carried_threshold(dtype))
            if dtype is not None and is_float(dtype)
            else np.inf
        )


@jax.jit
def _to_f64(x):
    return x.astype(_F64)


@jax.jit
def _abs(x):
    return jnp.abs(x)


def _widen(val: Any) -> Any:
    """The float64 copy of a float value; anything else as it is. A JAX array is widened by
    one compiled conversion (about a third of `jnp.asarray`'s cost per call; the same
    values: widening is exact)."""
    if is_float(getattr(val, "dtype", None)):
        if isinstance(val, jax.Array):
            return _to_f64(val)
        return jnp.asarray(val, dtype=_F64)
    if isinstance(val, float):
        return jnp.asarray(val, dtype=_F64)
    return val


def _wide_of(v: _SV) -> Any:
    """`_widen` of a value's own (not its shadow's) elements, kept on the value."""
    if v.wide is None:
        v.wide = _widen(v.val)
    return v.wide


def _mag_of(v: _SV) -> Any:
    """|`_wide_of`| of a float value (a reduction's sum|terms|), kept on the value."""
    if v.mag is None:
        v.mag = _abs(_wide_of(v))
    return v.mag


def _f64_params(params: Any) -> Any:
    """Equation parameters with every float dtype widened to float64 (casts, accumulators)."""
    if isinstance(params, dict):
        return {k: _f64_params(v) for k, v in params.items()}
    if isinstance(params, np.dtype) and is_float(params):
        return _F64
    return params


def _host(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


#: Output dtypes numpy widens to float64 exactly as it subtracts: the figures read them as
#: they are (`diag.diverge.rules`), with no float64 copy.
_NATIVE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def _low(x: Any) -> np.ndarray:
    """An op's output for the figures: as it is in float16/32/64, else a float64 copy."""
    a = np.asarray(x)
    return a if a.dtype in _NATIVE else a.astype(np.float64)


def _f64(x: Any) -> np.ndarray:
    """A float64 result (a shadow, a reference) as numpy, without a copy."""
    return np.asarray(x, dtype=np.float64)


def _bind(e, vals: list, wide: bool = False) -> list:
    """The equation on `vals`; with `wide`, its float dtypes widened to float64."""
    return bind(e, vals, _f64_params(bind_params(e)[1]) if wide else None)


class _Shadow(Evaluator):
    """The diverge policy on diag's evaluator: each value carries its float64 shadow; a
    `Ledger` per op."""

    def __init__(self):
        super().__init__()
        self.ledger = Ledger()
        self.unfollowed: set[str] = set()
        self.literal_cache: dict[int, list[tuple[int, float]]] = {}

    def wrap(self, val: Any) -> _SV:
        v = _SV(val, _widen(val))
        v.wide = v.sh  # an input, constant or literal is its own shadow
        return v

    def index(self, v: Value, i: int) -> _SV:
        sv = cast(_SV, v)  # this evaluator makes only _SV values (wrap/index/stack/apply)
        x = sv.val[i]
        sh = x if sv.sh is sv.val else sv.sh[i]  # a value that is its shadow stays so
        return _carry(_SV(x, sh, sv.err, sv.thr), [sv])

    def stack(self, vs: list, aval) -> _SV:
        if not vs:
            z = jnp.zeros(aval.shape, aval.dtype)
            return _SV(z, _widen(z))
        val = jnp.stack([v.val for v in vs])
        same = all(v.sh is v.val for v in vs)  # integers equal to their shadows stay so
        sh = val if same else jnp.stack([v.sh for v in vs])
        out = _SV(val, sh, max(v.err for v in vs), max(v.thr for v in vs))
        return _carry(out, vs)

    def apply(self, e, ins: list, path: str, backward: bool) -> list:
        ins = jax_decide.literal_inputs(self, e, ins)
        vals = _bind(e, [i.val for i in ins])
        floats = [k for k, v in enumerate(e.outvars) if is_float(v.aval.dtype)]
        followed = True
        if not floats and all(i.sh is i.val for i in ins) and not _float_params(e, ins):
            shadows = vals  # integers or predicates from equal inputs: the same outputs
        else:
            try:
                shadows = _bind(e, [i.sh for i in ins], True)
            except Exception:  # noqa: BLE001 - no float64 form: follow the program's values
                self.unfollowed.add(e.primitive.name)
                shadows, followed = [_widen(v) for v in vals], False
        where = _where(e, tuple(self.outer))
        phase = "backward" if backward else "forward"
        producers = _union(ins)
        if not floats:
            outs = [_SV(v, s) for v, s in zip(vals, shadows)]
            for o in outs:
                o.srcs = producers
            self._decide(e, ins, outs, vals, shadows, where, path, phase, {})
            return outs
        ref = _reference(e, ins, shadows) if followed else None
        outs, entries = self._measure(
            e, ins, vals, shadows, ref, floats, (where, path, phase, producers)
        )
        self._decide(e, ins, outs, vals, shadows, where, path, phase, entries)
        self.observe(e, ins, outs, path, backward)  # each value with its float64 shadow
        return outs

    def _measure(self, e, ins, vals, shadows, ref, floats, at) -> tuple[list, dict[int, int]]:
        """Each output as a value; each float output measured (`Ledger.measure`) against its
        reference (`_reference`) and shadow. Returns the values and, per float output, its
        ledger entry."""
        where, path, phase, producers = at
        name = e.primitive.name
        longest = max((max(np.shape(i.val), default=1) for i in ins), default=1)
        carried_in = [(i.err, i.thr) for i in ins if is_float(getattr(i.val, "dtype", None))]
        inherited = max((t for _, t in carried_in), default=0.0)
        outs = []
        entries: dict[int, int] = {}
        tags = _tags(e, ins)
        for k, (v, s) in enumerate(zip(vals, shadows)):
            if k not in floats:
                outs.append(_SV(v, s))
                outs[-1].srcs = producers
                continue
            terms = max([np.size(i.val) / max(np.size(v), 1) for i in ins] + [longest])
            dtype = np.dtype(e.outvars[k].aval.dtype)
            thr = max(inherited, diverge_carried_threshold(dtype))
            entries[k] = len(self.ledger.entries)
            y, s_np = _low(v), _f64(s)
            if ref is None:
                r = None
            elif ref is _EXACT:
                r = _host(v)  # a copy of input elements: the float64 op gives them widened
            else:
                r = s_np if ref is shadows else _f64(ref[k])
            err = self.ledger.measure(
                name,
                name,
                y,
                r,
                s_np,
                dtype,
                carried_in,
                thr,
                where,
                path,
                phase,
                facts=_facts(e, ins, k),
                terms=terms,
                longest=int(longest),
                producers=producers,
                tags=tags,
            )
            outs.append(_SV(v, s, err, thr))
            outs[-1].srcs = (entries[k],)
        return outs, entries

    def _decide(self, e, ins, outs, vals, shadows, where, path, phase, entries) -> None:
        """Judge `e` if it is a decision; pass on what later decisions are judged by."""
        jax_decide.propagate(e, ins, outs, entries)
        jax_decide.decide(self, e, ins, outs, vals, shadows, where, path, phase)


def _same_decision(v: _SV) -> bool:
    """Whether a value that is not a float (an index, a predicate) is its shadow: one a
    decision made other than float64 differs, and then the op on the shadows is no reference
    for the op's own error."""
    if v.thr != np.inf or v.sh is v.val:
        return True
    return bool(np.array_equal(np.asarray(v.val), np.asarray(v.sh)))


#: At most this many producers are kept per value (a scan's stacked output reads every
#: iteration's value; the latest ones are the cause search's way back).
MAX_PRODUCERS = 8


def _union(ins: list) -> tuple[int, ...]:
    """The ledger entries the values `ins` were computed from, latest first, at most
    `MAX_PRODUCERS`."""
    seen = {i: None for v in ins for i in getattr(v, "srcs", ())}
    return tuple(sorted(seen, reverse=True)[:MAX_PRODUCERS])


def _tags(e, ins: list) -> frozenset[str]:
    """What the cause search ranks an op by (`diag.diverge.ledger.TAGS`): a cast to a
    narrower float dtype; an input literal the tracer rounded."""
    tags = set()
    if e.primitive.name == "convert_element_type" and ins:
        src = getattr(ins[0].val, "dtype", None)
        new = e.params.get("new_dtype")
        if is_float(src) and new is not None and is_float(new):
            if numerics.precision_bits(np.dtype(new)) < numerics.precision_bits(np.dtype(src)):
                tags.add("narrowing")
    if any(i.lit is not None and i.lit[0] != i.lit[1] for i in ins):
        tags.add("literal")
    return frozenset(tags)


def _carry(out: _SV, srcs: list) -> _SV:
    """`out` (sliced or stacked from `srcs`) with what `jax_decide` keeps per value."""
    out.srcs = _union(srcs)
    cul = [s.cul for s in srcs if s.cul is not None]
    out.cul = max(cul, key=lambda c: c[0]) if cul else None
    out.cum, out.dec = any(s.cum for s in srcs), any(s.dec for s in srcs)
    out.flip = next((s.flip for s in srcs if s.flip is not None), None)
    out.perm = next((s.perm for s in srcs if s.perm is not None), None)
    return out


def _facts(e, ins: list, k: int) -> Callable[[], tuple[np.ndarray, Any]]:
    """(sum of |terms|, number of terms) of output k of a reduction, on demand: the float64
    op on |inputs| (each input's |float64 copy| kept on the value) and on ones (`_count`)."""

    def get():
        mag = _bind(e, [_mag_of(i) if _is_float_value(i) else _wide_of(i) for i in ins], True)
        return _f64(mag[k]), _count(e, [_wide_of(i) for i in ins], k)

    return get


def _float_params(e, ins: list) -> bool:
    """Whether the float64 form of `e` could differ from `e` on the same operands: a float
    operand, or a float dtype among its parameters (`_f64_params` widens it)."""
    if any(_is_float_value(i) for i in ins):
        return True
    params = bind_params(e)[1]
    return _f64_params(params) != params


def _is_float_value(v: _SV) -> bool:
    return is_float(getattr(v.val, "dtype", None))


#: Terms per element of a reduction's output by (primitive, parameters, output, operand
#: shapes and dtypes): the op on ones depends on nothing else, and a step's layers repeat the
#: same few. Only a count that is one number for every element is kept (as that number: the
#: rules take one n for the whole output by the same IEEE operations as n per element).
_COUNTS: dict = {}


def _count(e, wide: list, k: int) -> Any:
    """The float64 op on ones: how many terms each element of output k sums (a number or an
    array)."""
    key: tuple | None = None
    if all(is_float(getattr(w, "dtype", None)) for w in wide):
        try:
            params = _f64_params(bind_params(e)[1])
            key = (e.primitive, tuple(sorted(params.items())), k,
                   tuple((np.shape(w), np.dtype(w.dtype)) for w in wide))  # fmt: skip
            got = _COUNTS.get(key)
        except TypeError:  # an unhashable parameter: no cache
            key = got = None
        if got is not None:
            return got
    ones = [jnp.ones_like(w) if is_float(getattr(w, "dtype", None)) else w for w in wide]
    cnt = _f64(_bind(e, ones, True)[k])
    if key is not None and cnt.size and cnt.min() == cnt.max():
        if len(_COUNTS) > 4096:
            _COUNTS.clear()
        one = _COUNTS[key] = float(cnt.flat[0])
        return one
    return cnt


#: Primitives whose float outputs are copies of input elements (or of a padding operand): on
#: finite inputs the float64 op on the widened inputs gives the widened outputs, bit for bit.
EXACT = frozenset(
    """
reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice
dynamic_update_slice gather concatenate pad rev copy copy_p select_n reduce_max reduce_min
max min sort top_k
""".split()
)
_EXACT = object()  # `_reference`'s answer for such an op


def _reference(e, ins: list, shadows: list) -> Any:
    """The float64 op on the actual inputs: `shadows` where every input is its shadow;
    `_EXACT` for an `EXACT` op on finite inputs (the output widened is the reference);
    else the op re-run on the inputs' float64 copies (None where it cannot be)."""
    if all(i.err == 0.0 for i in ins) and all(map(_same_decision, ins)):
        return shadows  # the shadows are the inputs: the float64 op on them is the reference
    if e.primitive.name in EXACT and all(_finite(i) for i in ins):
        return _EXACT
    try:
        return _bind(e, [_wide_of(i) for i in ins], True)
    except Exception:  # noqa: BLE001
        return None


def _finite(v: _SV) -> bool:
    """Whether a value has no NaN or infinity (anything not a float has none)."""
    if not _is_float_value(v):
        return True
    a = np.asarray(v.val)
    return bool(np.isfinite(a if a.dtype in _NATIVE else a.astype(np.float32)).all())


def _where(e, outer: tuple) -> Callable[[], tuple[str, str]]:
    """(source, library line) of an equation, computed only when it is reported."""
    return lambda: source_and_library(e, outer)


def shadow(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    outputs: list | None = None,
    keep: dict | None = None,
) -> ShadowReport:
    """See `diag.diverge.shadow`; `outputs`, when given, receives the float64 shadow of each
    leaf of the function's result (None for a leaf that is not a float); `keep` receives the
    ledger (``ledger``) and the entries each result leaf was computed from (``sources``), for
    the cause search (`diag.diverge.cause`)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    prog = Program(fn, args, kwargs)
    try:
        closed = jax.make_jaxpr(prog.flat)(*prog.arrays)
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise DivergeError(
            f"{name} could not be traced ({type(e).__name__}: {e}); diag "
            f"diverge needs a function jax.make_jaxpr can trace"
        ) from e
    h = _Shadow()
    out_bwd = tuple(False for _ in closed.jaxpr.outvars)
    with jax.enable_x64(True), np.errstate(all="ignore"):
        try:
            outs = h.eval(
                closed.jaxpr, h.consts(closed), [h.wrap(a) for a in prog.arrays], "", out_bwd
            )
        except DivergeError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DivergeError(
                f"evaluating {name} equation by equation raised {type(e).__name__}: {e}"
            ) from e
        finally:
            release_scratch()  # the figures' per-thread buffers (diag.diverge.rules)
    res = next((o for o in outs if is_float(getattr(o.val, "dtype", None))), None)
    result, result_thr = (0.0, np.inf) if res is None else (res.err, res.thr)
    n = len(outs) - len(prog.state_names)  # the result's leaves, then the NNX state's
    if keep is not None:
        keep["ledger"] = h.ledger
        keep["sources"] = [o.srcs for o in outs[:n]]
    if outputs is not None:
        outputs.extend(
            _host(o.sh) if is_float(getattr(o.val, "dtype", None)) else None for o in outs[:n]
        )
    note = ""
    if h.unfollowed:
        note = (
            f"no float64 form for {', '.join(sorted(h.unfollowed))}: the shadow restarts "
            f"from their outputs"
        )
    return h.ledger.report("jax", name, result, note, result_thr)
