"""A sampler step in JAX: temperature, top-k filtering, greedy argmax; token ids out.

The step a decoder runs once per generated token. Its outputs are integers, so diag judges
them by exact agreement with the float64 reference, row by row; a row whose choice moves when
the logits move by one rounding of their dtype would be a `warn` (forced by rounding), any
other differing row a `fail`.

* `clean`: probabilities with `jax.nn.softmax` (which subtracts the row maximum).
* `planted`: probabilities as exp(x) / sum(exp(x)) without that subtraction. At temperature
  0.1 a logit above 8.87 scales past 88.7, where float32 `exp` overflows to inf; inf / inf is
  NaN, and the argmax picks the first NaN, not the best token. Float64 (exp overflows past
  709.8) ranks the same row correctly.

    diag run examples/sampler_jax.py:clean      # token ids agree with float64
    diag run examples/sampler_jax.py:planted    # fails; names the exp and its line

In a test: ``fn, args = clean(); diag.testing.assert_numerics(fn, *args)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BATCH, VOCAB, TOP_K, TEMPERATURE = 64, 512, 40, 0.1


def _pick(probs):
    kth = jax.lax.top_k(probs, TOP_K)[0][:, -1:]
    return jnp.argmax(jnp.where(probs >= kth, probs, 0.0), axis=-1)


@jax.jit
def sample_step(logits):
    """Greedy token per row after temperature and top-k."""
    return _pick(jax.nn.softmax(logits / TEMPERATURE, axis=-1))


@jax.jit
def sample_step_no_max(logits):
    """The planted bug: the softmax without subtracting the row maximum."""
    e = jnp.exp(logits / TEMPERATURE)  # inf for logits above 8.87
    return _pick(e / e.sum(-1, keepdims=True))


def _logits():
    return 3.0 * jax.random.normal(jax.random.key(0), (BATCH, VOCAB), jnp.float32)


def clean():
    return sample_step, (_logits(),)


def planted():
    return sample_step_no_max, (_logits(),)
