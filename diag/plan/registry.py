"""The op registry: every module under `probes/` (installed as `diag.probes`) is one op.

An op module defines `PROBE` (a `diag.plan.probe.Probe` row whose `op` is the module's name);
`PROBES` maps each op name to its row, in name order. Which ops a backend runs follows from
the rows (`ops_for`: the ops with an implementation for its framework), so adding an op is
one module plus a suite entry, and nothing here or in the backends names it.

Run from a source tree that is not installed (a torch-xla worker under another Python, with
diag's folder on PYTHONPATH), `diag.probes` is not on diag's path: `_probes_package` maps
the repository's `probes/` folder in as `diag.probes`, as the installed package does.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

from diag.plan.probe import Probe

__all__ = [
    "PROBES",
    "FINGERPRINT_OP",
    "REPORT_SECTIONS",
    "SUITE_DIR",
    "build",
    "discover",
    "implementation",
    "ops_for",
    "probe_module",
]

PACKAGE = "diag.probes"


def _probes_package() -> ModuleType:
    """`diag.probes`, installed (or editable), or the source tree's `probes/` folder."""
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError:
        folder = Path(__file__).resolve().parents[2] / "probes"
        spec = importlib.util.spec_from_file_location(
            PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
        return module


def probe_module(op: str) -> ModuleType:
    """The module of op `op` (`diag.probes.<op>`)."""
    _probes_package()
    return importlib.import_module(f"{PACKAGE}.{op}")


def discover() -> dict[str, Probe]:
    """Every op module's row, by op name (modules whose name starts with `_` are helpers)."""
    package = _probes_package()
    rows = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.ispkg or info.name.startswith("_"):
            continue
        row = getattr(probe_module(info.name), "PROBE", None)
        if not isinstance(row, Probe) or row.op != info.name:
            raise TypeError(
                f"{PACKAGE}.{info.name} must define PROBE, a diag.plan.probe.Probe "
                f"with op = '{info.name}'"
            )
        rows[row.op] = row
    return rows


PROBES: dict[str, Probe] = discover()
#: The shipped suite files (`diag run --suite NAME`), installed beside the op modules.
SUITE_DIR = Path(_probes_package().__path__[0]) / "suites"

# The op whose arithmetic diag fingerprints (`Probe.fingerprint`): `diag env` and each run's
# workers measure it.
FINGERPRINT_OP = next(p.op for p in PROBES.values() if p.fingerprint)
# The report section of each op that has one (run.json's `report_sections`).
REPORT_SECTIONS = {p.op: p.report_section for p in PROBES.values() if p.report_section}


def ops_for(framework: str) -> tuple[str, ...]:
    """The ops with an implementation for `framework` (`BackendSpec.ops`)."""
    return tuple(op for op, p in PROBES.items() if framework in p.implementations)


def build(backend, op: str, **op_args):
    """The function of device arrays that runs `op` on `backend` (a set-up backend module):
    the op module's implementation for the framework whose ops the backend runs (its
    `IMPLEMENTATION`, else its `FRAMEWORK`)."""
    runs = getattr(backend, "IMPLEMENTATION", backend.FRAMEWORK)
    return implementation(op, runs)(backend, **op_args)


def implementation(op: str, framework: str):
    """The builder of `op` for `framework`: `(backend, **op_args) -> function`."""
    try:
        return PROBES[op].implementations[framework]
    except KeyError:
        raise KeyError(
            f"op '{op}' has no {framework} implementation (its module: {PACKAGE}.{op})"
        ) from None
