"""The run: the plan executed on every backend, each result judged against the ground truth.

`runner` drives a run (`diag.run(...)` calls `runner.run`, mirroring ``diag run``),
`backend_runs` launches the workers, `store` keeps inputs, truths and outputs of a case,
`judge` turns a worker's outputs into records, `ab` runs the same suite with one setting
changed. The module itself is callable: ``diag.run(suite="matmul")``.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    """`diag.run(...)` runs a suite, as it did when `diag.run` was a function.

    The package and the function share a name; Python binds `diag.run` to the package once
    it is imported, so the package itself is made callable (one name, both uses), as
    `diag.preflight` is.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from diag.run.runner import run

        return run(*args, **kwargs)


def __getattr__(name: str):
    """Submodules load on first use: `diag.run.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallableModule
