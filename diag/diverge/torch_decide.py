"""Decisions in the PyTorch shadow: each comparison, argmax, top-k and sort taken in float64 too.

The shadow mode (`diag.diverge.torch_shadow`) runs every aten op on the float64 shadows of its
inputs, so a comparison's shadow output is the float64 decision. This module judges it against
the decision the program took (`diag.diverge.decisions.judge_decision`), records a flip, and
says which value the shadow follows from then on: the float64 decision (a mask, the indices of
a sort), so that what comes after is judged against the float64 program; where the two
decisions are the same up to equal values (a tie sorted either way) the program's own one, so
that a tie taken the other way is not carried on as a difference.

Python scalars compared with a bf16/fp16 tensor are rounded to the tensor's dtype before the
comparison (``x <= 0.1`` on bf16 compares with 0.10009765625); the shadow compares with the
value written. Such a literal is reported (`LiteralRecord`), and a flip it causes alone is
made by the computation (a bf16 implementation may compare with the exact value), not forced.

What moved a value across is told by each tensor's `Origin`: for a float value, the op whose
own rounding is the larger part of its error against the shadow (an op whose error mostly
came in with its inputs passes on the origin of its most erroneous input); for a mask or
indices that differ from their float64 shadow, the decision that made them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from diag import numerics
from diag.diverge import decisions
from diag.diverge.decisions import FORCED, MADE, DecisionRecord, LiteralRecord
from diag.status import Status

#: aten op (name without overload) -> (decision kind, which output holds the decision, the
#: sign that makes "largest" the decided direction: argmin/min decide on -x).
DECISIONS: dict[str, tuple[str, int, int]] = {
    **{n: ("compare", 0, 1) for n in ("gt", "ge", "lt", "le", "eq", "ne")},
    "argmax": ("argmax", 0, 1),
    "argmin": ("argmax", 0, -1),
    "max": ("argmax", 1, 1),  # max.dim: (values, indices)
    "min": ("argmax", 1, -1),
    "topk": ("top_k", 1, 1),
    "sort": ("sort", 1, 1),
}
#: Kinds a flip is reported at; a sort's permutation is an intermediate (equal-looking values
#: in another order): its flips are reported where they change a mask or a pick.
_REPORTED = {"compare": True, "threshold": True, "argmax": True, "top_k": True, "sort": False}
#: Ops that use a mask or indices to pick float values, and the kind of decision they report.
CONSUMERS = {
    "where": "select",
    "masked_fill": "mask",
    "masked_scatter": "mask",
    "index_put": "mask",
    "index_put_": "mask",
    "masked_fill_": "mask",
}
_CUMULATIVE = frozenset({"cumsum", "cumsum_", "cumprod", "logcumsumexp"})


class Origin:
    """What moved a value (or a decision) off its float64 shadow.

    Attributes:
        primitive, where: the op (``aten.div``) and its lines (a `where` callable).
        forced: for a decision: whether its flip was forced by rounding; None for a value.
        recorded: for a decision: whether a `DecisionRecord` was made for it (a sort's is
            made where its permutation first changes a mask or a pick).
        made_by: the bare op name that produced the value (through views): ``cumsum``.
    """

    __slots__ = ("primitive", "where", "forced", "recorded", "made_by", "cause")

    def __init__(self, primitive, where, forced=None, recorded=True, made_by="", cause=""):
        self.primitive, self.where, self.forced = primitive, where, forced
        self.recorded, self.made_by, self.cause = recorded, made_by, cause

    @property
    def text(self) -> str:
        """``aten.div at logits_process.py:302 (__call__)``; a decision's: ``the flipped
        aten.le at ...``."""
        if not self.primitive:
            return ""
        flipped = "the flipped " if self.forced is not None else ""
        return f"{flipped}{self.primitive} at {where_text(self.where)}"


NO_ORIGIN = Origin("", None, made_by="")


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype.is_floating_point:
        t = t.to(torch.float64)
    return t.cpu().numpy()


def bound_args(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An aten call's arguments by their schema names."""
    out = {a.name: v for a, v in zip(func._schema.arguments, args)}
    out.update(kwargs)
    return out


def where_text(where) -> str:
    source, library = where()
    return library or source or "an unknown line"


class Decider:
    """Judges the decisions of one shadow run; `mode` is the shadow mode (its `shadow_of`,
    `origin_of`, `ledger`)."""

    def __init__(self, mode):
        self.mode = mode

    def decide(self, name, func, args, kwargs, out, sh_out, where, path, phase):
        """Judge op `name` (a key of `DECISIONS`); return (the shadow output the shadow
        follows, the `Origin` of its decision output when that differs from the program's)."""
        kind, k, sign = DECISIONS[name]
        b = bound_args(func, args, kwargs)
        x = b.get("self")
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            return sh_out, None
        if kind == "compare":
            return self._compare(name, x, b.get("other"), out, sh_out, where, path, phase)
        multi = isinstance(out, (tuple, list))
        low_t, exact_t = (out[k], sh_out[k]) if multi else (out, sh_out)
        if torch.equal(low_t, exact_t):
            return sh_out, None
        dim = b.get("dim", None if kind == "argmax" else -1)
        if name == "topk" and not b.get("largest", True):
            sign = -1
        xl, xe = _np(x) * sign, _np(self.mode.shadow_of(x)[0]) * sign
        lo, ex = _np(low_t), _np(exact_t)
        if dim is None:  # argmax over the flattened tensor
            xl, xe, lo, ex = xl.reshape(-1), xe.reshape(-1), lo.reshape(()), ex.reshape(())
        else:
            d = dim % max(x.dim(), 1)
            xl, xe = np.moveaxis(xl, d, -1), np.moveaxis(xe, d, -1)
            if kind != "argmax":  # indices along the decided axis: put it last too
                lo, ex = np.moveaxis(lo, d, -1), np.moveaxis(ex, d, -1)
            elif lo.ndim == x.dim():  # keepdim
                lo, ex = np.squeeze(lo, d), np.squeeze(ex, d)
        dtype = numerics.as_dtype(str(x.dtype).split(".")[-1])
        judged = decisions.judge_decision(
            kind, lo, ex, dtype=dtype, operands_low=[xl], operands_exact=[xe]
        )
        if judged[0] == 0:  # the same decision up to equal values: follow the program's
            if multi:
                return type(sh_out)(low_t if i == k else s for i, s in enumerate(sh_out)), None
            return low_t, None
        origin = self._judged(name, kind, judged, dtype, [x], where, path, phase, literal=None)
        return sh_out, origin

    def _compare(self, name, x, other, out, sh_out, where, path, phase):
        common = torch.result_type(x, other) if isinstance(other, torch.Tensor) else x.dtype
        if not common.is_floating_point:
            return sh_out, None
        dtype = numerics.as_dtype(str(common).split(".")[-1])
        literal = None
        if isinstance(other, (float, int)) and not isinstance(other, bool):
            used = float(torch.tensor(other, dtype=x.dtype).item())
            if used != float(other):
                literal = (float(other), used)
                self.mode.ledger.literals.append(
                    LiteralRecord(
                        source=where_text(where),
                        written=repr(float(other)),
                        used=repr(used),
                        dtype=numerics.dtype_name(dtype),
                    )
                )
        if torch.equal(out, sh_out):
            return sh_out, None
        operands = [x] + ([other] if isinstance(other, torch.Tensor) else [])
        ex = [
            _np(self.mode.shadow_of(t)[0]) if t.dtype.is_floating_point else _np(t)
            for t in operands
        ]
        lo = [_np(t) for t in operands]
        if len(ex) == 1:
            ex.append(np.float64(other))
            lo.append(np.float64(literal[1] if literal else other))
        judged = decisions.judge_decision(
            "compare",
            _np(out),
            _np(sh_out),
            dtype=dtype,
            operands_low=lo,
            operands_exact=ex,
            exact_operands=(1,) if literal is not None else (),  # the literal as written
        )
        if judged[0] == 0:
            return out, None
        kind = (
            "threshold"
            if any(self.mode.origin_of(t).made_by in _CUMULATIVE for t in operands)
            else "compare"
        )
        origin = self._judged(
            name,
            kind,
            judged,
            dtype,
            operands,
            where,
            path,
            phase,
            literal=(literal, ex, _np(out) != _np(sh_out)),
        )
        return sh_out, origin

    def _judged(self, name, kind, judged, dtype, operands, where, path, phase, literal):
        """Record a flipped decision (its cause from its operands' origins); its `Origin`."""
        ins = [self.mode.origin_of(t) for t in operands if isinstance(t, torch.Tensor)]
        upstream = next((o for o in ins if o.forced is not None), None)
        primitive = f"aten.{name}"
        if judged[3]:  # one rounding of its own float64 operands explains it
            upstream = None
        cause = "" if upstream is not None else self._cause(literal, dtype, operands, where)
        rec = decisions.record(
            len(self.mode.ledger.entries), primitive, kind, judged, dtype, where, path, phase, cause
        )
        if upstream is not None:  # its operands differ by an earlier flipped decision
            rec = decisions.follows(rec, upstream.text, bool(upstream.forced))
        reported = _REPORTED[kind]
        if reported:
            self.mode.ledger.decisions.append(rec)
        return Origin(primitive, where, rec.verdict == Status.WARN, reported, name, rec.cause_op)

    def _cause(self, literal, dtype, operands, where) -> str:
        """What moved a value across: a literal rounded to the dtype, if it alone flips an
        element; else the origin of the float operand that carries the most error."""
        if literal is not None and literal[0] is not None:
            (written, used), ex, flipped = literal
            if decisions.literal_moved(ex[0], flipped, written, used, dtype).any():
                return (
                    f"the literal {written!r} rounded to {used!r} "
                    f"({numerics.dtype_name(dtype)}) at {where_text(where)}"
                )
        floats = [t for t in operands if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
        if not floats:
            return ""
        worst = max(floats, key=lambda t: self.mode.shadow_of(t)[1])
        return self.mode.origin_of(worst).text

    def consume(self, name, func, args, kwargs, dins: list, where, path, phase) -> None:
        """An op that picks float values by a mask or indices whose float64 shadow differs
        (`dins`): report the decision there if it was not reported where it was made (a sort
        whose other order changes which values are kept)."""
        kind = CONSUMERS.get(name, "select")
        for t in dins:
            o = self.mode.origin_of(t)
            if o.recorded or o.forced is None:
                continue
            lo, ex = _np(t), _np(self.mode.shadow_of(t)[0])
            if lo.shape != ex.shape:
                continue
            diff = lo != ex
            flipped = int(diff.sum())
            if not flipped:
                continue
            floats = [x for x in args if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
            dtype = numerics.as_dtype(str(floats[0].dtype).split(".")[-1]) if floats else "float32"
            rec = decisions.record(
                len(self.mode.ledger.entries),
                f"aten.{name}",
                kind,
                (flipped, int(diff.size), math.nan, bool(o.forced)),
                dtype,
                where,
                path,
                phase,
                o.text,
            )
            by = f", moved by {o.cause}" if o.cause else ""
            cause = FORCED if o.forced else MADE
            rec = dataclasses.replace(
                rec,
                cause_op=f"{o.text}{by}",
                reason=f"{decisions.what(rec)}: {o.text} ({cause}{by}) changed which values it "
                "keeps",
            )
            self.mode.ledger.decisions.append(rec)
            o.recorded = True


__all__ = [
    "CONSUMERS",
    "DECISIONS",
    "NO_ORIGIN",
    "Decider",
    "DecisionRecord",
    "Origin",
    "bound_args",
]
