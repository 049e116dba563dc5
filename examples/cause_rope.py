"""Rotary position angles computed in bfloat16: the error shows in `cos`, the cause is the
product one line above it (`diag run examples/cause_rope.py:planted`, `diag diverge ...`).

At position 2000 one bfloat16 ULP is 8 (radians): the product `positions * inv_freq` is
correctly rounded, yet `cos` of it is a different number. `fixed` computes the angles in
float32 and rounds only cos and sin to bfloat16.
"""

import jax.numpy as jnp
import numpy as np


def rotate(v, angles):
    c, s = jnp.cos(angles).astype(v.dtype), jnp.sin(angles).astype(v.dtype)
    v1, v2 = v[..., :16], v[..., 16:]
    return jnp.concatenate([v1 * c - v2 * s, v1 * s + v2 * c], -1)


def attention_logits(q, k, positions, inv_freq):
    angles = positions[:, None] * inv_freq[None, :]
    return {"logits": rotate(q, angles) @ rotate(k, angles).T / 8.0}


def attention_logits_fixed(q, k, positions, inv_freq):
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    return {"logits": rotate(q, angles) @ rotate(k, angles).T / 8.0}


def _inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(128, 32)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(128, 32)), jnp.bfloat16)
    positions = jnp.arange(2000, 2128, dtype=jnp.bfloat16)  # a long context
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(16) / 16), jnp.bfloat16)
    return q, k, positions, inv_freq


def planted():
    return attention_logits, _inputs()


def fixed():
    return attention_logits_fixed, _inputs()
