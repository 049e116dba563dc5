"""Per-step judging of a training run (no framework needed: runs are float64 references,
perturbed on purpose).

Claims: a run equal to the reference up to float32 rounding passes; an update error planted
in one tensor at step 1 fails, naming step 1, the `update` stage and that tensor; a NaN in a
gradient at step 1 fails naming the step and the tensor; a bf16 run beyond the measured
screen warns, never fails while finite; two backends are held to twice the tolerance; the
report's training section draws a curve per backend and names the first divergence.
"""

from __future__ import annotations

import numpy as np
import pytest

from diag.compare.outcome import Outcome
from diag.probes.train import agree, evaluate
from diag.oracle import OracleResult
from diag.report.training import train_context
from diag.tolerance import TRAIN_RUN_RTOL
from diag.train.config import init_params, make_batches
from diag.train.reference import run_reference

PARAMS = {"layers": 1, "width": 16, "vocab": 32, "seq": 8, "batch": 4, "steps": 3,
          "heads": 2, "lr": 3e-3, "compute": "float32", "dtype": "float32"}


@pytest.fixture(scope="module")
def data():
    from diag.train.config import from_case

    cfg = from_case(PARAMS)
    rng = np.random.default_rng(0)
    p, t = init_params(cfg, rng), make_batches(cfg, rng)
    return [p, t], run_reference(cfg, p, t)


def _outcome(inputs, ref, run, compute="float32"):
    names = list(run)
    truth = OracleResult(value=ref["loss"], method="float64-reference", fallbacks=0,
                         elements=0, cache_hit=False, seconds=0.0, extra={"trajectory": ref})
    return Outcome(inputs=inputs, outputs=[run[n] for n in names], names=names, truth=truth,
                   params={**PARAMS, "compute": compute})


def _f32(ref):
    return {k: v.astype(np.float32) for k, v in ref.items()}


def test_a_run_rounded_to_float32_passes(data):
    inputs, ref = data
    ev = evaluate(_outcome(inputs, ref, _f32(ref)))
    assert ev.status == "pass" and ev.metrics["first_divergence"] is None, ev.reason
    assert len(ev.metrics["curve"]["grad_err"]) == 3
    assert 0 < max(ev.metrics["curve"]["grad_err"]) < TRAIN_RUN_RTOL["float32"]["grad"]


def test_a_planted_update_error_fails_naming_step_stage_and_tensor(data):
    inputs, ref = data
    run = _f32(ref)
    run["param/h0.mlp.fc.w"] = run["param/h0.mlp.fc.w"].copy()
    w = run["param/h0.mlp.fc.w"][1]  # the parameters after step 1
    run["param/h0.mlp.fc.w"][1] = w + np.float32(1e-3) * np.sign(w)  # ~1/6 of 2 steps' travel
    ev = evaluate(_outcome(inputs, ref, run))
    fd = ev.metrics["first_divergence"]
    assert ev.status == "fail" and (fd["step"], fd["stage"], fd["tensor"]) == (
        1, "update", "h0.mlp.fc.w"), ev.reason
    assert "step 1: the update of h0.mlp.fc.w" in ev.reason


def test_a_nan_gradient_fails_naming_step_and_tensor(data):
    inputs, ref = data
    run = _f32(ref)
    run["grad/h0.ln1.g"] = run["grad/h0.ln1.g"].copy()
    run["grad/h0.ln1.g"][1, 3] = np.nan
    ev = evaluate(_outcome(inputs, ref, run))
    assert ev.status == "fail" and ev.metrics["nonfinite"] == {"step": 1,
                                                               "tensor": "grad of h0.ln1.g"}
    assert "NaN/Inf at step 1 in the grad of h0.ln1.g" in ev.reason


def test_bf16_drift_beyond_the_screen_warns_and_inside_passes(data):
    inputs, ref = data
    ok = evaluate(_outcome(inputs, ref, _f32(ref), compute="bfloat16"))
    assert ok.status == "pass" and "mixed precision" in ok.reason
    run = _f32(ref)
    run["grad/wte"] = run["grad/wte"] * np.float32(3.0)  # 200% off: beyond any bf16 drift
    ev = evaluate(_outcome(inputs, ref, run, compute="bfloat16"))
    assert ev.status == "warn" and ev.metrics["first_divergence"]["tensor"] == "wte"


def test_two_backends_are_held_to_twice_the_tolerance(data):
    inputs, ref = data
    a, b = _f32(ref), _f32(ref)
    tol = TRAIN_RUN_RTOL["float32"]["loss"]
    b["loss"] = (a["loss"].astype(np.float64) * (1 + 1.5 * tol)).astype(np.float32)
    v = agree(_outcome(inputs, ref, a), _outcome(inputs, ref, b), ("x", "y"), None)
    status, reason = v.status, v.reason
    assert status == "pass", reason  # 1.5x one backend's allowance: within 2x
    b["loss"] = (a["loss"].astype(np.float64) * (1 + 3 * tol)).astype(np.float32)
    v = agree(_outcome(inputs, ref, a), _outcome(inputs, ref, b), ("x", "y"), None)
    status, reason = v.status, v.reason
    assert status == "fail" and "step 0: the loss" in reason


def test_the_report_section_draws_curves_and_names_the_divergence(data):
    inputs, ref = data
    run = _f32(ref)
    run["grad/wte"] = run["grad/wte"] * np.float32(2.0)
    ev = evaluate(_outcome(inputs, ref, run))
    records = [{"op": "train", "kind": "probe", "case": "c", "backend": "jax-cpu",
                "status": ev.status, "reason": ev.reason, "metrics": ev.metrics}]
    ctx = train_context(records, {"train": "training"})
    (case,) = ctx["cases"]
    assert case["status"] == "fail" and case["rows"][0]["first_divergence"]["tensor"] == "wte"
    assert case["svg"].startswith("<svg") and "train-0-" in case["svg"]
    assert train_context(records, {}) is None  # sections decide which ops are shown
