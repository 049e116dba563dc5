"""diag.diverge.shadow on PyTorch: the same planted divergences as tests/test_diverge_jax.py,
named with their aten op, line and figures, forward and backward; clean versions report none.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import diag  # noqa: E402
from diag.tolerance.diverge import diverge_carried_threshold as carried_threshold  # noqa: E402
from tests.test_diverge_jax import line_of  # noqa: E402


def cancel(a, b):
    s = a + b
    return s - a


def test_cancellation_is_the_subtraction():
    a, b = torch.full((8,), 1.0), torch.full((8,), 1e-6)
    rep = diag.diverge.shadow(cancel, a, b)
    f = rep.first
    assert f.primitive == "aten.sub" and f.source == line_of(cancel, "s - a")
    got = float((np.float32(1.0) + np.float32(1e-6)) - np.float32(1.0))
    want = abs(got - float(np.float32(1e-6))) / float(np.float32(1e-6))
    assert f.carried == pytest.approx(want, rel=1e-9) and f.own_ulps == 0.0
    assert f.carried > f.threshold >= f.carried_in


def seqsum(x):
    s = torch.zeros((), dtype=x.dtype)
    for i in range(x.shape[0]):
        s = s + x[i]
    return s


def test_bf16_sequential_sum_of_a_long_vector_names_the_iteration():
    rep = diag.diverge.shadow(seqsum, torch.ones(1024, dtype=torch.bfloat16))
    thr = carried_threshold("bfloat16")
    k = next(k for k in range(1024) if (k + 1 - 256) / (k + 1) > thr)
    f = rep.first
    assert f.primitive == "aten.add" and f.index == k  # one add per iteration
    assert f.source == line_of(seqsum, "s = s + x[i]")
    assert f.carried == pytest.approx((k + 1 - 256) / (k + 1)) and f.own_ratio <= 1
    assert rep.result_error == pytest.approx((1024 - 256) / 1024)


def test_bf16_reduction_verdict_matches_its_figures():
    x = torch.tensor(np.random.default_rng(1).uniform(0.5, 1.5, 4096)).to(torch.bfloat16)
    rep = diag.diverge.shadow(lambda v: v.sum(), x)
    exact = x.double().sum().item()
    assert rep.result_error == pytest.approx(abs(x.sum().item() - exact) / exact, rel=1e-6)
    broke = any(o.own_ratio > 1 or o.carried > o.threshold for o in rep.ops)
    assert (rep.first is not None) == broke


def softmax_naive(x):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


def softmax_stable(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def test_fp16_softmax_without_max_subtraction_overflows_in_exp():
    x = torch.tensor(np.random.default_rng(0).normal(0, 5, (4, 64))).to(torch.float16)
    assert x.max().item() > math.log(65504)
    f = diag.diverge.shadow(softmax_naive, x).first
    assert f.primitive == "aten.exp" and f.source == line_of(softmax_naive, "torch.exp")
    assert math.isinf(f.carried) and f.own_ratio <= 1
    assert diag.diverge.shadow(softmax_stable, x).first is None
    assert diag.diverge.shadow(lambda v: torch.softmax(v, -1), x).first is None


def layer_norm_one_pass(x):
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) / torch.sqrt(var + 1e-5)


def layer_norm_two_pass(x):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5)


def test_layer_norm_one_pass_variance_is_the_subtraction():
    x = torch.tensor(np.random.default_rng(2).normal(100.0, 1.0, (16, 256)), dtype=torch.float32)
    f = diag.diverge.shadow(layer_norm_one_pass, x).first
    assert f.primitive == "aten.sub" and f.source == line_of(layer_norm_one_pass, "var =")
    assert f.carried > f.threshold >= f.carried_in and f.own_ratio <= 1
    assert diag.diverge.shadow(layer_norm_two_pass, x).first is None
    assert diag.diverge.shadow(lambda v: torch.nn.functional.layer_norm(v, (256,)), x).first \
        is None


def test_backward_ops_are_named_with_their_forward_line():
    w = torch.nn.Parameter(torch.tensor(np.random.default_rng(4).normal(0, 5, (4, 64)),
                                        dtype=torch.float16))

    def step():
        loss = softmax_naive(w).float().sum()
        loss.backward()
        return loss

    rep = diag.diverge.shadow(step)
    assert rep.first.primitive == "aten.exp" and rep.first.phase == "forward"
    assert rep.first.source == line_of(softmax_naive, "torch.exp")
    forward_lines = {line_of(step, "loss = softmax_naive"), line_of(softmax_naive, "torch.exp"),
                     line_of(softmax_naive, "return e /")}
    back = [o for o in rep.ops if o.phase == "backward"]
    assert back and all(o.source in forward_lines for o in back)
    assert all(o.amplification == o.amplification for o in rep.ops)  # no NaN figure
    assert w.grad is not None  # the step ran once, as the user would run it


def test_random_draws_run_once_and_uninitialised_memory_is_not_judged():
    def f(x):
        y = x.clone()
        y[:, :4].mul_(3.0)  # written through a view: the shadow follows
        return torch.nn.functional.dropout(y, 0.5, training=True)  # empty_like + bernoulli_

    x = torch.randn(8, 16)
    torch.manual_seed(0)
    f(x)
    after_plain = torch.rand(4)
    torch.manual_seed(0)
    rep = diag.diverge.shadow(f, x)
    assert torch.equal(torch.rand(4), after_plain)  # the user's generator moved as in a plain run
    assert rep.first is None
    assert all(o.primitive not in ("aten.empty_like", "aten.bernoulli_") for o in rep.ops)
    assert rep.result_error <= 2 ** -24  # the view write was shadowed, not lost
