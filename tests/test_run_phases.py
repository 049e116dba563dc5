"""Where a run's time went: run.json's `phases` per backend, the one-line summary of them, and
compiled programs shared by the cases that run the same program.

Claims, through the real `diag` script: every planned backend has every phase, the worker's
compile and run seconds add up to what its records say, the terminal prints one `diag: time:`
line naming each backend's wall time; cases that differ only in their input values run one
compiled program, and the record of each later one names the case it shares it with.
"""

from __future__ import annotations

import json
from pathlib import Path

from diag.run.runner import PHASES
from tests.conftest import needs_jax, needs_torch, run_diag

pytestmark = [needs_jax, needs_torch]

SHARED_SUITE = """
[suite]
name = "shared"
seed = 3

[[probe]]
name = "same_program"
op = "softmax"
inputs = ["normal", "normal5", "near_1e4"]
dtypes = ["float32"]
shapes = [[4, 1024]]
"""


def test_run_json_says_where_the_time_went_and_cases_share_a_compiled_program(tmp_path):
    suite = tmp_path / "shared.toml"
    suite.write_text(SHARED_SUITE)
    out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu,torch-cpu",
                   "--no-report", "--out", str(tmp_path / "runs"), "--cache-dir",
                   str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    meta = json.loads((run_dir / "run.json").read_text())
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    phases = meta["phases"]
    assert set(phases) == {"jax-cpu", "torch-cpu"}
    for label, p in phases.items():
        assert set(p) == set(PHASES)
        assert all(v >= 0 for v in p.values())
        assert p["wall"] >= max(p["start"], p["compile"], p["run"]) > 0
        mine = [r for r in records if r["backend"] == label]
        assert len(mine) == 3
        assert abs(p["compile"] - sum(r["timings"]["compile_s"] for r in mine)) < 0.002
        assert abs(p["run"] - sum(sum(r["timings"]["run_s_samples"]) for r in mine)) < 0.002
        assert all(r["timings"]["transfer_s"] > 0 for r in mine)
        # Three input sets, one program: the first case compiles it, the others share it.
        first, *later = mine
        assert "compile_shared_with" not in first["timings"]
        assert [r["timings"]["compile_shared_with"] for r in later] == [first["case"]] * 2
        assert all(r["status"] == "pass" for r in mine)
    jax_later = [r for r in records if r["backend"] == "jax-cpu"][1:]
    assert all(r["timings"]["compile_s"] == 0.0 for r in jax_later)  # compiled once
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("diag: time:")]
    for label in ("jax-cpu", "torch-cpu"):
        assert f"{label} {phases[label]['wall']:.1f} s (start" in line


def test_repeat_budget_stops_slow_cases_and_inf_times_every_case_repeats_times(tmp_path):
    """`--repeat-budget 0`: one timed run per case, whatever `--repeats` says; `inf`: every
    case `--repeats` times; in between, a case stops once its runs add up to the budget."""
    suite = tmp_path / "shared.toml"
    suite.write_text(SHARED_SUITE)
    samples = {}
    for budget in ("0", "inf", "0.0005"):
        runs = tmp_path / f"runs-{budget}"
        out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu", "--repeats", "4",
                       "--repeat-budget", budget, "--no-report", "--out", str(runs),
                       "--cache-dir", str(tmp_path / "cache"))
        assert out.returncode == 0, out.stderr
        (run_dir,) = runs.iterdir()
        records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
        samples[budget] = [r["timings"]["run_s_samples"] for r in records]
    assert [len(s) for s in samples["0"]] == [1, 1, 1]
    assert [len(s) for s in samples["inf"]] == [4, 4, 4]
    for s in samples["0.0005"]:  # stopped at the first run that reached the budget, or at 4
        assert 1 <= len(s) <= 4
        assert all(sum(s[:i]) < 0.0005 for i in range(1, len(s)))
        assert len(s) == 4 or sum(s) >= 0.0005


def test_bad_repeat_budget_is_a_usage_error():
    out = run_diag("run", "--repeat-budget", "-1", "--no-report")
    assert out.returncode == 2
    assert "--repeat-budget" in out.stderr


def test_an_eager_call_that_takes_the_budget_is_the_one_timed_run(tmp_path):
    """torch-cpu's ops are eager: the warm-up call is a call of the op. With a budget that
    call alone reaches (0), it is the case's one timed run (`first_call`, no compile time),
    and its output is the one judged, the same bits as a later call's; with `inf` the
    warm-up stays a warm-up. JAX compiles ahead of time, so its records never say so."""
    suite = tmp_path / "shared.toml"
    suite.write_text(SHARED_SUITE)
    records = {}
    for budget in ("0", "inf"):
        runs = tmp_path / f"runs-{budget}"
        out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu,torch-cpu",
                       "--repeats", "3", "--repeat-budget", budget, "--no-report",
                       "--out", str(runs), "--cache-dir", str(tmp_path / "cache"))
        assert out.returncode == 0, out.stderr
        (run_dir,) = runs.iterdir()
        records[budget] = {(r["backend"], r["case"]): r for r in map(
            json.loads, (run_dir / "results.jsonl").read_text().splitlines())
            if r["kind"] == "probe"}
    assert len(records["0"]) == len(records["inf"]) == 6
    for (backend, case), first in records["0"].items():
        later = records["inf"][backend, case]
        t = first["timings"]
        if backend == "torch-cpu":
            assert t["first_call"] is True and t["compile_s"] == 0.0
            assert len(t["run_s_samples"]) == 1
        else:
            assert "first_call" not in t and len(t["run_s_samples"]) == 1
        assert "first_call" not in later["timings"]
        assert len(later["timings"]["run_s_samples"]) == 3
        assert later["timings"]["compile_s"] > 0 or backend == "jax-cpu"
        assert first["metrics"]["output_digests"] == later["metrics"]["output_digests"]
        assert first["status"] == later["status"]
