"""The PyTorch re-runner of the cause search: the function run again under a dispatch mode that
computes chosen call sites in a wider dtype.

A site is an aten op called from one line (its user line, the library line below it, forward
or backward), as the shadow names it. Under `_Promote` every aten op whose site is chosen runs
on float operands widened (float32 for bf16/fp16, float64 for float32) and returns the wider
result. Everything else runs as written, except that an op given operands of two float dtypes
(a promoted value meeting a bf16 weight in a matmul, which aten would refuse) computes in the
wider, as type promotion carries a value; a cast the code wrote (``.to(torch.bfloat16)``)
still narrows, and an op that writes into a tensor (``add_``) writes in that tensor's dtype.
The function runs on a fresh copy of its arguments each time (a training step updates its
model), with torch's random generator state restored.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from diag.diverge.cause import package_of, wider
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
    def __init__(self, sites: frozenset, packages: dict):
        super().__init__()
        self.sites = sites
        self.names = {k[0] for k in sites}
        self.packages = packages

    def _key(self, name: str) -> tuple[str, str, str, str]:
        node = torch._C._current_autograd_node()
        if node is None:
            src, library = lines_from_stack()
            phase = "forward"
        else:
            src, phase, _ = self.where(node)
            library = ""
        file, line, fn = src
        where = f"{os.path.basename(file)}:{line} ({fn})" if file else ""
        return (f"aten.{name}", where, library, phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = written_args(func)
        if writes is VIEW:
            return func(*args, **kwargs)
        floats = [t for t in flat_args((args, kwargs), []) if is_float(t) and t.dtype in _FLOAT]
        if not floats:
            return func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        promote = False
        if f"aten.{name}" in self.names:
            key = self._key(name)
            promote = key in self.sites
            if promote and key not in self.packages:
                self.packages[key] = _package()
        dtypes = {t.dtype for t in floats}
        widest = min(dtypes, key=_eps)
        up = widest if len(dtypes) > 1 else None
        if promote:
            target = _WIDE.get(_name(widest), widest)
            up = target if up is None or _eps(target) < _eps(up) else up
        if up is None:
            return func(*args, **kwargs)
        kept = {id(t) for g in written_tensors(writes, args, kwargs) for t in g} if writes else set()
        if name in _CASTS and not promote:
            return func(*args, **kwargs)  # a cast the code wrote, as written
        if name in _CASTS:
            kwargs = dict(kwargs, dtype=up) if kwargs.get("dtype") in _FLOAT else kwargs

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


def _map(x: Any, fn: Callable) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _package() -> str:
    """The installed package below the user's line on the stack (transformers), or ``""``."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if is_user_file(path):
            return ""
        got = package_of(path)
        if got and got != "torch":
            return got
        f = f.f_back  # type: ignore[assignment]
    return ""


class Rerun:
    """`__call__(sites)`: the function run once more on a fresh copy of its arguments with
    `sites` promoted; its output leaves (``leaves`` turns the result into (path, array))."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, leaves: Callable):
        self.pristine = copy.deepcopy((fn, args, kwargs))
        self.rng = torch.random.get_rng_state()
        self.leaves = leaves
        self.packages: dict = {}
        self.runs = 0

    def __call__(self, sites: frozenset) -> list[tuple[str, Any]]:
        fn, args, kwargs = copy.deepcopy(self.pristine)
        mode = _Promote(sites, self.packages)
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(self.rng)
            with mode.running():
                result = fn(*args, **kwargs)
        self.runs += 1
        return self.leaves(result)
