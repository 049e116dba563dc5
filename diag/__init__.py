"""diag: do these devices, frameworks and compiler flags compute what the math says?

`import diag` loads no framework (jax, torch, torch_xla); each is imported only inside its
backend module, in the worker subprocess that runs it. Submodules are loaded on first use:
``import diag; diag.nodes.scan(...)`` works without ``import diag.nodes`` (a test reads every
``diag.<name>`` the README and docs/ mention and touches it after a bare ``import diag``).

The package follows the pipeline (docs/design.md): `plan` -> `run` -> `worker` and
`backends`, judged with `oracle`, `compare` and `tolerance`, written as `records`, read by
`gate` and `report`. Modules that lived flat in `diag/` before 0.2 keep their old names as
aliases that warn once (`diag.precision` is `diag.arith.precision`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

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
    "arith",
    "compare",
    "diverge",
    "errors",
    "gate",
    "nan",
    "nodes",
    "numerics",
    "oracle",
    "plan",
    "preflight",
    "probes",
    "records",
    "report",
    "run",
    "settings",
    "tap",
    "testing",
    "tolerance",
    "train",
    "userfn",
    "worker",
]

# The library's packages, loaded on first attribute access (none imports a framework at
# import time). `run` and `preflight` are callable packages (``diag.run(...)``,
# ``diag.preflight(...)``). `cli` and `render` are the command line's, not the library's.
_LAZY_MODULES = set(__all__) - {"DiagError", "SuiteError", "UsageError", "tap"}

#: Where each module of the flat layout (before 0.2) lives now. ``import diag.precision`` and
#: ``diag.precision`` still work, with a DeprecationWarning naming the new place.
MOVED = {
    "ab": "diag.run.ab",
    "backend_runs": "diag.run.backend_runs",
    "baseline": "diag.gate.baseline",
    "cases": "diag.plan.cases",
    "dot_algorithms": "diag.arith.dot_algorithms",
    "drift": "diag.gate.drift",
    "environment": "diag.settings.environment",
    "faults": "diag.worker.faults",
    "features": "diag.arith.features",
    "flags": "diag.settings.flags",
    "inputs": "diag.plan.inputs",
    "judge": "diag.run.judge",
    "junit": "diag.gate.junit",
    "outputs": "diag.records.outputs",
    "precision": "diag.arith.precision",
    "probe": "diag.plan.probe",
    "protocol": "diag.worker.protocol",
    "record_drift": "diag.gate.record_drift",
    "registry": "diag.plan.registry",
    "results": "diag.records.results",
    "results_file": "diag.records.results_file",
    "run_meta": "diag.records.run_meta",
    "runner": "diag.run.runner",
    "store": "diag.run.store",
    "suite": "diag.plan.suite",
    "suite_fn": "diag.plan.suite_fn",
    "unit_model": "diag.arith.unit_model",
    "worker_python": "diag.worker.interpreter",
    "workers": "diag.worker.host",
}


def _moved(old: str) -> ModuleType:
    new = MOVED[old]
    warnings.warn(
        f"diag.{old} moved to {new}; the old name will be removed in diag 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``diag.<old>`` for a moved module: the new module under the old name."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "diag" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = _moved(spec.name.partition(".")[2])
        # The import system sets the old name's spec on the module it gets; the module keeps
        # its own (restored in exec_module), so it stays importable and picklable by its name.
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def tap(name: str, x):
    """Identity that records `x` under `name` for `diag.diverge.compare`; see
    `diag.diverge.tap` (JAX arrays, inside jit too, and torch tensors)."""
    from diag.diverge.taps import tap as diverge_tap

    return diverge_tap(name, x)


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"diag.{name}")
    if name in MOVED:
        return _moved(name)
    raise AttributeError(f"module 'diag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
