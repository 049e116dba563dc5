"""`diag.nan` on third-party PyTorch training code: Hugging Face GPT-2, torch.nn, torch.optim.

Every expected answer comes from a reference locator written here, independent of diag: the
function runs once under a plain dispatch mode that checks every aten op's output in execution
order and keeps the first op whose output holds a NaN/Inf while all of its float inputs are
finite, with the frames of the library and of this file that called it. Models are built from
configs with random weights (nothing is downloaded).

Claims: "first" is first in execution order (GPT-2's fp16 ``query @ key^T`` overflows before the
causal mask is added: the matmul in modeling_gpt2.py is named, not the add); gradients written
by ``backward`` are results (an RMSE loss at exactly 0 writes NaN into every ``.grad`` while the
returned loss is finite); a step that writes NaN into parameters through torch.optim is found;
clean steps with -inf masks are clean.
"""

from __future__ import annotations

import importlib.util
import os
import traceback

import pytest

from tests.conftest import REPO_ROOT, needs_torch, run_diag

pytestmark = needs_torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from diag import nan  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The steps under test, built by the example diag ships (the same file `diag nan` is run on).
STEPS_FILE = REPO_ROOT / "examples" / "nan_torch_steps.py"
_spec = importlib.util.spec_from_file_location("nan_torch_steps", STEPS_FILE)
steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps)
gpt2 = steps.gpt2


class FirstNonFinite(TorchDispatchMode):
    """Reference locator: the first aten op (execution order) whose output holds a NaN/Inf
    while its float inputs are all finite, and the frames that called it."""

    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
            flat_out = torch.utils._pytree.tree_leaves(out)

            def bad(ts):
                return any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
                           and not bool(torch.isfinite(t).all()) for t in ts)

            if bad(flat_out) and not bad(flat_in):
                frames = traceback.extract_stack()
                self.first = (str(func), frames)
        return out


def reference(fn, *args):
    torch.autograd.set_multithreading_enabled(False)  # backward on this thread, in the mode
    try:
        mode = FirstNonFinite()
        with mode:
            result = fn(*args)
        return mode.first, result
    finally:
        torch.autograd.set_multithreading_enabled(True)


def op_name(func: str) -> str:
    """``aten.bmm.default`` -> ``aten.bmm`` (diag keeps the overload only when not default)."""
    parts = func.split(".")
    return ".".join(parts[:2]) if parts[-1] == "default" else func


def frame_in(frames, filename: str):
    got = [f for f in frames if os.path.basename(f.filename) == filename]
    return got[-1] if got else None


def test_gpt2_fp16_overflow_names_the_first_op_in_execution_order_not_the_mask_add():
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    model = gpt2(scale=1000.0)

    def forward(i):
        with torch.no_grad():
            return model(i).logits

    (want_op, frames), logits = reference(forward, ids)
    assert not bool(torch.isfinite(logits).all())  # the premise: the logits are not finite
    lib = frame_in(frames, "modeling_gpt2.py")
    assert lib is not None and "matmul" in lib.line  # the reference agrees: q @ k^T first

    report = nan.locate(forward, ids)
    assert report is not None
    assert report.primitive == op_name(want_op)
    assert report.kind == "Inf"
    assert report.library.startswith(f"modeling_gpt2.py:{lib.lineno} ")
    assert "GPT2Attention" in report.path
    assert f"via modeling_gpt2.py:{lib.lineno}" in nan.reason(report)


def test_gpt2_fp16_clean_forward_is_clean():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model = gpt2()

    def forward(i):
        with torch.no_grad():
            return model(i).logits

    first, logits = reference(forward, ids)
    assert first is None and bool(torch.isfinite(logits).all())
    assert nan.locate(forward, ids) is None


def test_attention_with_an_additive_minus_inf_mask_is_clean():
    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 8, 32)
    mask = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)  # -inf by design

    def step(x, mask):
        out, _ = attn(x, x, x, attn_mask=mask)
        loss = out.pow(2).mean()
        loss.backward()
        return loss

    assert nan.locate(step, x, mask) is None
    assert all(bool(torch.isfinite(p.grad).all()) for p in attn.parameters())


def distillation(seed: int = 0):
    """A student that equals its teacher and an RMSE loss: sqrt(mse) at mse == 0."""
    return steps.rmse_distillation(
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 3)), (16, 4), seed)


def test_rmse_at_zero_writes_nan_into_every_gradient_and_the_hunt_names_the_backward_op():
    student, step = distillation()
    (want_op, _), loss = reference(step)
    assert float(loss) == 0.0  # the premise: the returned loss is finite (exactly 0)
    assert all(not bool(torch.isfinite(p.grad).all()) for p in student.parameters())

    student, step = distillation()  # fresh gradients
    report = nan.locate(step)
    assert report is not None, "gradients written by backward are results"
    assert report.phase == "backward"
    assert report.primitive == op_name(want_op)
    assert report.path == "SqrtBackward0"


def test_nan_written_into_parameters_by_torch_optim_is_found():
    student, step = distillation()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def train_step():
        opt.zero_grad()
        loss = step()
        opt.step()
        return loss

    (want_op, _), _ = reference(train_step)
    assert not bool(torch.isfinite(student[0].weight).all())  # SGD wrote NaN into it

    student, step = distillation()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    report = nan.locate(train_step)
    assert report is not None and report.primitive == op_name(want_op)
    assert report.phase == "backward"


MIXED = '''
import jax.numpy as jnp  # the module imports JAX; the function computes with torch


def helper():
    import torch
    return torch.log(torch.tensor([-1.0, 2.0]))


def torch_nan():
    return helper()


def jax_nan():
    return jnp.log(jnp.array([-1.0, 2.0]))
'''


def test_the_framework_comes_from_the_values_not_the_module_imports(tmp_path):
    path = tmp_path / "funcs.py"
    path.write_text(MIXED)
    (want_op, _), result = reference(lambda: torch.log(torch.tensor([-1.0, 2.0])))
    assert bool(torch.isnan(result).any())
    proc = run_diag("nan", f"{path}:torch_nan", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    import json

    got = json.loads(proc.stdout)
    assert got["found"] and got["report"]["framework"] == "torch"
    assert got["report"]["primitive"] == op_name(want_op)
    proc = run_diag("nan", f"{path}:jax_nan", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["report"]["primitive"] == "log"


def test_a_torch_result_is_never_called_clean_by_the_jax_hunt():
    def f():
        return torch.log(torch.tensor([-1.0]))

    with pytest.raises(nan.NanHuntError, match="NaN/Inf"):
        nan.hunt(f, framework="jax")


def test_cli_finds_nan_written_into_gradients():
    proc = run_diag("nan", f"{STEPS_FILE}:rmse_case")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "backward" in proc.stdout and "SqrtBackward0" in proc.stdout


def test_cli_names_gpt2s_attention_matmul():
    import json

    forward, (ids,) = steps.gpt2_case()  # what `diag nan` runs, in this process
    (want_op, frames), _ = reference(forward, ids)
    lib = frame_in(frames, "modeling_gpt2.py")
    proc = run_diag("nan", f"{STEPS_FILE}:gpt2_case", "--json", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["report"]
    assert report["primitive"] == op_name(want_op)
    assert report["library"].startswith(f"modeling_gpt2.py:{lib.lineno} ")
