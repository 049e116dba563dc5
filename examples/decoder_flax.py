"""A small decoder's forward pass in JAX/Flax (linen), judged by diag against float64.

Two pre-norm transformer blocks (causal self-attention, GELU MLP), a tied output head, random
weights from a fixed key; logits out. The weights are drawn at the scale a trained model
reaches (std 0.4): attention logits above 11, where `exp` overflows float16.

* `clean`: the softmax with `jax.nn.softmax` in float32.
* `planted`: the softmax in float16 without subtracting the row maximum (a "memory saving"
  seen in ports of fused kernels): scores above 11.09 overflow `exp` to inf and their rows
  turn to NaN.

    diag run examples/decoder_flax.py:clean      # every output within its allowance
    diag run examples/decoder_flax.py:planted    # fails; names the exp and its line

In a test: ``fn, args = clean(); diag.testing.assert_numerics(fn, *args)``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 12, 32, 2, 2
INIT = nn.initializers.normal(0.4)


def softmax_fp16_no_max(scores):
    """The planted bug: exp in float16 of unshifted scores (inf past 11.09)."""
    e = jnp.exp(scores.astype(jnp.float16))
    return (e / e.sum(-1, keepdims=True)).astype(scores.dtype)


class Block(nn.Module):
    softmax: str = "float32"

    @nn.compact
    def __call__(self, x):
        b, n, d = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = jnp.split(nn.Dense(3 * d, kernel_init=INIT)(h), 3, axis=-1)
        q, k, v = (t.reshape(b, n, HEADS, d // HEADS).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // HEADS).astype(x.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
        if self.softmax == "float16":
            weights = softmax_fp16_no_max(scores)
        else:
            weights = jax.nn.softmax(scores, axis=-1)
        a = (weights @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        x = x + nn.Dense(d, kernel_init=INIT)(a)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(d, kernel_init=INIT)(nn.gelu(nn.Dense(4 * d, kernel_init=INIT)(h)))


class Decoder(nn.Module):
    softmax: str = "float32"

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, WIDTH, embedding_init=INIT)
        x = embed(ids) + self.param("pos", INIT, (SEQ, WIDTH))
        for _ in range(LAYERS):
            x = Block(self.softmax)(x)
        return embed.attend(nn.LayerNorm()(x))


@jax.jit
def forward(params, ids):
    """The decoder's logits, softmax in float32."""
    return Decoder("float32").apply(params, ids)


@jax.jit
def forward_fp16_softmax(params, ids):
    """The planted bug: the same decoder with the float16 softmax."""
    return Decoder("float16").apply(params, ids)


def _inputs():
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
    return jax.jit(Decoder().init)(jax.random.key(0), ids), ids


def clean():
    return forward, _inputs()


def planted():
    return forward_fp16_softmax, _inputs()
