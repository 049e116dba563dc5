"""Every process's observations, in process order, through the framework's own all-gather.

A `Runtime.allgather` takes one numpy array per process (same shape and dtype everywhere) and
returns them stacked ``[P, ...]``: jax's ``multihost_utils.process_allgather``, torch's
``torch.distributed.all_gather`` (gloo on CPU, NCCL on GPU). Processes may hold different
numbers of devices, so per-device rows are padded to the largest count and cut back after;
text (host names, device kinds, configuration fingerprints) travels as padded UTF-8 bytes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.nodes.local import LocalRun, Runtime

__all__ = ["Gathered", "barrier", "gather", "gather_texts", "gather_ulps"]


@dataclass
class Gathered:
    """What every process saw, one row per device of every process (process order)."""

    devices: list[dict[str, Any]]
    digests: np.ndarray  # uint8 [D, W, R, 32]
    nan: np.ndarray
    inf: np.ndarray
    times: np.ndarray
    injected: np.ndarray
    rows: list[tuple[int, int]]  # (process, local index) of each row
    dmax: int  # the largest local device count (the padding)


def barrier(rt: Runtime) -> None:
    """Wait until every process gets here (a one-byte all-gather: every runtime has one)."""
    if rt.distributed:
        rt.allgather(np.zeros(1, np.uint8))


def gather_texts(rt: Runtime, text: str) -> list[str]:
    """Every process's `text`, in process order (one string per process)."""
    if not rt.distributed:
        return [text]
    raw = np.frombuffer(text.encode(), np.uint8)
    sizes = rt.allgather(np.array([raw.size], np.int32)).reshape(-1)
    padded = np.zeros(int(sizes.max()) or 1, np.uint8)
    padded[: raw.size] = raw
    got = rt.allgather(padded)
    return [bytes(got[p, : int(n)]).decode(errors="replace") for p, n in enumerate(sizes)]


def _pad(a: np.ndarray, dmax: int, fill=0) -> np.ndarray:
    extra = dmax - a.shape[0]
    if extra == 0:
        return a
    return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, a.dtype)])


def gather(rt: Runtime, local: LocalRun) -> Gathered:
    """Every process's rows, in process order."""
    host = socket.gethostname()
    if not rt.distributed:
        devs = [
            {
                "device_id": dev.id,
                "process_index": rt.process_index,
                "host": host,
                "kind": dev.kind,
                "platform": dev.platform,
            }
            for dev in local.devices
        ]
        return Gathered(
            devs,
            local.digests,
            local.nan,
            local.inf,
            local.times,
            local.injected,
            [(0, i) for i in range(len(devs))],
            len(devs),
        )
    counts = rt.allgather(np.array([len(local.devices)], np.int32)).reshape(-1)
    dmax = int(counts.max())
    ids = _pad(np.array([dev.id for dev in local.devices], np.int32), dmax, -1)
    first = local.devices[0] if local.devices else None
    hosts = gather_texts(rt, host)
    kinds = gather_texts(rt, first.kind if first else "")
    platforms = gather_texts(rt, first.platform if first else "")
    g_ids, g_dig, g_nan, g_inf, g_times, g_inj = [
        rt.allgather(a)
        for a in (
            ids,
            _pad(local.digests, dmax),
            _pad(local.nan, dmax),
            _pad(local.inf, dmax),
            _pad(local.times.astype(np.float32), dmax),
            _pad(local.injected.astype(np.uint8), dmax),
        )
    ]
    devs, rows = [], []
    for p in range(len(counts)):
        for i in range(int(counts[p])):
            devs.append(
                {
                    "device_id": int(g_ids[p, i]),
                    "process_index": p,
                    "host": hosts[p],
                    "kind": kinds[p],
                    "platform": platforms[p],
                }
            )
            rows.append((p, i))

    def take(a):
        return np.stack([a[p, i] for p, i in rows])

    return Gathered(
        devs,
        take(g_dig),
        take(g_nan),
        take(g_inf),
        take(g_times).astype(np.float64),
        take(g_inj).astype(bool),
        rows,
        dmax,
    )


def gather_ulps(rt: Runtime, local_ulps: np.ndarray, got: Gathered) -> np.ndarray:
    """Every device's ULP distances (each process measured its own devices')."""
    if not rt.distributed:
        return local_ulps
    g = rt.allgather(_pad(local_ulps.astype(np.float32), got.dmax, np.nan)).astype(np.float64)
    return np.stack([g[p, i] for p, i in got.rows])
