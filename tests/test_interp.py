"""diag's instrumentation kernel (`diag.interp`), on which `diag.nan` and `diag.diverge` run.

Claims: the evaluator hands a policy every first-order equation, in execution order, with its
path (loop iteration included), and its results equal the compiled function's bit for bit; the
compiled-equation shortcuts (one program per signature, elementwise equations on padded flat
copies, moves in numpy) give the same bits as binding the primitive directly; the framework
comes from the values a function handles, then from the names its code uses.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.conftest import needs_jax

pytestmark = needs_jax

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from diag.interp import framework_of, names_framework, values_framework  # noqa: E402
from diag.interp.jax_compile import bind  # noqa: E402
from diag.interp.jaxpr import Evaluator  # noqa: E402


class Recorder(Evaluator):
    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, e, ins, outs, path, backward):
        self.seen.append((e.primitive.name, path, backward))


def test_the_policy_callback_sees_every_equation_in_order_and_results_match_jit():
    def f(x):
        def body(c, xi):
            return c * xi + 1.0, jnp.sin(c)

        c, ys = jax.lax.scan(body, 1.0, x)
        return jax.grad(lambda y: jnp.sum(jnp.exp(y)))(ys) + c

    x = jnp.linspace(0.5, 1.5, 3)
    closed = jax.make_jaxpr(f)(x)
    ev = Recorder()
    outs = ev.eval(closed.jaxpr, ev.consts(closed), [ev.wrap(x)], "", (False,))
    np.testing.assert_array_equal(np.asarray(outs[0].val), np.asarray(jax.jit(f)(x)))
    scan_paths = [p for name, p, _ in ev.seen if name == "sin"]
    assert scan_paths == ["scan[0]", "scan[1]", "scan[2]"]
    assert any(backward for name, _, backward in ev.seen if name == "mul")
    assert ev.seen[-1][0] == "add"  # `+ c` is the last equation


_UNARY = ["exp", "log", "tanh", "sqrt", "rsqrt", "logistic", "sin", "erf", "log1p", "expm1"]
_BINARY = ["add", "sub", "mul", "div", "pow", "max", "atan2"]


@pytest.mark.parametrize("dtype, shape", [(np.float32, (3, 37)), (np.float16, (1000,)),
                                          (ml_dtypes.bfloat16, (5, 1, 7))])
def test_bucketed_elementwise_equations_give_the_same_bits(dtype, shape):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.uniform(0.1, 3.0, shape).astype(dtype))
    b = jnp.asarray(rng.uniform(0.1, 3.0, shape).astype(dtype))
    for name in _UNARY + _BINARY:
        fn = getattr(jax.lax, name if name != "logistic" else "logistic")
        args = (a,) if name in _UNARY else (a, b)
        e = jax.make_jaxpr(fn)(*args).jaxpr.eqns[-1]
        direct = np.asarray(e.primitive.bind(*args, **e.params))
        got = np.asarray(bind(e, list(args), bucket=True)[0])
        assert got.shape == direct.shape
        assert np.array_equal(got.view(np.uint16 if got.itemsize == 2 else np.uint32),
                              direct.view(np.uint16 if got.itemsize == 2 else np.uint32)), name


def test_moves_in_numpy_match_jax():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    cases = [lambda v: v.reshape(6, 4), lambda v: jnp.transpose(v, (2, 0, 1)),
             lambda v: jnp.broadcast_to(v[:, None], (2, 5, 3, 4)),
             lambda v: jnp.squeeze(v[:1], 0)]
    for f in cases:
        for e in jax.make_jaxpr(f)(x).jaxpr.eqns:
            if e.primitive.name in ("reshape", "transpose", "broadcast_in_dim", "squeeze"):
                src = x if e.invars[0] is jax.make_jaxpr(f)(x).jaxpr.invars[0] else None
                if src is None:
                    continue
                want = np.asarray(e.primitive.bind(src, **e.params))
                np.testing.assert_array_equal(np.asarray(bind(e, [src], bucket=True)[0]), want)


def test_the_framework_comes_from_values_then_names():
    torch = pytest.importorskip("torch")

    def uses_torch(x):
        return torch.log(x)

    def uses_nothing():
        return helper()  # noqa: F821 - never called

    assert values_framework(uses_torch, (torch.ones(2),), {}) == "torch"
    assert values_framework(uses_torch, (jnp.ones(2),), {}) == "jax"
    assert values_framework(uses_torch, (1.0,), {}) is None
    assert names_framework(uses_torch) == "torch"
    assert names_framework(uses_nothing) is None
    assert framework_of(torch.nn.Linear(2, 2), (), {}) == "torch"
