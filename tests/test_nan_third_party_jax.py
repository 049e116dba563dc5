"""`diag.nan` on third-party JAX training code: Flax linen and NNX, optax, donated buffers.

Every expected answer comes from a reference locator written here, independent of diag: the
step's jaxpr is walked one equation at a time with plain `Primitive.bind` (descending only into
jit and custom_jvp/vjp bodies), keeping the first equation whose output holds a NaN/Inf while
all its inputs are finite; for eager Flax NNX modules, JAX's own op-by-op mode
(`jax.disable_jit` with `jax_debug_nans`/`jax_debug_infs`) names the primitive.

Claims: a jitted optax step that donates its buffers is answered (no "deleted or donated
buffer"); an eager NNX module with dropout (RNG state) in fp16, named by the function rather than
passed to it, is hunted without a TraceContextError; a clean step with a -inf attention mask is
clean; the per-equation programs land in JAX's persistent compilation cache under diag's cache
folder.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.conftest import needs_jax, run_diag

pytestmark = needs_jax

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

from diag import nan  # noqa: E402

_CALLS = ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call")


def reference(fn, *args):
    """(primitive, user line number) of the first equation, in execution order, that makes a
    NaN/Inf from finite inputs; None when there is none."""
    from jax._src import source_info_util

    def bad(x):
        a = np.asarray(x)
        return a.dtype.kind == "f" and not np.isfinite(a.astype(np.float64)).all()

    def walk(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if hasattr(v, "val") and not hasattr(v, "count") else env[v]

        for e in jaxpr.eqns:
            ins = [read(v) for v in e.invars]
            sub = e.params.get("jaxpr") or e.params.get("call_jaxpr") or e.params.get("fun_jaxpr")
            if e.primitive.name in _CALLS and sub is not None:
                outs, found = walk(sub.jaxpr, sub.consts, ins)
                if found:
                    return outs, found
            else:
                outs = e.primitive.bind(*ins, **e.params)
                outs = outs if e.primitive.multiple_results else [outs]
                if any(bad(o) for o in outs) and not any(bad(i) for i in ins):
                    frame = source_info_util.user_frame(e.source_info.traceback)
                    return outs, (e.primitive.name, frame.start_line if frame else 0)
            env.update(zip(e.outvars, outs))
        return [read(v) for v in jaxpr.outvars], None

    closed = jax.make_jaxpr(fn)(*args)
    return walk(closed.jaxpr, closed.consts, list(jax.tree_util.tree_leaves(args)))[1]


def line_with(fn, text: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if text in s)


class MLP(linen.Module):
    @linen.compact
    def __call__(self, tok):
        x = linen.Embed(100, 16)(tok).mean(axis=1)
        x = linen.LayerNorm()(linen.relu(linen.Dense(32)(x)))
        return linen.Dense(10)(x)


def optax_step(tx):
    model = MLP()

    def loss_fn(params, tok, y):
        logits = model.apply(params, tok)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, opt_state, tok, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, tok, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tok = jax.random.randint(jax.random.key(0), (32, 8), 0, 99)  # token 99 is never seen
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)
    params = model.init(jax.random.key(2), tok)
    return train_step, (params, tx.init(params), tok, y)


def test_donated_optax_step_is_answered_and_names_adams_division():
    # eps=0: the embedding row of a token never seen has zero gradient, and Adam's update
    # divides 0 by sqrt(0): NaN written into the parameters.
    train_step, args = optax_step(optax.adam(1e-3, eps=0.0))
    want = reference(train_step, *args)
    assert want is not None and want[0] == "div"
    step = jax.jit(train_step, donate_argnums=(0, 1))
    report = nan.locate(step, *args)
    assert report is not None
    assert (report.primitive, report.kind) == (want[0], "NaN")
    assert report.library.startswith("transform.py:") or "optax" in report.note or report.source


def test_donated_optax_step_clean_is_clean():
    train_step, args = optax_step(optax.adam(1e-3))
    assert reference(train_step, *args) is None
    assert nan.locate(jax.jit(train_step, donate_argnums=(0, 1)), *args) is None


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 8, rngs=rngs, dtype=jnp.float16, param_dtype=jnp.float16)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 4, rngs=rngs, dtype=jnp.float16, param_dtype=jnp.float16)

    def __call__(self, x):
        return self.l2(self.drop(self.l1(x)))


def test_eager_nnx_module_with_dropout_in_fp16_named_by_the_function():
    net = Net(nnx.Rngs(0, dropout=1))
    net.l1.kernel[...] = jnp.full((8, 8), 10.0, jnp.float16)
    x = jnp.full((4, 8), 3000.0, jnp.float16)  # 8 * 3000 * 10 overflows fp16 (65504)

    def forward(x):
        return net(x)  # the module is named, not passed: its RNG state is written by the call

    ref_net = nnx.clone(net)
    with jax.disable_jit(), jax.debug_infs(True), pytest.raises(FloatingPointError) as err:
        ref_net(x)
    want = re.search(r"encountered in (\w+)", str(err.value))[1]
    count_before = int(net.drop.rngs.count[...])
    report = nan.locate(forward, x)
    assert report is not None and report.kind == "Inf"
    assert report.primitive == want
    # the module is left as one call leaves it: the dropout stream advanced once
    assert int(net.drop.rngs.count[...]) == count_before + 1


def test_masked_attention_with_minus_inf_is_clean():
    def attend(q, k, v):
        s = q @ k.T / np.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool))
        s = jnp.where(mask, s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v

    q, k, v = (jax.random.normal(jax.random.key(i), (8, 16)) for i in range(3))
    assert reference(attend, q, k, v) is None
    assert nan.locate(jax.jit(attend), q, k, v) is None


TARGET = '''
import jax, jax.numpy as jnp


def loss(w, x):
    return jnp.sum(jnp.log(x @ w))


def case():
    w = jnp.array([[1.0], [-2.0]])
    x = jnp.ones((3, 2))
    return jax.jit(jax.value_and_grad(loss)), (w, x)
'''


def test_programs_are_kept_in_the_persistent_cache_under_diags_folder(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(TARGET)
    env = {"DIAG_CACHE_DIR": str(tmp_path / "cache")}
    first = run_diag("nan", f"{path}:case", "--json", env=env)
    assert first.returncode == 1, first.stdout + first.stderr
    kept = list((tmp_path / "cache" / "jax-ops").iterdir())
    assert kept, "no compiled program was kept"
    second = run_diag("nan", f"{path}:case", "--json", env=env)
    assert json.loads(second.stdout)["report"] == json.loads(first.stdout)["report"]
    assert json.loads(first.stdout)["report"]["primitive"] == "log"


CLI_TARGETS = '''
import jax
import jax.numpy as jnp
import optax
from flax import nnx


def loss(p, x):
    return jnp.mean(jnp.sqrt(x @ p["w"]))


tx = optax.adam(1e-2)


def train_step(p, s, x):
    value, g = jax.value_and_grad(loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, value


def donated():
    p = {"w": jnp.array([[1.0], [-3.0]])}
    x = jnp.ones((4, 2))
    return jax.jit(train_step, donate_argnums=(0, 1)), (p, tx.init(p), x)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 8, rngs=rngs, dtype=jnp.float16, param_dtype=jnp.float16)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.l1(x))


net = Net(nnx.Rngs(0, dropout=1))
net.l1.kernel[...] = jnp.full((8, 8), 10.0, jnp.float16)


def forward(x):
    return net(x)


def eager_nnx():
    return forward, (jnp.full((4, 8), 3000.0, jnp.float16),)
'''


@pytest.mark.parametrize("target, primitive, kind", [("donated", "sqrt", "NaN"),
                                                     ("eager_nnx", None, "Inf")])
def test_cli_answers_donated_and_eager_nnx_steps(tmp_path, target, primitive, kind):
    path = tmp_path / "steps.py"
    path.write_text(CLI_TARGETS)
    proc = run_diag("nan", f"{path}:{target}", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["report"]
    assert report["kind"] == kind and report["framework"] == "jax"
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"steps_ref_{target}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn, args = getattr(mod, target)()
    if primitive is None:  # the reference: JAX's own op-by-op mode on the same module
        with jax.disable_jit(), jax.debug_infs(True), pytest.raises(FloatingPointError) as err:
            fn(*args)
        primitive = re.search(r"encountered in (\w+)", str(err.value))[1]
    else:  # the reference walker on the undonated step
        assert reference(mod.train_step, *args)[0] == primitive
    assert report["primitive"] == primitive
