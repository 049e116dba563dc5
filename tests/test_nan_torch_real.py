"""`diag.nan.locate` on PyTorch training code as people write it.

`torch.optim` with `foreach=True` (the default for CUDA parameters) and `fused=True` updates
every parameter with one multi-tensor op that returns nothing: the hunt must check each tensor
an op writes, as its schema says. An additive attention mask holds -inf by design: what a
function is given is not a finding. A NaN that makes the function raise (a sampler fed a NaN
row) is reported with the exception that followed. Each NaN is named at the op, line (marker
comment) and phase where it was born; each clean step is clean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import marked_line, needs_torch, run_diag

pytestmark = needs_torch

torch = pytest.importorskip("torch")

from diag import nan  # noqa: E402

HERE = Path(__file__)


def line_of(marker: str) -> int:
    return marked_line(HERE, marker)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def adamw_step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()  # L-opt-step
    return loss


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_update_that_divides_zero_by_zero_is_born_in_the_multi_tensor_op(impl):
    model = make_model()
    # eps=0 and an input column of zeros: that column's weight gradient is exactly 0, so
    # AdamW's first update is 0 / (sqrt(0) + 0).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0, **{impl: True})
    x = torch.randn(16, 4)
    x[:, 2] = 0.0
    y = torch.randn(16, 1)
    before = [p.detach().clone() for p in model.parameters()]
    rep = nan.locate(adamw_step, model, opt, x, y)
    assert rep is not None and rep.kind == "NaN" and rep.phase == "forward"
    assert ("_foreach_" if impl == "foreach" else "_fused_adamw") in rep.primitive
    assert rep.line == line_of("L-opt-step")
    assert all(bool(torch.isfinite(p).all()) for p in before)
    assert rep.output is not None and rep.output.shape == (8, 4)  # the first layer's weight
    # The step ran once, as written: the weight now holds the NaN it wrote.
    assert bool(torch.isnan(model[0].weight[:, 2]).all())
    assert bool(torch.isfinite(model[0].weight[:, [0, 1, 3]]).all())


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_clean_step_is_clean(impl):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{impl: True})
    assert nan.locate(adamw_step, model, opt, torch.randn(16, 4), torch.randn(16, 1)) is None


def sqrt_loss_step(model, opt, x):
    opt.zero_grad()
    h = model(x)
    loss = torch.sqrt(h * h).mean()  # L-sqrt-abs
    loss.backward()
    opt.step()
    return loss


def test_nan_gradient_carried_into_a_foreach_update_keeps_its_backward_birth():
    model = make_model()
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.zero_()  # h == 0 exactly: d sqrt(h*h) / dh = 0 * inf
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    rep = nan.locate(sqrt_loss_step, model, opt, torch.randn(16, 4))
    assert rep is not None and rep.phase == "backward"
    assert rep.line == line_of("L-sqrt-abs")


def encoder_and_mask(T: int = 6, d: int = 16, eps: float = 1e-5):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.1,
                                             batch_first=True, norm_first=True,
                                             layer_norm_eps=eps)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(T)  # -inf above the diagonal
    return enc, mask


def lm_step(enc, x, mask, padding=None):
    out = enc(x, mask=mask, src_key_padding_mask=padding)  # L-encoder
    return out.pow(2).mean()


def test_transformer_with_a_minus_inf_causal_mask_is_clean():
    enc, mask = encoder_and_mask()
    assert bool(torch.isinf(mask).any())
    x = torch.randn(3, 6, 16)
    assert nan.locate(lm_step, enc, x, mask) is None
    enc.eval()
    assert nan.locate(lm_step, enc, x, mask) is None


def test_transformer_layer_norm_without_epsilon_is_named_and_the_mask_shown_as_a_fact():
    enc, mask = encoder_and_mask(eps=0.0)
    x = torch.randn(3, 6, 16)
    x[1, 4] = 0.5  # a constant token: variance 0, and no epsilon to save rsqrt(0)
    rep = nan.locate(lm_step, enc, x, mask)
    assert rep is not None and rep.phase == "forward"
    assert "layer_norm" in rep.primitive
    assert rep.line == line_of("L-encoder")
    assert rep.path.endswith("LayerNorm")
    assert any(fact.startswith("args[2]") and "Inf" in fact for fact in rep.arrived)


def sample(logits, temperature):
    probs = torch.softmax(logits / temperature, dim=-1)  # L-temperature
    return torch.multinomial(probs, 1)  # L-multinomial


def test_a_nan_that_makes_the_sampler_raise_reports_its_birth_and_the_exception():
    logits = torch.randn(4, 10)
    logits[2, 3] = float("-inf")  # a banned token: a fact, not a finding
    rep = nan.locate(sample, logits, torch.tensor([1.0, 1.0, 0.0, 1.0])[:, None])
    assert rep is not None and rep.primitive == "aten.div.Tensor" and rep.kind == "Inf"
    assert rep.line == line_of("L-temperature")
    assert "aten.multinomial" in rep.raised and "RuntimeError" in rep.raised
    assert f":{line_of('L-multinomial')} " in rep.raised
    assert nan.locate(sample, logits, torch.ones(4, 1)) is None


def test_a_function_that_raises_without_nan_is_still_an_error():
    def bad(x):
        return torch.multinomial(x, 1)

    with pytest.raises(nan.NanHuntError, match="RuntimeError"):
        nan.locate(bad, torch.tensor([[-1.0, 2.0]]))


def test_backward_report_has_no_backward_code_note_for_builtin_ops():
    x = torch.zeros(3, requires_grad=True)

    def f(x):
        y = torch.linalg.vector_norm(x) ** 0.5
        y.backward()
        return x.grad

    rep = nan.locate(f, x)
    assert rep is not None and rep.phase == "backward"
    assert "run by backward code" not in rep.note


def test_matmul_report_has_no_per_element_inputs():
    a = torch.full((3, 3), 3e38)
    rep = nan.locate(lambda a: a @ a, a)
    assert rep is not None and rep.kind == "Inf" and rep.inputs_at_index is None


TARGETS = '''
import torch

def masked_clean():
    scores = torch.randn(4, 4)
    mask = torch.triu(torch.full((4, 4), float("-inf")), 1)
    return (lambda s, m: torch.softmax(s + m, -1)), (scores, mask)

def passed_in():
    x = torch.tensor([1.0, float("nan")])
    return (lambda x: x * 2), (x,)

def raising():
    def sample(logits):
        return torch.multinomial(torch.softmax(logits / 0.0, -1), 1)
    return sample, (torch.randn(2, 5),)
'''


@pytest.fixture
def targets(tmp_path):
    p = tmp_path / "torch_targets.py"
    p.write_text(TARGETS)
    return p


def test_cli_mask_is_clean_exit_0(targets):
    got = run_diag("nan", f"{targets}:masked_clean")
    assert got.returncode == 0, got.stderr
    assert "no NaN/Inf produced" in got.stdout


def test_cli_input_report_header_says_passed_in_exit_1(targets):
    got = run_diag("nan", f"{targets}:passed_in")
    assert got.returncode == 1, got.stderr
    assert "born in input" not in got.stdout and "input produced" not in got.stdout
    assert "passed in" in got.stdout


def test_cli_raising_sampler_exits_1_with_birth_and_exception(targets):
    got = run_diag("nan", f"{targets}:raising", "--json")
    assert got.returncode == 1, got.stderr
    rep = json.loads(got.stdout)["report"]
    assert rep["primitive"] == "aten.div.Tensor" and "aten.multinomial" in rep["raised"]


def test_a_closure_step_names_the_closed_over_parameters_that_arrived_nan():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with torch.no_grad():
        model[0].weight[1, 1] = float("nan")

    def step():
        return adamw_step(model, opt, torch.randn(16, 4), torch.randn(16, 1))

    rep = nan.locate(step)
    assert rep is not None and rep.phase == "input"
    assert "parameter model.0.weight held 1 NaN on arrival" in rep.arrived
    assert "model.0.weight" in nan.reason(rep)
