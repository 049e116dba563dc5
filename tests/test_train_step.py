"""The training-step probe: one SGD step of a small MLP on every backend against a float64
evaluation, and a step that goes non-finite is hunted to the op that broke it.

Claims: the float64 reference's gradient is the derivative of its loss (finite differences);
jax-cpu and torch-cpu steps are finite and within a few ULP of the reference's loss; with
weights that overflow float16 the fp16 step fails and its reason names the op, the source
line in the backend's step and the phase (diag.nan); a NaN where the reference is finite
fails, a loss far from the reference warns.
"""

from __future__ import annotations

import numpy as np
import pytest

from diag import run
from diag.probes.train_step import compare_train_step, judge_train_step
from diag.tolerance import TRAIN_LOSS_ULP_SCREEN
from diag.oracle import train_step_result
from diag.oracle._train import train_step_core
from tests.conftest import needs_jax, needs_torch

SUITE = """
[suite]
name = "t"
seed = 3

[[probe]]
name = "mlp"
op = "train_step"
inputs = ["mlp", "mlp_huge"]
dtypes = ["float32", "float16"]
shapes = [[16, 64, 8]]
"""


def _inputs(seed=0, b=16, d=64, c=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype)
            for s in ((b, d), (d, d), (d, c))]


def test_reference_gradient_is_the_derivative_of_its_loss():
    x, w1, w2 = (a.astype(np.float64) for a in _inputs())
    lr, h = 1.0, 1e-6
    _, n1, n2 = train_step_core(x, w1, w2, lr)
    g1, g2 = (w1 - n1) / lr, (w2 - n2) / lr
    for w, g, which in ((w1, g1, 0), (w2, g2, 1)):
        for idx in [(0, 0), (3, 5), (w.shape[0] - 1, w.shape[1] - 1)]:
            plus, minus = w.copy(), w.copy()
            plus[idx] += h
            minus[idx] -= h
            args_p = (x, plus, w2) if which == 0 else (x, w1, plus)
            args_m = (x, minus, w2) if which == 0 else (x, w1, minus)
            fd = (train_step_core(*args_p, lr)[0] - train_step_core(*args_m, lr)[0]) / (2 * h)
            assert abs(fd - g[idx]) <= 1e-7 + 1e-5 * abs(g[idx]), (which, idx, fd, g[idx])


def test_a_nan_where_the_reference_is_finite_fails_and_a_far_loss_warns():
    inputs = _inputs()
    ref = train_step_result(*inputs)
    truth = {"loss": ref.value, **ref.extra}
    good = dict(truth)
    m = compare_train_step(good, truth, inputs)
    assert judge_train_step(m)[0] == "pass" and m["loss_ulp"] == 0
    broken = {**truth, "w2": truth["w2"].copy()}
    broken["w2"][0, 0] = np.nan
    m = compare_train_step(broken, truth, inputs)
    status, reason = judge_train_step(m, nan_reason="NaN born in log at f.py:3 (g), forward")
    assert status == "fail" and m["unexpected_nonfinite"] == 1
    assert reason.endswith("NaN born in log at f.py:3 (g), forward")
    off = {**truth, "loss": np.asarray(truth["loss"] * np.float32(1.001), np.float32)}
    m = compare_train_step(off, truth, inputs)
    status, reason = judge_train_step(m)
    assert status == "warn" and m["loss_ulp"] > TRAIN_LOSS_ULP_SCREEN


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    (root / "t.toml").write_text(SUITE)
    return run(str(root / "t.toml"), ["jax-cpu", "torch-cpu"], out=root / "runs", repeats=1)


def _by(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


@needs_jax
@needs_torch
def test_normal_steps_are_finite_and_match_the_reference(train_run):
    for r in _by(train_run.records, kind="probe"):
        if "mlp_huge" in r["case"] and r["dtype"] == "float16":
            continue
        assert r["status"] == "pass", r["reason"]
        assert r["metrics"]["loss_ulp"] <= 4
    for r in _by(train_run.records, kind="agreement"):
        assert r["status"] == "pass", r["reason"]


@needs_jax
@needs_torch
@pytest.mark.parametrize("backend, op, where", [
    # The step is the train_step module's `on_jax` / `on_torch` (probes/train_step.py).
    ("jax-cpu", "Inf born in dot_general", "train_step.py:"),
    ("torch-cpu", "Inf born in aten.mm", "train_step.py:"),
])
def test_fp16_overflow_fails_naming_the_op_line_and_phase(train_run, backend, op, where):
    (rec,) = [r for r in _by(train_run.records, kind="probe", backend=backend, dtype="float16")
              if "mlp_huge" in r["case"]]
    assert rec["status"] == "fail"
    assert "the step went non-finite" in rec["reason"]
    assert rec["metrics"]["reference_nonfinite"] == 0  # the math itself fits float16
    assert f"{op} at {where}" in rec["reason"] and "forward" in rec["reason"]
    report = rec["metrics"]["nan_report"]
    assert report["phase"] == "forward" and report["source"].startswith(where)
