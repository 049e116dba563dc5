"""Planted precision bugs in JAX code on Flax linen and NNX modules and optax steps (random
weights), each with its correct twin and its float64 evaluation.

Every maker returns ``(fn, args)``: parameters and modules are arguments, so diag's float64
reference widens them itself. The line that holds the planted bug ends in ``# planted: <case>``; its
twin changes that line (or the dtype the module is given). ``<case>_float64()`` evaluates
the twin's math in float64 with x64 on, which the tests measure both against.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

BF16, F16, F32, F64 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _cast(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)


# -- 1. rotary angles in bf16 (linen projections, bf16) ----------------------------------
class QK(nn.Module):
    dtype: Any = BF16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, dtype=self.dtype)(x), nn.Dense(16, dtype=self.dtype)(x)


def _rotate(v, angles):
    c, s = jnp.cos(angles).astype(v.dtype), jnp.sin(angles).astype(v.dtype)
    v1, v2 = v[..., :8], v[..., 8:]
    return jnp.concatenate([v1 * c - v2 * s, v1 * s + v2 * c], -1)


def rope_bf16(params, x, positions, inv_freq):
    q, k = QK().apply(params, x)
    angles = positions[:, None] * inv_freq[None, :]  # planted: rope
    return _rotate(q, angles) @ _rotate(k, angles).T / 4.0


def rope_fp32(params, x, positions, inv_freq):
    q, k = QK().apply(params, x)
    angles = positions.astype(F32)[:, None] * inv_freq.astype(F32)[None, :]
    return _rotate(q, angles) @ _rotate(k, angles).T / 4.0


def _rope_args():
    x = jnp.asarray(_rng(0).normal(size=(128, 32)), BF16)
    params = _cast(QK().init(jax.random.key(0), x), BF16)
    positions = jnp.asarray(np.arange(128) + 2000, BF16)  # a long context
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(8) / 8), BF16)
    return params, x, positions, inv_freq


def rope_planted():
    return rope_bf16, _rope_args()


def rope_twin():
    return rope_fp32, _rope_args()


def rope_float64():
    params, x, positions, inv_freq = _rope_args()
    with jax.enable_x64(True):
        q, k = QK(dtype=F64).apply(_cast(params, F64), jnp.asarray(x, F64))
        angles = jnp.asarray(positions, F64)[:, None] * jnp.asarray(inv_freq, F64)[None, :]
        return np.asarray(_rotate(q, angles) @ _rotate(k, angles).T / 4.0)


# -- 2. a scan carry kept in bfloat16 (a linen recurrence) -------------------------------
class Smooth(nn.Module):
    """A dense layer, then an exponential moving average along time (a linear recurrence)."""

    carry: Any = BF16

    @nn.compact
    def __call__(self, xs):
        h = nn.Dense(8, dtype=BF16)(xs)

        def step(c, x):
            c = 0.995 * c + 0.005 * x.astype(c.dtype)  # planted: scan
            return c, c

        _, ys = jax.lax.scan(step, jnp.zeros(8, self.carry), h)
        return ys.astype(BF16)


def smooth(params, xs, module):
    return module.apply(params, xs)


def _smooth_args(carry):
    xs = jnp.asarray(_rng(1).normal(size=(400, 8)) + 2.0, BF16)
    params = _cast(Smooth().init(jax.random.key(1), xs), BF16)
    return params, xs, Smooth(carry=carry)


def scan_planted():
    return smooth, _smooth_args(BF16)


def scan_twin():
    return smooth, _smooth_args(F32)


def scan_float64():
    params, xs, _ = _smooth_args(F32)
    with jax.enable_x64(True):
        p = _cast(params, F64)["params"]["Dense_0"]
        h = jnp.asarray(xs, F64) @ p["kernel"] + p["bias"]

        def step(c, x):
            c = 0.995 * c + 0.005 * x
            return c, c

        return np.asarray(jax.lax.scan(step, jnp.zeros(8, F64), h)[1])


# -- 3. an eps that underflows in float16 (an NNX norm on zero-padded rows) ---------------
class Norm(nnx.Module):
    def __init__(self, d: int, dtype):
        self.scale = nnx.Param(jnp.ones(d, dtype))

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return self.scale * (x - mean) * jax.lax.rsqrt(var + 1e-8)  # planted: eps


class NormF32(Norm):
    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        inv = jax.lax.rsqrt(var.astype(F32) + 1e-8).astype(x.dtype)
        return self.scale * (x - mean) * inv


def normalize(norm, x):
    return norm(x)


def _norm_x():
    x = _rng(2).normal(size=(8, 64))
    x[5:] = 0.0  # padding rows
    return x


def eps_planted():
    return normalize, (Norm(64, F16), jnp.asarray(_norm_x(), F16))


def eps_twin():
    return normalize, (NormF32(64, F16), jnp.asarray(_norm_x(), F16))


def eps_float64():
    x = np.asarray(jnp.asarray(_norm_x(), F16), np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-8)


# -- 4. a long reduction in bf16: gradient accumulation over micro-batches (optax) -------
def _loss(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


def accumulate_bf16(params, xs, ys):
    def body(acc, batch):
        g = jax.grad(_loss)(params, *batch)
        acc = jax.tree.map(lambda a, gi: a + gi.astype(a.dtype), acc, g)  # planted: accumulate
        return acc, None

    acc0 = jax.tree.map(lambda p: jnp.zeros_like(p, BF16), params)
    acc, _ = jax.lax.scan(body, acc0, (xs, ys))
    grads = jax.tree.map(lambda a: a.astype(F32) / xs.shape[0], acc)
    opt = optax.sgd(0.1)
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)


def accumulate_fp32(params, xs, ys):
    def body(acc, batch):
        g = jax.grad(_loss)(params, *batch)
        return jax.tree.map(lambda a, gi: a + gi.astype(a.dtype), acc, g), None

    acc0 = jax.tree.map(lambda p: jnp.zeros_like(p, F32), params)
    acc, _ = jax.lax.scan(body, acc0, (xs, ys))
    grads = jax.tree.map(lambda a: a.astype(F32) / xs.shape[0], acc)
    opt = optax.sgd(0.1)
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)


def _accumulate_args():
    r = _rng(3)
    params = {"w": jnp.asarray(r.normal(size=(8, 2)), F32), "b": jnp.zeros(2, F32)}
    xs = jnp.asarray(r.normal(size=(128, 4, 8)), F32)
    ys = jnp.asarray(r.normal(size=(128, 4, 2)) + 3.0, F32)  # far from the fit: one direction
    return params, xs, ys


def accumulate_planted():
    return accumulate_bf16, _accumulate_args()


def accumulate_twin():
    return accumulate_fp32, _accumulate_args()


def accumulate_float64():
    params, xs, ys = _accumulate_args()
    with jax.enable_x64(True):
        p, x, y = _cast(params, F64), jnp.asarray(xs, F64), jnp.asarray(ys, F64)
        out = accumulate_fp32(p, x, y)
        return {k: np.asarray(v) for k, v in out.items()}


# -- 5. a training step whose module hard-codes bfloat16 (linen Dense(dtype=), optax) ---
class MLP(nn.Module):
    dtype: Any = F32

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(32, dtype=self.dtype)(x))  # planted: step
        return nn.Dense(4, dtype=self.dtype)(h).astype(F32)  # planted: step, layer 2


def _update(loss_fn, params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    opt = optax.sgd(1e-2)
    updates, _ = opt.update(grads, opt.init(params), params)
    return loss, grads, optax.apply_updates(params, updates)


def step_bf16(params, x, y):
    def loss_fn(p):
        return ((MLP(dtype=BF16).apply(p, x) - y) ** 2).mean()

    return _update(loss_fn, params)


def step_fp32(params, x, y):
    def loss_fn(p):
        return ((MLP(dtype=F32).apply(p, x) - y) ** 2).mean()

    return _update(loss_fn, params)


def _step_args():
    r = _rng(4)
    x = jnp.asarray(r.normal(size=(64, 16)), F32)
    params = MLP().init(jax.random.key(4), x)
    y = MLP().apply(params, x) + 0.01 * jnp.asarray(r.normal(size=(64, 4)), F32)
    return params, x, y


def step_planted():
    return step_bf16, _step_args()


def step_twin():
    return step_fp32, _step_args()


def step_float64():
    params, x, y = _step_args()
    with jax.enable_x64(True):
        p, x64, y64 = _cast(params, F64), jnp.asarray(x, F64), jnp.asarray(y, F64)

        def loss_fn(q):
            return ((MLP(dtype=F64).apply(q, x64) - y64) ** 2).mean()

        return jax.tree.map(np.asarray, _update(loss_fn, p))


# -- 6. an fp16 softmax without the max subtraction (an NNX attention pooling) -----------
class Pool(nnx.Module):
    def __init__(self, d: int, scale: float):
        k = _rng(5).normal(size=(d, 1)) * scale
        self.query = nnx.Param(jnp.asarray(k, F16))

    def __call__(self, h):
        scores = (h @ self.query[...])[..., 0]
        e = jnp.exp(scores)  # planted: softmax
        w = e / e.sum(-1, keepdims=True)
        return (w[..., None] * h).sum(1)


class PoolSoftmax(Pool):
    def __call__(self, h):
        w = jax.nn.softmax((h @ self.query[...])[..., 0], -1)
        return (w[..., None] * h).sum(1)


def pool(module, h):
    return module(h)


def _pool_h():
    return jnp.asarray(_rng(6).normal(size=(4, 64, 32)), F16)


def softmax_planted():
    return pool, (Pool(32, 3.0), _pool_h())


def softmax_twin():
    return pool, (PoolSoftmax(32, 3.0), _pool_h())


def softmax_float64():
    h = np.asarray(_pool_h(), np.float64)
    q = np.asarray(Pool(32, 3.0).query[...], np.float64)
    s = (h @ q)[..., 0]
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w[..., None] * h).sum(1)
