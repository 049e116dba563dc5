"""PyTorch NaN hunter: the NaN policy on diag's dispatch-mode skeleton (`diag.interp.torch_mode`).

Every aten op, forward and backward, runs once under the mode; each output is judged: a NaN no
input held, or an Inf from finite inputs, is a *birth*, and every non-finite tensor carries the
birth it descends from.

The function runs once, as the user would run it: a training step that updates parameters in
place is not repeated. Results that count ("sinks") are what the function returns, the
gradients autograd accumulated, and every tensor an op writes per its schema (an optimizer's
update, `_foreach_*_` and fused multi-tensor ops included). What it was given and left alone
is not a result: a -inf attention mask is a fact shown with the report, not a finding.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import numpy as np
import torch

from diag.interp.torch_mode import OpMode
from diag.interp.torch_ops import (
    OP_KIND,
    VIEW,
    all_finite,
    flat_args,
    flat_nonlist,
    host_copy,
    is_float,
    list_arguments,
    op_kind,
    op_name,
    per_index,
    tensor_flags,
    written_args,
    written_tensors,
)
from diag.interp.torch_source import library_from_stack, source_from_node, source_from_stack
from diag.nan.report import NanHuntError, NanReport
from diag.nan.summary import first_bad_index, summarize, values_at
from diag.nan.torch_names import arrived as arrived_facts
from diag.nan.torch_names import gradient_versions, named_inputs, sinks
from diag.nan.torch_pointwise import pointwise_birth


class _Birth:
    __slots__ = ("op", "kind", "phase", "src", "path", "ins", "out", "note", "pointwise", "library")

    def __init__(self, op, kind, phase, src, path, ins, out, note, pointwise, library=""):
        self.op, self.kind, self.phase, self.src, self.path = op, kind, phase, src, path
        self.ins, self.out, self.note, self.pointwise = ins, out, note, pointwise
        self.library = library


class BirthHunter(OpMode):
    """Judges every aten op's outputs; records births and the birth each bad tensor is from."""

    def __init__(self):
        super().__init__()
        self.births: list[_Birth] = []
        self._taint: dict[int, tuple[weakref.ref, int]] = {}
        self.written: dict[int, weakref.ref] = {}  # by id: an optimizer writes each often
        self.grads: list[weakref.ref] = []
        self.ops = 0  # aten ops seen
        self._known: dict[int, tuple[weakref.ref, tuple[int, ...], tuple[bool, bool]]] = {}
        # (birth its bad inputs descend from, whether it had bad inputs, what happened) for
        # the first op that raised.
        self.raised: tuple[int | None, bool, str] | None = None

    def flags(self, t: torch.Tensor) -> tuple[bool, bool]:
        """`tensor_flags`, remembered per tensor until its version counter moves: torch bumps it on
        every in-place write, through any view, so a remembered answer is never stale."""
        got = self._known.get(id(t))
        if got is not None and got[0]() is t and t._version in got[1]:
            return got[2]
        f = tensor_flags(t)
        self._known[id(t)] = (weakref.ref(t), (t._version,), f)
        return f

    def flags_written(self, t: torch.Tensor) -> tuple[bool, bool]:
        """Flags of a tensor an op just wrote. The mode runs below autograd's
        ADInplaceOrView kernel, which bumps the version after the op returns (multi-tensor
        `_foreach_*_` ops do not bump it at all): the answer holds for the version the tensor
        has now and the one it is about to have, until the next write, which the mode sees."""
        f = tensor_flags(t)
        v = t._version
        self._known[id(t)] = (weakref.ref(t), (v, v + 1), f)
        return f

    def _finite_copy(self, args: tuple, outs: list) -> bool:
        """A copy of a tensor known finite is finite (same dtype: a narrowing cast can
        overflow)."""
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        src = args[0]
        if any(t.dtype != src.dtype for t in outs):
            return False
        got = self._known.get(id(src))
        return (
            got is not None
            and got[0]() is src
            and src._version in got[1]
            and got[2] == (False, False)
        )

    def _all_finite_written(self, lists: list[list]) -> bool:
        """The fast path of a multi-tensor update: every tensor it wrote is finite (the
        common case) is settled with one screen each and no per-index bookkeeping."""
        written = [t for g in lists for t in g if is_float(t)]
        if not all_finite(written):
            return False
        for t in written:
            v = t._version
            self._known[id(t)] = (weakref.ref(t), (v, v + 1), (False, False))
            self._taint.pop(id(t), None)
        return True

    def taint_of(self, t: torch.Tensor) -> int | None:
        got = self._taint.get(id(t))
        if got is not None and got[0]() is t:
            return got[1]
        return None

    def _set_taint(self, t: torch.Tensor, taint: int | None) -> None:
        if taint is None:
            self._taint.pop(id(t), None)
        else:
            self._taint[id(t)] = (weakref.ref(t), taint)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        writes = written_args(func)
        if writes is VIEW:
            # A view holds its input's values: it cannot give birth, and carries the birth
            # of what it views. No check needed.
            out = func(*args, **kwargs)
            base = args[0] if args else None
            if isinstance(base, torch.Tensor) and isinstance(out, torch.Tensor):
                taint = self.taint_of(base)
                if taint is not None:
                    self._set_taint(out, taint)
            return out
        if writes:
            groups = written_tensors(writes, args, kwargs)
            pre = {id(t): self.flags(t) for g in groups for t in g if is_float(t)}
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self._note_raise(func, flat_args(kwargs, flat_args(args, [])), e)
            raise
        node = torch._C._current_autograd_node()
        if isinstance(out, (tuple, list)):
            outs = [
                t
                for t in (
                    flat_args(out, []) if any(isinstance(x, (tuple, list)) for x in out) else out
                )
                if is_float(t)
            ]
        else:
            outs = [out] if is_float(out) else []
        if node is not None and type(node).__name__ == "AccumulateGrad":
            self.grads.extend(weakref.ref(t) for t in outs)
        if not writes:
            if outs:
                self._pure(func, node, args, kwargs, outs)
            return out
        self._in_place(func, node, args, kwargs, groups, pre, outs)
        return out

    def _pure(self, func, node, args, kwargs, outs: list) -> None:
        """Judge an op that writes none of its arguments."""
        kind = OP_KIND.get(func)
        if kind is None:
            kind = OP_KIND[func] = op_kind(func)
        if kind == "fill" or (kind == "copy" and self._finite_copy(args, outs)):
            for t in outs:  # finite by construction: remember, skip the check
                self._known[id(t)] = (weakref.ref(t), (t._version,), (False, False))
        elif kind != "garbage":
            self._judge(func, node, (args, kwargs), outs, None, False)

    def _in_place(self, func, node, args, kwargs, groups, pre, outs: list) -> None:
        """Judge an op that writes (some of) its arguments: what it wrote is a result."""
        flat_in = flat_args(kwargs, flat_args(args, []))
        for g in groups:
            for t in g:
                if is_float(t):
                    self.written[id(t)] = weakref.ref(t)
        lists = [g for g in groups if isinstance(g, list)]
        full = len(lists) == len(groups)
        lists = [g for g in lists if g]  # amsgrad's max_exp_avg_sqs is [] when unused
        if lists and full and per_index(func, args, kwargs, lists):
            # A multi-tensor op (`_foreach_*_`, a fused optimizer) is one elementwise op per
            # index of its lists: judge each index on its own tensors, so a NaN already in one
            # parameter's gradient does not hide a NaN born in another's update.
            if self._all_finite_written(lists):
                return
            n = len(lists[0])
            scalars = [x for x in flat_nonlist(args, kwargs)]
            list_args = list_arguments(func, args, kwargs)
            for i in range(n):
                written_i = [g[i] for g in lists if is_float(g[i])]
                ins_i = [lst[i] for lst in list_args] + scalars
                self._judge(func, node, ins_i, written_i, pre, True)
            return
        seen = {id(t) for t in outs}
        outs += [t for g in groups for t in g if is_float(t) and id(t) not in seen]
        if outs:
            self._judge(func, node, flat_in, outs, pre, True)

    def _judge(self, func, node, flat_in, outs, pre, mutable) -> None:
        """Record a birth when `outs` hold a NaN no input held (or an Inf from finite inputs),
        and carry the birth each non-finite output descends from. `pre` holds the flags of
        tensors the op writes, taken before it ran."""
        out_flags = [self.flags_written(t) if mutable else self.flags(t) for t in outs]
        if not any(n or i for n, i in out_flags):
            if mutable:
                for t in outs:
                    self._set_taint(t, None)  # overwritten in place with finite values
            return
        if isinstance(flat_in, tuple):  # (args, kwargs), flattened only when needed
            flat_in = flat_args(flat_in[1], flat_args(flat_in[0], []))
        ins = [x for x in flat_in if is_float(x)]
        in_flags = [pre[id(t)] if pre is not None and id(t) in pre else self.flags(t) for t in ins]
        in_flags += [
            (x != x, x in (float("inf"), float("-inf"))) for x in flat_in if isinstance(x, float)
        ]
        in_nan = any(n for n, _ in in_flags)
        in_bad = any(n or i for n, i in in_flags)
        out_nan = any(n for n, _ in out_flags)
        out_inf = any(i for _, i in out_flags)
        in_taints = [self.taint_of(t) for t, (n, i) in zip(ins, in_flags) if n or i]
        inherited = [x for x in in_taints if x is not None]
        taint = min(inherited) if inherited else None
        kind = None
        if (out_nan and not in_nan) or (out_inf and not in_bad):
            kind = "NaN" if out_nan and not in_nan else "Inf"
        elif not mutable and torch.Tag.pointwise in func.tags:
            # An elementwise op fed some non-finite elements (a -inf mask) can still give
            # birth elsewhere: x / 0 on the finite elements. Judge it element by element.
            # The output still descends from the earliest birth among its inputs' when they
            # had one: "first" is first in execution order (an overflowing q @ k^T before the
            # mask's add that overflows again).
            kind = pointwise_birth(flat_in, outs)
        if kind is not None:
            self._record(func, node, flat_in, outs, out_flags, mutable, kind)
            if taint is None:
                taint = len(self.births) - 1
        for t, (n, i) in zip(outs, out_flags):
            self._set_taint(t, taint if (n or i) else None)

    def _note_raise(self, func, flat_in, error: Exception) -> None:
        """An op raised: keep which births its non-finite inputs descend from, if any."""
        if self.raised is not None:
            return
        bad = [(t, tensor_flags(t)) for t in flat_in if is_float(t)]
        bad = [(t, f) for t, f in bad if f[0] or f[1]]
        bad_taints = [self.taint_of(t) for t, _ in bad]
        taints = [x for x in bad_taints if x is not None]
        node = torch._C._current_autograd_node()
        file, line, fn = source_from_stack() if node is None else source_from_node(node, self.key)
        where = f" at {os.path.basename(file)}:{line} ({fn})" if file else ""
        self.raised = (
            min(taints) if taints else None,
            bool(bad),
            f"{op_name(func)}{where} then raised {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}",
        )

    def _record(self, func, node, flat_in, outs, out_flags, mutable, kind) -> None:
        src, phase, path = self.where(node)
        ins = [
            host_copy(x)
            for x in flat_in
            if (isinstance(x, torch.Tensor) and x.numel() > 0) or isinstance(x, float)
        ]
        bad = next(t for t, (n, i) in zip(outs, out_flags) if n or i)
        note = (
            "the op writes its input in place: input summaries show it after the op"
            if mutable
            else ""
        )
        if node is not None and isinstance(node, _CUSTOM_NODE):
            file, line, fn = source_from_stack()
            if file:  # the custom autograd.Function's own backward code
                note = f"run by backward code at {os.path.basename(file)}:{line} ({fn}). {note}"
        note = note.strip()
        pointwise = torch.Tag.pointwise in func.tags
        library = library_from_stack() if node is None else ""
        self.births.append(
            _Birth(
                op_name(func), kind, phase, src, path, ins, host_copy(bad), note, pointwise, library
            )
        )


_CUSTOM_NODE = torch.autograd.function.BackwardCFunction


def _report(b: _Birth, n_births: int) -> NanReport:
    file, line, func = b.src
    src = f"{os.path.basename(file)}:{line} ({func})" if file else ""
    idx = first_bad_index(b.out, b.kind)
    return NanReport(
        framework="torch",
        primitive=b.op,
        kind=b.kind,
        source=src,
        path=b.path,
        phase=b.phase,
        inputs=tuple(summarize(a) for a in b.ins),
        output=summarize(b.out),
        file=file,
        line=line,
        function=func,
        bad_index=idx,
        inputs_at_index=values_at(b.ins, b.out.shape, idx) if b.pointwise else None,
        births=n_births,
        note=b.note,
        library=b.library,
    )


def locate(fn: Callable, args: tuple, kwargs: dict) -> NanReport | None:
    """See `diag.nan.locate`."""
    # The screens' dot products may overflow (then the exact check runs): not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        return _locate(fn, args, kwargs)


def locate_if_torch(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, NanReport | None]:
    """`locate`, and whether the function ran any torch op (if not, it is not torch's and the
    report says nothing)."""
    hunter = BirthHunter()
    with np.errstate(over="ignore", invalid="ignore"):
        report = _locate(fn, args, kwargs, hunter)
    return hunter.ops > 0, report


def _locate(
    fn: Callable, args: tuple, kwargs: dict, hunter: BirthHunter | None = None
) -> NanReport | None:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    hunter = hunter or BirthHunter()
    named = named_inputs(fn, args, kwargs)
    arrived = arrived_facts(named, hunter.flags)
    grads_before = gradient_versions(named)
    try:
        with hunter.running():
            result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        return _raised(hunter, name, e, arrived)
    # Gradients may have been made after `named` was built: name them too.
    named.update({k: v for k, v in named_inputs(fn, args, kwargs).items() if k not in named})
    bad = []
    for where, t in sinks(result, named, hunter.grads, hunter.written, grads_before):
        nan, inf = hunter.flags(t)
        if nan or inf:
            bad.append((where, t, "NaN" if nan else "Inf"))
    if not bad:
        return None
    bad_taints = [hunter.taint_of(t) for _, t, _ in bad]
    roots = [r for r in bad_taints if r is not None]
    if roots:
        return _with(_report(hunter.births[min(roots)], len(hunter.births)), arrived=arrived)
    if hunter.births and not arrived:
        rep = _report(hunter.births[0], len(hunter.births))
        return _with(
            rep,
            note=(
                f"{bad[0][0]} holds {bad[0][2]}; it could not be traced to one op (a view written "
                f"in place?), so this is the first op that produced one"
            ),
        )
    where, t, kind = bad[0]
    given = "; ".join(arrived) or "an input"
    return NanReport(
        framework="torch",
        primitive="input",
        kind=kind,
        source="",
        path=where,
        phase="input",
        inputs=(),
        output=summarize(host_copy(t)),
        births=len(hunter.births),
        arrived=tuple(arrived),
        note=f"no op produced it: it reached {where} from what the function was given ({given})",
    )


def _with(rep: NanReport, **changes) -> NanReport:
    if "arrived" in changes:
        changes["arrived"] = tuple(changes["arrived"])
    if rep.note and "note" in changes:
        changes["note"] = f"{changes['note']}. {rep.note}"
    return NanReport(**{**rep.__dict__, **changes})


def _raised(hunter: BirthHunter, name: str, error: Exception, arrived: list[str]) -> NanReport:
    """The function raised. If the op that raised was fed NaN/Inf, that is the finding: report
    where it was born and what it made happen; otherwise it is an error like any other."""
    got = hunter.raised
    if got is None or not got[1]:
        first = (
            f"; {len(hunter.births)} NaN/Inf birth(s) were seen before it" if hunter.births else ""
        )
        raise NanHuntError(f"{name} raised {type(error).__name__}: {error}{first}") from error
    taint, _, what = got
    if taint is not None:
        return _with(
            _report(hunter.births[taint], len(hunter.births)), raised=what, arrived=arrived
        )
    given = "; ".join(arrived) or "an input"
    return NanReport(
        framework="torch",
        primitive="input",
        kind="NaN",
        source="",
        path="",
        phase="input",
        births=len(hunter.births),
        raised=what,
        arrived=tuple(arrived),
        note=f"no op produced it: the raising op was fed what the function was given ({given})",
    )
