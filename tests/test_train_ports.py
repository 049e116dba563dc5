"""Drift or bug: each planted porting bug is detected and named, two correct ports are not.

Claims (float32, a small transformer, 3 AdamW steps, the PyTorch port of the JAX original):
a correct port is judged `drift` (both runs follow the float64 reference within tolerance);
each bug of `diag.train.PORT_BUGS` planted in the port is judged `bug`, blames the port, names
the first step, stage and tensor where it leaves the reference, and names that bug (and only
that bug) as the explanation; a bug planted in the original blames the original.
"""

from __future__ import annotations

import pytest

from diag.train import PORT_BUGS, TrainConfig, compare_ports
from diag.tolerance import TRAIN_RUN_RTOL
from tests.conftest import needs_jax, needs_torch

CFG = TrainConfig(layers=2, width=32, heads=4, vocab=64, seq=16, batch=4, steps=3)

# Where each bug first shows: forward bugs change the loss or the gradients of step 0, the
# optimizer bugs its update (the gradients of step 0 are still right).
_STAGES = {"adam_eps_inside": ("update",), "l2_weight_decay": ("update",),
           "ln_eps_1e-6": ("loss", "grad"), "gelu_tanh": ("loss", "grad"),
           "no_attn_scale": ("loss", "grad")}

pytestmark = [needs_jax, needs_torch]


def test_two_correct_ports_drift_and_no_bug_is_named():
    r = compare_ports("jax", "torch", cfg=CFG)
    assert r.verdict == "drift" and r.culprit is None and not r.suspects, r.reason
    assert "drift, not a bug" in r.reason
    # they do differ (or the test could not tell drift from identity), within tolerance
    pair = r.summaries["port vs original"]["curve"]
    assert max(pair["grad_err"]) > 0
    assert max(pair["grad_err"]) <= 2 * TRAIN_RUN_RTOL["float32"]["grad"]


@pytest.mark.parametrize("bug", list(PORT_BUGS))
def test_each_planted_porting_bug_is_detected_and_named(bug):
    r = compare_ports("jax", "torch", bug=bug, cfg=CFG)
    assert r.verdict == "bug" and r.culprit == "port", r.reason
    assert r.suspects == [bug], r.reason
    div = r.first_divergence
    assert div.step == 0 and div.stage in _STAGES[bug], div
    assert div.error > div.allowed
    assert f"step {div.step}" in r.reason and bug in r.reason
    if div.stage != "loss":
        assert div.tensor in r.reason


def test_a_bug_in_the_original_blames_the_original():
    r = compare_ports("jax", "torch", original_bug="gelu_tanh", cfg=CFG)
    assert r.verdict == "bug" and r.culprit == "original" and r.suspects == ["gelu_tanh"]
    assert "the original (jax) leaves" in r.reason


def test_an_unknown_bug_is_a_usage_error():
    from diag.errors import UsageError

    with pytest.raises(UsageError, match="unknown porting bug"):
        compare_ports("reference", "reference", bug="typo", cfg=CFG)
