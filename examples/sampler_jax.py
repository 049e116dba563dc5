"""A sampler step in JAX: temperature, top-k filtering, greedy argmax; token ids out.

The step a decoder runs once per generated token. Its outputs are integers, so diag judges
them by exact agreement with the float64 reference, row by row; a row whose two best logits
are closer than rounding the inputs to their dtype can resolve would be a `warn` (forced by
rounding), any other differing row a `fail`.

* `clean`: the float32 logits are scaled and ranked in float32.
* `planted`: the logits are cast to bfloat16 first (to "save memory" in the sampler): two
  logits 0.01 apart near 8 fall into one bfloat16 value (spacing 0.0625 there), and the
  argmax picks a token the float32 logits do not rank first.

    diag run examples/sampler_jax.py:clean      # token ids agree with float64
    diag run examples/sampler_jax.py:planted    # fails; names the argmax and its line

In a test: ``diag.testing.assert_numerics(*clean())``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BATCH, VOCAB, TOP_K, TEMPERATURE = 64, 512, 40, 0.7


def _step(logits, dtype):
    scaled = logits.astype(dtype) / TEMPERATURE
    kth = jax.lax.top_k(scaled, TOP_K)[0][:, -1:]
    filtered = jnp.where(scaled >= kth, scaled, -jnp.inf)
    return jnp.argmax(filtered, axis=-1)


def sample_step(logits):
    """Greedy token per row after temperature and top-k, in the logits' own dtype."""
    return _step(logits, logits.dtype)


def sample_step_bf16(logits):
    """The planted bug: the same step on bfloat16 logits."""
    return _step(logits, jnp.bfloat16)


def _logits():
    return 3.0 * jax.random.normal(jax.random.key(0), (BATCH, VOCAB), jnp.float32)


def clean():
    return sample_step, (_logits(),)


def planted():
    return sample_step_bf16, (_logits(),)
