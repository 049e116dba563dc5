"""Which Python a framework's workers run under, and the command that starts one.

A framework's workers may run under another interpreter, e.g. torch_xla, which needs its own
torch. The mapping travels in the workers' environment as DIAG_PYTHON_<FRAMEWORK>
(`--python torch-xla=PATH` sets DIAG_PYTHON_TORCH_XLA), so a user can also set it once in their
shell, and every worker start (runs, discovery, `diag env`) reads it from the one place.
diag's own checkout reaches that Python through PYTHONPATH (`diag.worker.host.worker_env`); the
host never imports the framework.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from diag.backends import BACKENDS
from diag.errors import UsageError

__all__ = ["python_var", "parse_python", "worker_cmd"]


def python_var(framework: str) -> str:
    """The environment variable naming `framework`'s Python: DIAG_PYTHON_TORCH_XLA."""
    return "DIAG_PYTHON_" + framework.upper().replace("-", "_")


def _frameworks() -> list[str]:
    return list(dict.fromkeys(s.framework for s in BACKENDS.values() if s.framework != "numpy"))


def _checked_python(path: str, where: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UsageError(
            f"{where}: '{path}' is not an executable file; give the path of a "
            f"Python, e.g. scripts/torch-xla-env.sh DEST creates DEST/bin/python"
        )
    return path


def parse_python(assignments: list[str] | None) -> dict[str, str]:
    """`--python FRAMEWORK=PATH` options as the workers' environment variables.

    Raises:
      UsageError: not FRAMEWORK=PATH, an unknown framework, or a path that is not an
        executable file.
    """
    env: dict[str, str] = {}
    known = {f.replace("_", "-"): f for f in _frameworks()}
    for item in assignments or []:
        name, sep, path = item.partition("=")
        framework = known.get(name.strip().replace("_", "-"))
        if not sep or not path:
            raise UsageError(
                f"--python expects FRAMEWORK=PATH (e.g. torch-xla=/venv/bin/python), got {item!r}"
            )
        if framework is None:
            raise UsageError(
                f"--python {item}: unknown framework '{name}'; known: {', '.join(known)}"
            )
        env[python_var(framework)] = _checked_python(os.path.expanduser(path), f"--python {item}")
    return env


def _python(framework: str, env: Mapping[str, str]) -> str:
    """The Python `framework`'s workers run under: its DIAG_PYTHON_* or diag's own."""
    var = python_var(framework)
    return _checked_python(env[var], var) if env.get(var) else sys.executable


def worker_cmd(framework: str, env: Mapping[str, str], *args: str) -> list[str]:
    """The command line of a `framework` worker: its Python, diag's worker module, `args`."""
    return [_python(framework, env), "-m", "diag.worker.main", *args]
