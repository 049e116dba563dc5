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


class Recent:
    """Float64 copies of the latest `limit` activations widened for a reference, by memory and
    layout: an activation read by the next few ops (a GELU's ``x`` by four, a residual by a
    norm and an add, a forward output by the backward op that unpacks it as a new tensor
    object) is widened once for their references (16 of a GPT-2 forward's 107 widenings, 14%
    of their elements; 6 of an MLP training step's 23, 26%; keyed by tensor object, 3 of
    the 23). Each entry holds its tensor's memory, so no other tensor can be given that memory
    while it is kept; a write the shadow sees drops the copies of its memory (`forget`), a
    write through a view moves the version. 16 finds every repeat in those two; keeping the
    copies of a whole forward pass cost more in memory traffic than widening again (at width
    1024: 10.2-10.5x eager against 9.3-9.7x)."""

    def __init__(self, limit: int) -> None:
        self._kept: dict[tuple, tuple[Any, int, torch.Tensor]] = {}
        self._limit = limit

    def __bool__(self) -> bool:
        return bool(self._kept)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in float64: the kept copy of the same values, else a new one (kept)."""
        try:
            memory = None if t.is_inference() else t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            memory = None
        if memory is None:
            return t.detach().to(torch.float64, copy=True)
        key = (
            memory.data_ptr(),
            t.device,
            t.storage_offset(),
            t.shape,
            t.stride(),
            t.dtype,
            t.is_neg(),
        )
        kept = self._kept
        got = kept.pop(key, None)
        if got is None or got[1] != t._version:
            got = (memory, t._version, t.detach().to(torch.float64, copy=True))
            if len(kept) >= self._limit:
                del kept[next(iter(kept))]
        kept[key] = got  # the latest last
        return got[2]

    def forget(self, written: list) -> None:
        """Drop the copies of the memory of the `written` tensors."""
        ptrs = {storage(t) for t in written}
        for key in [k for k in self._kept if k[0] in ptrs]:
            del self._kept[key]


def storage(t: Any) -> int | None:
    """Where a tensor's memory starts (None for one without plain memory: sparse, meta)."""
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):
        return None
