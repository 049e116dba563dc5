"""The PyTorch re-runner of the cause search: the function run again under a dispatch mode that
computes chosen call sites in a wider dtype.

A site is an aten op called from one line (its user line, the library line below it, forward
or backward), as the shadow names it. Under `_Promote` every aten op whose site is chosen runs
on float operands widened (float32 for bf16/fp16, float64 for float32) and returns the wider
result. Everything else runs as written, except that an op given operands of two float dtypes
(a promoted value meeting a bf16 weight in a matmul, which aten would refuse) computes in the
wider, as type promotion carries a value, for `MAX_HOPS` ops that compute with it; then the
result is rounded to the dtype the code gives it. A cast the code wrote
(``.to(torch.bfloat16)``) still narrows; a promoted narrowing cast is one the user would drop,
and its wider value stays. An op that writes into a tensor (``add_``) writes in that tensor's
dtype.
The function runs on a fresh copy of its arguments each time (a training step updates its
model), with torch's random generator state restored, and runs whole each time.
"""

from __future__ import annotations

import copy
import linecache
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from diag.diverge.cause import MAX_HOPS, package_of
from diag.diverge.rules import op_class
from diag.interp.torch_mode import OpMode
from diag.interp.torch_ops import VIEW, flat_args, is_float, written_args, written_tensors
from diag.interp.torch_source import is_user_file, lines_from_stack

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WIDE = {
    "bfloat16": torch.float32,
    "float16": torch.float32,
    "float32": torch.float64,
}
_CASTS = frozenset({"_to_copy", "to", "_to_dtype"})


def _eps(d: torch.dtype) -> float:
    return torch.finfo(d).eps


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class _Promote(OpMode):
    """Runs the function with `sites` promoted (see the module docstring).

    Per tensor made wider than the code makes it, `_wide` keeps the dtype the code gives it
    and how many more ops its width lasts (`cause.MAX_HOPS`).
    """

    def __init__(self, sites: frozenset, packages: dict):
        super().__init__()
        self.sites = sites
        self.names = {k[0] for k in sites}
        self.packages = packages
        self._wide: dict[int, tuple[weakref.ref, torch.dtype, int]] = {}
        self._code = ""  # the code of the line `_key` last read

    def _key(self, name: str) -> tuple[str, str, str, str]:
        node = torch._C._current_autograd_node()
        if node is None:
            src, library = lines_from_stack()
            phase = "forward"
        else:
            src, phase, _ = self.where(node)
            library = ""
        file, line, fn = src
        self._code = linecache.getline(file, line).strip() if file else ""
        where = f"{os.path.basename(file)}:{line} ({fn})" if file else ""
        return (f"aten.{name}", where, library, phase)

    def _info(self, t: Any) -> tuple[torch.dtype, int] | None:
        got = self._wide.get(id(t)) if isinstance(t, torch.Tensor) else None
        if got is not None and got[0]() is t:
            return got[1], got[2]
        return None

    def _mark(self, out: Any, natural: torch.dtype, budget: int) -> None:
        for t in flat_args(out, []):
            if is_float(t) and t.dtype in _FLOAT and _eps(t.dtype) < _eps(natural):
                self._wide[id(t)] = (weakref.ref(t), natural, budget)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = written_args(func)
        if writes is VIEW:
            out = func(*args, **kwargs)
            info = self._info(args[0]) if args else None
            if info is not None:
                self._mark(out, *info)
            return out
        floats = [t for t in flat_args((args, kwargs), []) if is_float(t) and t.dtype in _FLOAT]
        if not floats:
            return func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        promote = False
        if f"aten.{name}" in self.names:
            key = self._key(name)
            promote = key in self.sites
            if promote and key not in self.packages:
                self.packages[key] = (_package(), "", self._code)
        infos = [self._info(t) for t in floats]
        natural = min((i[0] if i is not None else t.dtype for t, i in zip(floats, infos)), key=_eps)
        widest = min((t.dtype for t in floats), key=_eps)
        cast = name in _CASTS and kwargs.get("dtype") in _FLOAT
        budget: int | None = None
        if promote and cast and _eps(kwargs["dtype"]) > _eps(floats[0].dtype):
            up: torch.dtype | None = floats[0].dtype  # the cast dropped, for good
            kwargs = dict(kwargs, dtype=up)
        elif promote:
            up = _WIDE.get(_name(natural), natural)
            up = up if _eps(up) < _eps(widest) else widest
            budget = MAX_HOPS
            if cast:
                kwargs = dict(kwargs, dtype=up)
        elif cast or len({t.dtype for t in floats}) == 1 and not any(infos):
            return func(*args, **kwargs)  # as written (a cast the code wrote narrows)
        else:
            up = widest
            kept = [i[1] for i in infos if i is not None]
            step = 0 if op_class(name) == "structural" else 1
            budget = max(kept) - step if kept else None
        out = self._run(func, args, kwargs, writes, up)
        if budget is not None and not writes:
            if budget <= 0:
                return _map(out, lambda x: _narrow(x, natural))
            self._mark(out, natural, budget)
        return out

    def _run(self, func, args, kwargs, writes, up):
        groups = written_tensors(writes, args, kwargs) if writes else []
        kept = {id(t) for g in groups for t in g}

        def widen(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and id(x) not in kept and x.dtype in _FLOAT:
                return x.to(up) if _eps(x.dtype) > _eps(up) else x
            if isinstance(x, torch.dtype) and x in _FLOAT and _eps(x) > _eps(up):
                return up
            return x

        try:
            return func(*_map(args, widen), **_map(kwargs, widen))
        except (RuntimeError, TypeError):  # an op that cannot take them: as written
            return func(*args, **kwargs)


def _narrow(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _FLOAT and _eps(x.dtype) < _eps(dtype):
        return x.to(dtype)
    return x


def _map(x: Any, fn: Callable) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _package() -> str:
    """The installed package nearest below the user's line on the stack (``transformers``,
    ``torch`` for torch's own Python code), or ``""``."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if is_user_file(path):
            return ""
        got = package_of(path)
        if got:
            return got
        f = f.f_back  # type: ignore[assignment]
    return ""


class Rerun:
    """`__call__(sites)`: the function run once more on a fresh copy of its arguments with
    `sites` promoted; its output leaves (``leaves`` turns the result into (path, array)).

    The arguments as given are copied by each run and never run on (`diag.diverge.explain`
    runs the shadow on a copy of its own), so a training step starts each run from the same
    model. ``setup_s`` is how long the last run's copy took: no part of the function's time.
    The whole function runs each time: an eager function cannot start again at a line in the
    middle (its locals, its modules' buffers, a branch taken on a value are Python's)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, leaves: Callable):
        self.given = (fn, args, kwargs)
        self.rng = torch.random.get_rng_state()
        self.leaves = leaves
        self.packages: dict = {}
        self.setup_s = 0.0
        self.runs = 0

    def __call__(self, sites: frozenset) -> list[tuple[str, Any]]:
        clock = time.perf_counter()
        fn, args, kwargs = copy.deepcopy(self.given)
        self.setup_s = time.perf_counter() - clock
        mode = _Promote(sites, self.packages)
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(self.rng)
            with mode.running():
                result = fn(*args, **kwargs)
        self.runs += 1
        return self.leaves(result)
