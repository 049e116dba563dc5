"""A JAX block and its PyTorch port, both tapping the same names with `diag.tap`; the port
uses the tanh approximation of GELU, the JAX original the exact one.

    diag diverge examples/diverge_port.py:run_jax examples/diverge_port.py:run_torch
    diag diverge examples/diverge_port.py:run_jax examples/diverge_port.py:run_torch_fixed
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

import diag

D = 32
_rng = np.random.default_rng(0)
W = {k: _rng.normal(0, 1 / math.sqrt(D), (D, D)).astype(np.float32)
     for k in ("q", "k", "v", "o", "up", "down")}
X = _rng.normal(0, 1, (16, D)).astype(np.float32)


@jax.jit
def jax_block(x, w):
    h = diag.tap("ln1", jax.nn.standardize(x, axis=-1, epsilon=1e-5))
    s = diag.tap("scores", (h @ w["q"]) @ (h @ w["k"]).T / math.sqrt(D))
    x = x + diag.tap("attn", jax.nn.softmax(s, -1) @ (h @ w["v"]) @ w["o"])
    h = diag.tap("ln2", jax.nn.standardize(x, axis=-1, epsilon=1e-5))
    a = diag.tap("mlp.act", jax.nn.gelu(h @ w["up"], approximate=False))
    return diag.tap("out", x + a @ w["down"])


def torch_block(x, w, gelu="tanh"):
    F = torch.nn.functional
    h = diag.tap("ln1", F.layer_norm(x, (D,), eps=1e-5))
    s = diag.tap("scores", (h @ w["q"]) @ (h @ w["k"]).T / math.sqrt(D))
    x = x + diag.tap("attn", torch.softmax(s, -1) @ (h @ w["v"]) @ w["o"])
    h = diag.tap("ln2", F.layer_norm(x, (D,), eps=1e-5))
    a = diag.tap("mlp.act", F.gelu(h @ w["up"], approximate=gelu))
    return diag.tap("out", x + a @ w["down"])


def run_jax():
    return jax_block(jnp.asarray(X), {k: jnp.asarray(v) for k, v in W.items()})


def run_torch():
    return torch_block(torch.tensor(X), {k: torch.tensor(v) for k, v in W.items()})


def run_torch_fixed():
    return torch_block(torch.tensor(X), {k: torch.tensor(v) for k, v in W.items()}, "none")
