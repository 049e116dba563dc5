"""`diag.nan.locate` on JAX training code as people write it: Flax NNX, optax, donation.

Real steps change state: NNX modules and optimizers write new values into their Variables,
dropout advances an RNG counter, `donate_argnums` gives the inputs' buffers away. The hunt must
start from the state the user's call started from (never from the state a first run left), count
state written by the step as a result, survive donation, and leave the user's objects as one
call would. Each NaN is named at the op, line (marker comment) and phase where it was born; each
clean step is clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import marked_line, needs_jax, run_diag

pytestmark = needs_jax

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from diag import nan  # noqa: E402

HERE = Path(__file__)


def line_of(marker: str) -> int:
    return marked_line(HERE, marker)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def log_loss(model, x):
    return jnp.mean(jnp.log(model(x)))  # L-nnx-log


def norm_reg_loss(model, x):
    w = model.l2.kernel[...]
    return jnp.mean(model(x) ** 2) + jnp.sqrt(jnp.sum(w * w))  # L-nnx-sqrt


def make(loss_fn, lr=1e-2):
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x)
        opt.update(model, grads)
        return loss

    return model, opt, step


def test_nnx_step_nan_in_the_loss_is_born_forward_not_blamed_on_the_input():
    model, opt, step = make(log_loss)
    x = jax.random.normal(jax.random.key(1), (16, 4))  # model(x) < 0 somewhere: log is NaN
    rep = nan.locate(step, model, opt, x)
    assert rep is not None and rep.phase == "forward"
    assert (rep.primitive, rep.kind, rep.line) == ("log", "NaN", line_of("L-nnx-log"))
    assert rep.path.startswith("jit[step]")


def test_nnx_step_that_writes_nan_into_parameters_is_found_and_run_once():
    model, opt, step = make(norm_reg_loss)
    model.l2.kernel[...] = jnp.zeros_like(model.l2.kernel[...])  # sqrt'(0) = inf
    x = jnp.ones((16, 4))
    assert bool(jnp.isfinite(norm_reg_loss(model, x)))  # the loss a user would watch
    rep = nan.locate(step, model, opt, x)
    assert rep is not None, "the loss is finite, but the update writes NaN into l2.kernel"
    assert (rep.phase, rep.line) == ("backward", line_of("L-nnx-sqrt"))
    assert rep.kind == "Inf" and rep.primitive in ("div", "rsqrt", "pow")
    # One call's worth of effect on the user's objects: one optimizer step, NaN in the kernel.
    assert int(opt.step[...]) == 1
    assert bool(jnp.isnan(model.l2.kernel[...]).all())


def test_nnx_clean_step_is_clean_and_updates_the_module_once():
    model, opt, step = make(lambda m, x: jnp.mean(m(x) ** 2))
    before = model.l1.kernel[...]
    x = jnp.ones((16, 4))
    assert nan.locate(step, model, opt, x) is None
    assert int(opt.step[...]) == 1
    assert not bool(jnp.array_equal(before, model.l1.kernel[...]))


def test_eager_nnx_module_with_dropout_is_hunted_and_its_rng_advances_once():
    class Head(nnx.Module):
        def __init__(self, rngs):
            self.mlp = MLP(rngs, dropout=0.5)

        def __call__(self, x):
            return jnp.log(self.mlp(x))  # L-eager-log

    head = Head(nnx.Rngs(0, dropout=1))
    count = int(head.mlp.drop.rngs.count[...])
    x = jax.random.normal(jax.random.key(2), (16, 4))
    rep = nan.locate(head, x)
    assert rep is not None and (rep.primitive, rep.phase) == ("log", "forward")
    assert rep.line == line_of("L-eager-log")
    assert int(head.mlp.drop.rngs.count[...]) == count + 1
    # The module's own call, clean: None, and the RNG advances once more.
    assert nan.locate(head.mlp, x) is None
    assert int(head.mlp.drop.rngs.count[...]) == count + 2


def test_nnx_scan_over_layers_names_the_iteration():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return jnp.sqrt(self.lin(x) + 3.0)  # L-scan-sqrt

    @nnx.split_rngs(splits=5)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
        return Block(rngs)

    blocks = make_blocks(nnx.Rngs(0))

    @nnx.jit
    def forward(blocks, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, h):
            return block(h) * 4.0

        return body(blocks, x)

    x = jnp.ones((2, 4))
    rep = nan.locate(forward, blocks, x)
    assert rep is not None and (rep.primitive, rep.kind, rep.phase) == ("sqrt", "NaN", "forward")
    assert rep.line == line_of("L-scan-sqrt")
    assert "scan[" in rep.path
    it = int(rep.path.split("scan[")[1].split("]")[0])
    # The iteration named is the first whose input to sqrt goes negative: check it directly.
    h = x
    for i in range(5):
        pre = h @ blocks.lin.kernel[...][i] + blocks.lin.bias[...][i] + 3.0
        if bool((pre < 0).any()):
            assert it == i
            break
        h = jnp.sqrt(pre) * 4.0
    else:
        pytest.fail("no iteration went negative; the planted trap did not spring")


def test_optax_step_with_donated_params_reports_the_birth():
    tx = optax.adam(1e-2)

    def loss_fn(w, x):
        return jnp.mean(jnp.log(x @ w))  # L-optax-log

    def step(w, state, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss

    jstep = jax.jit(step, donate_argnums=(0, 1))
    w = jax.random.normal(jax.random.key(0), (4, 2))
    state = tx.init(w)
    x = jax.random.normal(jax.random.key(3), (8, 4))
    rep = nan.locate(jstep, w, state, x)
    assert rep is not None and (rep.primitive, rep.phase) == ("log", "forward")
    assert rep.line == line_of("L-optax-log")
    w2 = jnp.abs(jax.random.normal(jax.random.key(0), (4, 2)))
    assert nan.locate(jstep, w2, tx.init(w2), jnp.abs(x)) is None


def test_a_jnp_norm_gradient_at_zero_names_the_user_line_and_the_library_line():
    def loss(x):
        return jnp.linalg.norm(x)  # L-lib-norm

    rep = nan.locate(jax.grad(loss), jnp.zeros(3))
    assert rep is not None and rep.phase == "backward"
    assert rep.source == f"{HERE.name}:{line_of('L-lib-norm')} (loss)"
    assert "linalg.py" in rep.note


def test_a_matmul_report_has_no_per_element_inputs():
    x = jnp.full((3, 3), 1e30, jnp.float32)
    rep = nan.locate(lambda a: a @ a, x)
    assert rep is not None and rep.primitive == "dot_general" and rep.kind == "Inf"
    assert rep.bad_index is not None and rep.inputs_at_index is None


def test_cli_under_a_bad_xla_flag_exits_2_naming_it(tmp_path):
    target = tmp_path / "t.py"
    target.write_text("import jax.numpy as jnp\n\ndef f():\n    return jnp.log(-1.0)\n")
    got = run_diag("nan", f"{target}:f", env={"XLA_FLAGS": "--xla_nonexistent_flag=1"})
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag:")
    assert "xla_nonexistent_flag" in lines[0]


def test_nnx_step_with_donated_state_reports_the_birth_and_keeps_the_module_usable():
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(log_loss)(model, x)
        opt.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (16, 4))
    rep = nan.locate(step, model, opt, x)
    assert rep is not None and (rep.primitive, rep.phase) == ("log", "forward")
    assert rep.line == line_of("L-nnx-log")
    assert int(opt.step[...]) == 1
    assert model.l1.kernel[...].shape == (4, 8)  # not a deleted buffer
    float(model.l1.kernel[...].sum())
