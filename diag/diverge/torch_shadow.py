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

import os
import weakref
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import torch

from diag.diverge.ledger import Ledger
from diag.diverge.records import DivergeError, ShadowReport
from diag.diverge.rules import op_class, release_scratch
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
from diag.tolerance.diverge import diverge_carried_threshold

_NP = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
       torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}
_REAL = frozenset(_NP)
_SEEDED = torch.Tag.nondeterministic_seeded


def _real(t: Any) -> bool:
    return is_float(t) and t.dtype in _REAL


def _map(x: Any, fn: Callable) -> Any:
    """`x` (an aten call's args/kwargs) with every tensor and float dtype passed through fn."""
    if isinstance(x, (torch.Tensor, torch.dtype)):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


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
    """Runs each op three ways and hands the figures to a `Ledger`."""

    def __init__(self):
        super().__init__()
        self.ledger = Ledger()
        self.unfollowed: set[str] = set()
        self._sh: dict[int, tuple[weakref.ref, torch.Tensor, float, float]] = {}

    def shadow_of(self, t: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(shadow, carried error, threshold); a tensor never seen is its own shadow."""
        got = self._sh.get(id(t))
        if got is not None and got[0]() is t:
            return got[1], got[2], got[3]
        return (t.detach().to(torch.float64, copy=True), 0.0,
                diverge_carried_threshold(_NP[t.dtype]))

    def _keep(self, t: torch.Tensor, sh: torch.Tensor, err: float, thr: float) -> None:
        key, table = id(t), self._sh

        def drop(ref: weakref.ref) -> None:  # a shadow lives as long as its tensor
            got = table.get(key)
            if got is not None and got[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), sh, err, thr)

    def _sh_arg(self, x: Any) -> Any:
        if isinstance(x, torch.dtype):
            return _wide(x)
        if _real(x):
            return self.shadow_of(x)[0]
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = written_args(func)
        if writes is VIEW:
            out = func(*args, **kwargs)
            base = args[0] if args else None
            if _real(base) and isinstance(out, torch.Tensor):
                sh, err, thr = self.shadow_of(base)
                try:
                    self._keep(out, func(sh, *args[1:], **kwargs), err, thr)
                except Exception:  # noqa: BLE001
                    pass
            return out
        ins = [x for x in flat_args((args, kwargs), []) if _real(x)]
        kind = OP_KIND.get(func)
        if kind is None:
            kind = OP_KIND[func] = op_kind(func)
        # Nothing to shadow; a random draw (run once: the user's generator must not move);
        # a fill or uninitialised memory (`empty_like`): values that come from no arithmetic.
        if not ins or _SEEDED in func.tags or kind in ("fill", "garbage"):
            return self._plain(func, args, kwargs)
        before = [self.shadow_of(t) for t in ins]
        # float64 copies of the actual inputs: taken before an op that writes its inputs,
        # after (and only when needed) for the others
        own = (_map(args, _wide), _map(kwargs, _wide)) if writes else None
        sh_args, sh_kwargs = _map(args, self._sh_arg), _map(kwargs, self._sh_arg)
        out = func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        try:
            sh_out = func(*sh_args, **sh_kwargs)
        except Exception:  # noqa: BLE001 - no float64 form: follow the program's values
            self.unfollowed.add(f"aten.{name}")
            return self._plain(func, args, kwargs, ran=out)
        if all(err == 0.0 for _, err, _ in before) and not writes:
            ref = sh_out  # the shadows are the inputs: the float64 op on them is the reference
            own = (sh_args, sh_kwargs)
        else:
            if own is None:  # an input equal to its shadow lends it as its float64 copy
                exact = {id(t): sh for t, (sh, err, _) in zip(ins, before) if err == 0.0}
                own = (_map(args, lambda x: _wide_or(x, exact)),
                       _map(kwargs, lambda x: _wide_or(x, exact)))
            try:
                ref = func(*own[0], **own[1])
            except Exception:  # noqa: BLE001
                ref = None
        if writes:  # what the op wrote, paired with its shadow and reference copies
            lows = [t for g in written_tensors(writes, args, kwargs) for t in g]
            shs = [t for g in written_tensors(writes, sh_args, sh_kwargs) for t in g]
            refs = [t for g in written_tensors(writes, *own) for t in g]
        else:
            lows, shs = flat_args(out, []), flat_args(sh_out, [])
            refs = flat_args(ref, []) if ref is not None else [None] * len(lows)
        carried_in = [(err, thr) for _, err, thr in before]
        inherited = max(thr for _, _, thr in before)
        src, phase, path = self.where()
        where = _where(src)
        longest = max((max(t.shape, default=1) for t in ins), default=1)
        for k, (y, s) in enumerate(zip(lows, shs)):
            if not _real(y) or not isinstance(s, torch.Tensor):
                continue
            r = refs[k] if k < len(refs) else None
            facts = None
            if op_class(name) == "reduction" and not writes:
                facts = _facts(func, own[0], own[1], k)
            terms = max([t.numel() / max(y.numel(), 1) for t in ins] + [longest])
            dtype = _NP[y.dtype]
            thr = max(inherited, diverge_carried_threshold(dtype))
            err = self.ledger.measure(
                f"aten.{name}", name, _low(y), _host(r) if isinstance(r, torch.Tensor)
                else None, _host(s), dtype, carried_in, thr, where, path, phase,
                facts=facts, terms=terms, longest=int(longest))
            self._keep(y, s, err, thr)
        self.observe(func, ins, lows)  # each tensor's float64 shadow: `shadow_of`
        return out

    def _plain(self, func, args, kwargs, ran: Any = None):
        """Run an op once; its outputs are their own shadows."""
        out = func(*args, **kwargs) if ran is None else ran
        for t in flat_args(out, []):
            if _real(t):
                self._keep(t, t.detach().to(torch.float64, copy=True), 0.0,
                           diverge_carried_threshold(_NP[t.dtype]))
        return out


def _facts(func, args, kwargs, k: int) -> Callable[[], tuple[np.ndarray, Any]]:
    """(sum of |terms|, number of terms) of output k of a reduction, on demand; `args` and
    `kwargs` are the float64 ones the reference ran on (they are not written)."""

    def get():
        mag = flat_args(func(*_map(args, _abs), **_map(kwargs, _abs)), [])[k]
        return _host(mag), _count(func, args, kwargs, k)

    return get


#: Terms per element of a reduction's output, by op and argument shapes: the op on ones does
#: not depend on the values, and the same layer's ops repeat (every step, every layer of a
#: width). Only counts that are one number for every element are kept.
_COUNTS: dict = {}


def _count(func, args, kwargs, k: int) -> Any:
    """The op on ones: how many terms each element of output k sums (a number or an array)."""
    key: tuple[Any, int, Any, Any] | None
    try:
        key = (func, k, _signature(args), _signature(kwargs))
        got = _COUNTS.get(key)
    except TypeError:  # an argument that is not hashable: no cache
        key = got = None
    if got is not None:
        return got
    cnt = _host(flat_args(func(*_map(args, _ones), **_map(kwargs, _ones)), [])[k])
    if key is not None and cnt.size and cnt.min() == cnt.max():
        if len(_COUNTS) > 4096:
            _COUNTS.clear()
        one = _COUNTS[key] = float(cnt.flat[0])
        return one
    return cnt


def _signature(x: Any) -> Any:
    """What the op on ones depends on: shapes of float64 tensors, and every other value; a
    tensor of another dtype (indices) holds values the count may depend on: not hashable."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float64:
            raise TypeError("a non-float tensor")
        return ("tensor", tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_signature(y) for y in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    hash(x)
    return (type(x).__name__, x)


def _wide_or(x: Any, exact: dict) -> Any:
    """`_wide`, except that a tensor equal to its float64 shadow is given that shadow."""
    if isinstance(x, torch.Tensor):
        got = exact.get(id(x))
        if got is not None:
            return got
    return _wide(x)


def _abs(x: Any) -> Any:
    return x.abs() if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x


def _ones(x: Any) -> Any:
    return torch.ones_like(x) if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x


def _where(src: tuple[str, int, str]) -> Callable[[], tuple[str, str]]:
    file, line, fn = src
    text = f"{os.path.basename(file)}:{line} ({fn})" if file else ""
    return lambda: (text, "")


def shadow(
    fn: Callable, args: tuple, kwargs: dict, outputs: list | None = None
) -> ShadowReport:
    """See `diag.diverge.shadow`; `outputs`, when given, receives the float64 shadow of each
    tensor of the function's result (None for one that is not a float)."""
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
    result_error = mode.shadow_of(first)[1] if first is not None else 0.0
    if outputs is not None:
        outputs.extend(
            _host(mode.shadow_of(t)[0]) if _real(t) else None
            for t in flat_args(result, [])
            if isinstance(t, torch.Tensor)
        )
    note = ""
    if mode.unfollowed:
        note = (f"no float64 form for {', '.join(sorted(mode.unfollowed))}: the shadow "
                f"restarts from their outputs")
    return mode.ledger.report("torch", name, result_error, note)
