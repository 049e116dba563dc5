"""A top-p / greedy sampler written as flax and gemma samplers are (softmax, a full top_k,
a cumsum, a 0.9 cut), run in bfloat16 under jit on 32k-token logits:

    diag diverge examples/diverge_sampler.py:made         # exit 1: the bf16 cumsum moves
                                                          # tokens across the 0.9 cut
    diag diverge examples/diverge_sampler.py:made_greedy  # exit 1: the bf16 division ties
                                                          # two log-probabilities
    diag diverge examples/diverge_sampler.py:forced       # exit 0, a warning: two logits
                                                          # closer than bf16 resolves
    diag diverge examples/diverge_sampler.py:clean        # exit 0: every decision as float64's
"""

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 32_000


@jax.jit
def sample(logits, temperature):
    """(greedy token, top-p kept mask in vocabulary order) per row."""
    logits = logits / temperature
    probs = jax.nn.softmax(logits, axis=-1)
    probs_sorted, indices = jax.lax.top_k(probs, k=probs.shape[-1])
    cumsum = jnp.cumsum(probs_sorted, axis=-1)
    mask = cumsum - probs_sorted > 0.9
    kept = jnp.take_along_axis(~mask, jnp.argsort(indices, axis=-1), axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    return greedy, kept


@jax.jit
def greedy_logprob(logits, temperature):
    """Greedy on log-probabilities (as a sampler that scores its pick does)."""
    return jnp.argmax(jax.nn.log_softmax(logits / temperature, axis=-1), axis=-1)


def _background(mean: float, scale: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, scale, (1, VOCAB))


def _bf16(x) -> jax.Array:
    return jnp.asarray(x, jnp.bfloat16)


def made():
    """A flat distribution over 32k tokens: the bf16 cumsum loses the small probabilities it
    adds, so the 0.9 cut keeps other tokens than float64 keeps (made by the computation)."""
    return sample, (_bf16(_background(0.0, 2.0)), _bf16(1.0))


def _leaders() -> np.ndarray:
    """Two leaders one bf16 step apart (5.625, 5.65625; the larger one later), the rest of
    the mass far below: divided by 0.7 both round to 8.0625 in bf16."""
    x = _background(-5.0, 1.0)
    x[0, 100], x[0, 200] = 5.625, 5.65625
    return x


def forced():
    """Greedy on logits / 0.7 itself: the float64 quotients are closer than bf16 resolves, so
    no bf16 sampler can pick the right one (forced by rounding: a warning, exit 0)."""
    return sample, (_bf16(_leaders()), _bf16(0.7))


def made_greedy():
    """Greedy on log-probabilities of the same logits: the float64 log-probabilities are
    about 11 bf16 ULP apart; the division's rounding tied them (made by the computation)."""
    return greedy_logprob, (_bf16(_leaders()), _bf16(0.7))


def clean():
    """One token holds most of the mass: every cut and the greedy pick as float64 takes them."""
    x = _background(-5.0, 1.0)
    x[0, 7] = 12.0
    return sample, (_bf16(x), _bf16(1.0))
