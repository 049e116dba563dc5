"""diag.diverge.compare: a JAX model and its PyTorch port tap the same names; a port with one
layer changed (GELU approximation, layer-norm eps, missing attention scale) is named at that
layer, in either framework; a correct port reports no divergence.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

import diag  # noqa: E402
from diag.tolerance.diverge import diverge_tap_allowance as tap_allowance  # noqa: E402

D, T = 32, 16
RNG = np.random.default_rng(7)
W = {k: RNG.normal(0, 1 / math.sqrt(D), (D, D)).astype(np.float32)
     for k in ("q", "k", "v", "o", "up", "down")}
# Small activations (std 0.05), as embeddings often are: there a layer norm's eps matters.
X = RNG.normal(0, 0.05, (T, D)).astype(np.float32)
CORRECT = {"gelu_tanh": False, "eps": 1e-5, "scale": True}
BUGS = {"gelu_tanh": ("mlp.act", True), "eps": ("ln1", 1e-6), "scale": ("scores", False)}


def jax_block(x, w, gelu_tanh=False, eps=1e-5, scale=True):
    def ln(h, name):
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return diag.tap(name, (h - m) / jnp.sqrt(v + eps))

    h = ln(x, "ln1")
    q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
    s = diag.tap("scores", q @ k.T * (1 / math.sqrt(D) if scale else 1.0))
    x = x + diag.tap("attn", jax.nn.softmax(s, -1) @ v @ w["o"])
    h = ln(x, "ln2")
    a = diag.tap("mlp.act", jax.nn.gelu(h @ w["up"], approximate=gelu_tanh))
    return diag.tap("out", x + a @ w["down"])


def torch_block(x, w, gelu_tanh=False, eps=1e-5, scale=True):
    F = torch.nn.functional
    h = diag.tap("ln1", F.layer_norm(x, (D,), eps=eps))
    q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
    s = diag.tap("scores", q @ k.T * (1 / math.sqrt(D) if scale else 1.0))
    x = x + diag.tap("attn", torch.softmax(s, -1) @ v @ w["o"])
    h = diag.tap("ln2", F.layer_norm(x, (D,), eps=eps))
    a = diag.tap("mlp.act", F.gelu(h @ w["up"], approximate="tanh" if gelu_tanh else "none"))
    return diag.tap("out", x + a @ w["down"])


def run_jax(**variant):
    w = {k: jnp.asarray(v) for k, v in W.items()}
    f = jax.jit(lambda x: jax_block(x, w, **variant))
    return lambda: f(jnp.asarray(X))


def run_torch(**variant):
    w = {k: torch.tensor(v) for k, v in W.items()}
    return lambda: torch_block(torch.tensor(X), w, **variant)


def test_a_correct_port_reports_no_divergence():
    rep = diag.diverge.compare(run_jax(**CORRECT), run_torch(**CORRECT))
    assert rep.first is None
    assert [t.name for t in rep.taps] == ["ln1", "scores", "attn", "ln2", "mlp.act", "out"]
    assert all(0 <= t.max_rel <= t.allowed for t in rep.taps)
    assert all(t.allowed == tap_allowance("float32") for t in rep.taps)
    assert not rep.only_a and not rep.only_b


@pytest.mark.parametrize("broken", ["torch", "jax"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_port_with_one_layer_changed_is_named_at_that_layer(bug, broken):
    layer, value = BUGS[bug]
    variant = {**CORRECT, bug: value}
    a = run_jax(**(CORRECT if broken == "torch" else variant))
    b = run_torch(**(variant if broken == "torch" else CORRECT))
    rep = diag.diverge.compare(a, b)
    assert rep.first is not None and rep.first.name == layer
    assert rep.first.max_rel > rep.first.allowed and rep.first.ratio > 1
    before = [t for t in rep.taps if t.index < rep.first.index]
    assert all(t.max_rel <= t.allowed for t in before)
    if bug == "scale":  # one side's scores are sqrt(D) times the other's
        r = math.sqrt(D)
        want = (r - 1) / r if broken == "torch" else r - 1
        assert rep.first.max_rel == pytest.approx(want, rel=1e-4)
        assert rep.first.mean_rel == pytest.approx(want, rel=1e-4)


def test_taps_repeat_names_and_the_name_map_pairs_them():
    def a():
        for i in range(3):
            diag.tap("x", jnp.full((4,), float(i)))

    def b():
        for i in range(3):
            diag.tap("y", torch.full((4,), float(i) if i < 2 else 2.5))

    rep = diag.diverge.compare(a, b, name_map={"y": "x"})
    assert [t.name for t in rep.taps] == ["x", "x#1", "x#2"]
    assert rep.first.name == "x#2" and rep.first.max_rel == pytest.approx(0.5 / 2.5)
    # Without the map nothing is shared: no verdict can be given (exit 2 from the CLI), and
    # the error names what each side tapped.
    with pytest.raises(diag.diverge.NothingCompared, match=r"run A: x, x#1, x#2; run B: y, "
                                                           r"y#1, y#2") as err:
        diag.diverge.compare(a, b)
    assert err.value.exit_code == 2


def test_tap_is_an_identity_outside_compare():
    x = torch.ones(3)
    assert diag.tap("t", x) is x
    assert float(jax.jit(lambda v: diag.tap("t", v) * 2)(jnp.ones(3)).sum()) == 6.0


def test_a_run_that_raises_is_a_diverge_error():
    def bad():
        raise ValueError("boom")

    with pytest.raises(diag.diverge.DivergeError, match="run B .*ValueError: boom"):
        diag.diverge.compare(run_torch(**CORRECT), bad)
