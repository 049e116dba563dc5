"""Starting jax for a scan and gathering every process's observations (jax.distributed).

jax is imported here, inside functions only: `import diag` stays framework-free, and
``--host-devices`` must set XLA_FLAGS before jax starts. Multi-host scans use JAX's own runtime:
`jax.distributed.initialize` and `jax.experimental.multihost_utils.process_allgather`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from diag.errors import DiagError, UsageError

if TYPE_CHECKING:
    from diag.nodes.scan import _Local

_NAME_BYTES = 64


class NodeScanError(DiagError):
    """The scan itself could not run (jax missing, distributed start-up failed)."""


def import_jax(host_devices: Optional[int]):
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
        raise NodeScanError("diag nodes needs jax: pip install 'diag[jax]' (or jax[tpu], "
                            "jax[cuda12])") from None
    if host_devices is not None and already:
        have = len(jax.devices("cpu"))
        if have != host_devices:
            raise UsageError(f"--host-devices {host_devices}: jax was already started in this "
                             f"process with {have} CPU device(s); XLA reads "
                             f"{flag} once, so scan in a fresh process")
    return jax


def init_distributed(jax, coordinator: Optional[str], num_processes: Optional[int],
                      process_id: Optional[int], timeout: int) -> None:
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise UsageError("--coordinator, --num-processes and --process-id go together; give "
                         "all three, or none to let jax detect the cluster (TPU pod, SLURM)")
    kwargs: dict[str, Any] = {"initialization_timeout": timeout}
    if coordinator is not None:
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes,
                      process_id=process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NodeScanError(f"jax.distributed could not start ({first}); outside a TPU pod or "
                            "SLURM job pass --coordinator HOST:PORT --num-processes N "
                            "--process-id I on every host") from None


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


def hex_digests(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 32] -> str array [...] of hex digests."""
    flat = raw.reshape(-1, raw.shape[-1])
    return np.array([bytes(row).hex() for row in flat], dtype=object).reshape(raw.shape[:-1])


def _name_bytes(text: str) -> np.ndarray:
    raw = text.encode()[:_NAME_BYTES]
    return np.frombuffer(raw + b"\0" * (_NAME_BYTES - len(raw)), np.uint8).copy()


def _name_text(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode(errors="replace")


def gather(jax, local: _Local, process_index: int, host: str, distributed: bool):
    """Every process's rows, in process order: (device dicts, arrays...)."""
    kinds = [dev.device_kind for dev in local.devices]
    if not distributed:
        devs = [{"device_id": int(dev.id), "process_index": process_index, "host": host,
                 "kind": kinds[i], "platform": dev.platform}
                for i, dev in enumerate(local.devices)]
        return devs, local.digests, local.nan, local.inf, local.times, local.injected
    from jax.experimental import multihost_utils as mu

    counts = np.asarray(mu.process_allgather(np.array([len(local.devices)], np.int32)))
    counts = counts.reshape(-1)
    dmax = int(counts.max())

    def pad(a, fill=0):
        extra = dmax - a.shape[0]
        if extra == 0:
            return a
        return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, a.dtype)])

    ids = pad(np.array([dev.id for dev in local.devices], np.int32), -1)
    meta = np.stack([_name_bytes(host), _name_bytes(kinds[0] if kinds else ""),
                     _name_bytes(local.devices[0].platform if local.devices else "")])
    g = [np.asarray(mu.process_allgather(a)) for a in (
        ids, meta, pad(local.digests), pad(local.nan), pad(local.inf),
        pad(local.times.astype(np.float32)), pad(local.injected.astype(np.uint8)))]
    g_ids, g_meta, g_dig, g_nan, g_inf, g_times, g_inj = g
    devs, rows = [], []
    for p in range(len(counts)):
        for i in range(int(counts[p])):
            devs.append({"device_id": int(g_ids[p, i]), "process_index": p,
                         "host": _name_text(g_meta[p, 0]), "kind": _name_text(g_meta[p, 1]),
                         "platform": _name_text(g_meta[p, 2])})
            rows.append((p, i))
    take = lambda a: np.stack([a[p, i] for p, i in rows])  # noqa: E731
    return (devs, take(g_dig), take(g_nan), take(g_inf), take(g_times).astype(np.float64),
            take(g_inj).astype(bool))


def gather_ulps(local_ulps: np.ndarray, distributed: bool, counts_rows) -> np.ndarray:
    if not distributed:
        return local_ulps
    from jax.experimental import multihost_utils as mu

    dmax, rows = counts_rows
    extra = dmax - local_ulps.shape[0]
    if extra:
        local_ulps = np.concatenate([local_ulps, np.full((extra,) + local_ulps.shape[1:],
                                                         np.nan)])
    g = np.asarray(mu.process_allgather(local_ulps.astype(np.float32))).astype(np.float64)
    return np.stack([g[p, i] for p, i in rows])


def jax_versions(jax) -> dict[str, str]:
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except Exception:
        jaxlib_version = "unknown"
    return {"jax": jax.__version__, "jaxlib": jaxlib_version}
