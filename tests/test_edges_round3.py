"""Edges, round 3 (issue 41): damaged run folders, runs cut short, hand-edited baselines, a
damaged cache, a timeout, usage lines, suite files that are code.

Every test drives the real `diag` console script into one edge and checks the exit code the
README documents, the one `diag:` line, and what the run folder says. Expected answers come
from the test's own bookkeeping (what it wrote, what it cut, which signal it sent), never from
diag.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from diag.records.results import Record, RunDir
from tests.conftest import (
    REPO_ROOT,
    diag_script,
    needs_jax,
    needs_torch,
    one_diag_line,
    run_diag,
)

# A numpy emulation backend: no framework to import, so a run takes about a second.
EMU = "emu-bf16x3"

TWO_CASES = """
[suite]
name = "two"
seed = 7

[[probe]]
name = "sweep"
op = "matmul"
dtypes = ["float32"]
shape = ["d", 4, "d"]
sweep = { d = [16, 32] }
"""


def _verdict(html: str) -> tuple[str, str]:
    """The report's verdict word and text."""
    m = re.search(r'id="verdict" data-verdict="([^"]*)">([^<]*)<', html)
    assert m, "no verdict in the report"
    return m.group(1), m.group(2)


def _folder(root: Path, statuses: list[str]) -> RunDir:
    """A finished run folder holding one record per status, its run.json counted by hand."""
    run = RunDir.create(root / "runs", "r1", {"host": "test"})
    for i, status in enumerate(statuses):
        run.append(Record(op="matmul", probe="t.p", case=f"case{i}", params={},
                          backend="jax-cpu", device={}, dtype="float32", metrics={},
                          status=status, reason=f"{status} reason"))
    counts = {s: statuses.count(s) for s in ("pass", "warn", "fail", "error", "skip")}
    worst = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
    run.update_meta(state="finished", counts=counts, verdict=worst)
    return run


# --- 2: a torn last line that held the one failure ------------------------------------------

def test_a_torn_last_line_that_was_the_one_failure_is_damage_and_the_verdict_stays_fail(
        tmp_path):
    run = _folder(tmp_path, ["pass", "warn", "fail"])
    data = run.results_jsonl.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    run.results_jsonl.write_bytes(data[: last + (len(data) - last) // 2])  # tear the fail
    out = run_diag("report", str(run.path))
    assert out.returncode == 2, out.stderr
    assert "is torn" in out.stderr
    assert "holds 2 readable record(s) while run.json counts 3" in out.stderr
    assert "1 record(s) are lost" in out.stderr
    word, text = _verdict((run.path / "report.html").read_text("utf-8"))
    assert word == "fail", text
    assert text.startswith("FAIL") and "all checks passed" not in text


def test_a_torn_last_line_of_an_interrupted_run_that_counted_it_out_is_no_loss(tmp_path):
    run = _folder(tmp_path, ["pass", "pass"])
    run.update_meta(state="interrupted", counts={"pass": 2}, verdict="incomplete")
    with run.results_jsonl.open("a") as f:
        f.write('{"probe": "t.p", "sta')  # killed mid-write, after run.json was counted
    out = run_diag("report", str(run.path))
    assert out.returncode == 0, out.stderr
    assert "is torn" in out.stderr and "lost" not in out.stderr


# --- 6: garbage in results.jsonl --------------------------------------------------------------

def test_garbage_results_count_every_counted_record_as_lost(tmp_path):
    run = _folder(tmp_path, ["pass"])
    counted = 58
    run.update_meta(counts={"pass": counted - 1, "fail": 1})
    garbage = 53
    run.results_jsonl.write_text("".join(f"#garbage {i} ]]\n" for i in range(garbage)))
    out = run_diag("report", str(run.path))
    assert out.returncode == 2, out.stderr
    assert f"holds 0 readable record(s) while run.json counts {counted}" in out.stderr
    assert f"{counted} record(s) are lost" in out.stderr
    assert f"{garbage - 1} line(s)" in out.stderr  # the last is reported as torn
    word, _ = _verdict((run.path / "report.html").read_text("utf-8"))
    assert word == "fail"


# --- 5 and 3: a run cut short by a signal ----------------------------------------------------

def _cut_short(tmp_path: Path, sig: int) -> tuple[Path, subprocess.CompletedProcess]:
    """A real `diag run` whose second case hangs, sent `sig` once the first record is in."""
    suite = tmp_path / "two.toml"
    suite.write_text(TWO_CASES)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DIAG_WORKER_FAULT": "hang@c0001",
           "DIAG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([diag_script(), "run", "--suite", str(suite), "--backend", EMU,
                             "--out", str(tmp_path / "cut"), "--repeats", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline, results = time.monotonic() + 120, None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((tmp_path / "cut").glob("*/results.jsonl"))
        if found and found[0].read_text().strip():
            results = found[0]
            break
        time.sleep(0.1)
    assert results is not None, "no record arrived"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    return results.parent, subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                                       stderr)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_says_incomplete_with_its_exit_code_everywhere(tmp_path, sig):
    ended = 128 + sig  # what a shell reports for a process a signal ended
    finished = run_diag("run", "--suite", str(_suite(tmp_path)), "--backend", EMU, "--out",
                        str(tmp_path / "whole"), "--no-report",
                        env={"DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert finished.returncode in (0, 1), finished.stderr
    whole = next((tmp_path / "whole").iterdir())
    base = tmp_path / "baseline.json"
    assert run_diag("baseline", str(whole), "-o", str(base)).returncode == 0

    folder, proc = _cut_short(tmp_path, sig)
    assert proc.returncode == ended, proc.stderr
    meta = json.loads((folder / "run.json").read_text())
    assert meta["state"] == "interrupted"
    assert meta["verdict"] == "incomplete"  # never pass or warn
    assert meta["exit_code"] == ended
    word, text = _verdict((folder / "report.html").read_text("utf-8"))
    assert word == "incomplete" and text.startswith("INCOMPLETE"), text
    line = one_diag_line(run_diag("check", str(folder), "--baseline", str(base)), 2)
    assert "the run is 'interrupted', not finished" in line
    assert f"exit code {ended}" in line
    line = one_diag_line(run_diag("baseline", str(folder), "-o", str(tmp_path / "b2.json")), 2)
    assert "the run is 'interrupted', not finished" in line


def _suite(tmp_path: Path) -> Path:
    suite = tmp_path / "two.toml"
    suite.write_text(TWO_CASES)
    return suite


# --- 4: hand-edited baselines -----------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "named"), [
    ("digests", 12, "field 'digests' is 12"),
    ("bound_exceeded", "huge", "metric 'bound_exceeded' is 'huge'"),
    ("bound_ratio", [1], "metric 'bound_ratio' is [1]"),
])
@pytest.mark.parametrize("bitwise", [False, True], ids=["tolerance", "bitwise"])
def test_a_baseline_field_of_the_wrong_type_is_an_unusable_baseline(tmp_path, field, value,
                                                                     named, bitwise):
    out = run_diag("run", "--suite", str(_suite(tmp_path)), "--backend", EMU, "--out",
                   str(tmp_path / "runs"), "--no-report",
                   env={"DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode in (0, 1), out.stderr
    run = next((tmp_path / "runs").iterdir())
    base = tmp_path / "baseline.json"
    assert run_diag("baseline", str(run), "-o", str(base)).returncode == 0
    data = json.loads(base.read_text())
    assert run_diag("check", str(run), "--baseline", str(base),
                    *(["--bitwise"] if bitwise else [])).returncode == 0  # unedited: no drift
    rec = data["records"][0]
    if field == "digests":
        rec["digests"] = value
    else:
        assert field in rec["metrics"]
        rec["metrics"][field] = value
    base.write_text(json.dumps(data))
    line = one_diag_line(run_diag("check", str(run), "--baseline", str(base),
                                   *(["--bitwise"] if bitwise else [])), 2)
    assert named in line and "record 0" in line


# --- 8: the ground-truth cache: a damaged sidecar, clear, info ---------------------------------

def test_a_damaged_cache_sidecar_is_recomputed_with_a_warning_naming_it(tmp_path):
    cache = tmp_path / "cache"
    args = ("run", "--suite", str(_suite(tmp_path)), "--backend", EMU, "--out",
            str(tmp_path / "runs"), "--no-report", "--cache-dir", str(cache))
    first = run_diag(*args)
    assert first.returncode in (0, 1), first.stderr
    sidecars = sorted(cache.glob("??/*.json"))
    assert len(sidecars) == 2  # one truth per case of the suite
    for path in sidecars:
        path.write_text('{"garbage": ')
    again = run_diag(*args)
    assert again.returncode == first.returncode, again.stderr
    for path in sidecars:
        assert f"ground-truth cache entry {path} is damaged" in again.stderr
        assert json.loads(path.read_text())["sha256"]  # recomputed and written back whole
    runs = sorted((tmp_path / "runs").iterdir())
    statuses = [[r["status"] for r in RunDir(run).records()] for run in runs]
    assert statuses[0] == statuses[1]


def test_cache_clear_removes_only_the_files_diag_and_jax_wrote(tmp_path):
    cache = tmp_path / "cache"
    run = run_diag("run", "--suite", str(_suite(tmp_path)), "--backend", EMU, "--out",
                   str(tmp_path / "runs"), "--no-report", "--cache-dir", str(cache))
    assert run.returncode in (0, 1), run.stderr
    entries = sorted(cache.glob("??/*"))
    jax_dir = cache / "jax"
    jax_dir.mkdir()
    # What JAX's persistent cache writes (jax/_src/lru_cache.py): <name>-<64 hex>-cache, -atime.
    jax_files = [jax_dir / f"jit_f-{'ab' * 32}-cache", jax_dir / f"jit_f-{'ab' * 32}-atime"]
    foreign = [jax_dir / "notes.txt", jax_dir / "mine" / "model.ckpt", cache / "ab" / "keep.me"]
    for path in jax_files + foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_text("x")
    out = run_diag("cache", "clear", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    assert f"removed {len(entries) + len(jax_files)} cached file(s)" in out.stdout + out.stderr
    assert all(p.exists() for p in foreign)
    assert not any(p.exists() for p in entries + jax_files)


def test_cache_info_reports_the_jax_cache_the_user_set(tmp_path):
    cache, mine = tmp_path / "cache", tmp_path / "my-jax-cache"
    (cache / "jax").mkdir(parents=True)
    (cache / "jax" / f"jit_g-{'cd' * 32}-cache").write_text("old")
    mine.mkdir()
    for i in range(3):
        (mine / f"jit_f{i}-{'ef' * 32}-cache").write_bytes(b"x" * 10)
    env = {"JAX_COMPILATION_CACHE_DIR": str(mine)}
    info = run_diag("cache", "info", "--json", "--cache-dir", str(cache), env=env)
    assert info.returncode == 0, info.stderr
    jc = json.loads(info.stdout)["jax_compilation_cache"]
    assert (jc["path"], jc["files"], jc["bytes"]) == (str(mine), 3, 30)
    assert jc["set_by"] == "JAX_COMPILATION_CACHE_DIR"
    human = run_diag("cache", "info", "--cache-dir", str(cache), env=env)
    assert f"JAX compilation cache {mine} (set by JAX_COMPILATION_CACHE_DIR" in human.stdout
    info = run_diag("cache", "info", "--json", "--cache-dir", str(cache),
                    env={"JAX_COMPILATION_CACHE_DIR": ""})
    assert "jax_compilation_cache" not in json.loads(info.stdout)  # an empty value: off


# --- 9: a case past its timeout leaves no planned record unaccounted for --------------------

def test_every_planned_record_is_written_when_a_case_times_out(tmp_path):
    slow, fast = "emu-bf16x1", EMU
    out = run_diag("run", "--suite", str(_suite(tmp_path)), "--backend", f"{fast},{slow}",
                   "--timeout", "1", "--out", str(tmp_path / "runs"), "--no-report",
                   env={"DIAG_CACHE_DIR": str(tmp_path / "cache"),
                        "DIAG_WORKER_FAULT": f"hang@{slow}:c0001"})  # the second case hangs
    assert out.returncode == 4, out.stderr
    cases, backends = 2, 2
    planned = cases * backends + cases * (backends * (backends - 1) // 2)  # + agreements
    run = next((tmp_path / "runs").iterdir())
    records = RunDir(run).records()
    assert len(records) == planned
    meta = json.loads((run / "run.json").read_text())
    assert sum(meta["counts"].values()) == planned and meta["state"] == "finished"
    assert f"[{planned}/{planned}]" in out.stderr  # the progress count reaches what it planned
    hung = [r for r in records if r["case"] == "32x4x32 float32" and r["backend"] == slow]
    assert len(hung) == 1 and "within 1 s (timeout)" in hung[0]["reason"]
    pair = [r for r in records if r["kind"] == "agreement" and r["case"] == "32x4x32 float32"]
    assert len(pair) == 1 and pair[0]["status"] == "error"
    assert pair[0]["backend"] == "|".join(sorted((slow, fast)))
    assert f"{slow} has no output" in pair[0]["reason"]
    assert "within 1 s (timeout)" in pair[0]["reason"]
    counts = ", ".join(f"{meta['counts'][s]} {s}" for s in ("pass", "warn", "fail", "error")
                       if meta["counts"][s])
    assert f"diag: {counts}; run folder" in out.stdout


# --- 10: the time line names only backends that ran -------------------------------------------

@needs_jax
@needs_torch
def test_a_jax_functions_time_line_names_no_torch_backend(tmp_path):
    out = run_diag("run", f"{REPO_ROOT / 'examples' / 'user_function.py'}:jax_block", "--out",
                   str(tmp_path / "runs"), "--no-report",
                   env={"DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("diag: time: "))
    timed = re.findall(r"(?:^diag: time: |; )([a-z0-9+-]+) \d", line)
    run = next((tmp_path / "runs").iterdir())
    ran = {r["backend"] for r in RunDir(run).records() if r["status"] != "skip"}
    assert timed and set(timed) == ran, (line, ran)
    assert not any(b.startswith("torch") for b in timed), line
    meta = json.loads((run / "run.json").read_text())
    assert set(meta["phases"]) == ran and set(meta["backends_planned"]) == ran


# --- 11: usage lines and help pages --------------------------------------------------------------

def test_an_unknown_backend_points_to_diag_run_help(tmp_path):
    line = one_diag_line(run_diag("run", "--suite", str(_suite(tmp_path)), "--backend",
                                   "jax-cpux", "--out", str(tmp_path / "runs")), 2)
    assert "unknown backend 'jax-cpux'" in line and "jax-cpu" in line
    assert line.endswith("see 'diag run --help'")
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize(("typed", "suggested"), [
    ("--bogus", None), ("--zzz", None), ("--outt", "--out"), ("--suit", "--suite"),
    ("--no-reprot", "--no-report"),
])
def test_an_unknown_option_suggests_only_a_close_one(typed, suggested):
    line = one_diag_line(run_diag("run", typed, "x"), 2)
    assert line.startswith(f"diag: no such option: {typed}")
    assert line.endswith("see 'diag run --help'")
    if suggested is None:
        assert "mean" not in line and "--out" not in line and "ossible" not in line, line
    else:
        assert f"did you mean {suggested}?" in line


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize(("args", "sentence"), [
    ((), "Name the first divergent op or tap, every decision (comparison, argmax, top-k "
         "cut, mask) taken the other way than float64, and the cause"),
    (("report",), "Exits 2 when the folder is damaged: results.jsonl has lines that cannot "
                  "be read (other than a torn last line), or holds fewer records than"),
])
def test_help_pages_wrap_at_the_terminal_width_not_at_the_source_lines(args, sentence):
    # On a terminal wide enough for the sentence, it is on one line of the help page.
    out = run_diag(*args, "--help", env={"COLUMNS": "300", "TERM": "dumb"})
    assert out.returncode == 0, out.stderr
    assert any(sentence in " ".join(_words(ln.strip("│ "))) for ln in out.stdout.splitlines()), \
        out.stdout


# --- 12: a suite file that names code says so before loading it --------------------------------

def test_a_suite_naming_code_lists_it_before_importing_any_of_it(tmp_path):
    (tmp_path / "evil.py").write_text(
        "import sys\n"
        "print('EVIL MODULE IMPORTED', file=sys.stderr, flush=True)\n"
        "def f():\n"
        "    import numpy as np\n"
        "    return (lambda x: x * 2, (np.ones(3, np.float32),))\n"
    )
    (tmp_path / "s.toml").write_text(
        '[suite]\nname = "handed"\n\n[[probe]]\nname = "mine"\nfn = "evil.py:f"\n')
    out = run_diag("run", "--suite", "s.toml", "--backend", EMU, "--out", "runs",
                   "--no-report", cwd=tmp_path)
    # The emulation backend runs matmul only: refused (exit 2) after the suite loaded.
    assert out.returncode == 2, out.stderr
    err = out.stderr
    announced = err.find("diag: suite s.toml imports and runs this Python code")
    imported = err.find("EVIL MODULE IMPORTED")
    assert 0 <= announced < imported, err
    assert f"    {tmp_path.resolve() / 'evil.py'}:f (probe[0].fn)" in err


def test_a_suite_of_diags_own_probes_announces_no_code(tmp_path):
    out = run_diag("run", "--suite", str(_suite(tmp_path)), "--backend", EMU, "--out",
                   str(tmp_path / "runs"), "--no-report",
                   env={"DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode in (0, 1), out.stderr
    assert "imports and runs" not in out.stderr
