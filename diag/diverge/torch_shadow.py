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
import weakref
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import torch

from diag.diverge.chunked import max_absdiff_parts
from diag.diverge.ledger import Ledger
from diag.diverge.records import DivergeError, ShadowReport
from diag.diverge.rules import carried_error, max_absdiff, op_class, release_scratch
from diag.diverge.torch_copies import Copies
from diag.diverge.torch_decide import CONSUMERS, DECISIONS, NO_ORIGIN, Decider, Origin
from diag.diverge.torch_facts import draws, facts, host, latest, map_args, op_tags
from diag.interp.torch_mode import OpMode
from diag.interp.torch_ops import (
    OP_KIND,
    VIEW,
    flat_args,
    is_float,
    op_kind,
    written_args,
    written_tensors,
)
from diag.interp.torch_source import lines_from_stack
from diag.tolerance.diverge import diverge_carried_threshold

_NP = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}
_REAL = frozenset(_NP)
_SEEDED = torch.Tag.nondeterministic_seeded


def _real(t: Any) -> bool:
    return is_float(t) and t.dtype in _REAL


def _low(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy, without a float64 copy: the rules widen float32 and
    float16 exactly as they subtract (bfloat16, which numpy lacks, becomes float32, exactly)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def _wide(x: Any) -> Any:
    if isinstance(x, torch.dtype):
        return torch.float64 if x in _REAL else x
    if _real(x):
        return x.detach().to(torch.float64, copy=True)
    return x


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
        self._sh: dict[int, tuple[weakref.ref, torch.Tensor, float, float, Any, tuple]] = {}
        # the ledger entries the op being judged read (the cause search's dataflow), its tags
        self._producers: tuple[int, ...] = ()
        self._tags: frozenset[str] = frozenset()
        self.decider = Decider(self)
        self._decided = False  # whether a mask or indices has ever had a shadow of its own
        self.mags: dict = {}  # |x| of float64 arguments of reductions (`torch_facts`)
        self._fresh = Copies()  # float64 copies of the tensors not seen yet

    def shadow_of(self, t: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(shadow, carried error, threshold); a tensor never seen is its own shadow (a mask
        or indices that differ from their float64 shadow carry an infinite error)."""
        got = self._sh.get(id(t))
        if got is not None and got[0]() is t:
            return got[1], got[2], got[3]
        if not _real(t):
            return t, 0.0, 0.0
        return self._fresh.of(t), 0.0, diverge_carried_threshold(_NP[t.dtype])

    def origin_of(self, t: torch.Tensor) -> Origin:
        """What moved `t` off its shadow (`NO_ORIGIN` when nothing did)."""
        got = self._sh.get(id(t))
        if got is not None and got[0]() is t and got[4] is not None:
            return got[4]
        return NO_ORIGIN

    def sources_of(self, t: Any) -> tuple[int, ...]:
        """The ledger entries `t` was computed from (empty for a tensor never seen)."""
        got = self._sh.get(id(t)) if isinstance(t, torch.Tensor) else None
        if got is not None and got[0]() is t:
            return got[5]
        return ()

    def _distinct(self, t: Any) -> bool:
        """A mask or indices with a float64 shadow of their own."""
        if not isinstance(t, torch.Tensor) or _real(t):
            return False
        got = self._sh.get(id(t))
        return got is not None and got[0]() is t

    def _keep(
        self,
        t: torch.Tensor,
        sh: torch.Tensor,
        err: float,
        thr: float,
        origin=None,
        srcs: tuple[int, ...] | None = None,
    ):
        key, table = id(t), self._sh
        srcs = self._producers if srcs is None else srcs

        def drop(ref: weakref.ref) -> None:  # a shadow lives as long as its tensor
            got = table.get(key)
            if got is not None and got[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), sh, err, thr, origin, srcs)
        if not _real(t):
            self._decided = True

    def _keep_decided(self, t: torch.Tensor, sh: torch.Tensor, origin: Any) -> None:
        """A mask's or indices' shadow, kept only while it differs from the program's."""
        if sh.shape == t.shape and sh.dtype == t.dtype and torch.equal(sh, t):
            self._sh.pop(id(t), None)
        else:
            self._keep(t, sh, math.inf, 0.0, origin)

    def _sh_arg(self, x: Any) -> Any:
        if isinstance(x, torch.dtype):
            return _wide(x)
        if _real(x) or self._distinct(x):
            return self.shadow_of(x)[0]
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = written_args(func)
        if writes is VIEW:
            return self._view(func, args, kwargs)
        if writes and self._fresh:
            self._fresh.forget([t for g in written_tensors(writes, args, kwargs) for t in g])
        flat = flat_args((args, kwargs), [])
        ins = [x for x in flat if _real(x)]
        dins = [x for x in flat if self._distinct(x)] if self._decided else []
        kind = OP_KIND.get(func)
        if kind is None:
            kind = OP_KIND[func] = op_kind(func)
        # A random draw (run once: the user's generator must not move); uninitialised
        # memory (`empty_like`): values that come from no arithmetic.
        if kind == "garbage":
            return self._plain(func, args, kwargs)
        if _SEEDED in func.tags and draws(func, args, kwargs):
            if ins:
                self.drawn.add(f"aten.{func._schema.name.split('::', 1)[-1]}")
            return self._plain(func, args, kwargs)
        if not ins and not dins:
            return self._made(func, args, kwargs)
        if kind == "fill":
            return self._plain(func, args, kwargs)
        return self._shadowed(func, args, kwargs, writes, ins, dins)

    def _made(self, func, args, kwargs):
        """Floats made from no float: integers cast (``position_ids.to(x.dtype)``), divided or
        scaled, an ``arange`` or ``full`` in a narrow dtype. Their shadow is the same op in
        float64 on the integers, exact where the narrow dtype rounds (position 2001 in
        bfloat16 is 2000); taking the rounded output as its own shadow would hide that
        rounding from every op downstream, and the float64 reference with it."""
        out = func(*args, **kwargs)
        lows = flat_args(out, [])
        if not any(_real(t) for t in lows):
            return self._plain(func, args, kwargs, ran=out)

        def wide(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype not in (torch.bool, torch.float64):
                return x.to(torch.float64) if not x.is_complex() else x
            return _wide(x)

        try:
            shs = flat_args(func(*map_args(args, wide), **map_args(kwargs, wide)), [])
        except Exception:  # noqa: BLE001 - no float64 form: the output is its own shadow
            return self._plain(func, args, kwargs, ran=out)
        for y, s in zip(lows, shs):
            if not _real(y) or not isinstance(s, torch.Tensor) or s.shape != y.shape:
                continue
            s = s.detach().to(torch.float64)
            dtype = _NP[y.dtype]
            err, _ = carried_error(np.atleast_1d(_low(y)), np.atleast_1d(host(s)), dtype)
            self._keep(y, s, err, diverge_carried_threshold(dtype))
        return out

    def _view(self, func, args, kwargs):
        """A view's shadow is the same view of its base's shadow."""
        out = func(*args, **kwargs)
        base = args[0] if args else None
        if isinstance(out, torch.Tensor) and (_real(base) or self._distinct(base)):
            sh, err, thr = self.shadow_of(base)
            try:
                self._keep(
                    out,
                    func(sh, *args[1:], **kwargs),
                    err,
                    thr,
                    self.origin_of(base),
                    self.sources_of(base),
                )
            except Exception:  # noqa: BLE001
                pass
        return out

    def _shadowed(self, func, args, kwargs, writes, ins, dins):
        """Run the op as written, on the shadows and in float64; judge and keep its outputs."""
        before = [self.shadow_of(t) for t in ins]
        self._producers = latest({i: None for t in ins + dins for i in self.sources_of(t)})
        self._tags = op_tags(func, args, kwargs, ins)
        if writes:  # a mask written in place gets a shadow of its own to write into
            for g in written_tensors(writes, args, kwargs):
                for t in g:
                    if not _real(t) and not self._distinct(t):
                        self._keep(t, t.clone(), math.inf, 0.0, None)
        # float64 copies of the actual inputs: taken before an op that writes its inputs,
        # after (and only when needed) for the others
        own = (map_args(args, _wide), map_args(kwargs, _wide)) if writes else None
        sh_args, sh_kwargs = map_args(args, self._sh_arg), map_args(kwargs, self._sh_arg)
        out = func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        try:
            sh_out = func(*sh_args, **sh_kwargs)
        except Exception:  # noqa: BLE001 - no float64 form: follow the program's values
            self.unfollowed.add(f"aten.{name}")
            return self._plain(func, args, kwargs, ran=out)
        ref, own = self._reference(
            func, args, kwargs, writes, ins, dins, before, own, (sh_args, sh_kwargs, sh_out)
        )
        where, phase, path = self._lines()
        decided = None
        if name in DECISIONS and ins:
            sh_out, decided = self.decider.decide(
                name, func, args, kwargs, out, sh_out, where, path, phase
            )
        elif dins and (name in CONSUMERS or any(_real(t) for t in flat_args(out, []))):
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
            name,
            func,
            (args, kwargs),
            own,
            writes,
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
        if all(err == 0.0 for _, err, _ in before) and not writes and not dins:
            return sh_out, (sh_args, sh_kwargs)  # the shadows are the inputs
        if writes and not any(_real(t) for g in written_tensors(writes, args, kwargs) for t in g):
            return None, None  # it writes masks or indices only: nothing to measure
        if own is None:  # an input equal to its shadow lends it as its float64 copy
            exact = {id(t): sh for t, (sh, err, _) in zip(ins, before) if err == 0.0}
            own = (
                map_args(args, lambda x: _wide_or(x, exact)),
                map_args(kwargs, lambda x: _wide_or(x, exact)),
            )
        try:
            return func(*own[0], **own[1]), own
        except Exception:  # noqa: BLE001
            return None, own

    def _lines(self) -> tuple[Callable[[], tuple[str, str]], str, str]:
        """(where: a callable giving (user line, library line), phase, path) of this op."""
        node = torch._C._current_autograd_node()
        if node is None:
            src, library = lines_from_stack()
            phase, path = "forward", "/".join(self.modules)
        else:
            src, phase, path = self.where(node)
            library = ""
        file, line, fn = src

        def where() -> tuple[str, str]:  # called only for the ops a report shows
            return (f"{os.path.basename(file)}:{line} ({fn})" if file else ""), library

        return where, phase, path

    def _outputs(self, name, func, low, own, writes, ins, dins, before, triples, lines, origin):
        """Measure each float output against its reference and shadow; keep the shadows
        (`low`: the op's own arguments, `own`: the float64 ones its reference ran on)."""
        where, phase, path = lines
        carried_in = [(err, thr) for _, err, thr in before] + [(math.inf, 0.0) for _ in dins]
        inherited = max((thr for _, _, thr in before), default=0.0)
        longest = max((max(t.shape, default=1) for t in ins), default=1)
        lows, shs, refs = triples
        for k, (y, s) in enumerate(zip(lows, shs)):
            if not isinstance(y, torch.Tensor) or not isinstance(s, torch.Tensor):
                continue
            if not _real(y):
                self._keep_decided(y, s, origin)
                continue
            if s.shape != y.shape:  # picked by a flipped mask: the shadow restarts from y
                sh = y.detach().to(torch.float64, copy=True)
                self._keep(y, sh, math.inf, diverge_carried_threshold(_NP[y.dtype]), origin)
                self.restarted.add(f"aten.{name}")
                continue
            r = refs[k] if k < len(refs) else None
            fx = None
            if op_class(name) == "reduction" and not writes and own is not None:
                fx = facts(func, own[0], own[1], k, self.mags, low)
            terms = max([t.numel() / max(y.numel(), 1) for t in ins] + [longest])
            dtype = _NP[y.dtype]
            thr = max(inherited, diverge_carried_threshold(dtype))
            y_np, s_np = _low(y), host(s)
            r_np = (s_np if r is s else host(r)) if isinstance(r, torch.Tensor) else None
            err = self.ledger.measure(
                f"aten.{name}",
                name,
                y_np,
                r_np,
                s_np,
                dtype,
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
            o = self._value_origin(name, (y_np, r_np, s_np, err), ins, dins, where)
            self._keep(y, s, err, thr, o, (len(self.ledger.entries) - 1,))

    def _value_origin(self, name, figures, ins, dins, where) -> Origin | None:
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
                return Origin(f"aten.{name}", where, made_by=name)
        inputs = dins or ins
        worst = max(inputs, key=lambda t: self.shadow_of(t)[1])
        o = self.origin_of(worst)
        if o.forced is not None or not o.primitive:
            return o if o.primitive else Origin(f"aten.{name}", where, made_by=name)
        return Origin(o.primitive, o.where, made_by=name)

    def _plain(self, func, args, kwargs, ran: Any = None):
        """Run an op once; its outputs are their own shadows."""
        out = func(*args, **kwargs) if ran is None else ran
        for t in flat_args(out, []):
            if _real(t):
                self._keep(
                    t,
                    t.detach().to(torch.float64, copy=True),
                    0.0,
                    diverge_carried_threshold(_NP[t.dtype]),
                    srcs=(),
                )
            elif isinstance(t, torch.Tensor):
                self._sh.pop(id(t), None)
        return out


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


def _wide_or(x: Any, exact: dict) -> Any:
    """`_wide`, except that a tensor equal to its float64 shadow is given that shadow (a
    parameter's is kept: `torch_copies`); the others are widened afresh (keeping the copies
    of activations measured slower: 10.2-10.5x eager against 9.3-9.7x at width 1024)."""
    if isinstance(x, torch.Tensor):
        got = exact.get(id(x))
        if got is not None:
            return got
    return _wide(x)


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
    first = next((t for t in flat_args(result, []) if _real(t)), None)
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
            host(mode.shadow_of(t)[0]) if _real(t) else None
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
