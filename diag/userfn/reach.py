"""What a user's function reaches besides its arguments: the module globals and closure cells
its code names, the way scripts and notebooks hold a model (``fc1 = nn.Linear(...)`` at module
level, ``params`` closed over by a jitted step).

Their float state is part of the computation: a float64 reference that widens the arguments
but not them evaluates a mix (torch refuses it: "mixed dtype"; JAX computes the
model in float32 and calls it float64). A slot is found by name, the way Python resolves it: the
global names the function's code loads or stores (nested lambdas and comprehensions included)
that its globals hold, and its closure cells; a plain function of the same module that it
calls (through `jax.jit`, `functools.partial`, a decorator keeping ``__wrapped__``) is walked
in turn, so the globals of a helper are reached too. Library modules, classes and functions are
never slots: diag swaps a value in the user's own globals dict or cell, never in a library.

`swapped` points slots at other values for the duration of a block and puts every slot back
afterwards, whatever happens (an exception, a step that rebinds its ``global params``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import inspect
import os
import re
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Slot", "reachable", "swapped"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """A name the function reaches: a module global (holder: the globals dict) or a closure
    cell (holder: the cell), and the value it held when found.

    Attributes:
        holder: the module's globals dict, or the closure cell.
        name: the global's or the free variable's name.
        value: what it held.
    """

    holder: Any
    name: str
    value: Any

    @property
    def label(self) -> str:
        """``global fc1`` or ``closure params``: how the record names it."""
        return f"{'global' if isinstance(self.holder, dict) else 'closure'} {self.name}"

    def put(self, value: Any) -> None:
        if isinstance(self.holder, dict):
            self.holder[self.name] = value
        else:
            self.holder.cell_contents = value


def _unwrap(f: Any) -> Any:
    """The plain function under jit wrappers, partials, decorators and bound methods."""
    for _ in range(16):
        if isinstance(f, functools.partial):
            f = f.func
        elif isinstance(f, types.MethodType):
            f = f.__func__
        elif getattr(f, "__wrapped__", None) is not None and f.__wrapped__ is not f:
            f = f.__wrapped__
        else:
            break
    return f


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _global_names(code: types.CodeType) -> set[str]:
    """The global names a code object loads or stores (not its attribute names, which share
    ``co_names``: ``h.norm`` must not reach a global ``norm``)."""
    return {
        str(i.argval)
        for i in dis.get_instructions(code)
        if i.opname in ("LOAD_GLOBAL", "STORE_GLOBAL", "LOAD_NAME")
    }


def _is_code(v: Any) -> bool:
    """A module, a class or a function (a library's or the user's): no numbers of its own."""
    return isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType)) or isinstance(
        _unwrap(v), types.FunctionType
    )


#: An installed library's file (a venv's site-packages, or the base interpreter's), the
#: standard library's, or diag's own: its globals are never the user's to swap.
_SITE = re.compile(r"[/\\](site|dist)-packages[/\\]")
_NOT_USERS = tuple(
    os.path.normcase(p) + os.sep
    for p in (sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.dirname(__file__)))
)


def _is_users(f: types.FunctionType) -> bool:
    path = os.path.normcase(os.path.abspath(f.__code__.co_filename))
    return not _SITE.search(path) and not path.startswith(_NOT_USERS)


def reachable(fn: Callable) -> list[Slot]:
    """Every global and closure cell that ``fn`` (and the functions of its module it calls)
    names and that holds a value, not code (see the module docstring); for a module or other
    callable object, its class's ``forward`` or ``__call__``; none for a library's function."""
    root = _unwrap(fn)
    if not isinstance(root, types.FunctionType):  # a module or callable object: its method
        cls = type(root)
        method = getattr(cls, "forward", None) or inspect.getattr_static(cls, "__call__", None)
        root = _unwrap(method)
    if not isinstance(root, types.FunctionType) or not _is_users(root):
        return []
    home = root.__globals__
    found: list[Slot] = []
    seen: set[tuple[int, str]] = set()
    stack, walked = [root], set()

    def visit(holder: Any, name: str, value: Any) -> None:
        f = _unwrap(value)
        if isinstance(f, types.FunctionType) and f.__globals__ is home:
            stack.append(f)  # the user's own helper: its names are reached too
            return
        if _is_code(value) or (holder is not None and (id(holder), name) in seen):
            return
        seen.add((id(holder), name))
        found.append(Slot(holder, name, value))

    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in walked:
            continue
        walked.add(id(f))
        glob = f.__globals__
        names = sorted({n for c in _codes(f.__code__) for n in _global_names(c)})
        for name in names:
            if name in glob:
                visit(glob, name, glob[name])
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            visit(cell, name, value)
    return found


@contextlib.contextmanager
def swapped(slots: list[Slot], values: list[Any]) -> Iterator[None]:
    """Point each slot at its value in `values` for the block; every slot holds what it held
    before afterwards (its `Slot.value`), whatever the block did or raised."""
    try:
        for s, v in zip(slots, values):
            if v is not s.value:
                s.put(v)
        yield
    finally:
        for s in slots:
            s.put(s.value)
