"""JAX backend (cpu/gpu/tpu). Imported only inside a worker subprocess.

Defines the same op names as every backend and `diag.oracle`. Each op returns a function of
device arrays; `prepare` jits, lowers and compiles it so compile time is measured apart from
run time.

Verified on CPU only (jaxlib CPU); the GPU/TPU paths are the same code with another platform
string. On CPU, matmul precision settings are accepted but do not change the arithmetic
(field notes: bit-identical to f32 for every setting).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
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
            # XLA reads these once, at start-up: what this worker's results were computed under.
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
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


def softmax():
    """`jax.nn.softmax` over the last axis, in the input dtype."""
    return lambda x: jax.nn.softmax(x, axis=-1)


def gelu():
    """`jax.nn.gelu(approximate=True)`: the tanh approximation, in the input dtype."""
    return lambda x: jax.nn.gelu(x, approximate=True)


def top_k(k: int):
    """`jax.lax.top_k`: the k largest along the last axis, values and indices."""
    def f(x):
        values, indices = jax.lax.top_k(x, k)
        return {"values": values, "indices": indices}

    return f


def approx_max_k(k: int, recall_target: float = 0.95, aggregate_to_topk: bool = True,
                 reduction_input_size_override: int = -1):
    """`jax.lax.approx_max_k`: approximate on TPU; elsewhere XLA's fallback (field notes:
    on CPU float32 the same TopK as `lax.top_k`, other dtypes a sort). With
    `aggregate_to_topk=False` it returns an implementation-defined number of candidates."""
    def f(x):
        values, indices = jax.lax.approx_max_k(
            x, k, recall_target=recall_target, aggregate_to_topk=aggregate_to_topk,
            reduction_input_size_override=reduction_input_size_override)
        return {"values": values, "indices": indices}

    return f


def _sampler(x):
    """How a model's sampler picks the greedy token, four ways, in one function."""
    probs = jax.nn.softmax(x, axis=-1)
    return {"argmax": jnp.argmax(x, axis=-1).astype(jnp.int32),
            "argmax_softmax": jnp.argmax(probs, axis=-1).astype(jnp.int32),
            "top_k": jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32),
            "approx_max_k": jax.lax.approx_max_k(x, 1)[1][..., 0].astype(jnp.int32)}


def greedy_token(batches: tuple[int, ...] = ()):
    """The greedy token per row by every path a sampler may take.

    `jit/*`: the four choices fused in one jitted function, where XLA may keep bf16
    intermediates in float32 (`--xla_allow_excess_precision`). `eager/*`: op by op, each
    result materialised in the input dtype (softmax output rounded before the argmax).
    `jit/batchB/*`: the jitted function on batches of B rows, for each B in `batches`
    (the probe table fixes them: `diag.probes.SAMPLER_BATCHES`).
    """
    fused = jax.jit(_sampler)

    def paths(x):
        out = {f"jit/{name}": v for name, v in fused(x).items()}
        probs = jax.nn.softmax(x, axis=-1)  # materialised, in x's dtype
        out["eager/argmax"] = jnp.argmax(x, axis=-1).astype(jnp.int32)
        out["eager/argmax_softmax"] = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        out["eager/top_k"] = jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32)
        out["eager/approx_max_k"] = jax.lax.approx_max_k(x, 1)[1][..., 0].astype(jnp.int32)
        for b in batches:
            chunks = [fused(x[i:i + b]) for i in range(0, x.shape[0], b)]
            for name in chunks[0]:
                out[f"jit/batch{b}/{name}"] = jnp.concatenate([c[name] for c in chunks])
        return out

    paths.eager = True
    return paths


def _train_loss(w1, w2, x):
    """Softmax cross-entropy of a tanh MLP; labels from the inputs (see diag.oracle._train)."""
    labels = jnp.argmax(x[:, :w2.shape[1]], axis=1)
    logits = jnp.tanh(x @ w1) @ w2
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def train_step(lr: float = 0.1):
    """One SGD step (`jax.value_and_grad`), in the inputs' dtype: loss and updated weights."""
    def step(x, w1, w2):
        loss, (g1, g2) = jax.value_and_grad(_train_loss, argnums=(0, 1))(w1, w2, x)
        return {"loss": loss, "w1": w1 - lr * g1, "w2": w2 - lr * g2}

    return step


def train(compute: str = "float32", **case):
    """N AdamW steps of a small transformer (`diag.train`; the math is in
    `diag.train.jax_model`): loss, every gradient and every parameter, per step."""
    from diag.train import jax_model

    return jax_model.op(compute, case, _device)
