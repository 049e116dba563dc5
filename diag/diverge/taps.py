"""`tap(name, x)`: an identity that records a value while `compare` runs, and module auto-taps.

JAX values go through `jax.debug.callback`, so a tap works inside jit, scan and grad: the
compiled function keeps the callback, which records only while a recorder is active (outside
`compare` it returns at once). Torch tensors are copied to the host on the spot. Module outputs
are tapped under their path: torch through global forward hooks (``encoder.layers.0``), flax
linen through `flax.linen.intercept_methods` (``encoder/layers_0``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

_LOCK = threading.Lock()
_ACTIVE: list[Recorder] = []


class Recorder:
    """Taps in the order they ran: (name, float64 copy, dtype name, shape)."""

    def __init__(self):
        self.taps: list[tuple[str, np.ndarray, str, tuple[int, ...]]] = []

    def add(self, name: str, value: Any) -> None:
        from diag import numerics

        arr = np.asarray(value)
        dtype = str(arr.dtype)
        if numerics.is_supported(arr.dtype):
            dtype = numerics.dtype_name(arr.dtype)
        with _LOCK:
            self.taps.append((name, arr.astype(np.float64), dtype, tuple(arr.shape)))


def _record(name: str, value: Any) -> None:
    if _ACTIVE:
        _ACTIVE[-1].add(name, value)


def _torch_host(t) -> Any:
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


def tap(name: str, x: Any) -> Any:
    """See `diag.diverge.tap`."""
    if type(x).__module__.startswith("torch"):
        if _ACTIVE:
            import torch

            with torch._C.DisableTorchFunction():
                _record(name, _torch_host(x))
        return x
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, (jax.Array, jax.core.Tracer)):
        jax.debug.callback(functools.partial(_record, name), x)
        return x
    if _ACTIVE:
        _record(name, np.asarray(x))
    return x


@contextlib.contextmanager
def recording(modules: bool = False) -> Iterator[Recorder]:
    """Record every tap (and, with `modules`, every module output) made inside the block."""
    rec = Recorder()
    _ACTIVE.append(rec)
    undo = _module_taps() if modules else []
    try:
        yield rec
        jax = sys.modules.get("jax")
        if jax is not None:
            jax.effects_barrier()  # callbacks of asynchronously dispatched work have run
    finally:
        for u in undo:
            u()
        _ACTIVE.remove(rec)


def _first_leaf(out: Any, kind: type) -> Any:
    if isinstance(out, kind):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            got = _first_leaf(o, kind)
            if got is not None:
                return got
    if isinstance(out, dict):
        for o in out.values():
            got = _first_leaf(o, kind)
            if got is not None:
                return got
    return None


def _module_taps() -> list:
    """Install the torch and flax module taps for the frameworks already imported."""
    undo = []
    if "torch" in sys.modules:
        undo += _torch_module_taps()
    if "flax" in sys.modules:
        undo += _flax_module_taps()
    return undo


def _torch_module_taps() -> list:
    import torch

    names: dict[int, str] = {}
    depth = [0]

    def enter(module, inputs):
        if depth[0] == 0 and id(module) not in names:
            names.update({id(m): n for n, m in module.named_modules() if n})
        depth[0] += 1

    def leave(module, inputs, output):
        depth[0] -= 1
        name = names.get(id(module))
        t = _first_leaf(output, torch.Tensor)
        if name and t is not None and t.is_floating_point():
            tap(name, t)

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    return [h.remove for h in hooks]


def _flax_module_taps() -> list:
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover - flax without linen
        return []
    import jax

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        path = getattr(context.module, "path", ())
        if context.method_name == "__call__" and path:
            leaf = _first_leaf(out, (jax.Array, jax.core.Tracer))
            if leaf is not None:
                tap("/".join(str(p) for p in path), leaf)
        return out

    cm = nn.intercept_methods(interceptor)
    cm.__enter__()
    return [lambda: cm.__exit__(None, None, None)]
