"""Your own function under diag: a small decoder block in JAX and in PyTorch, and a planted bug.

    diag run examples/user_function.py:jax_block      # pass on jax-cpu (and jax-gpu, jax-tpu)
    diag run examples/user_function.py:torch_block    # pass on torch-cpu (torch-cuda, torch-xla)
    diag run examples/user_function.py:planted        # fail: names the subtraction, line 33

Each FUNCTION returns (fn, args): diag ships the arguments bit-identical to every backend of
the function's framework (and, for a torch module, its weights), runs fn there, and judges
every output against the same function evaluated in float64 on this machine.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

D, T = 64, 16


def block(params, x):
    """Layer norm (two-pass), a tanh MLP, and the greedy token of each row."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(var + 1e-5)
    y = jnp.tanh(h @ params["w1"]) @ params["w2"]
    return {"hidden": y, "token": jnp.argmax(y @ params["unembed"], axis=-1)}


def planted_block(params, x):
    """The same block with a one-pass variance, E[x^2] - E[x]^2: on activations far from zero
    (here offset by 300) float32 cancels most of the variance's digits."""
    mean = x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) - mean * mean
    h = (x - mean) / jnp.sqrt(var + 1e-5)
    y = jnp.tanh(h @ params["w1"]) @ params["w2"]
    return {"hidden": y, "token": jnp.argmax(y @ params["unembed"], axis=-1)}


def _params_and_x():
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((D, 4 * D)) / np.sqrt(D)).astype(np.float32),
        "w2": (rng.standard_normal((4 * D, D)) / np.sqrt(4 * D)).astype(np.float32),
        "unembed": (rng.standard_normal((D, 100)) / np.sqrt(D)).astype(np.float32),
    }
    return params, (300.0 + rng.standard_normal((T, D))).astype(np.float32)


def jax_block():
    return jax.jit(block), _params_and_x()


def planted():
    return jax.jit(planted_block), _params_and_x()


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up, self.down = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def torch_block():
    return TorchBlock(), (torch.randn(T, D),)
