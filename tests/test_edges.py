"""Trust at the edges (issue 29): every fault and bad input ends in a true verdict, one line,
nothing lost.

Each test drives the real `diag` console script (or the library call a user makes) into one
edge: a ground-truth cache entry cut to 0 bytes, a worker that hangs after its last case, a
full disk under --out, output paths that cannot be written, a reader that closes the pipe,
an interrupted run; and checks the exit code the README documents and the one `diag:` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.oracle.cache import GroundTruthCache
from diag.records.outputs import prepare_output
from diag.records.results import Record, RunDir, read_results
from diag.errors import UsageError
from tests.conftest import REPO_ROOT, diag_script, needs_jax, one_diag_line, run_diag

ONE_CASE = """
[suite]
name = "one"
seed = 7

[[probe]]
name = "sweep"
op = "matmul"
dtypes = ["float32"]
shape = ["d", 4, "d"]
sweep = { d = [16, 32] }
"""


def _run_folder(root: Path, statuses=("pass",)) -> RunDir:
    run = RunDir.create(root / "runs", "r1", {"host": "test"})
    for i, status in enumerate(statuses):
        run.append(Record(op="matmul", probe="t.p", case=f"case{i}", params={},
                          backend="jax-cpu", device={}, dtype="float32", metrics={},
                          status=status, reason=f"{status} reason"))
    run.update_meta(state="finished")
    return run


# --- 1: an EOFError is never a fake Ctrl-C ---------------------------------------------------

def test_an_empty_cache_entry_is_recomputed_with_a_warning(tmp_path):
    import numpy as np

    cache = GroundTruthCache(tmp_path / "c")
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    for put, get in ((cache.put, cache.get), (cache.put_mapped, cache.get_mapped)):
        key = f"{put.__name__}-key" + "0" * 40
        put(key, value)
        npy, _ = (cache.root / key[:2] / f"{key}.npy", None)
        npy.write_bytes(b"")  # a file truncated to 0 bytes (a full disk, a crash mid-copy)
        assert get(key) is None  # a miss, so the caller recomputes it
        put(key, value)
        np.testing.assert_array_equal(np.asarray(get(key).value), value)


@needs_jax
def test_a_truncated_cache_file_under_diag_run_is_recomputed_not_exit_130(tmp_path):
    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE)
    env = {"DIAG_CACHE_DIR": str(tmp_path / "cache")}
    args = ("run", "--suite", str(suite), "--backend", "jax-cpu", "--no-report",
            "--out", str(tmp_path / "runs"))
    first = run_diag(*args, env=env)
    assert first.returncode == 0, first.stderr
    entries = list((tmp_path / "cache").rglob("*.npy"))
    assert entries
    for npy in entries:
        npy.write_bytes(b"")
    again = run_diag(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert "recomputing it" in again.stderr
    runs = sorted((tmp_path / "runs").iterdir())
    assert json.loads((runs[-1] / "run.json").read_text())["state"] == "finished"


def test_a_stray_eoferror_is_an_internal_error_line_exit_70():
    code = ("import sys; import diag.cli as c; from diag.cli._app import app\n"
            "@app.command('boom')\n"
            "def boom():\n    raise EOFError('No data left in file')\n"
            "sys.argv = ['diag', 'boom']; c.main()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    line = one_diag_line(out, 70)
    assert line.startswith("diag: internal error: EOFError: No data left in file")


# --- 2: a worker that hangs after its last case ----------------------------------------------

@needs_jax
def test_a_worker_hung_after_its_last_case_keeps_every_record(tmp_path, monkeypatch):
    import diag

    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE)
    monkeypatch.setenv("DIAG_WORKER_FAULT", "hang@jax-cpu:end")
    result = diag.run(str(suite), ["jax-cpu"], out=tmp_path, repeats=1, case_timeout=2,
                      startup_timeout=10)
    assert [r["status"] for r in result.records] == ["pass", "pass"]
    meta = json.loads((result.run_dir / "run.json").read_text())
    assert meta["state"] == "finished"
    assert "hung measuring its arithmetic" in meta["backends"]["jax-cpu"]["arithmetic_error"]
    assert result.exit_code == 0


# --- 3: a full disk under --out --------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root may mount one); skipped where mounting is not permitted."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(folder: Path, leave: int) -> None:
    """Fill `folder`'s file system up to `leave` bytes free."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    (folder / "filler").write_bytes(b"\0" * max(free - leave, 0))


@needs_jax
def test_a_full_disk_under_out_is_one_line_run_json_aborted_temp_removed(tmp_path, small_disk):
    suite = tmp_path / "s.toml"
    suite.write_text(ONE_CASE.replace("[16, 32]", "[16, 32, 48, 64, 80, 96, 112, 128]"))
    _fill(small_disk, 12_000)  # room for run.json and a record or two, not for eight
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu", "--out",
                   str(small_disk), env={"TMPDIR": str(tmp)})
    line = one_diag_line(out, 2)
    assert "no space left on the device holding" in line and str(small_disk) in line
    assert "more needed" in line
    run = next(p for p in small_disk.iterdir() if p.is_dir())
    meta = json.loads((run / "run.json").read_text())
    assert meta["state"] == "aborted"
    read = read_results(run)
    assert read.torn_last_line is None and not read.unreadable
    assert list(tmp.iterdir()) == []  # the run's temp folder is gone


def test_a_report_on_a_full_disk_is_one_line_naming_the_folder(tmp_path, small_disk):
    run = _run_folder(tmp_path)
    _fill(small_disk, 0)
    target = small_disk / "r.html"
    line = one_diag_line(run_diag("report", str(run.path), "--out", str(target), timeout=60), 2)
    assert line.startswith(f"diag: cannot write the report to '{target}': no space left")
    assert not target.exists()


# --- 5, 17: output paths ---------------------------------------------------------------------

def test_output_paths_get_their_parents_or_one_true_line(tmp_path):
    made = prepare_output(tmp_path / "new" / "sub" / "j.xml", "the JUnit file", "--junit")
    assert made.parent.is_dir()
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match="'.*afile' is a file, not a folder"):
        prepare_output(tmp_path / "afile" / "j.xml", "the JUnit file", "--junit")
    with pytest.raises(UsageError, match="it is a folder"):
        prepare_output(tmp_path, "the JUnit file", "--junit")


def test_report_out_under_a_file_says_not_a_folder(tmp_path):
    run = _run_folder(tmp_path)
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "r.html"
    line = one_diag_line(run_diag("report", str(run.path), "--out", str(target), timeout=60), 2)
    assert "is a file, not a folder" in line and "File exists" not in line


def test_baseline_and_check_junit_paths(tmp_path):
    run = _run_folder(tmp_path, ("pass", "pass"))
    (tmp_path / "afile").write_text("")
    bad = one_diag_line(run_diag("baseline", str(run.path), "-o",
                               str(tmp_path / "afile" / "b.json"), timeout=60), 2)
    assert "is a file, not a folder" in bad
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(run.path), "-o", str(base), timeout=60).returncode == 0
    junit = tmp_path / "new" / "sub" / "j.xml"
    ok = run_diag("check", str(run.path), "--baseline", str(base), "--junit", str(junit),
                  timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert junit.read_text().count("<testcase") == 2
    for target, says in ((tmp_path / "afile" / "j.xml", "is a file, not a folder"),
                         (tmp_path, "it is a folder")):
        out = run_diag("check", str(run.path), "--baseline", str(base), "--junit", str(target),
                       timeout=60)
        assert says in one_diag_line(out, 2)


# --- 12, 11: progress counts and the closing table -------------------------------------------

def test_planned_records_count_every_record_a_run_writes(tmp_path):
    from diag.backends import get_spec
    from diag.plan.plan import Plan
    from diag.plan.suite import load_suite

    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE)
    loaded = load_suite(str(suite))
    specs = [get_spec("jax-cpu"), get_spec("torch-cpu")]
    # 2 cases x (2 probe records + 1 agreement record between the two backends)
    assert Plan.of(loaded, specs).records() == 2 * (2 + 1)


@pytest.mark.skipif(not (os.environ.get("DIAG_SKIP_TORCH") is None), reason="torch off")
@needs_jax
def test_progress_counts_each_record_once_and_the_plan_is_true(tmp_path):
    pytest.importorskip("torch")
    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE)
    out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu,torch-cpu",
                   "--no-report", "--out", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    run = next((tmp_path / "runs").iterdir())
    written = len(read_results(run).records)
    assert f"diag run: {written} record(s) planned" in out.stderr
    counters = [ln.split("]")[0] for ln in out.stderr.splitlines()
                if ln.startswith("diag run: [")]
    assert len(counters) == written and len(set(counters)) == written
    assert counters[-1] == f"diag run: [{written}/{written}"


def test_a_clean_run_with_skipped_backends_has_no_records_to_look_at():
    from diag import render

    from diag.records.results import Record

    common = dict(op="matmul", params={}, device={}, dtype="float32", metrics={})
    records = [Record(status="pass", backend="jax-cpu", probe="s.p", case="c", reason="",
                      **common).to_json(),
               Record(status="skip", backend="jax-tpu", probe="s", case="*",
                      reason="jax-tpu: no TPU", **common).to_json()]
    table = render.problems_table(records)
    assert table is not None and "to look at" not in str(table.title)
    assert "1 backend(s) not run" in str(table.title)


# --- 16: a broken pipe -----------------------------------------------------------------------

def test_a_reader_that_closes_the_pipe_is_not_a_numerical_failure():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([diag_script(), "env", "--no-fingerprints"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The reader goes away before diag writes (as `| head -2` does once it has its lines;
    # closing first makes the broken pipe certain, not a race with the pipe's buffer)
    proc.stdout.close()
    proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err


# --- 18: an interrupted run keeps a report ---------------------------------------------------

@needs_jax
def test_an_interrupted_run_writes_the_report_of_what_finished(tmp_path):
    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DIAG_WORKER_FAULT": "hang@jax-cpu:c0001",
           "DIAG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([diag_script(), "run", "--suite", str(suite), "--backend",
                             "jax-cpu", "--out", str(tmp_path / "runs")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    results = None
    while time.monotonic() < deadline:  # the first case's record is written; c0001 hangs
        found = list((tmp_path / "runs").glob("*/results.jsonl"))
        if found and found[0].read_text().strip():
            results = found[0]
            break
        time.sleep(0.2)
    assert results is not None, "no record arrived"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    html = (results.parent / "report.html").read_text()
    assert "interrupted" in html
    assert json.loads((results.parent / "run.json").read_text())["state"] == "interrupted"


# --- 10: no numpy warning on a wide-range float16 case ----------------------------------------

def test_inf_in_truth_and_output_compares_without_a_numpy_warning():
    import warnings

    import numpy as np

    from diag.compare.elementwise import agreement, compare

    out = np.array([np.inf, -np.inf, 1.0, 2.0], dtype=np.float16)
    truth = out.copy()  # Inf where the truth is Inf: agreement, not an invalid subtraction
    bound = np.full(4, 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = compare(out, truth, bound)
        agreement(out, truth, bound)
    assert metrics["max_abs_err"] == 0.0


# --- 23 (and 13): the ci suite's bf16 softmax shows excess precision ---------------------------

@needs_jax
def test_the_ci_suites_bf16_softmax_entry_changes_under_no_excess_precision(tmp_path):
    """The entry exists to show XLA's excess precision (bf16 intermediates kept in f32):
    its seeded draw must change bits when `--xla_allow_excess_precision=false` is set. This is
    XLA's CPU compiler at work (not the CPU's arithmetic); if a newer jax stops showing it,
    the entry needs another draw, which is what this test is for."""
    import tomllib

    from diag.plan.suite import SUITE_DIR

    ci = tomllib.loads((SUITE_DIR / "ci.toml").read_text())
    (entry,) = [p for p in ci["probe"] if p["name"] == "softmax_bf16"]
    lines = [f"[suite]\nname = \"ci\"\nseed = {ci['suite']['seed']}\n\n[[probe]]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    suite = tmp_path / "ci_softmax.toml"
    suite.write_text("\n".join(lines) + "\n")
    out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu", "--out",
                   str(tmp_path / "r"), "--ab", "XLA_FLAGS=--xla_allow_excess_precision=false")
    assert out.returncode == 0, out.stderr[-2000:]
    # 13: an A/B run's closing lines, once each
    text = out.stdout + out.stderr
    assert text.count("diag: report: ") == 1 and text.count("run folder: ") == 1
    assert text.count("diag: results") == 1
    (run,) = (tmp_path / "r").iterdir()
    ab = {r["dtype"]: r for r in read_results(run).records if r.get("kind") == "ab"}
    assert ab["bfloat16"]["metrics"]["changed_outputs"] == ["output"], ab["bfloat16"]["reason"]
    assert ab["bfloat16"]["metrics"]["difference"]["mismatched"] > 0


def test_check_junit_on_a_full_disk_keeps_the_verdict_and_says_why(tmp_path, small_disk):
    run = _run_folder(tmp_path, ("pass", "pass"))
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(run.path), "-o", str(base), timeout=60).returncode == 0
    _fill(small_disk, 0)
    junit = small_disk / "j.xml"
    out = run_diag("check", str(run.path), "--baseline", str(base), "--junit", str(junit),
                   timeout=60)
    line = one_diag_line(out, 2)
    assert line.startswith(f"diag: cannot write the JUnit file to '{junit}': no space left")
    assert "diag: no drift: 2 record(s) compared" in out.stdout  # the verdict came first
    assert not junit.exists()


def test_preflight_junit_gets_its_parents_or_fails_before_the_work(tmp_path):
    junit = tmp_path / "new" / "sub" / "pf.xml"
    out = run_diag("preflight", "--budget", "0.5", "--junit", str(junit), timeout=120)
    assert out.returncode in (0, 1, 3, 4), out.stderr
    assert "diag preflight: " in out.stdout  # the verdict, then the file
    assert junit.read_text().count("<testcase") >= 1
    (tmp_path / "afile").write_text("")
    bad = run_diag("preflight", "--budget", "0.5", "--junit", str(tmp_path / "afile" / "pf.xml"),
                   timeout=120)
    assert "is a file, not a folder" in one_diag_line(bad, 2)
    assert "diag preflight: [" not in bad.stderr  # refused before any step ran


def test_a_drift_is_not_hidden_behind_an_unwritable_junit_file(tmp_path, small_disk):
    run = _run_folder(tmp_path, ("pass", "pass"))
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(run.path), "-o", str(base), timeout=60).returncode == 0
    drifted = _run_folder(tmp_path / "later", ("pass", "fail"))
    _fill(small_disk, 0)
    out = run_diag("check", str(drifted.path), "--baseline", str(base), "--junit",
                   str(small_disk / "j.xml"), timeout=60)
    assert out.returncode == 1, out.stderr  # the drift's 1, not the file's 2
    assert "cannot write the JUnit file" in out.stderr and "diag: drifted" in out.stdout
