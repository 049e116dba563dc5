"""Scratch arrays the softmax oracle reuses from call to call, one set per thread.

Why this module exists: the oracle's arithmetic on a block of 2**16 float64 values takes tens of
microseconds per pass, while a FRESH array of that size costs its first-touch page faults (on a
shared 2-core VM, measured ~1 ms per 2 MiB: 9 of the 10 ms of an [8, 32768] call). Keeping the
few scratch arrays of the last call turns those faults into one-time costs.

What is kept: per thread, one flat buffer per name (float64, float32 or bool), grown to the
largest block asked for up to `KEEP_ELEMENTS`; a larger block gets fresh arrays that are dropped
after the call, so at most ~8.5 MiB stay allocated per thread.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["KEEP_ELEMENTS", "scratch"]

#: Largest block (elements) whose scratch arrays are kept between calls.
KEEP_ELEMENTS = 1 << 18

_LOCAL = threading.local()


def scratch(name: str, shape: tuple[int, int], dtype) -> np.ndarray:
    """A C-contiguous array of `shape` and `dtype`, contents undefined.

    Args:
        name: the buffer's name; two live arrays must have different names.
        shape: (rows, n) of the block.
        dtype: float64, float32 or bool.

    Returns:
        A view of this thread's kept buffer `name` (the same memory on the next call with this
        name), or a fresh array when the block exceeds `KEEP_ELEMENTS`.
    """
    size = shape[0] * shape[1]
    dt = np.dtype(dtype)
    if size > KEEP_ELEMENTS:
        return np.empty(shape, dt)
    bufs: dict[str, np.ndarray] | None = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.dtype != dt or buf.size < size:
        buf = bufs[name] = np.empty(max(size, 1 << 12), dt)
    return buf[:size].reshape(shape)
