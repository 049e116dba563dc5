"""A layer norm with a one-pass variance, E[x^2] - E[x]^2, in float32 on activations whose
mean (100) is large against their spread (1): the subtraction cancels.

    diag diverge examples/diverge_layer_norm.py:planted   # exit 1: the subtraction
    diag diverge examples/diverge_layer_norm.py:fixed     # exit 0: two-pass variance
"""

import jax.numpy as jnp
import numpy as np


def layer_norm_one_pass(x):
    mean = x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) - mean * mean
    return (x - mean) / jnp.sqrt(var + 1e-5)


def layer_norm_two_pass(x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5)


def _x():
    return jnp.asarray(np.random.default_rng(0).normal(100.0, 1.0, (16, 256)), jnp.float32)


def planted():
    return layer_norm_one_pass, (_x(),)


def fixed():
    return layer_norm_two_pass, (_x(),)
