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
from collections.abc import Mapping
from typing import Any

from diag.settings import flags as _flags

__all__ = ["collect", "env_report", "NUMERICS_ENV_VARS"]

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

_PACKAGES = (
    "diag",
    "jax",
    "jaxlib",
    "torch",
    "torch_xla",
    "libtpu",
    "numpy",
    "ml_dtypes",
    "mpmath",
)


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_revision(cwd: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpu_model() -> str | None:
    """The CPU's model name: part of a CI baseline's key, since a CPU's arithmetic features
    (avx512_bf16, AMX) decide what some settings compute (torch-cpu's `medium` precision)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def collect(argv: list[str] | None = None) -> dict[str, Any]:
    """The host environment of a run (no framework imported)."""
    cwd = os.getcwd()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "command": " ".join(argv if argv is not None else sys.argv),
        "cwd": cwd,
        "git_revision": _git_revision(cwd),
        "packages": {p: v for p in _PACKAGES if (v := _version(p))},
        # XLA_FLAGS and LIBTPU_INIT_ARGS always (None: unset); the others when set.
        "env": {
            k: os.environ.get(k)
            for k in NUMERICS_ENV_VARS
            if k in os.environ or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
        },
        # XLA_FLAGS / LIBTPU_INIT_ARGS parsed, and what the settings rules say about the
        # environment variables and flags (diag.settings.flags; host side, no framework imported).
        "flags": _flags.host_flags(),
        "findings": _flags.host_findings(),
    }


def env_report(
    *,
    fingerprints: bool = True,
    timeout: float = _flags.ENV_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    deep: bool = False,
) -> dict[str, Any]:
    """Everything numerics-relevant in effect here: what `diag env` shows.

    Args:
      fingerprints: measure each backend's matmul under each precision setting it can
        express (`diag.arith.precision.fingerprint`); a few seconds per framework on CPU.
      timeout: seconds each framework worker may take.
      deep: also measure the arithmetic features of each backend's matmul
        (`diag.arith.precision.features`: rounding, extra bits, block FMA width, ...) at each
        precision setting, and on bf16 and fp16 inputs; about a second each on CPU.
      environ: the environment to audit (default: this process's).

    Returns:
      {"host", "flags", "xla_flags_check", "frameworks": {fw: {"backends", "platforms",
      "error"}}, "findings"}. Emulated backends are not listed: they are not hardware.

    Raises:
      BadFlag: XLA_FLAGS or LIBTPU_INIT_ARGS holds a flag XLA refuses (exit 2).
    """
    from diag.backends import BACKENDS
    from diag.settings.flags import FLAG_VARS, findings, host_flags, parse_flags, validate_xla_flags
    from diag.worker.host import framework_available, run_env_worker

    environ = dict(os.environ if environ is None else environ)
    for var in FLAG_VARS:
        parse_flags(environ.get(var), var)  # malformed -> BadFlag before anything starts
    check = validate_xla_flags(environ)
    frameworks: dict[str, Any] = {}
    for fw in ("jax", "torch", "torch_xla"):
        if not framework_available(fw, environ):
            hint = next(s.install_hint for s in BACKENDS.values() if s.framework == fw)
            frameworks[fw] = {"backends": {}, "error": f"{fw} is not installed ({hint})"}
            continue
        frameworks[fw] = run_env_worker(fw, environ, fingerprints, timeout, deep=deep)
    present = {name for fw in frameworks.values() for name in fw["backends"]}

    def settings(fw: str):
        infos = list(frameworks[fw]["backends"].values())
        return infos[0].get("settings", {}) if infos else None

    flags = host_flags(environ)
    host = collect()
    env_vars = {k: environ[k] for k in environ if k in NUMERICS_ENV_VARS or k.startswith("JAX_")}
    return {
        "host": {
            k: host[k] for k in ("host", "platform", "machine", "cpu_count", "python", "packages")
        },
        "env": env_vars,
        "flags": flags,
        "xla_flags_check": check,
        "frameworks": frameworks,
        "findings": findings(
            {
                "env": environ,
                "flags": flags,
                "jax": settings("jax"),
                "torch": settings("torch"),
                "torch_xla": settings("torch_xla"),
                "backends": present,
            }
        ),
    }
