"""JAX backend (cpu/gpu/tpu). Imported only inside a worker subprocess.

What is the backend's own: the devices, moving arrays, waiting, the precision knobs
(`precision_argument`, `precision_scope`) and the compiled HLO. The ops are each op module's
`on_jax` (`diag.plan.registry`), which returns a function of device arrays; `prepare` jits, lowers
and compiles it so compile time is measured apart from run time.

Verified on CPU only (jaxlib CPU); the GPU/TPU paths are the same code with another platform
string. On CPU, matmul precision settings are accepted but do not change the arithmetic
(measured, jax 0.10.2 on CPU: bit-identical to f32 for every setting).
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import numpy as np

from diag.backends.base import Prepared

FRAMEWORK = "jax"
_PLATFORMS = ("cpu", "gpu", "tpu")
_device = None

# diag's precision levels -> jax.lax.Precision (per-op argument) and
# jax_default_matmul_precision values (process-wide config).
_PRECISION_ARG = {
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}
_PRECISION_CONFIG = {"high": "high", "highest": "highest", "medium": "bfloat16"}


def discover() -> list[str]:
    found = []
    for platform in _PLATFORMS:
        try:
            if jax.devices(platform):
                found.append(platform)
        except RuntimeError:  # "Unknown backend" when the platform is absent
            pass
    return found


def setup(platform: str) -> dict:
    global _device
    _device = jax.devices(platform)[0]
    return {
        "device": {
            "platform": _device.platform,
            "kind": _device.device_kind,
            "id": _device.id,
            "count": len(jax.devices(platform)),
        },
        "framework": {
            "name": "jax",
            "version": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        },
        "settings": {
            # XLA reads these once, at start-up: what this worker's results were computed under.
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
            # (jax declares its options on Config at run time: the stubs lack them)
            "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,  # type: ignore[attr-defined]
            "jax_enable_x64": jax.config.jax_enable_x64,  # type: ignore[attr-defined]
            "jax_debug_nans": jax.config.jax_debug_nans,  # type: ignore[attr-defined]
        },
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:
        return None


def put(x: np.ndarray):
    return jax.device_put(np.asarray(x), _device)


def get(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def block(x) -> None:
    jax.block_until_ready(x)


def prepare(fn, args):
    """Jit, lower and compile `fn` for `args` (`diag.backends.base.Prepared`).

    An op that compiles its own parts (`fn.eager`, e.g. a sampler that runs both jitted and
    op by op) is run once as warm-up instead, and that call is reported (`Prepared.first`).
    """
    if getattr(fn, "eager", False):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        seconds = time.perf_counter() - t0
        return Prepared(lambda: fn(*args), seconds, first=(out, seconds))
    key = (fn, tuple((x.shape, x.dtype) for x in args))
    if key in _compiled:  # the same program for other inputs: compiled once per worker
        compiled = _compiled[key]
        return Prepared(lambda: compiled(*args), 0.0)
    t0 = time.perf_counter()
    compiled = _compiled[key] = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return Prepared(lambda: compiled(*args), compile_s)


#: (function, input signature) -> its compiled executable (`prepare`).
_compiled: dict = {}


def hlo_text(fn, args) -> str | None:
    """The optimised HLO XLA compiled for `fn` (what an A/B setting may change), or None for
    ops that compile their own parts."""
    if getattr(fn, "eager", False):
        return None
    return jax.jit(fn).lower(*args).compile().as_text()


def device():
    """The device `setup` opened (an op that places arrays itself, e.g. a training run)."""
    return _device


def precision_argument(precision: str):
    """diag's precision level as `jax.lax.Precision`, the per-op argument."""
    return _PRECISION_ARG[precision]


def precision_scope(precision: str):
    """A context in which traced matmuls use `precision` (jax_default_matmul_precision)."""
    if precision == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(_PRECISION_CONFIG[precision])
