"""`diag.nan.locate` on PyTorch names the aten op that gave birth to a NaN/Inf, its line, its phase.

The same traps as the JAX tests, in PyTorch: forward ops are seen through a dispatch mode,
backward ops through the autograd engine running under it, and a backward op is attributed to
the forward line it differentiates. Lines are found by marker comments, never hard-coded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import marked_line, needs_torch

pytestmark = needs_torch

torch = pytest.importorskip("torch")

from diag import nan  # noqa: E402

HERE = Path(__file__)


def line_of(marker: str) -> int:
    return marked_line(HERE, marker)


def src(marker: str, function: str) -> str:
    return f"{HERE.name}:{line_of(marker)} ({function})"


def log_loss(x):
    return torch.log(x).sum()  # T-log


def ratio(x, y):
    return x / y  # T-div


def masked_softmax(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # T-softmax


def decay(x, steps):
    c = torch.tensor(3.0)
    out = []
    for i in range(steps):
        c = c - x[i]
        out.append(torch.log(c))  # T-loop
    return torch.stack(out)


def norm_and_grad(x):
    x = x.clone().requires_grad_(True)
    n = torch.sqrt((x * x).sum())  # T-norm
    n.backward()
    return n.detach(), x.grad


class Root(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        r = torch.sqrt(x)  # T-fn-forward
        ctx.save_for_backward(r)
        return r

    @staticmethod
    def backward(ctx, g):
        (r,) = ctx.saved_tensors
        return g / (2 * r)  # T-fn-backward


def through_function(x):
    x = x.clone().requires_grad_(True)
    y = Root.apply(x).sum()  # T-fn-apply
    y.backward()
    return y.detach(), x.grad


def test_log_of_a_negative_is_found_forward_with_its_input():
    rep = nan.locate(log_loss, torch.tensor([1.0, -2.0, 3.0]))
    assert (rep.framework, rep.primitive, rep.kind, rep.phase) == (
        "torch", "aten.log", "NaN", "forward")
    assert rep.source == src("T-log", "log_loss")
    assert rep.bad_index == (1,) and rep.inputs_at_index == (-2.0,)


def test_zero_over_zero():
    rep = nan.locate(ratio, torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("aten.div.Tensor", "NaN", "forward")
    assert rep.source == src("T-div", "ratio")
    assert rep.inputs_at_index == (0.0, 0.0)


def test_fully_masked_softmax_row():
    mask = torch.tensor([[True, False, True], [False, False, False]])
    rep = nan.locate(masked_softmax, torch.ones(2, 3), mask)
    # CPU softmax is one fused kernel: the inf - inf happens inside aten._softmax.
    assert (rep.primitive, rep.kind, rep.phase) == ("aten._softmax", "NaN", "forward")
    assert rep.source == src("T-softmax", "masked_softmax")
    assert rep.bad_index == (1, 0) and rep.inputs[0].infs == 4


def test_nan_born_in_a_loop_points_at_the_loop_line():
    rep = nan.locate(decay, torch.ones(6), 6)
    # c goes 2, 1, 0: log(0) = -inf at the third iteration, and nothing before it.
    assert (rep.primitive, rep.kind, rep.phase) == ("aten.log", "Inf", "forward")
    assert rep.source == src("T-loop", "decay")
    assert rep.inputs[0].zeros == 1 and rep.inputs[0].min == 0.0


def test_gradient_of_a_norm_at_zero_is_born_backward_at_the_forward_line():
    value, grad = norm_and_grad(torch.zeros(3))
    assert value == 0.0 and bool(torch.isnan(grad).all())  # the trap is real
    rep = nan.locate(norm_and_grad, torch.zeros(3))
    assert (rep.primitive, rep.kind, rep.phase) == ("aten.div.Tensor", "Inf", "backward")
    assert rep.source == src("T-norm", "norm_and_grad")
    assert rep.path == "SqrtBackward0"
    assert rep.inputs_at_index[1] == 0.0


def test_custom_function_forward_and_backward():
    rep = nan.locate(through_function, torch.tensor([-1.0, 1.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("aten.sqrt", "NaN", "forward")
    assert rep.source == src("T-fn-forward", "forward")
    rep = nan.locate(through_function, torch.tensor([0.0, 1.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("aten.div.Tensor", "Inf", "backward")
    assert rep.source == src("T-fn-apply", "through_function")
    assert f"{HERE.name}:{line_of('T-fn-backward')} (backward)" in rep.note


def test_training_step_runs_once_and_names_the_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softplus(beta=-1.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def step(x):
        calls.append(1)
        opt.zero_grad()
        loss = torch.log(model(x)).mean()  # T-step
        loss.backward()
        opt.step()
        return loss.detach()

    # Softplus with beta=-1 is negative everywhere: log of it is NaN.
    rep = nan.locate(step, torch.randn(8, 3))
    assert len(calls) == 1
    assert (rep.primitive, rep.phase) == ("aten.log", "forward")
    assert rep.source == src("T-step", "step")


def test_op_inside_a_module_carries_the_module_path():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LogSigmoid())
    with torch.no_grad():
        model[0].weight.fill_(float("inf"))
        model[0].weight[0, 0] = -float("inf")
    rep = nan.locate(model, torch.ones(1, 2))
    # inf + (-inf) inside the Linear's matmul.
    assert rep.kind == "NaN" and rep.phase == "forward"
    assert rep.path == "Sequential/Linear"


def test_clean_and_masked_functions_give_none():
    assert nan.locate(log_loss, torch.tensor([1.0, 2.0])) is None
    # log(-1) is NaN, but where() discards it.
    assert nan.locate(lambda x: torch.where(x > 0, torch.log(x), 0.0),
                      torch.tensor([-1.0, 1.0])) is None
    # torch's own norm backward makes 0/0 and masks it: not the user's NaN.
    x = torch.zeros(3, requires_grad=True)
    assert nan.locate(lambda t: torch.linalg.norm(t).backward(), x) is None
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_nan_passed_in_is_reported_as_input():
    rep = nan.locate(lambda t: t * 2.0, torch.tensor([1.0, float("nan")]))
    # t * 2 propagates a NaN it was given: no op gave birth to it.
    assert (rep.primitive, rep.phase) == ("input", "input")


def test_a_function_that_raises_is_a_hunt_error():
    def boom(x):
        raise ValueError("no good")

    with pytest.raises(nan.NanHuntError, match=r"^diag: boom raised ValueError: no good$"):
        nan.locate(boom, torch.ones(1))


def test_zero_argument_closure_is_hunted_with_torch_even_with_jax_loaded():
    pytest.importorskip("jax")  # both frameworks in the process: the closure decides
    x = torch.tensor([0.0, 1.0])

    def step():
        return torch.log(x) * 0.0  # T-closure

    rep = nan.locate(step)
    # log(0) = -inf is born first; -inf * 0 = NaN descends from it.
    assert (rep.framework, rep.primitive, rep.kind) == ("torch", "aten.log", "Inf")
    assert rep.source == src("T-closure", "step")
