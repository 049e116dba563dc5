"""diag: do these devices, frameworks and compiler flags compute what the math says?

`import diag` loads no framework (jax, torch, torch_xla); each is imported only inside its
backend module, in the worker subprocess that runs it. Submodules are loaded on first use:
``import diag; diag.nodes.scan(...)`` works without ``import diag.nodes`` (a test reads every
``diag.<name>`` the README and docs/ mention and touches it after a bare ``import diag``).
"""

from __future__ import annotations

import importlib

from diag.errors import (
    DiagError,
    SuiteError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "DiagError",
    "SuiteError",
    "UsageError",
    "ab",
    "baseline",
    "compare",
    "diverge",
    "drift",
    "environment",
    "errors",
    "faults",
    "features",
    "flags",
    "inputs",
    "junit",
    "nan",
    "nodes",
    "numerics",
    "oracle",
    "precision",
    "preflight",
    "probes",
    "report",
    "results",
    "run",
    "runner",
    "suite",
    "suite_fn",
    "tap",
    "testing",
    "tolerance",
    "train",
    "userfn",
    "workers",
]

# The library's modules, loaded on first attribute access (none imports a framework at
# import time): every public name but the error classes and the two functions defined here.
# `cli` and `render` are the command line's, not the library's.
_LAZY_MODULES = set(__all__) - {"DiagError", "SuiteError", "UsageError", "run", "tap"}


def run(*args, **kwargs):
    """Run a suite on backends; see `diag.runner.run` (mirrors ``diag run``)."""
    from diag.runner import run as _run

    return _run(*args, **kwargs)


def tap(name: str, x):
    """Identity that records `x` under `name` for `diag.diverge.compare`; see
    `diag.diverge.tap` (JAX arrays, inside jit too, and torch tensors)."""
    from diag.diverge.taps import tap as diverge_tap

    return diverge_tap(name, x)


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"diag.{name}")
    raise AttributeError(f"module 'diag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
