"""The backend registry: which backends exist, which framework and device each one drives.

This module is framework-free: it only names backends and the module that implements them.
Each backend module (`jax_backend`, `torch_backend`, `torch_xla_backend`, `emu_backend`) keeps
the `Backend` protocol (`diag.backends.base`): devices, transfers, waiting, precision knobs,
HLO. It runs the op implementations each op module gives for its framework
(`BackendSpec.implementation`; `diag.plan.registry`), and is imported only inside its worker
subprocess (see `diag.worker.main`).

A backend is `<framework>-<platform>`; the platform is what the framework calls its device
type (JAX: cpu/gpu/tpu from `jax.devices()`; torch: cpu/cuda; torch_xla: its PJRT_DEVICE).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TypedDict

from diag.backends.base import Backend

__all__ = [
    "Backend",
    "BackendSpec",
    "BACKENDS",
    "get_spec",
    "framework_installed",
    "not_applicable",
    "promises_full_precision",
]


@dataclass(frozen=True)
class BackendSpec:
    """A backend as data.

    Attributes:
      name: what users type and records carry (`jax-cpu`).
      framework: the importable framework (`jax`, `torch`).
      module: the diag module implementing the ops, imported only in the worker.
      platform: the framework's device type.
      precision_via: how this framework takes a matmul precision setting:
        `argument` (per op) and/or `config` (a process-wide setting).
      precisions: the precision levels it can express.
      argument_precisions: the levels its per-op precision argument can express, when
        fewer than `precisions` (JAX's `lax.Precision` has no MEDIUM: 'bfloat16' is a
        config value only); None when the argument expresses them all.
    """

    name: str
    framework: str
    module: str
    platform: str
    precision_via: tuple[str, ...]
    precisions: tuple[str, ...]
    install_hint: str
    argument_precisions: tuple[str, ...] | None = None
    # Precision levels at which this backend promises true float32 arithmetic for float32
    # inputs (above them a bound breach is `fail`; below, lower precision is allowed and
    # reported as `warn`), and whether bf16/fp16 products are promised float32 accumulation.
    promised: tuple[str, ...] = ("default", "medium", "high", "highest")
    narrow_promised: bool = True
    # Whose op implementations it runs (an op module's `on_<implementation>`); '' for its own
    # framework's. torch_xla runs torch's on its lazy device.
    implementation: str = ""
    # Whether a run without --backend includes it (emulations are opt-in, never hardware).
    default: bool = True
    # A numpy model of an algorithm, not a device under test: its verdicts are `warn` at
    # worst (diag.run.runner), since an emulation promises nothing.
    emulated: bool = False
    # The side of an A/B experiment this spec runs ('' for a plain run and the A side, 'B'
    # for the side with the setting applied: diag.run.ab). Records carry it as `variant`.
    variant: str = ""

    @property
    def runs(self) -> str:
        """The framework whose op implementations this backend runs."""
        return self.implementation or self.framework

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops this backend runs: those whose module has an implementation for its
        framework (`diag.plan.registry.ops_for`); cases of other ops are not applicable to it and
        produce no record."""
        from diag.plan.registry import ops_for

        return ops_for(self.runs)

    @property
    def label(self) -> str:
        """What records, logs and run.json call this backend: `jax-cpu`, `jax-cpu+B`."""
        return f"{self.name}+{self.variant}" if self.variant else self.name


class _Family(TypedDict, total=False):
    """The BackendSpec fields shared by a framework's backends (keyword arguments)."""

    framework: str
    module: str
    precision_via: tuple[str, ...]
    precisions: tuple[str, ...]
    argument_precisions: tuple[str, ...]
    implementation: str
    install_hint: str


_JAX: _Family = dict(
    framework="jax",
    module="diag.backends.jax_backend",
    # jax.lax.Precision has DEFAULT/HIGH/HIGHEST; jax_default_matmul_precision also
    # takes 'bfloat16' (what diag calls 'medium', as torch does).
    precision_via=("argument", "config"),
    precisions=("default", "high", "highest", "medium"),
    argument_precisions=("default", "high", "highest"),
    install_hint="pip install 'diag[jax]'",
)
_TORCH: _Family = dict(
    framework="torch",
    module="diag.backends.torch_backend",
    # torch has no per-op matmul precision: only torch.set_float32_matmul_precision.
    precision_via=("config",),
    precisions=("default", "high", "highest", "medium"),
    install_hint="pip install 'diag[torch]'",
)
_TORCH_XLA: _Family = dict(
    framework="torch_xla",
    module="diag.backends.torch_xla_backend",
    precision_via=("config",),
    precisions=("default", "high", "highest"),
    implementation="torch",
    install_hint="create its environment with scripts/torch-xla-env.sh DEST, then "
    "pass --python torch-xla=DEST/bin/python",
)

BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        # CPUs compute float32 whatever the setting (measured, jax 0.10.2 on CPU; each run
        # fingerprints it: diag.arith.precision).
        BackendSpec(name="jax-cpu", platform="cpu", **_JAX),
        # DEFAULT may be TF32 on NVIDIA GPUs and one bf16 pass on TPU; only HIGHEST promises
        # float32. Narrow inputs may be accumulated in less than float32.
        BackendSpec(
            name="jax-gpu", platform="gpu", promised=("highest",), narrow_promised=False, **_JAX
        ),
        BackendSpec(
            name="jax-tpu", platform="tpu", promised=("highest",), narrow_promised=False, **_JAX
        ),
        # torch documents that 'high' and 'medium' permit TF32/bf16 internally, on CPU too;
        # whether 'medium' does multiply float32 in bf16 on a CPU is oneDNN's choice per CPU
        # (measured: bf16 on one machine, plain float32 on an AMD EPYC with avx512_bf16 and
        # no AMX). Each run fingerprints the setting it uses (diag.arith.precision).
        BackendSpec(name="torch-cpu", platform="cpu", promised=("default", "highest"), **_TORCH),
        # torch's default float32 matmul precision is 'highest' (TF32 off since 1.12);
        # allow_fp16/bf16_reduced_precision_reduction default to True for narrow inputs.
        BackendSpec(
            name="torch-cuda",
            platform="cuda",
            promised=("default", "highest"),
            narrow_promised=False,
            **_TORCH,
        ),
        # PyTorch/XLA: torch_backend's ops on torch_xla's lazy device, in a worker that usually
        # runs under another Python (torch_xla needs its own torch: diag.worker.host). Its matmul
        # precision is torch_xla's own set_mat_mul_precision (no 'medium'). Verified on CPU
        # only; TPU/CUDA are the same code with another PJRT_DEVICE, promising float32 only at
        # 'highest' as JAX's do.
        BackendSpec(name="torch-xla-cpu", platform="cpu", **_TORCH_XLA),
        BackendSpec(
            name="torch-xla-tpu",
            platform="tpu",
            promised=("highest",),
            narrow_promised=False,
            **_TORCH_XLA,
        ),
        BackendSpec(
            name="torch-xla-cuda",
            platform="cuda",
            promised=("highest",),
            narrow_promised=False,
            **_TORCH_XLA,
        ),
        # numpy emulations of dot algorithms (diag.arith.precision): opt-in, never hardware, and
        # promising nothing, so every verdict is `warn` at worst. The platform is the
        # algorithm.
        *(
            BackendSpec(
                name=f"emu-{short}",
                platform=algorithm,
                framework="numpy",
                module="diag.backends.emu_backend",
                precision_via=(),
                precisions=("default",),
                install_hint="numpy is always installed",
                promised=(),
                narrow_promised=False,
                default=False,
                emulated=True,
            )
            for short, algorithm in (
                ("bf16x1", "BF16_BF16_F32"),
                ("bf16x3", "BF16_BF16_F32_X3"),
                ("bf16x6", "BF16_BF16_F32_X6"),
                ("tf32", "TF32_TF32_F32"),
                ("tf32x3", "TF32_TF32_F32_X3"),
                ("f16", "F16_F16_F32"),
            )
        ),
    )
}


def get_spec(name: str) -> BackendSpec:
    """The spec of a backend name; raises `UsageError` naming the known ones."""
    from diag.errors import UsageError

    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(
            f"unknown backend '{name}'; known backends: {', '.join(BACKENDS)}"
        ) from None


def framework_installed(framework: str) -> bool:
    """Whether the framework can be imported, without importing it."""
    return importlib.util.find_spec(framework) is not None


def not_applicable(spec: BackendSpec, op: str, params: dict) -> str | None:
    """Why a case does not apply to a backend (None when it does).

    Such combinations are not measurements and produce no record: e.g. torch has no per-op
    matmul precision, so a `precision_via='argument'` case is JAX-only.
    """
    if op not in spec.ops:
        return f"{spec.name} implements only {', '.join(spec.ops)}"
    framework = params.get("framework")  # a user's function runs on its own framework only
    if framework is not None and framework != spec.runs:
        return f"{spec.name} runs {spec.runs} code; this function is {framework} code"
    via = params.get("precision_via")
    if via not in (None, "none") and via not in spec.precision_via:
        return f"{spec.framework} takes matmul precision only via {'/'.join(spec.precision_via)}"
    prec = params.get("precision")
    if prec is not None and prec not in spec.precisions:
        return f"{spec.framework} has no precision level '{prec}'"
    if (
        via == "argument"
        and prec is not None
        and spec.argument_precisions is not None
        and prec not in spec.argument_precisions
    ):
        return (
            f"{spec.framework}'s per-op precision argument has no level '{prec}'; "
            f"use precision_via='config'"
        )
    return None


def promises_full_precision(spec: BackendSpec, dtype: str, precision: str) -> bool:
    """Whether a bound breach on this backend, dtype and precision level is a broken promise."""
    if dtype == "float32":
        return precision in spec.promised
    return spec.narrow_promised
