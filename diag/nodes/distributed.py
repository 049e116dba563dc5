"""The scan's JAX runtime: starting jax (and jax.distributed), placing, gathering.

jax is imported here, inside functions only: `import diag` stays framework-free, and
``--host-devices`` must set XLA_FLAGS before jax starts. Multi-host scans use JAX's own runtime:
`jax.distributed.initialize` and `jax.experimental.multihost_utils.process_allgather`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from diag.errors import UsageError
from diag.nodes.local import Device
from diag.nodes.result import NodeScanError
from diag.nodes.workloads import Workload

__all__ = ["JaxRuntime", "NodeScanError", "StdoutToStderr", "import_jax", "init_distributed"]


def import_jax(host_devices: int | None):
    """Import jax, first forcing `host_devices` CPU devices when asked.

    Raises:
        UsageError: jax was already started in this process with another CPU device count.
        NodeScanError: jax is not installed.
    """
    flag = "--xla_force_host_platform_device_count"
    already = "jax" in sys.modules
    if host_devices is not None:
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
        os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={host_devices}"])
    try:
        import jax
    except ImportError:
        raise NodeScanError(
            "diag nodes needs jax: pip install 'diag[jax]' (or jax[tpu], jax[cuda12])"
        ) from None
    if host_devices is not None and already:
        have = len(jax.devices("cpu"))
        if have != host_devices:
            raise UsageError(
                f"--host-devices {host_devices}: jax was already started in this "
                f"process with {have} CPU device(s); XLA reads "
                f"{flag} once, so scan in a fresh process"
            )
    return jax


def init_distributed(
    jax, coordinator: str | None, num_processes: int | None, process_id: int | None, timeout: int
) -> None:
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise UsageError(
            "--coordinator, --num-processes and --process-id go together; give "
            "all three, or none to let jax detect the cluster (TPU pod, SLURM)"
        )
    kwargs: dict[str, Any] = {"initialization_timeout": timeout}
    if coordinator is not None:
        kwargs.update(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NodeScanError(
            f"jax.distributed could not start ({first}); outside a TPU pod or "
            "SLURM job pass --coordinator HOST:PORT --num-processes N "
            "--process-id I on every host"
        ) from None


class StdoutToStderr:
    """Send fd 1 to stderr while jax.distributed runs: its C++ collectives (Gloo) print
    connection lines on stdout, which would corrupt ``--json`` output a scheduler parses."""

    def __enter__(self):
        sys.stdout.flush()
        self._saved = os.dup(1)
        os.dup2(2, 1)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._saved, 1)
        os.close(self._saved)
        return False


#: jax.config options that change what a computation returns (read with getattr).
JAX_NUMERICS_OPTIONS = (
    "jax_default_matmul_precision",
    "jax_enable_x64",
    "jax_numpy_dtype_promotion",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_debug_nans",
    "jax_disable_jit",
    "jax_enable_checks",
)


def jax_versions(jax) -> dict[str, str]:
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except Exception:
        jaxlib_version = "unknown"
    return {"jax": jax.__version__, "jaxlib": jaxlib_version}


class JaxRuntime:
    """`diag.nodes.local.Runtime` on jax (and jax.distributed across processes)."""

    framework = "jax"

    def __init__(self, jax, platform: str | None, distributed: bool):
        self.jax, self.platform, self.distributed = jax, platform, distributed
        try:
            self._local = jax.local_devices(backend=platform) if platform else jax.local_devices()
            self._every = jax.devices(platform) if platform else jax.devices()
        except RuntimeError as e:
            raise UsageError(f"--platform {platform}: {str(e).splitlines()[0]}") from None
        self.process_index, self.process_count = jax.process_index(), jax.process_count()

    def local_devices(self) -> list[Device]:
        return [Device(int(d.id), str(d.device_kind), str(d.platform), d) for d in self._local]

    def all_devices(self) -> list[tuple[int, int]]:
        return [(int(d.id), int(d.process_index)) for d in self._every]

    def build(self, workload: Workload) -> Callable:
        return workload.build_for("jax")

    def put(self, x: np.ndarray, device: Device) -> Any:
        return self.jax.device_put(x, device.handle)

    def ready(self, y: Any) -> None:
        self.jax.block_until_ready(y)

    def to_numpy(self, y: Any) -> np.ndarray:
        return np.asarray(y)

    def allgather(self, a: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils as mu

        return np.asarray(mu.process_allgather(a))

    def versions(self) -> dict[str, str]:
        return jax_versions(self.jax)

    def settings(self) -> dict[str, str]:
        """jax's versions, numerics options and device kinds, and the measured arithmetic of
        a float32 matmul at the default precision (`diag.arith.precision.fingerprint`)."""
        from diag.arith.precision import fingerprint

        jnp = self.jax.numpy
        out = {f"jax {k}": v for k, v in self.versions().items()}
        for name in JAX_NUMERICS_OPTIONS:
            out[f"jax.config {name}"] = str(getattr(self.jax.config, name, None))
        out["device kinds"] = ", ".join(sorted({d.kind for d in self.local_devices()}))
        dev = self._local[0]
        mm = self.jax.jit(jnp.matmul)
        fp = fingerprint(lambda a, b: mm(self.jax.device_put(a, dev), self.jax.device_put(b, dev)))
        out["measured float32 matmul"] = (
            f"{fp.label} (input bits {list(fp.input_bits)}, accumulator {fp.accumulator})"
        )
        return out

    def shutdown(self) -> None:
        if self.distributed:
            try:
                self.jax.distributed.shutdown()
            except Exception:  # best effort; the verdict is already computed
                pass
