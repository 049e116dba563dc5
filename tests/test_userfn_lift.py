"""The float64 reference of a user's function reaches what the function reaches: module globals
and closure cells (torch modules, tensors, optimizers; JAX arrays, Flax linen params, NNX
modules, optax states) are widened with the arguments, on copies, and the user's objects are
the same objects with the same values afterwards, even when the function raises midway or
rebinds its globals. An optimizer passed beside its model steps the reference's model.

Every expected value is computed here in float64 (numpy, or torch in float64 on copies made
in the test), independently of diag.
"""

from __future__ import annotations

import copy
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _module(tmp_path, name: str, source: str):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


TORCH_GLOBALS = """
import torch
from torch import nn

torch.manual_seed(0)
norm = nn.LayerNorm(16)
fc = nn.Linear(16, 8)
scale = torch.linspace(0.5, 1.5, 8)
calls = 0


def _helper(h):
    return fc(h) * scale


def block(x):
    return _helper(norm(x))


def raises(x):
    global calls
    calls += 1
    y = block(x)
    raise ValueError("midway")
"""


def _block64(mod, x: np.ndarray) -> np.ndarray:
    w = {k: v.detach().double().numpy() for k, v in mod.norm.state_dict().items()}
    h = x.astype(np.float64)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    h = (h - mean) / np.sqrt(var + 1e-5) * w["weight"] + w["bias"]
    fc_w, fc_b = mod.fc.weight.detach().double().numpy(), mod.fc.bias.detach().double().numpy()
    return (h @ fc_w.T + fc_b) * mod.scale.double().numpy()


def test_torch_globals_reached_through_a_helper_are_widened_and_named(tmp_path):
    from diag.userfn import reference

    mod = _module(tmp_path, "tg_globals", TORCH_GLOBALS)
    x = torch.randn(4, 16)
    ref = reference(mod.block, (x,), {}, "torch")
    assert ref.kind == "float64"
    want = _block64(mod, x.numpy())
    (leaf,) = ref.leaves
    assert np.abs(leaf[1] - want).max() <= 1e-12 * np.abs(want).max()
    assert set(ref.lifted) == {
        "global norm (LayerNorm)",
        "global fc (Linear)",
        "global scale (Tensor)",
    }
    # the user's objects are untouched: same objects, float32, same values
    assert mod.fc.weight.dtype == torch.float32 and mod.scale.dtype == torch.float32


def test_the_users_globals_are_restored_when_the_function_raises_midway(tmp_path):
    from diag.userfn import UserFunctionError, reference

    mod = _module(tmp_path, "tg_raises", TORCH_GLOBALS)
    before = {n: getattr(mod, n) for n in ("norm", "fc", "scale")}
    weights = mod.fc.weight.detach().clone()
    with pytest.raises(UserFunctionError, match="raises raised ValueError"):
        reference(mod.raises, (torch.randn(4, 16),), {}, "torch")
    assert all(getattr(mod, n) is v for n, v in before.items())
    assert mod.fc.weight.dtype == torch.float32 and torch.equal(mod.fc.weight, weights)
    assert mod.scale.dtype == torch.float32
    assert mod.calls == 0  # a global the function rebinds is put back too


def test_an_optimizer_passed_beside_its_model_steps_the_references_model():
    from torch import nn

    from diag.userfn import reference

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.detach(), model.weight.detach().clone()

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    w0 = model.weight.detach().clone()
    ref = reference(step, (model, opt, x, y), {}, "torch")
    # independent: the same step in float64 on copies made here
    m64 = copy.deepcopy(model).double()
    o64 = torch.optim.Adam(m64.parameters(), lr=0.1)
    _, want = step(m64, o64, x.double(), y.double())
    got = ref.leaf("[1]")
    assert np.abs(got - want.numpy()).max() <= 1e-12
    assert np.abs(want.numpy() - w0.double().numpy()).max() > 0.05  # the step moved it
    assert torch.equal(model.weight, w0) and not opt.state  # the user's own: untouched


JAX_STATE = """
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as linen
from flax import nnx

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((4, 8)).astype(np.float32))


class Dense2(linen.Module):
    @linen.compact
    def __call__(self, h):
        return linen.Dense(4)(jnp.tanh(linen.Dense(16)(h)))


def closure():
    model = Dense2()
    params = model.init(jax.random.key(0), x)

    @jax.jit
    def f(h):
        return model.apply(params, h)

    return f, params


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)


net = Net(nnx.Rngs(0))


def nnx_fn(h):
    return jnp.tanh(net.l1(h))


w = {"w": jnp.asarray(rng.standard_normal((8, 4)).astype(np.float32))}
opt = optax.adam(1e-2)
state = opt.init(w)


@partial(jax.jit, donate_argnums=(0, 1))
def _update(p, s):
    loss, g = jax.value_and_grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def step():
    global w, state
    w, state, loss = _update(w, state)
    return loss, w["w"]
"""


def test_jax_closures_nnx_globals_and_donated_optax_state_are_widened_on_copies(tmp_path):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    from diag.userfn import reference

    mod = _module(tmp_path, "tg_jax", JAX_STATE)
    x = np.asarray(mod.x, np.float64)
    f, params = mod.closure()
    ref = reference(f, (mod.x,), {}, "jax")
    p = {k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in params["params"].items()}  # noqa: E501
    # linen names layers in the order they are built: Dense(4) before the Dense(16) inside it
    want = np.tanh(x @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
    want = want @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    assert ref.kind == "float64" and ref.lifted == ("closure params (dict, 4 arrays)",)
    assert np.abs(ref.leaves[0][1] - want).max() <= 1e-12 * np.abs(want).max()

    ref = reference(mod.nnx_fn, (mod.x,), {}, "jax")
    k, b = (np.asarray(v[...], np.float64) for v in (mod.net.l1.kernel, mod.net.l1.bias))
    want = np.tanh(x @ k + b)
    assert ref.lifted == ("global net (Net, 2 arrays)",)
    assert np.abs(ref.leaves[0][1] - want).max() <= 1e-12
    assert str(mod.net.l1.kernel[...].dtype) == "float32"

    w0, state0 = mod.w, mod.state
    ref = reference(mod.step, (), {}, "jax")
    # independent: one Adam step in float64 (bias-corrected first step: g / (|g| + eps))
    w64 = np.asarray(w0["w"], np.float64)
    g = 2.0 * x.T @ (x @ w64) / (x.shape[0] * w64.shape[1])
    loss = np.mean((x @ w64) ** 2)
    want_w = w64 - 1e-2 * g / (np.abs(g) + 1e-8)
    assert abs(ref.leaves[0][1] - loss) <= 1e-12 * loss
    assert np.abs(ref.leaves[1][1] - want_w).max() <= 1e-9
    # the step donated and rebound the copies: the user's own are the same, alive, float32
    assert mod.w is w0 and mod.state is state0 and not w0["w"].is_deleted()
    assert str(w0["w"].dtype) == "float32"


def _angles64() -> np.ndarray:
    return np.cos(np.arange(2000, 2064, dtype=np.float64) * 0.01)


def _sdpa_rope(pos):
    q = torch.cos(pos.to(torch.bfloat16) * 0.01).reshape(1, 1, 8, 8)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)  # dropout_p=0.0


@pytest.mark.parametrize(
    "name,fn,want",
    [
        ("an integer cast", lambda pos: torch.cos(pos.to(torch.bfloat16) * 0.01), _angles64),
        (
            "an arange in bfloat16",
            lambda pos: torch.cos(torch.arange(2000, 2064, dtype=torch.bfloat16) * 0.01) + pos * 0,
            _angles64,
        ),
        (
            "an attention after it",
            _sdpa_rope,
            lambda: _sdpa64(_angles64().reshape(8, 8)),
        ),
    ],
)
def test_floats_made_from_integers_in_a_narrow_dtype_have_an_exact_reference(name, fn, want):
    from diag.userfn import judge, reference

    pos = torch.arange(2000, 2064)
    ref = reference(fn, (pos,), {}, "torch")
    exact = want()
    got = ref.leaves[0][1].reshape(exact.shape)
    assert np.abs(got - exact).max() <= 1e-9, name  # bf16 positions move the angles by ~0.1
    y = fn(pos).float().numpy().reshape(exact.shape)
    expected = "pass" if np.abs(y - exact).max() / np.abs(exact).max() <= 2.0**-4 else "fail"
    assert expected == "fail" and [v.status for v in judge(fn(pos), ref)] == [expected]


def _sdpa64(q: np.ndarray) -> np.ndarray:
    s = q @ q.T / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ q


def test_floats_made_from_integers_in_bfloat16_have_an_exact_jax_reference():
    jnp = pytest.importorskip("jax.numpy")
    from diag.userfn import judge, reference

    # 2^-3, exact in bfloat16: JAX rounds a Python literal to the dtype it meets when it
    # traces (0.01 becomes 0.010009765625), before any equation a shadow could widen
    def f(pos):
        return jnp.cos(pos.astype(jnp.bfloat16) * 2.0**-3) + jnp.cos(
            jnp.arange(2000, 2064, dtype=jnp.bfloat16) * 2.0**-3
        )

    pos = np.arange(2000, 2064, dtype=np.int32)
    ref = reference(f, (pos,), {}, "jax")
    exact = 2 * np.cos(np.arange(2000, 2064, dtype=np.float64) * 2.0**-3)
    assert ref.kind == "shadow" and np.abs(ref.leaves[0][1] - exact).max() <= 1e-9
    y = np.asarray(f(pos), np.float64)
    assert np.abs(y - exact).max() / np.abs(exact).max() > 2.0**-4  # what bf16 positions do
    assert [v.status for v in judge(f(pos), ref)] == ["fail"]


def test_a_dropout_that_draws_is_run_once_and_said_in_the_note():
    from diag.userfn import reference

    def drawn(x):
        return torch.nn.functional.dropout(x.to(torch.bfloat16), 0.5, training=True).float()

    torch.manual_seed(0)
    ref = reference(drawn, (torch.linspace(1, 2, 64),), {}, "torch")
    assert ref.kind == "shadow" and "aten.bernoulli_ drew random numbers" in ref.note


def test_a_users_module_class_reaches_the_globals_its_forward_names(tmp_path):
    from diag.userfn import reference

    mod = _module(
        tmp_path,
        "tg_class",
        """
        import torch
        from torch import nn

        gain = torch.linspace(0.5, 1.5, 8)


        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return self.fc(x) * gain
        """,
    )
    torch.manual_seed(0)
    m, x = mod.Scaled(), torch.randn(4, 8)
    ref = reference(m, (x,), {}, "torch")
    w, b = m.fc.weight.detach().double().numpy(), m.fc.bias.detach().double().numpy()
    want = (x.double().numpy() @ w.T + b) * mod.gain.double().numpy()
    assert ref.kind == "float64" and ref.lifted == ("global gain (Tensor)",)
    assert np.abs(ref.leaves[0][1] - want).max() <= 1e-12 * np.abs(want).max()
