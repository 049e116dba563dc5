"""Float64 copies of the tensors a PyTorch shadow run has not seen, kept while they live.

A parameter or an input has no shadow until an op writes it: its shadow is its own value in
float64. A weight is read by its forward product and, transposed, by the backward ones, and
widening a 1024x1024 float32 weight costs 1.3 ms each time (a fresh 8 MiB buffer: 8 widenings,
10 ms of a 150 ms shadowed training step at width 1024). Each copy is kept while its tensor
lives at the version it was taken at; a write the shadow sees through an alias that does not
share the version counter (``w.data.mul_``) drops the copies of every tensor on that memory.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class Copies:
    """The kept float64 copies of one shadow run, by tensor."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref, int, torch.Tensor, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._kept)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in float64: the kept copy while `t` is at its version, else a new one."""
        key = id(t)
        got = self._kept.get(key)
        inference = t.is_inference()  # no version counter there: not kept
        if got is not None and got[0]() is t and not inference and got[1] == t._version:
            return got[2]
        sh = t.detach().to(torch.float64, copy=True)
        ptr = storage(t)
        if not inference and ptr is not None:
            kept = self._kept

            def drop(ref: weakref.ref) -> None:  # kept as long as its tensor lives
                if kept.get(key, (None,))[0] is ref:
                    del kept[key]

            kept[key] = (weakref.ref(t, drop), t._version, sh, ptr)
        return sh

    def forget(self, written: list) -> None:
        """Drop the copies of tensors on the memory of the `written` tensors."""
        ptrs = {storage(t) for t in written}
        for key in [k for k, v in self._kept.items() if v[3] in ptrs]:
            del self._kept[key]


def storage(t: Any) -> int | None:
    """Where a tensor's memory starts (None for one without plain memory: sparse, meta)."""
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):
        return None
