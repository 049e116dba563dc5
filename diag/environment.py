"""What a run happened in: host, versions and every numerics-relevant setting.

Collected on the host without importing any framework (versions come from package
metadata); each backend worker adds its own device and framework settings to run.json.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from typing import Any

from diag import flags as _flags

__all__ = ["collect", "NUMERICS_ENV_VARS"]

# Environment variables that change what XLA, JAX, torch or CUDA compute.
NUMERICS_ENV_VARS = (
    "XLA_FLAGS",
    "LIBTPU_INIT_ARGS",
    "JAX_PLATFORMS",
    "JAX_DEFAULT_MATMUL_PRECISION",
    "JAX_ENABLE_X64",
    "JAX_DEBUG_NANS",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "CUBLAS_WORKSPACE_CONFIG",
    "XLA_USE_BF16",
    "XLA_DOWNCAST_BF16",
    "XLA_USE_32BIT_LONG",
    "PJRT_DEVICE",
    "CUDA_VISIBLE_DEVICES",
    "TPU_VISIBLE_CHIPS",
)

_PACKAGES = ("diag", "jax", "jaxlib", "torch", "torch_xla", "libtpu", "numpy", "ml_dtypes",
             "mpmath")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_revision(cwd: str) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def collect(argv: list[str] | None = None) -> dict[str, Any]:
    """The host environment of a run (no framework imported)."""
    cwd = os.getcwd()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "command": " ".join(argv if argv is not None else sys.argv),
        "cwd": cwd,
        "git_revision": _git_revision(cwd),
        "packages": {p: v for p in _PACKAGES if (v := _version(p))},
        # XLA_FLAGS and LIBTPU_INIT_ARGS always (None: unset); the others when set.
        "env": {k: os.environ.get(k) for k in NUMERICS_ENV_VARS
                if k in os.environ or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        # XLA_FLAGS / LIBTPU_INIT_ARGS parsed, and what the settings rules say about the
        # environment variables and flags (diag.flags; host side, no framework imported).
        "flags": _flags.host_flags(),
        "findings": _flags.host_findings(),
    }
