"""diag: do these devices, frameworks and compiler flags compute what the math says?

`import diag` loads no framework (jax, torch, torch_xla); each is imported only inside its
backend module, in the worker subprocess that runs it. Submodules are loaded on first use.
"""

from __future__ import annotations

import importlib

from diag.errors import (
    BackendUnavailable,
    DiagError,
    SuiteError,
    UsageError,
    WorkerCrashed,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "DiagError",
    "SuiteError",
    "UsageError",
    "WorkerCrashed",
    "nan",
    "numerics",
    "flags",
    "oracle",
    "precision",
    "report",
    "results",
    "run",
    "suite",
]

_LAZY_MODULES = {"numerics", "oracle", "report", "results", "suite", "runner", "precision",
                 "flags", "nan"}


def run(*args, **kwargs):
    """Run a suite on backends; see `diag.runner.run` (mirrors ``diag run``)."""
    from diag.runner import run as _run

    return _run(*args, **kwargs)


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"diag.{name}")
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
