"""Bisection over a framework's releases: the versions the user's package index holds, one
environment per version tried, and the records run in it (`diag bisect --package`).

The versions come from the index the user's pip uses (`pip index versions`, which reads
pip's configuration: a private mirror answers as it would for `pip install`). Each version
tried gets its own virtual environment, kept in diag's cache folder between bisections
(`<cache>/venvs/<package>-<version>-py<X.Y>`), holding the release, its companions pinned as
the release needs (jaxlib with jax, torch with torch-xla), and what diag's worker imports,
pinned to this interpreter's versions (numpy, ml_dtypes, mpmath) so that the only difference
between two steps is the release. diag itself reaches that environment's workers through
PYTHONPATH, as for `diag run --python FRAMEWORK=PATH` (`diag.worker.interpreter`): the host
side (inputs, truth, judging) stays this process.

An environment is built in a temporary folder and renamed into place only once pip succeeded,
so a release that does not install leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from diag.gate.bisect import BisectError, Observation, observation
from diag.oracle.cache_folder import VENV_SUBFOLDER, default_cache_dir
from diag.plan.cases import Suite

__all__ = [
    "COMPANIONS",
    "DEFAULT_BACKENDS",
    "FRAMEWORKS",
    "WORKER_NEEDS",
    "between",
    "environment",
    "observer",
    "released_versions",
    "venv_folder",
]

#: Package -> the framework name diag's backends use (DIAG_PYTHON_<FRAMEWORK>).
FRAMEWORKS = {"jax": "jax", "torch": "torch", "torch-xla": "torch_xla"}

#: Package -> the companions a release needs, as a requirement made from its version: jaxlib
#: is released with jax under the same number; torch-xla X.Y needs torch X.Y.* (its metadata
#: does not say so; the wrong torch fails at import).
COMPANIONS: dict[str, Callable[[str], list[str]]] = {
    "jax": lambda v: [f"jaxlib=={v}"],
    "torch-xla": lambda v: [f"torch=={'.'.join(v.split('.')[:2])}.*"],
    "torch": lambda v: [],
}

#: Package -> the backend a bisection runs when none is named: its CPU backend, present on
#: every machine (name an accelerator's with --backend).
DEFAULT_BACKENDS = {"jax": "jax-cpu", "torch": "torch-cpu", "torch-xla": "torch-xla-cpu"}

#: What diag's worker imports besides the framework, pinned to this interpreter's versions.
WORKER_NEEDS = ("numpy", "ml_dtypes", "mpmath")

_MARKER = "diag-venv.json"
#: Seconds pip may take to install one release (a minute here; torch-xla is 3.8 GB).
PIP_TIMEOUT_S = 1800.0


def _pip(*args: str, python: str | None = None) -> subprocess.Popen:
    cmd = [python or sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    return lines[-1] if lines else "no output"


def released_versions(package: str) -> list[str]:
    """The released versions of `package` on the user's package index, oldest first
    (pre-releases left out).

    Raises:
      BisectError: pip cannot reach an index or the index has no such package.
    """
    from packaging.version import InvalidVersion, Version

    proc = _pip("index", "versions", package)
    out, err = proc.communicate(timeout=300)
    found = re.search(r"Available versions:\s*(.+)", out)
    if proc.returncode != 0 or not found:
        raise BisectError(
            f"{package}: the package index lists no releases ({_last_line(err or out)}); "
            "check the package's name and that pip reaches its index"
        )
    versions = []
    for v in found.group(1).split(","):
        try:
            if not Version(v.strip()).is_prerelease:
                versions.append(v.strip())
        except InvalidVersion:
            continue
    return sorted(set(versions), key=Version)


def between(package: str, versions: list[str], good: str, bad: str) -> list[str]:
    """The releases from `good` to `bad`, both included, oldest first.

    Raises:
      BisectError: an end the index does not hold, or ends in the wrong order.
    """
    from packaging.version import Version

    for end, v in (("--good", good), ("--bad", bad)):
        if v not in versions:
            near = ", ".join(versions[-8:])
            raise BisectError(
                f"{end} {v}: {package} has no such release on the package index; "
                f"the latest are {near}"
            )
    lo, hi = sorted((Version(good), Version(bad)))
    return [v for v in versions if lo <= Version(v) <= hi][:: 1 if Version(good) < hi else -1]


def venv_folder(package: str, version: str, root: Path | None = None) -> Path:
    """Where the environment of `package==version` is kept."""
    base = root if root is not None else default_cache_dir() / VENV_SUBFOLDER
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return base / f"{package}-{version}-py{py}"


def _requirements(package: str, version: str) -> list[str]:
    reqs = [f"{package}=={version}", *COMPANIONS.get(package, lambda v: [])(version)]
    for name in WORKER_NEEDS:
        try:
            reqs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            reqs.append(name)
    return reqs


def environment(
    package: str, version: str, root: Path | None = None, log: Callable[[str], None] = print
) -> Path:
    """The Python of an environment holding `package==version` (built once, then reused).

    Returns:
      The environment's `bin/python`.

    Raises:
      BisectError: the release (with its companions) does not install; nothing is left.
    """
    final = venv_folder(package, version, root)
    python = final / "bin" / "python"
    if (final / _MARKER).is_file() and python.is_file():
        return python
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{secrets.token_hex(4)}"
    reqs = _requirements(package, version)
    log(f"diag bisect: building an environment for {' '.join(reqs)} in {final}")
    try:
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(tmp)], capture_output=True, text=True, timeout=300
        )
        if made.returncode != 0:
            raise BisectError(f"cannot create a virtual environment: {_last_line(made.stderr)}")
        proc = _pip("install", "-q", *reqs, python=str(tmp / "bin" / "python"))
        try:
            out, err = proc.communicate(timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise BisectError(f"{package}=={version}: pip did not finish in time") from None
        if proc.returncode != 0:
            raise BisectError(
                f"{package}=={version} does not install ({_last_line(err or out)}); "
                "choose ends whose releases install here"
            )
        (tmp / _MARKER).write_text(json.dumps({"requirements": reqs}), encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:  # another bisection built it meanwhile: use theirs
            if not (final / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return python


def observer(
    package: str,
    suite: Suite,
    backends: list[str] | None,
    out: Path,
    record: list[str] | None = None,
    root: Path | None = None,
    log: Callable[[str], None] = print,
) -> Callable[[str, list[str] | None], Observation]:
    """`observe(version, keys)` for `diag.gate.bisect.bisect`: run the suite's cases (those
    whose key contains one of `record`, then only the cases of `keys`) on `backends` with the
    framework's workers in the environment of that release.

    Raises (when called):
      BisectError: the release does not install, or no case is left to run.
    """
    from diag.run import runner
    from diag.worker.interpreter import python_var

    framework = FRAMEWORKS.get(package)
    if framework is None:
        raise BisectError(
            f"--package {package}: diag runs no backend of it; bisect one of "
            f"{', '.join(FRAMEWORKS)}"
        )

    chosen = backends or [DEFAULT_BACKENDS[package]]

    def observe(version: str, keys: list[str] | None) -> Observation:
        python = environment(package, version, root, log)

        def wanted(c) -> bool:
            where = f"{suite.name}.{c.probe} | {c.label} | "
            if keys is not None:
                return any(k.startswith(where) for k in keys)
            return not record or any(r in where + b for r in record for b in chosen)

        cases = tuple(c for c in suite.cases if wanted(c))
        if not cases:
            raise BisectError(f"no case of suite {suite.name!r} matches --record {record}")
        folder = Path(tempfile.mkdtemp(prefix=f"{package}-{version}-", dir=out))
        log(f"diag bisect: {package} {version}: running {len(cases)} case(s)")
        result = runner.run(
            dataclasses.replace(suite, cases=cases),
            chosen,
            out=folder,
            repeats=1,
            env={python_var(framework): str(python)},  # as `diag run --python` sets it
            argv=["diag", "bisect", f"{package}=={version}"],
        )
        return observation(version, result.records, str(result.run_dir))

    return observe
