"""JAX backend (cpu/gpu/tpu). Imported only inside a worker subprocess.

Defines the same op names as every backend and `diag.oracle`. Each op returns a function of
device arrays; `prepare` jits, lowers and compiles it so compile time is measured apart from
run time.

Verified on CPU only (jaxlib CPU); the GPU/TPU paths are the same code with another platform
string. On CPU, matmul precision settings are accepted but do not change the arithmetic
(field notes: bit-identical to f32 for every setting).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

FRAMEWORK = "jax"
_PLATFORMS = ("cpu", "gpu", "tpu")
_device = None

# diag's precision levels -> jax.lax.Precision (per-op argument) and
# jax_default_matmul_precision values (process-wide config).
_PRECISION_ARG = {
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}
_PRECISION_CONFIG = {"high": "high", "highest": "highest",
                     "medium": "bfloat16"}


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
        "device": {"platform": _device.platform, "kind": _device.device_kind,
                   "id": _device.id, "count": len(jax.devices(platform))},
        "framework": {"name": "jax", "version": jax.__version__,
                      "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version()},
        "settings": {
            "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
            "jax_enable_x64": jax.config.jax_enable_x64,
            "jax_debug_nans": jax.config.jax_debug_nans,
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
    """Jit, lower and compile `fn` for `args`; return (thunk, compile seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return (lambda: compiled(*args)), compile_s


def matmul(precision: str = "default", precision_via: str = "none"):
    """`jnp.matmul` under a precision level, given per op or by the process-wide config."""
    if precision == "default":  # touch nothing: the framework's (or the user's) default
        return jnp.matmul
    if precision_via == "argument":
        prec = _PRECISION_ARG[precision]
        return lambda a, b: jnp.matmul(a, b, precision=prec)
    config = _PRECISION_CONFIG[precision]

    def f(a, b):
        with jax.default_matmul_precision(config):
            return jnp.matmul(a, b)

    return f
