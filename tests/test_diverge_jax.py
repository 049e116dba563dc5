"""diag.diverge.shadow on JAX: planted divergences are named with their op, line and figures;
clean versions of the same computations report none.

Expected figures are computed here independently (numpy, float64) from IEEE facts: a bf16 add
is correctly rounded, so a sequential bf16 sum of ones stops at 256; (a + b) - a is exact
(Sterbenz) and returns the rounding error of a + b; exp(x) overflows float16 above log(65504).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import diag  # noqa: E402
from diag.tolerance.diverge import diverge_carried_threshold as carried_threshold  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402


def line_of(fn, text: str) -> str:
    """``file.py:LINE (function)`` of the line of `fn` holding `text`."""
    lines, start = inspect.getsourcelines(fn)
    k = next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{start + k} ({fn.__name__})"


def cancel(a, b):
    s = a + b
    return s - a


def test_cancellation_is_the_subtraction():
    a = jnp.full((8,), 1.0, jnp.float32)
    b = jnp.full((8,), 1e-6, jnp.float32)
    rep = diag.diverge.shadow(cancel, a, b)
    f = rep.first
    assert f is not None and f.primitive == "sub"
    assert f.source == line_of(cancel, "s - a") and f.phase == "forward"
    got = float((np.float32(1.0) + np.float32(1e-6)) - np.float32(1.0))
    want = abs(got - float(np.float32(1e-6))) / float(np.float32(1e-6))
    assert f.carried == pytest.approx(want, rel=1e-9)
    assert f.own_ulps == 0.0  # Sterbenz: the subtraction itself is exact
    assert f.carried > f.threshold >= f.carried_in
    assert rep.result_error == pytest.approx(want, rel=1e-9)
    assert rep.ops[0].primitive == "sub" and rep.ops[0].amplification > 1e5


def body(c, xi):
    return c + xi, None


def seqsum(x):
    return jax.lax.scan(body, jnp.zeros((), x.dtype), x)[0]


def test_bf16_sequential_sum_of_a_long_vector_names_the_iteration():
    x = jnp.ones((1024,), jnp.bfloat16)
    rep = diag.diverge.shadow(seqsum, x)
    thr = carried_threshold("bfloat16")
    # The bf16 sum sticks at 256; the shadow after iteration k is k + 1.
    k = next(k for k in range(1024) if (k + 1 - 256) / (k + 1) > thr)
    f = rep.first
    assert f.primitive == "add" and f.path == f"scan[{k}]"
    assert f.source == line_of(body, "c + xi")
    assert f.carried == pytest.approx((k + 1 - 256) / (k + 1))
    assert f.own_ulps <= 0.5 and f.own_ratio <= 1  # each add is correctly rounded
    assert rep.result_error == pytest.approx((1024 - 256) / 1024)
    assert rep.n_ops == 1024


def test_bf16_reduction_verdict_matches_its_figures():
    """jnp.sum may accumulate bf16 in float32 (it upcasts) or in bf16: either way the verdict
    follows what was measured, and the result's figure is the one numpy computes."""
    x = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, 4096), jnp.bfloat16)
    rep = diag.diverge.shadow(lambda v: jnp.sum(v), x)
    exact = np.asarray(x).astype(np.float64).sum()
    assert rep.result_error == pytest.approx(abs(float(jnp.sum(x)) - exact) / exact, rel=1e-6)
    broke = any(o.own_ratio > 1 or o.carried > o.threshold for o in rep.ops)
    assert (rep.first is not None) == broke


def softmax_naive(x):
    e = jnp.exp(x)
    return e / e.sum(-1, keepdims=True)


def softmax_stable(x):
    e = jnp.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_fp16_softmax_without_max_subtraction_overflows_in_exp():
    x = jnp.asarray(np.random.default_rng(0).normal(0, 5, (4, 64)), jnp.float16)
    assert float(jnp.max(x)) > math.log(65504)  # exp of it overflows float16
    rep = diag.diverge.shadow(softmax_naive, x)
    f = rep.first
    assert f.primitive == "exp" and f.source == line_of(softmax_naive, "jnp.exp")
    assert math.isinf(f.carried) and f.own_ratio <= 1  # inf is exp's correct rounding
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))  # strict JSON: inf as text
    assert d["first"]["carried"] == "inf" and d["first"]["primitive"] == "exp"
    rep = diag.diverge.shadow(jax.jit(softmax_stable), x)
    assert rep.first is None
    assert all(o.own_ratio <= 1 and o.carried <= o.threshold for o in rep.ops)
    assert rep.ops[0].path.startswith("jit[softmax_stable]")


def _example(name: str):
    """A module of examples/ loaded from its file (the README's example, not a copy)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_norm_one_pass_variance_is_the_subtraction():
    example = _example("diverge_layer_norm")
    x = jnp.asarray(np.random.default_rng(2).normal(100.0, 1.0, (16, 256)), jnp.float32)
    rep = diag.diverge.shadow(example.layer_norm_one_pass, x)
    f = rep.first
    assert f.primitive == "sub" and f.source == line_of(example.layer_norm_one_pass, "var =")
    assert f.carried > f.threshold >= f.carried_in and f.own_ratio <= 1
    assert diag.diverge.shadow(example.layer_norm_two_pass, x).first is None


def test_gradient_ops_are_backward_and_keep_the_forward_line():
    x = jnp.asarray(np.random.default_rng(3).normal(0, 5, (4, 64)), jnp.float16)
    loss = lambda v: softmax_naive(v).astype(jnp.float32).sum()  # noqa: E731
    rep = diag.diverge.shadow(jax.value_and_grad(loss), x)
    assert rep.first.primitive == "exp" and rep.first.phase == "forward"
    assert rep.first.source == line_of(softmax_naive, "jnp.exp")
    back = [o for o in rep.ops if o.phase == "backward"]
    assert back and all(o.source for o in back)


def test_clean_function_reports_nothing_and_json_is_ready():
    x = jnp.linspace(-1, 1, 64, dtype=jnp.float32)
    rep = diag.diverge.shadow(lambda v: jnp.tanh(v) * 2 + 1, x)
    assert rep.first is None and rep.n_ops == 3
    d = rep.to_dict()
    assert d["first"] is None and len(d["curve"]) == 3


@pytest.mark.slow  # ~15 s on a busy 2-core machine: every equation of two Adam steps
def test_a_clean_training_loop_with_adam_reports_no_divergence():
    """optax's Adam cancels in its bias correction (1 - 0.999^t loses 9 bits in float32 at step
    1): a loss of precision the threshold (half the bits) lets through, as it should; the
    library line names where in optax the top contributor is."""
    optax = pytest.importorskip("optax")
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1, "w2": jax.random.normal(k2, (64, 1))}
    tx = optax.adam(1e-3)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))

    def loss_fn(p):
        return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - 1.0) ** 2)

    @jax.jit
    def train(p, s):
        def body(c, _):
            g = jax.grad(loss_fn)(c[0])
            u, s = tx.update(g, c[1], c[0])
            return (optax.apply_updates(c[0], u), s), None

        return jax.lax.scan(body, (p, s), None, length=2)[0]

    rep = diag.diverge.shadow(train, params, tx.init(params))
    assert rep.first is None
    top = rep.ops[0]
    assert top.carried <= top.threshold and top.path.startswith("jit[train]/scan[")
    assert "optax" in top.library or top.library.startswith("transform.py")
