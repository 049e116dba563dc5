"""Stand-ins for the other framework's modules while a user's file loads in a worker.

A user's file often imports both frameworks (a JAX model beside its PyTorch twin), but a
backend's worker may run in an environment that has only its own: torch_xla runs in a venv of
its own (torch 2.9) that has no JAX. The worker of a PyTorch backend never calls a JAX function
(nor the reverse), so while it loads the file, an ``import jax`` that finds no JAX gets a
stand-in: any attribute of it is another stand-in, calling one returns one (``jax.jit(f)`` at
module level), and a class may derive from one (``class M(nn.Module)`` with flax's ``nn``).
The stand-ins are in ``sys.modules`` only while the file is executed, so nothing else in the
worker sees them. A function that does use the absent framework gets stand-ins back, which
`diag.userfn.bind` reports as not arrays.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

#: The top-level modules of each framework's stack, stood in for in the other's workers.
JAX_MODULES = frozenset({"jax", "jaxlib", "flax", "optax", "equinox", "haiku", "chex", "orbax"})
TORCH_MODULES = frozenset({"torch", "torch_xla", "torchvision", "transformers"})


class _Absent:
    """An object of a framework that is not installed here (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> _Absent:
        return _Absent(f"{self._name}(...)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __repr__(self) -> str:
        return f"<{self._name}: not installed in this environment>"


class _AbsentModule(ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A stand-in for a module under one of `tops`; last on ``sys.meta_path``, so asked only
    for a module that no finder found installed."""

    def __init__(self, tops: frozenset[str]) -> None:
        self.tops = tops
        self.made: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if top not in self.tops or (
            top != fullname
            and top in sys.modules
            and not isinstance(sys.modules[top], _AbsentModule)
        ):
            return None  # an installed framework's optional submodule stays absent
        # last on sys.meta_path: reached only when no finder found the module installed
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> ModuleType:
        self.made.append(spec.name)
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


@contextmanager
def standing_in(tops: frozenset[str]) -> Iterator[None]:
    """While inside, an import of a module under `tops` that is not installed gets a stand-in;
    on leaving, the stand-ins leave ``sys.modules`` (the user's module keeps its references)."""
    if not tops:
        yield
        return
    finder = _Finder(tops)
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in finder.made:
            sys.modules.pop(name, None)
