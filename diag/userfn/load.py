"""Read ``FILE.py:FUNCTION`` or ``pkg.module:function``: the user's function and its arguments.

One loader for every command that takes a user's function (`diag nan`, `diag diverge`, `diag
run`, `diag preflight --probe`, `diag.testing`). FUNCTION is called with no arguments; if it
returns ``(fn, args)`` or ``(fn, args, kwargs)``, that is the function under test, else FUNCTION
itself is (and so runs a second time). The global random generators (Python's, numpy's, and
torch's when the file imported torch) are seeded before FUNCTION runs, so a model whose
weights FUNCTION draws at random is the same model in every process that loads it (the host and
each backend's worker).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from diag.errors import DiagError, UsageError
from diag.userfn.standin import standing_in

#: The seed the global generators get before FUNCTION runs (in every process alike).
LOAD_SEED = 0


class UserFunctionError(UsageError):
    """The user's function could not be loaded or run: the message says which and why (bad
    input: exit 2)."""


def _split(spec: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserFunctionError(
            f"expected FILE.py:FUNCTION or package.module:function, got {spec!r}"
        )
    return where, name


def _is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where or Path(where).is_file()


def _import_file(file: str, absent: frozenset[str] = frozenset()) -> ModuleType:
    path = Path(file)
    if not path.is_file():
        raise UserFunctionError(f"{file}: no such file")
    mod_name = f"_diag_user_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    loaded = sys.modules.get(mod_name)
    if loaded is not None and getattr(loaded, "__diag_source__", None) == path.read_bytes():
        return loaded  # the same file, unchanged: import it once per process
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserFunctionError(f"{file}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        with standing_in(absent):
            module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything
        sys.modules.pop(mod_name, None)
        raise UserFunctionError(f"{file}: importing it raised {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    module.__diag_source__ = path.read_bytes()  # type: ignore[attr-defined]
    return module


def _import_module(name: str, absent: frozenset[str] = frozenset()) -> ModuleType:
    sys.path.insert(0, str(Path.cwd()))
    try:
        with standing_in(absent):
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise UserFunctionError(f"{name}: no such module ({e})") from e
    except Exception as e:  # noqa: BLE001
        raise UserFunctionError(f"{name}: importing it raised {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(str(Path.cwd()))


def import_spec(
    spec: str, absent: frozenset[str] = frozenset()
) -> tuple[ModuleType, Callable, str]:
    """(module, FUNCTION, its name) for a spec, without calling FUNCTION; an import of a
    module under `absent` that is not installed gets a stand-in (`diag.userfn.standin`).

    Raises:
        UserFunctionError: a malformed spec, a missing file, module or function, or the module
            raised while being imported.
    """
    where, name = _split(spec)
    module = _import_file(where, absent) if _is_file_spec(where) else _import_module(where, absent)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserFunctionError(f"{where}: no function {name!r}")
    return module, fn, name


def seed_globals() -> None:
    """Seed Python's, numpy's and (when imported) torch's global generators with `LOAD_SEED`."""
    random.seed(LOAD_SEED)
    np.random.seed(LOAD_SEED)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(LOAD_SEED)


def call_maker(
    fn: Callable, name: str, raised: type[DiagError] = UserFunctionError
) -> tuple[Callable, tuple, dict]:
    """Call FUNCTION (seeded); ``(fn, args[, kwargs])`` it returns, else ``(FUNCTION, (), {})``.

    Raises:
        `raised`: FUNCTION raised (the message: ``NAME raised TYPE: MESSAGE``).
    """
    seed_globals()
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise raised(f"{name} raised {type(e).__name__}: {e}") from e
    if (
        isinstance(got, tuple)
        and len(got) in (2, 3)
        and callable(got[0])
        and isinstance(got[1], (tuple, list))
        and (len(got) == 2 or isinstance(got[2], dict))
    ):
        return got[0], tuple(got[1]), dict(got[2]) if len(got) == 3 else {}
    return fn, (), {}


def load_target(
    spec: str, raised: type[DiagError] = UserFunctionError
) -> tuple[Callable, tuple, dict]:
    """``FILE.py:FUNCTION`` or ``pkg.module:function`` -> (fn, args, kwargs), as `diag nan`
    reads it (see the module docstring).

    Raises:
        UserFunctionError: bad spec, missing file, module or function, or the file raised.
        `raised`: FUNCTION itself raised.
    """
    _, fn, name = import_spec(spec)
    return call_maker(fn, name, raised)


def source_hash(module: ModuleType) -> str:
    """sha256 (16 hex digits) of the source file of the module that defines the function:
    what the drift gate keys a user's function by, beside hardware and versions."""
    file = getattr(module, "__file__", None)
    data = Path(file).read_bytes() if file and Path(file).is_file() else b""
    return hashlib.sha256(data).hexdigest()[:16]
