"""PyTorch shadow execution: every aten op, forward and backward, in its dtype and in float64.

A `TorchDispatchMode` sees each aten op below autograd, the backward pass's included
(diag's dispatch-mode skeleton, `diag.interp.torch_mode`, which `diag.nan` runs on too: what an
op writes, which user line called it, the tag on each autograd node that names its forward
line). Per op three calls run:
the op as the program called it, the op on the float64 shadows of its inputs (float dtypes in
its arguments widened to float64), and the op in float64 on the actual inputs (the reference
for its own error; an input that carries no error lends its shadow as its float64 copy, and
when every input does, the shadow output is the reference and the third call is skipped).
Shadows are kept per tensor object; a view's shadow is the same view of its
base's shadow, so a write through a view reaches the shadow too.

Ops that draw random numbers (dropout) run once: running them again would move the generator
the user's program depends on; their shadow is their output. A tensor the shadow has not seen
(a saved tensor autograd rebuilt, a parameter) starts with a shadow equal to itself.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from diag.diverge.chunked import max_absdiff_parts
from diag.diverge.ledger import Ledger
from diag.diverge.records import DivergeError, ShadowReport
from diag.diverge.rules import carried_error, max_absdiff, release_scratch
from diag.diverge.torch_copies import Copies
from diag.diverge.torch_decide import NO_ORIGIN, Decider, Origin
from diag.diverge.torch_facts import draws, facts, host, latest, map_args, op_tags
from diag.diverge.torch_opinfo import NP, OpInfo, low, op_info, real, threshold, wide
from diag.interp.torch_mode import OpMode
from diag.interp.torch_ops import VIEW, flat_args, written_tensors
from diag.interp.torch_source import library_text, stack_lines

#: What `_Mode._sh` keeps per tensor: (weak reference to it, its float64 shadow, its carried
#: error, its threshold, its `Origin` or None, the ledger entries it was computed from).
Kept = tuple[Any, torch.Tensor, float, float, Any, tuple]


class _Mode(OpMode):
    """Runs each op three ways and hands the figures to a `Ledger`.

    Shadows are kept per tensor: a float tensor's float64 shadow, and a mask's or indices'
    when the float64 decision that made them differs from the program's (a tensor that is not
    float and has no entry is its own shadow).
    """

    def __init__(self):
        super().__init__()
        self.ledger = Ledger()
        self.unfollowed: set[str] = set()
        self.restarted: set[str] = set()  # shaped by a flipped mask: no shadow to compare
        self.drawn: set[str] = set()  # drew random numbers from float inputs: run once
        self._sh: dict[int, Kept] = {}
        # the ledger entries the op being judged read (the cause search's dataflow), its tags
        self._producers: tuple[int, ...] = ()
        self._tags: frozenset[str] = frozenset()
        self.decider = Decider(self)
        self._decided = False  # whether a mask or indices has ever had a shadow of its own
        self.mags: dict = {}  # |x| of float64 arguments of reductions (`torch_facts`)
        self._fresh = Copies()  # float64 copies of the tensors not seen yet
        table = self._sh

        def drop(ref: _Ref) -> None:  # a shadow lives as long as its tensor
            key = ref.key
            got = table.get(key)
            if got is not None and got[0] is ref:
                del table[key]

        self._drop = drop

    def _kept(self, t: Any) -> Kept | None:
        """What `_sh` keeps for tensor `t` (None when nothing: never seen, or its own shadow)."""
        got = self._sh.get(id(t))
        return got if got is not None and got[0]() is t else None

    def _entry(self, t: torch.Tensor) -> Kept:
        """`_kept` for a float tensor the shadow follows (`real`), or the entry of one never
        seen: its float64 copy, no error, its dtype's threshold."""
        got = self._kept(t)
        if got is not None:
            return got
        return (None, self._fresh.of(t), 0.0, threshold(t.dtype), None, ())

    def shadow_of(self, t: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(shadow, carried error, threshold); a tensor never seen is its own shadow (a mask
        or indices that differ from their float64 shadow carry an infinite error)."""
        got = self._kept(t)
        if got is not None:
            return got[1], got[2], got[3]
        if not real(t):
            return t, 0.0, 0.0
        return self._fresh.of(t), 0.0, threshold(t.dtype)

    def origin_of(self, t: torch.Tensor) -> Origin:
        """What moved `t` off its shadow (`NO_ORIGIN` when nothing did)."""
        got = self._kept(t)
        return got[4] if got is not None and got[4] is not None else NO_ORIGIN

    def sources_of(self, t: Any) -> tuple[int, ...]:
        """The ledger entries `t` was computed from (empty for a tensor never seen)."""
        got = self._kept(t) if isinstance(t, torch.Tensor) else None
        return got[5] if got is not None else ()

    def _distinct(self, t: Any) -> bool:
        """A mask or indices with a float64 shadow of their own."""
        if not isinstance(t, torch.Tensor) or real(t):
            return False
        return self._kept(t) is not None

    def _keep(
        self,
        t: torch.Tensor,
        sh: torch.Tensor,
        err: float,
        thr: float,
        origin=None,
        srcs: tuple[int, ...] | None = None,
        is_real: bool | None = None,
    ):
        ref = _Ref(t, self._drop)
        ref.key = key = id(t)
        self._sh[key] = (ref, sh, err, thr, origin, self._producers if srcs is None else srcs)
        if not (real(t) if is_real is None else is_real):
            self._decided = True

    def _keep_decided(self, t: torch.Tensor, sh: torch.Tensor, origin: Any) -> None:
        """A mask's or indices' shadow, kept only while it differs from the program's."""
        if sh.shape == t.shape and sh.dtype == t.dtype and torch.equal(sh, t):
            self._sh.pop(id(t), None)
        else:
            self._keep(t, sh, math.inf, 0.0, origin, is_real=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = op_info(func)
        writes = op.writes
        if writes is VIEW:
            return self._view(func, args, kwargs)
        if writes and self._fresh:
            self._fresh.forget([t for g in written_tensors(writes, args, kwargs) for t in g])
        flat = flat_args(args, [])
        if kwargs:
            flat_args(kwargs, flat)
        ins = [x for x in flat if real(x)]
        dins = [x for x in flat if self._distinct(x)] if self._decided else []
        # A random draw (run once: the user's generator must not move); uninitialised
        # memory (`empty_like`): values that come from no arithmetic.
        if op.kind == "garbage":
            return self._plain(func, args, kwargs)
        if op.seeded and draws(func, args, kwargs):
            if ins:
                self.drawn.add(op.primitive)
            return self._plain(func, args, kwargs)
        if not ins and not dins:
            return self._made(func, args, kwargs)
        if op.kind == "fill":
            return self._plain(func, args, kwargs)
        return self._shadowed(op, func, args, kwargs, ins, dins)

    def _made(self, func, args, kwargs):
        """Floats made from no float: integers cast (``position_ids.to(x.dtype)``), divided or
        scaled, an ``arange`` or ``full`` in a narrow dtype. Their shadow is the same op in
        float64 on the integers, exact where the narrow dtype rounds (position 2001 in
        bfloat16 is 2000); taking the rounded output as its own shadow would hide that
        rounding from every op downstream, and the float64 reference with it."""
        out = func(*args, **kwargs)
        lows = flat_args(out, [])
        if not any(real(t) for t in lows):
            return self._plain(func, args, kwargs, ran=out)

        def widen(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype not in (torch.bool, torch.float64):
                return x.to(torch.float64) if not x.is_complex() else x
            return wide(x)

        try:
            shs = flat_args(func(*map_args(args, widen), **map_args(kwargs, widen)), [])
        except Exception:  # noqa: BLE001 - no float64 form: the output is its own shadow
            return self._plain(func, args, kwargs, ran=out)
        for y, s in zip(lows, shs):
            if not real(y) or not isinstance(s, torch.Tensor) or s.shape != y.shape:
                continue
            s = s.detach().to(torch.float64)
            err, _ = carried_error(np.atleast_1d(low(y)), np.atleast_1d(host(s)), NP[y.dtype])
            self._keep(y, s, err, threshold(y.dtype), is_real=True)
        return out

    def _view(self, func, args, kwargs):
        """A view's shadow is the same view of its base's shadow."""
        out = func(*args, **kwargs)
        base = args[0] if args else None
        if not isinstance(out, torch.Tensor) or not isinstance(base, torch.Tensor):
            return out
        got = self._entry(base) if real(base) else self._kept(base)
        if got is not None:
            origin = got[4] if got[4] is not None else NO_ORIGIN
            try:
                self._keep(out, func(got[1], *args[1:], **kwargs), got[2], got[3], origin, got[5])
            except Exception:  # noqa: BLE001
                pass
        return out

    def _shadowed(self, op: OpInfo, func, args, kwargs, ins, dins):
        """Run the op as written, on the shadows and in float64; judge and keep its outputs."""
        writes, name = op.writes, op.name
        before = [self._entry(t) for t in ins]  # (ref, shadow, error, threshold, ...)
        seen = {i: None for e in before for i in e[5]}
        for t in dins:
            seen.update((i, None) for i in self._sh[id(t)][5])
        self._producers = latest(seen)
        self._tags = op_tags(func, args, kwargs, ins, name)
        if writes:  # a mask written in place gets a shadow of its own to write into
            for g in written_tensors(writes, args, kwargs):
                for t in g:
                    if not real(t) and not self._distinct(t):
                        self._keep(t, t.clone(), math.inf, 0.0, None, is_real=False)
        # float64 copies of the actual inputs: taken before an op that writes its inputs,
        # after (and only when needed) for the others
        own = (map_args(args, wide), map_args(kwargs, wide)) if writes else None
        shadows = {id(t): e[1] for t, e in zip(ins, before)}
        for t in dins:
            shadows[id(t)] = self._sh[id(t)][1]
        if writes:  # the masks given shadows just now
            for t in flat_args((args, kwargs), []):
                if id(t) not in shadows and self._distinct(t):
                    shadows[id(t)] = self._sh[id(t)][1]

        def sh_arg(x: Any) -> Any:
            return wide(x) if isinstance(x, torch.dtype) else shadows.get(id(x), x)

        sh_args, sh_kwargs = map_args(args, sh_arg), map_args(kwargs, sh_arg)
        out = func(*args, **kwargs)
        try:
            sh_out = func(*sh_args, **sh_kwargs)
        except Exception:  # noqa: BLE001 - no float64 form: follow the program's values
            self.unfollowed.add(op.primitive)
            return self._plain(func, args, kwargs, ran=out)
        ref, own = self._reference(
            func, args, kwargs, writes, ins, dins, before, own, (sh_args, sh_kwargs, sh_out)
        )
        where, phase, path = self._lines()
        decided = None
        if op.decision and ins:
            sh_out, decided = self.decider.decide(
                name, func, args, kwargs, out, sh_out, where, path, phase
            )
        elif dins and (op.consumer or any(real(t) for t in flat_args(out, []))):
            self.decider.consume(name, func, args, kwargs, dins, where, path, phase)
        if writes:  # what the op wrote, paired with its shadow and reference copies
            lows = [t for g in written_tensors(writes, args, kwargs) for t in g]
            shs = [t for g in written_tensors(writes, sh_args, sh_kwargs) for t in g]
            refs = [t for g in written_tensors(writes, *own) for t in g] if own else []
        else:
            lows, shs = flat_args(out, []), flat_args(sh_out, [])
            refs = flat_args(ref, []) if ref is not None else []
        origin = decided or next((self.origin_of(t) for t in dins), None)
        self._outputs(
            op,
            func,
            (args, kwargs),
            own,
            ins,
            dins,
            before,
            (lows, shs, refs),
            (where, phase, path),
            origin,
        )
        self.observe(func, ins, lows)  # each tensor's float64 shadow: `shadow_of`
        return out

    def _reference(self, func, args, kwargs, writes, ins, dins, before, own, shadowed):
        """(the float64 op on the actual inputs or None, the arguments it ran on)."""
        sh_args, sh_kwargs, sh_out = shadowed
        if not writes and not dins and all(e[2] == 0.0 for e in before):
            return sh_out, (sh_args, sh_kwargs)  # the shadows are the inputs
        if writes and not any(real(t) for g in written_tensors(writes, args, kwargs) for t in g):
            return None, None  # it writes masks or indices only: nothing to measure
        if own is None:  # an input equal to its shadow lends it as its float64 copy
            exact = {id(t): e[1] for t, e in zip(ins, before) if e[2] == 0.0}

            def widen(x: Any) -> Any:
                # the others are widened afresh: keeping copies of activations for later ops
                # measured slower (at width 1024: 10.2-10.5x eager against 9.3-9.7x; the
                # latest 16, shared by memory and layout, saved 14-26% of the widened
                # elements and no measurable time)
                got = exact.get(id(x)) if isinstance(x, torch.Tensor) else None
                return wide(x) if got is None else got

            own = (map_args(args, widen), map_args(kwargs, widen))
        try:
            return func(*own[0], **own[1]), own
        except Exception:  # noqa: BLE001
            return None, own

    def _lines(self) -> tuple[Callable[[], tuple[str, str]], str, str]:
        """(where: a callable giving (user line, library line), phase, path) of this op."""
        node = torch._C._current_autograd_node()
        if node is None:
            src, library = stack_lines(sys._getframe(1))
            phase, path = "forward", "/".join(self.modules)
        else:
            (src, phase, path), library = self.where(node), None
        file, line, fn = src

        def where() -> tuple[str, str]:  # called only for the ops a report shows
            return (f"{os.path.basename(file)}:{line} ({fn})" if file else ""), library_text(
                library
            )

        return where, phase, path

    def _outputs(self, op, func, low_args, own, ins, dins, before, triples, lines, origin):
        """Measure each float output against its reference and shadow; keep the shadows
        (`low_args`: the op's own arguments, `own`: the float64 ones its reference ran on)."""
        where, phase, path = lines
        name, writes = op.name, op.writes
        carried_in = [(e[2], e[3]) for e in before] + [(math.inf, 0.0) for _ in dins]
        inherited, longest, most = 0.0, 1, 0
        for t, e in zip(ins, before):
            inherited, longest = max(inherited, e[3]), max(longest, max(t.shape, default=1))
            most = max(most, t.numel())
        lows, shs, refs = triples
        for k, (y, s) in enumerate(zip(lows, shs)):
            if not isinstance(y, torch.Tensor) or not isinstance(s, torch.Tensor):
                continue
            if not real(y):
                self._keep_decided(y, s, origin)
                continue
            if s.shape != y.shape:  # picked by a flipped mask: the shadow restarts from y
                sh = y.detach().to(torch.float64, copy=True)
                self._keep(y, sh, math.inf, threshold(y.dtype), origin, is_real=True)
                self.restarted.add(op.primitive)
                continue
            r = refs[k] if k < len(refs) else None
            fx = None
            if op.reduction and not writes and own is not None:
                fx = facts(func, own[0], own[1], k, self.mags, low_args)
            terms = max(most / max(y.numel(), 1), longest) if ins else longest
            thr = max(inherited, threshold(y.dtype))
            y_np, s_np = low(y), host(s)
            r_np = (s_np if r is s else host(r)) if isinstance(r, torch.Tensor) else None
            err = self.ledger.measure(
                op.primitive,
                name,
                y_np,
                r_np,
                s_np,
                NP[y.dtype],
                carried_in,
                thr,
                where,
                path,
                phase,
                facts=fx,
                terms=terms,
                longest=int(longest),
                producers=self._producers,
                tags=self._tags,
            )
            o = self._value_origin(op, (y_np, r_np, s_np, err), ins, dins, where)
            self._keep(y, s, err, thr, o, (len(self.ledger.entries) - 1,), is_real=True)

    def _value_origin(self, op, figures, ins, dins, where) -> Origin | None:
        """The op whose own rounding is the larger part of this value's error against its
        shadow: this one, or (an error that came in) the origin of its most erroneous input."""
        y, r, s, err = figures
        if err == 0.0:
            return None
        if r is not None and y.shape == r.shape == s.shape:
            own = self.ledger.own_diff  # max |y - r|, measured by the ledger
            if own is None:
                own = max_absdiff(y, r)
            came = self.ledger.came_diff
            if came is None:
                came = _came(r, s, own, self.ledger.carried_diff)
            if own > 0.0 and own >= came:
                return Origin(op.primitive, where, made_by=op.name)
        inputs = dins or ins
        worst = max(inputs, key=lambda t: self.shadow_of(t)[1])
        o = self.origin_of(worst)
        if o.forced is not None or not o.primitive:
            return o if o.primitive else Origin(op.primitive, where, made_by=op.name)
        return Origin(o.primitive, o.where, made_by=op.name)

    def _plain(self, func, args, kwargs, ran: Any = None):
        """Run an op once; its outputs are their own shadows."""
        out = func(*args, **kwargs) if ran is None else ran
        for t in flat_args(out, []):
            if real(t):
                sh = t.detach().to(torch.float64, copy=True)
                self._keep(t, sh, 0.0, threshold(t.dtype), srcs=(), is_real=True)
            elif isinstance(t, torch.Tensor):
                self._sh.pop(id(t), None)
        return out


class _Ref(weakref.ref):
    """A weak reference to a tensor that knows its key in `_Mode._sh` (one callback serves
    every entry: no closure made per kept tensor)."""

    __slots__ = ("key",)
    key: int


def _came(r: np.ndarray, s: np.ndarray, own: float, carried: float) -> float:
    """max |r - s|, the error that came in with the inputs, or inf when it surely exceeds
    `own` = max |y - r|: with `carried` = max |y - s| above 3 own, some element has
    |r - s| >= |y - s| - |y - r| > 2 own (each difference is rounded once, relatively by
    2^-53 at most), so the pass over the output is not needed to compare them."""
    if r is s:
        return 0.0
    if math.isfinite(carried) and carried > 3.0 * own:
        return math.inf
    return max_absdiff_parts(r, s)


def shadow(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    outputs: list | None = None,
    keep: dict | None = None,
) -> ShadowReport:
    """See `diag.diverge.shadow`; `outputs`, when given, receives the float64 shadow of each
    tensor of the function's result (None for one that is not a float); `keep` receives the
    ledger (``ledger``) and the entries each result tensor was computed from (``sources``),
    for the cause search (`diag.diverge.cause`)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    mode = _Mode()
    try:
        with np.errstate(all="ignore"), mode.running():
            result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise DivergeError(f"{name} raised {type(e).__name__}: {e}") from e
    finally:
        release_scratch()
    first = next((t for t in flat_args(result, []) if real(t)), None)
    result_error, thr = 0.0, math.inf
    if first is not None:
        _, result_error, thr = mode.shadow_of(first)
    notes = []
    if keep is not None:
        keep["ledger"] = mode.ledger
        keep["sources"] = [
            mode.sources_of(t) for t in flat_args(result, []) if isinstance(t, torch.Tensor)
        ]
    if outputs is not None:
        outputs.extend(
            host(mode.shadow_of(t)[0]) if real(t) else None
            for t in flat_args(result, [])
            if isinstance(t, torch.Tensor)
        )
    if mode.unfollowed:
        notes.append(
            f"no float64 form for {', '.join(sorted(mode.unfollowed))}: the shadow "
            f"restarts from their outputs"
        )
    if mode.restarted:
        notes.append(
            f"{', '.join(sorted(mode.restarted))} picked another number of values by a "
            f"flipped mask: the shadow restarts from their outputs"
        )
    if mode.drawn:
        notes.append(
            f"{', '.join(sorted(mode.drawn))} drew random numbers: run once, the shadow "
            f"restarts from their outputs"
        )
    note = "; ".join(notes)
    return mode.ledger.report("torch", name, result_error, note, result_threshold=thr)
