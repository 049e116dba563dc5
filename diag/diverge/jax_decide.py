"""The decisions of a JAX shadow run: comparisons, argmax/argmin, top_k, select_n.

`diag.diverge.jax_shadow` evaluates every equation twice, in its dtypes and in float64 on the
shadows, so the shadow of a decision's output *is* the float64 decision: the shadow of a
``gt`` is the float64 predicate, that of ``argmax``/``top_k``/an argsort the float64 indices,
and a ``select_n`` or ``gather`` evaluated on the shadows follows them (a full-row
``top_k``'s order, no finding by itself, is judged at the first ``gather`` it changes). The
shadow therefore follows the float64 decision, and later findings are not artefacts of the
first. This module compares each decision with its shadow (`diag.diverge.decisions` judges a
flip forced or made), keeps per value what the judgement needs (the op that added the most
carried error among its ancestors: `cul`; whether it descends from a cumulative sum: `cum`;
whether a recorded decision already covers a predicate: `dec`; a ranking's order not yet
judged: `perm`), and gives a literal rounded at trace time (``0.8984375:bf16`` for a written
``0.9``) a shadow of the value written.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from diag import numerics
from diag.diverge.decisions import (
    FORCED,
    KINDS,
    MADE,
    LiteralRecord,
    follows,
    judge_decision,
    literal_moved,
    record,
    what,
    written_literal,
)
from diag.interp.jax_compile import bind
from diag.interp.jax_source import Literal, source
from diag.interp.jaxpr import is_inexact
from diag.status import Status

COMPARE = frozenset("gt ge lt le eq ne".split())
#: An argsort (``sort`` with an index payload) is not judged by itself: a permutation that
#: differs among values the dtype cannot tell apart (or that its softmax rounded) is no
#: finding; the shadow follows the float64 permutation, and what is decided on the sorted
#: values (a cumsum threshold, a greedy pick) or read with it (the result) is judged.
RANKING = {"argmax": "argmax", "argmin": "argmax", "top_k": "top_k"}
#: Where each ranking primitive names its axis, and which output holds the indices.
AXIS = {
    "argmax": ("axes", 0),
    "argmin": ("axes", 0),
    "top_k": ("axis", 1),
}
MINIMA = frozenset({"argmin"})
CUMULATIVE = frozenset("cumsum cumlogsumexp".split())
#: Literals in dtypes with fewer significand bits than this are reported (float32's rounding
#: of ``0.1`` is 3e-9 relative: true, but noise in a report); every rounded literal gets the
#: written value as its shadow whatever its dtype.
REPORT_BELOW_BITS = 24


def host(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def is_float(dtype: Any) -> bool:
    """Whether `dtype` is a real floating dtype (bf16, fp8, float32, ...; not complex)."""
    return dtype is not None and is_inexact(dtype) and np.dtype(dtype).kind != "c"


def literal_inputs(h, e, ins: list) -> list:
    """`ins` with each float literal that the tracer rounded (a written ``0.9`` used as
    ``0.8984375`` in bf16) given the written value as its shadow (and its rounding as its
    carried error); the literal is recorded in the ledger."""
    got = h.literal_cache.get(id(e))
    if got is None:
        got = h.literal_cache[id(e)] = _written(h, e)
    if not got:
        return ins
    ins = list(ins)
    for k, w in got:
        v = ins[k]
        used = float(np.asarray(v.val, np.float64))
        err = abs(used - w) / abs(w) if w else 0.0
        sv = type(v)(v.val, jnp.asarray(w, jnp.float64), err, 0.0)
        sv.cul = (err, f"the literal {w!r} (used as {used!r})", None)
        sv.lit = (w, used)
        ins[k] = sv
    return ins


def _written(h, e) -> list[tuple[int, float]]:
    found = []
    for k, var in enumerate(e.invars):
        if not isinstance(var, Literal):
            continue
        dtype = getattr(var.val, "dtype", None)
        if dtype is None or not is_float(dtype) or np.ndim(var.val) != 0:
            continue
        used = float(np.asarray(var.val, np.float64))
        src, filename, line, _ = source(e)
        if not filename or not np.isfinite(used):
            continue
        text = written_literal(filename, line, used, np.dtype(dtype))
        if text is None:
            continue
        found.append((k, float(text)))
        if numerics.precision_bits(np.dtype(dtype)) < REPORT_BELOW_BITS:
            name = numerics.dtype_name(np.dtype(dtype))
            h.ledger.literals.append(LiteralRecord(src, text, repr(used), name))
    return found


def propagate(e, ins: list, outs: list, entries: dict[int, int]) -> None:
    """Set `culprit`, `cum`, `dec` of each output from the inputs and this op.

    `entries` maps an output position to its ledger entry index (float outputs measured)."""
    name = e.primitive.name
    inherited = max((i.cul for i in ins if i.cul is not None), key=lambda c: c[0], default=None)
    cin = max((i.err for i in ins if i.thr != np.inf), default=0.0)
    cum = name in CUMULATIVE or any(i.cum for i in ins)
    dec = name in COMPARE or name in RANKING or any(i.dec for i in ins)
    flip = next((i.flip for i in ins if i.flip is not None), None)
    perm = next((i.perm for i in ins if i.perm is not None), None)
    for k, o in enumerate(outs):
        o.cum, o.dec, o.cul, o.flip, o.perm = cum, dec, inherited, flip, perm
        idx = entries.get(k)
        if idx is None or not np.isfinite(cin):
            continue
        added = o.err - cin
        if added > 0 and (inherited is None or added > inherited[0]):
            o.cul = (added, idx, inherited[1] if inherited is not None else None)


def decide(h, e, ins: list, outs: list, vals, shadows, where, path: str, phase: str) -> None:
    """Compare the decision equation `e` (if it is one) with its float64 shadow; record it,
    and mark its outputs as descending from the flip."""
    name = e.primitive.name
    exact_ops: tuple[int, ...] = ()
    if name in COMPARE:
        if not all(_float_val(i) for i in ins) or np.array_equal(vals[0], shadows[0]):
            return
        kind = "threshold" if any(i.cum for i in ins) else "compare"
        ops = ins
        low, exact = np.asarray(vals[0]), np.asarray(shadows[0])
        lows, exacts = [host(i.val) for i in ins], [host(i.sh) for i in ins]
        exact_ops = tuple(k for k, i in enumerate(ins) if i.lit is not None)
    elif name == "select_n":
        pred = ins[0]
        if pred.dec or np.array_equal(np.asarray(pred.val), np.asarray(pred.sh)):
            return
        kind, ops, lows, exacts = "select", [pred], [], []
        low, exact = np.asarray(pred.val), np.asarray(pred.sh)
    elif name in RANKING:
        got = _ranking(e, ins, vals, shadows)
        if got is None:
            return
        kind, low, exact, lows, exacts = got
        ops = ins[:1]
    elif name == "gather":
        _picked(h, e, ins, vals, where, path, phase)
        return
    elif name == "sort":
        _argsort(h, e, ins, outs, vals, shadows)
        return
    else:
        return
    dtype = np.dtype(ins[0].val.dtype) if kind != "select" else np.dtype(np.float64)
    if kind == "select":
        dtype = next(
            (np.dtype(i.val.dtype) for i in ins[1:] if _float_val(i)), np.dtype(np.float64)
        )
    rec = h.ledger.decide(
        name, kind, low, exact, dtype, lows, exacts, where, path, phase,
        cause_op=lambda: _cause(h, ops, low, exact, dtype, exacts),
        exact_operands=exact_ops,
    )  # fmt: skip
    if rec is None:
        if kind == KINDS[2]:  # top_k: its kept set is float64's, its order may not be
            _pending_perm(h, name, ops, outs, low, exact, dtype, lows, exacts)
        return
    upstream = next((o.flip for o in ops if o.flip is not None), None)
    if upstream is not None and rec.verdict == Status.FAIL:
        text = f"the flipped {upstream.primitive} at {upstream.source or 'an unknown line'}"
        rec = follows(rec, text, upstream.cause == FORCED)
        h.ledger.decisions[-1] = rec
    for o in outs:
        o.flip = rec


@dataclasses.dataclass
class Perm:
    """A ranking (a full-row `top_k`) whose permutation differs from float64's where the
    float64 values differ, not reported where it was taken (its kept set is float64's): the
    first `gather` that picks other elements with it reports it (`_picked`)."""

    primitive: str
    dtype: Any
    keys: np.ndarray  # the float64 values ranked (the decided axis last)
    low: np.ndarray  # the program's permutation and float64's (indices, the axis last)
    exact: np.ndarray
    forced: bool  # the whole permutation: every position's value ties the float64 one's
    cause: str
    recorded: bool = False


def _pending_perm(h, name, ops, outs, low, exact, dtype, lows, exacts) -> None:
    flipped, _, _, forced = judge_decision(
        KINDS[3], low, exact, dtype=dtype, operands_low=lows, operands_exact=exacts
    )
    if flipped:
        cause = "" if forced else _culprit_name(h, ops)
        perm = Perm(name, dtype, exacts[0], low, exact, forced, cause)
        for o in outs:
            o.perm = perm


def _argsort(h, e, ins: list, outs: list, vals, shadows) -> None:
    """An argsort (``sort`` of float keys with an index payload): its order, like a full
    ``top_k``'s, is judged where a ``gather`` reads with it."""
    if len(ins) != 2 or e.params.get("num_keys", 1) != 1 or not _float_val(ins[0]):
        return
    low, exact = np.asarray(vals[1]), np.asarray(shadows[1])
    if low.dtype.kind not in "iu" or np.array_equal(low, exact):
        return
    axis = e.params.get("dimension", -1)
    low, exact = np.moveaxis(low, axis, -1), np.moveaxis(exact, axis, -1)
    if not np.array_equal(
        np.sort(low, axis=-1), np.broadcast_to(np.arange(low.shape[-1]), low.shape)
    ):
        return  # a payload that is not the positions: no permutation
    keys = np.moveaxis(host(ins[0].sh), axis, -1)
    dtype = np.dtype(ins[0].val.dtype)
    _pending_perm(h, "argsort", ins[:1], outs[1:], low, exact, dtype, [], [keys])


def _picked(h, e, ins: list, vals, where, path: str, phase: str) -> None:
    """A `gather` of booleans (a kept mask put back in vocabulary order) read with indices
    that carry a permutation not yet reported: a decision where the mask read with the
    program's indices differs from the same mask read with the float64 ones (what the order
    alone changed; a cut the mask took is judged where it was taken, and a float output
    carries the difference as its error)."""
    perm = next((i.perm for i in ins[1:] if i.perm is not None), None)
    out = np.asarray(vals[0])
    if perm is None or perm.recorded or out.dtype != np.bool_ or len(ins) != 2:
        return
    idx = ins[1]
    alt = np.asarray(bind(e, [ins[0].val, jnp.asarray(idx.sh).astype(idx.val.dtype)])[0])
    diff = out != alt
    if not diff.any():
        return
    forced = _order_forced(perm, out, diff)
    judged = (int(diff.sum()), int(diff.size), math.nan, forced)
    by = "" if forced or not perm.cause else f", moved by {perm.cause}"
    rec = record(len(h.ledger.entries), "gather", "select", judged, perm.dtype, where, path, phase)
    rec = dataclasses.replace(
        rec,
        cause_op="" if forced else f"the order of {perm.primitive}{by}",
        reason=f"{what(rec)}: the order of {perm.primitive} ({FORCED if forced else MADE}{by}) "
        "changed which elements it picks",
    )
    h.ledger.decisions.append(rec)
    perm.recorded = True


def _order_forced(perm: Perm, out: np.ndarray, diff: np.ndarray) -> bool:
    """Whether one rounding of the ranked float64 values explains the elements the order
    moved: each sits, in the program's order, where float64's order has a value equal to its
    own once rounded. Only when the output is laid out as the ranked values (a mask in
    vocabulary order); else the judgement of the whole permutation."""
    keys = np.asarray(perm.keys, np.float64)
    if keys.shape != out.shape or perm.low.shape != keys.shape:
        return perm.forced
    n = keys.shape[-1]
    for k, low, exact, moved in zip(
        *(np.reshape(a, (-1, n)) for a in (keys, perm.low, perm.exact, diff))
    ):
        at = np.empty(n, np.int64)
        at[low.astype(np.int64)] = np.arange(n)  # each element's place in the program's order
        j = np.nonzero(moved)[0]
        # rounding is elementwise: only the elements compared are rounded
        mine, there = (
            numerics.round_to_dtype(k[i], perm.dtype).astype(np.float64)
            for i in (j, exact.astype(np.int64)[at[j]])
        )
        if np.any(mine != there):
            return False
    return True


def _cause(h, ops: list, low, exact, dtype, exacts: list) -> str:
    """What moved a value across: a literal rounded at trace time, when its rounding alone
    flips an element (the once-rounded operand against the used literal decides otherwise
    than the float64 operand against the written one); else `_culprit_name`."""
    lits = [(k, o.lit) for k, o in enumerate(ops) if o.lit is not None]
    if len(lits) == 1 and len(exacts) == 2:
        k, (written, used) = lits[0]
        diff = np.broadcast_to(np.asarray(low) != np.asarray(exact), np.broadcast(*exacts).shape)
        moved = literal_moved(exacts[1 - k], diff, written, used, dtype)
        if moved.any():
            name = numerics.dtype_name(dtype)
            lit = f"the literal {written!r} rounded to {used!r} ({name})"
            if moved.all():
                return lit
            rest = _culprit_name(h, ops)
            n = f"{int(moved.sum())} of {moved.size} flips"
            return f"{lit} ({n}), and {rest}" if rest else f"{lit} ({n})"
    return _culprit_name(h, ops)


def _ranking(e, ins, vals, shadows):
    """(kind, low, exact, operands low, operands exact) of argmax/argmin/top_k, with
    the decided axis last; None when there is nothing to decide."""
    name, p = e.primitive.name, e.params
    x = ins[0]
    if not _float_val(x):
        return None
    key, out = AXIS[name]
    axis = p.get(key, -1)
    if isinstance(axis, tuple):  # argmax's axes: one axis
        axis = axis[0]
    low, exact = np.asarray(vals[out]), np.asarray(shadows[out])
    if np.array_equal(low, exact):
        return None
    lo, ex = host(x.val), host(x.sh)
    if name in MINIMA:
        lo, ex = -lo, -ex
    lo, ex = np.moveaxis(lo, axis, -1), np.moveaxis(ex, axis, -1)
    if low.ndim == lo.ndim:  # top_k: indices along the axis (argmax: the axis reduced)
        low, exact = np.moveaxis(low, axis, -1), np.moveaxis(exact, axis, -1)
    return RANKING[name], low, exact, [lo], [ex]


def _float_val(v) -> bool:
    return is_float(getattr(v.val, "dtype", None))


def _culprit_name(h, ops: list) -> str:
    """``div at s.py:12 (sample), its error grown by exp at s.py:13 (sample)``: the op that
    added the most carried error among the decision's operands' ancestors (the grower), after
    the op whose error it grew (the one that added the most before it), when there is one."""
    cul = max((o.cul for o in ops if o.cul is not None), key=lambda c: c[0], default=None)
    if cul is None:
        return ""
    name = _label(h, cul[1])
    via = cul[2] if len(cul) > 2 else None
    return name if via is None else f"{_label(h, via)}, its error grown by {name}"


def _label(h, label: int | str) -> str:
    if isinstance(label, str):
        return label
    entry = h.ledger.entries[label]
    src, lib = entry.where()
    return f"{entry.primitive} at {src or lib or 'an unknown line'}"
