"""Automatic taps of module outputs: a flax linen model and its PyTorch port are compared layer
by layer with no `diag.tap` in either, their paths paired by a name map. The classic port bug,
flax's LayerNorm epsilon (1e-6) against torch's (1e-5), is named at the first layer norm.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

import diag  # noqa: E402

D, T = 32, 16
RNG = np.random.default_rng(11)
W = {k: RNG.normal(0, 1 / math.sqrt(D), (D, D)).astype(np.float32) for k in ("up", "down")}
X = RNG.normal(0, 0.05, (T, D)).astype(np.float32)


class TorchMLP(torch.nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.up = torch.nn.Linear(D, D, bias=False)
        self.act = torch.nn.GELU(approximate=approximate)
        self.down = torch.nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TorchBlock(torch.nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(D, elementwise_affine=False)
        self.mlp = TorchMLP(approximate)

    def forward(self, x):
        return x + self.mlp(self.ln1(x))


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, use_bias=False, name="up")(x)
        return nn.Dense(D, use_bias=False, name="down")(jax.nn.gelu(h, approximate=False))


class FlaxBlock(nn.Module):
    eps: float = 1e-6  # flax's default; torch's is 1e-5

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=self.eps, use_scale=False, use_bias=False, name="ln1")(x)
        return x + FlaxMLP(name="mlp")(h)


def run_torch(approximate="none"):
    model = TorchBlock(approximate)
    with torch.no_grad():
        model.mlp.up.weight.copy_(torch.tensor(W["up"].T))
        model.mlp.down.weight.copy_(torch.tensor(W["down"].T))
    return lambda: model(torch.tensor(X))


def run_flax(eps=1e-6):
    params = {"params": {"mlp": {"up": {"kernel": jnp.asarray(W["up"])},
                                 "down": {"kernel": jnp.asarray(W["down"])}}}}
    f = jax.jit(lambda x: FlaxBlock(eps).apply(params, x))
    return lambda: f(jnp.asarray(X))


def to_torch_name(path: str) -> str:
    return path.replace("/", ".")


def test_flax_default_eps_is_named_at_the_layer_norm():
    rep = diag.diverge.compare(run_torch(), run_flax(), modules=True, name_map=to_torch_name)
    names = [t.name for t in rep.taps]
    assert names == ["ln1", "mlp.up", "mlp.down", "mlp"]
    assert rep.first.name == "ln1" and rep.first.max_rel > rep.first.allowed
    assert "mlp.act" in rep.only_a  # torch's GELU is a module; flax's is a function


def test_matching_eps_is_clean_and_a_gelu_module_swap_is_named():
    rep = diag.diverge.compare(run_torch(), run_flax(eps=1e-5), modules=True,
                               name_map=to_torch_name)
    assert rep.first is None and len(rep.taps) == 4
    rep = diag.diverge.compare(run_torch(), run_torch("tanh"), modules=True)
    assert rep.first.name == "mlp.act"
    assert [t.name for t in rep.taps if t.beyond][:1] == ["mlp.act"]
