"""The `diag` command as a user runs it: exit codes, one-line errors, JSON, Ctrl-C.

Every test runs the installed `diag` console script in a subprocess, as a shell would
(`run_diag`); what a command found is on stdout, progress and errors on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path


from tests.conftest import REPO_ROOT, diag_script, needs_jax, needs_torch, run_diag

diag = run_diag


def test_help_lists_the_commands():
    out = diag("--help")
    assert out.returncode == 0
    for verb in ("run", "report", "cache"):
        assert verb in out.stdout


def test_unknown_suite_exits_2_and_writes_nothing(tmp_path):
    out = diag("run", "--suite", "nope", "--out", str(tmp_path / "runs"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: nope: field 'suite'")
    assert "matmul" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_unknown_backend_exits_2_and_writes_nothing(tmp_path):
    out = diag("run", "--backend", "jax-cpu,tpu-v9", "--out", str(tmp_path / "runs"))
    assert out.returncode == 2
    assert out.stderr.strip() == ("diag: unknown backend 'tpu-v9'; known backends: jax-cpu, "
                                  "jax-gpu, jax-tpu, torch-cpu, torch-cuda, torch-xla-cpu, "
                                  "torch-xla-tpu, torch-xla-cuda, emu-bf16x1, "
                                  "emu-bf16x3, emu-bf16x6, emu-tf32, emu-tf32x3, emu-f16; "
                                  "see 'diag run --help'")
    assert not (tmp_path / "runs").exists()


def test_wrong_typed_suite_file_exits_2_naming_file_and_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[probe]]\nname = "x"\nop = "matmul"\ndtypes = ["float32"]\n'
                   'shapes = [[4, "four", 4]]\n')
    out = diag("run", "--suite", str(bad), "--out", str(tmp_path / "runs"))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"diag: {bad}: field 'probe[0].shapes[0][1]': expected a "
                                  f"positive integer, got str 'four'")
    assert not (tmp_path / "runs").exists()


def test_report_on_a_folder_that_is_not_a_run_exits_2(tmp_path):
    out = diag("report", str(tmp_path))
    assert out.returncode == 2
    assert "not a diag run folder" in out.stderr


@needs_jax
@needs_torch
def test_run_json_exit_0_and_report(tmp_path, tiny_suite):
    out = diag("run", "--suite", tiny_suite, "--backend", "jax-cpu", "--backend", "torch-cpu",
               "--out", str(tmp_path), "--json", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["counts"]["fail"] == 0 and summary["counts"]["error"] == 0
    assert summary["counts"]["pass"] >= 15
    assert Path(summary["report"]).is_file()
    assert len(summary["records"]) == sum(summary["counts"].values())


@needs_jax
def test_silently_wrong_output_fails_with_exit_1(tmp_path, tiny_suite):
    out = diag("run", "--suite", tiny_suite, "--backend", "jax-cpu", "--out", str(tmp_path),
               "--no-report", "--repeats", "1", env={"DIAG_WORKER_FAULT": "corrupt@c0002"})
    assert out.returncode == 1, out.stderr
    assert "fail" in out.stdout and "64x4x64 float32" in out.stdout
    (run_dir,) = [p.parent for p in tmp_path.glob("*/run.json")]
    recs = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    (bad,) = [r for r in recs if r["status"] == "fail"]
    assert bad["metrics"]["bound_exceeded"] == 1 and bad["metrics"]["worst"]["index"] == "(0, 0)"
    assert bad["metrics"]["worst"]["got"] == 2 * bad["metrics"]["worst"]["truth"]
    assert not (run_dir / "report.html").exists()


@needs_jax
def test_worker_crash_exits_4(tmp_path, tiny_suite):
    out = diag("run", "--suite", tiny_suite, "--backend", "jax-cpu", "--out", str(tmp_path),
               "--no-report", "--repeats", "1", env={"DIAG_WORKER_FAULT": "kill@c0000"})
    assert out.returncode == 4
    assert "killed by SIGKILL" in out.stdout


@needs_jax
def test_ctrl_c_keeps_finished_records_and_marks_the_run_interrupted(tmp_path, tiny_suite):
    proc = subprocess.Popen([diag_script(), "run", "--suite", tiny_suite, "--backend",
                             "jax-cpu", "--out", str(tmp_path), "--repeats", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DIAG_WORKER_FAULT": "hang@c0003",
                                 "PYTHONPATH": str(REPO_ROOT)})
    deadline = time.time() + 120
    results = None
    while time.time() < deadline:
        found = list(tmp_path.glob("*/results.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            results = found[0]
            break
        time.sleep(0.2)
    assert results is not None, "no records appeared"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in err
    meta = json.loads((results.parent / "run.json").read_text())
    assert meta["state"] == "interrupted"
    kept = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["case"] for r in kept] == ["16x4x16 float32", "16x4x16 bfloat16", "64x4x64 float32"]
    assert all(r["status"] == "pass" for r in kept)
    # The hung worker did not outlive the run.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"diag-{results.parent.name}" not in ps


def test_cache_info_and_clear(tmp_path):
    import numpy as np

    from diag import oracle

    cache = oracle.GroundTruthCache(tmp_path / "c")
    a = np.ones((4, 3), np.float32)
    first = oracle.matmul_result(a, a.T, cache=cache)
    again = oracle.matmul_result(a, a.T, cache=cache)
    assert not first.cache_hit and again.cache_hit
    np.testing.assert_array_equal(again.value, np.full((4, 4), 3, np.float32))
    info = diag("cache", "info", "--json", "--cache-dir", str(tmp_path / "c"))
    assert info.returncode == 0 and json.loads(info.stdout)["entries"] == 1
    cleared = diag("cache", "clear", "--cache-dir", str(tmp_path / "c"))
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert json.loads(diag("cache", "info", "--json", "--cache-dir", str(tmp_path / "c")).stdout)["entries"] == 0


def test_out_that_is_a_file_exits_2(tmp_path, tiny_suite):
    # The inputs were written (while the frameworks listed their devices) before the run
    # folder failed: the work folder holding them is removed all the same.
    target = tmp_path / "a-file"
    target.write_text("")
    (tmp_path / "tmp").mkdir()
    out = diag("run", "--suite", tiny_suite, "--backend", "jax-cpu", "--out", str(target),
               env={"TMPDIR": str(tmp_path / "tmp")})
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"diag: cannot create a run folder under '{target}'")
    assert list((tmp_path / "tmp").iterdir()) == []


@needs_jax
def test_a_flag_jax_refuses_exits_2_and_leaves_no_work_folder(tmp_path, tiny_suite):
    (tmp_path / "tmp").mkdir()
    out = diag("run", "--suite", tiny_suite, "--backend", "jax-cpu", "--out", str(tmp_path),
               env={"TMPDIR": str(tmp_path / "tmp"), "XLA_FLAGS": "--xla_no_such_flag_diag=1"})
    assert out.returncode == 2 and "xla_no_such_flag_diag" in out.stderr
    assert list((tmp_path / "tmp").iterdir()) == [] and not list(tmp_path.glob("2*"))
