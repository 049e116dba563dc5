"""The `train` suite through the real `diag` script: N AdamW steps on jax-cpu and torch-cpu.

Claims: float32 runs of a correct model pass against the float64 reference with a curve per
step and no first divergence; bf16 mixed-precision records carry their measured drift and
their verdict agrees with it (pass inside the screen, warn beyond, never fail while finite);
two backends are compared step by step; a corrupted output (the worker doubles the first
step's loss) fails at step 0 naming the loss, and `diag run` exits 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diag.plan.suite import load_suite
from tests.conftest import needs_jax, needs_torch, run_diag

SUITE = """
[suite]
name = "t"
seed = 5

[[probe]]
name = "gpt"
op = "train"
inputs = "transformer"
dtypes = ["float32"]
shapes = [[1, 16, 32, 8, 4, 3]]
heads = 2
compute = ["float32", "bfloat16"]
"""


def _records(out: Path) -> list[dict]:
    (path,) = out.glob("*/results.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_shipped_suite_shares_weights_and_reference_between_fp32_and_bf16():
    cases = load_suite("train").cases
    assert [c.params["compute"] for c in cases] == ["float32", "bfloat16"]
    assert len({c.input_key for c in cases}) == 1


def _run(tmp_path, env=None):
    (tmp_path / "t.toml").write_text(SUITE)
    return run_diag("run", "--suite", str(tmp_path / "t.toml"), "-b", "jax-cpu", "-b",
                    "torch-cpu", "--repeats", "1", "-o", str(tmp_path / "runs"), env=env,
                    timeout=600)


# Each runs two workers through the real script: ~30-60 s on a 2-core machine.
@pytest.mark.slow
@needs_jax
@needs_torch
def test_fp32_passes_bf16_reports_drift_and_backends_are_compared(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    records = _records(tmp_path / "runs")
    probes = [r for r in records if r["kind"] == "probe" and r["op"] == "train"]
    assert len(probes) == 4
    for r in probes:
        m = r["metrics"]
        assert len(m["curve"]["grad_err"]) == 3 and len(m["loss"]) == 3
        if r["params"]["compute"] == "float32":
            assert r["status"] == "pass" and m["first_divergence"] is None, r["reason"]
        else:
            # bf16 drifts: the verdict follows what diag measured against its screen
            expected = "pass" if m["first_divergence"] is None else "warn"
            assert r["status"] == expected and "mixed precision" in r["reason"]
            assert max(m["curve"]["grad_err"]) > 1e-4  # it does drift, far beyond float32
    pairs = [r for r in records if r["kind"] == "agreement" and r["op"] == "train"]
    assert len(pairs) == 2 and all("jax-cpu vs torch-cpu" in r["reason"] for r in pairs)


@pytest.mark.slow
@needs_jax
@needs_torch
def test_a_corrupted_loss_fails_at_step_0_and_exits_1(tmp_path):
    proc = _run(tmp_path, env={"DIAG_WORKER_FAULT": "corrupt@torch-cpu:c0000"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    bad = [r for r in _records(tmp_path / "runs")
           if r["kind"] == "probe" and r["backend"] == "torch-cpu"
           and r["params"]["compute"] == "float32"]
    assert bad[0]["status"] == "fail"
    assert bad[0]["metrics"]["first_divergence"]["step"] == 0
    assert bad[0]["metrics"]["first_divergence"]["stage"] == "loss"
    assert "step 0: the loss" in bad[0]["reason"]


def test_a_model_that_cannot_be_built_is_refused_with_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text(SUITE.replace("heads = 2", "heads = 3"))
    proc = run_diag("run", "--suite", str(tmp_path / "bad.toml"), "-b", "jax-cpu", "-o",
                    str(tmp_path / "runs"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("diag:") and "multiple of heads" in proc.stderr
