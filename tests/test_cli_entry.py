"""What a first contact with the `diag` script shows is true: exit codes, one-line errors,
headlines, damaged run folders, SIGTERM, names with brackets, output for a CI log, the
documented library names.

Every CLI claim is checked through the installed `diag` console script in a subprocess
(`run_diag`), as a shell or a CI job runs it; runs use the numpy-emulated backend
`emu-bf16x3` (no framework needed, a second or two) unless a claim needs more.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.records.results import Record, RunDir, worst_status
from tests.conftest import REPO_ROOT, diag_script, run_diag

EMU = "emu-bf16x3"

# Probe names that are rich markup: `[/oops]` closes a tag never opened (rich raises),
# `[heads]` reads as a style (rich drops it).
MARKUP_SUITE = """
[suite]
name = "markup"
seed = 3

[[probe]]
name = "[/oops] x"
op = "matmul"
dtypes = ["float32"]
shapes = [[8, 4, 8]]

[[probe]]
name = "attn[heads]"
op = "matmul"
dtypes = ["float32", "bfloat16"]
shapes = [[16, 8, 16]]
"""


def _one_error_line(out, code: int) -> str:
    """The run exited `code` with exactly one `diag:` line on stderr and no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, (out.returncode, out.stderr)
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("diag: ") and "Traceback" not in out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def no_click(tmp_path_factory) -> str:
    """A PYTHONPATH folder whose `click` cannot be imported, as on a fresh typer 0.29 venv."""
    root = tmp_path_factory.mktemp("no-click")
    (root / "click").mkdir()
    (root / "click" / "__init__.py").write_text(
        'raise ImportError("click is not installed (typer >= 0.29 vendors its own)")\n')
    probe = subprocess.run([sys.executable, "-c", "import click"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(root)})
    assert probe.returncode != 0  # the shadow works: diag must not need `click`
    return str(root)


# --- usage errors --------------------------------------------------------------------------

USAGE_ERRORS = [
    ((), "missing command", "diag --help"),
    (("report",), "missing argument", "diag report --help"),
    (("run", "--bogus"), "--bogus", "diag run --help"),
    (("run", "--repeats", "abc"), "'--repeats'", "diag run --help"),
    (("run", "--repeats", "0"), "'--repeats'", "diag run --help"),
    (("run", "--backend"), "'--backend' requires an argument", "diag run --help"),
    (("frobnicate",), "'frobnicate'", "diag --help"),
    (("cache",), "missing command", "diag cache --help"),
]


@pytest.mark.parametrize("args,names,helps", USAGE_ERRORS,
                         ids=[" ".join(a) or "(none)" for a, _, _ in USAGE_ERRORS])
def test_usage_error_is_one_line_exit_2_without_the_click_package(args, names, helps,
                                                                  no_click):
    out = run_diag(*args, env={"PYTHONPATH": no_click}, timeout=60)
    line = _one_error_line(out, 2)
    assert names in line and f"see '{helps}'" in line
    assert out.stdout == ""


def test_usage_error_is_the_same_with_click_installed():
    out = run_diag("run", "--repeats", "abc", timeout=60)
    line = _one_error_line(out, 2)
    assert line.startswith("diag: invalid value for '--repeats'")


@pytest.fixture
def broken_jinja2(tmp_path) -> str:
    """A PYTHONPATH folder whose `jinja2` raises on import: a broken install, a bug to diag."""
    root = tmp_path / "broken"
    (root / "jinja2").mkdir(parents=True)
    (root / "jinja2" / "__init__.py").write_text('raise RuntimeError("jinja2 is broken")\n')
    return str(root)


def _run_folder(tmp_path, records, state="finished") -> RunDir:
    run = RunDir.create(tmp_path / "runs", "r1", {"host": "test"})
    for rec in records:
        run.append(rec)
    run.update_meta(state=state)
    return run


def _rec(status: str, **kw) -> Record:
    base = dict(op="matmul", probe="t.p", case=f"case-{status}", params={},
                backend="jax-cpu", device={}, dtype="float32", metrics={}, status=status,
                reason=f"{status} reason")
    base.update(kw)
    return Record(**base)


def test_unexpected_exception_is_one_line_exit_70_and_debug_shows_the_traceback(
        tmp_path, broken_jinja2):
    run = _run_folder(tmp_path, [_rec("pass")])
    out = run_diag("report", str(run.path), env={"PYTHONPATH": broken_jinja2}, timeout=60)
    line = _one_error_line(out, 70)
    assert line == ("diag: internal error: RuntimeError: jinja2 is broken; rerun with --debug "
                    "for the traceback and report it")
    debug = run_diag("--debug", "report", str(run.path), env={"PYTHONPATH": broken_jinja2},
                     timeout=60)
    assert debug.returncode == 70
    assert "Traceback (most recent call last)" in debug.stderr
    assert 'RuntimeError("jinja2 is broken")' in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == line


# --- headlines -------------------------------------------------------------------------------

@pytest.mark.parametrize("statuses,verdict", [
    (["pass"] * 130 + ["skip"] * 3, "pass"),
    (["skip", "warn", "pass"], "warn"),
    (["skip", "fail", "error"], "error"),
    (["skip", "skip"], "skip"),
    ([], "skip"),
])
def test_a_skip_never_outranks_a_checked_result(statuses, verdict):
    assert worst_status(statuses) == verdict


def test_report_headline_says_nothing_was_checked_only_when_nothing_was(tmp_path):
    mixed = _run_folder(tmp_path / "a", [_rec("pass"), _rec("skip", op="*", backend="jax-tpu")])
    out = run_diag("report", str(mixed.path), timeout=60)
    assert out.returncode == 0, out.stderr
    html = (mixed.path / "report.html").read_text()
    assert 'data-verdict="pass"' in html and "nothing was checked" not in html
    skipped = _run_folder(tmp_path / "b", [_rec("skip", op="*", backend="jax-tpu")])
    assert run_diag("report", str(skipped.path), timeout=60).returncode == 0
    assert "SKIPPED: nothing was checked" in (skipped.path / "report.html").read_text()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`diag run` with no --backend on the tiny suite: every backend present runs, the
    absent ones are recorded as skips (the main job's situation), output captured (no tty)."""
    from tests.conftest import TINY_SUITE

    root = tmp_path_factory.mktemp("default-run")
    suite = root / "tiny.toml"
    suite.write_text(TINY_SUITE)
    out = run_diag("run", "--suite", str(suite), "--out", str(root / "runs"), "--repeats",
                   "1", env={"DIAG_CACHE_DIR": str(root / "cache")}, timeout=600)
    (run_dir,) = [p.parent for p in (root / "runs").glob("*/run.json")]
    return out, run_dir


def test_main_job_verdict_is_the_worst_checked_status_not_skip(default_run):
    out, run_dir = default_run
    records = RunDir(run_dir).records()
    statuses = [r["status"] for r in records]
    if "skip" not in statuses:
        pytest.skip("every backend diag knows is present here: no skip records")
    checked = [s for s in statuses if s != "skip"]
    assert checked, out.stderr
    expected = max(checked, key=("pass", "warn", "fail", "error").index)
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["verdict"] == expected
    html = (run_dir / "report.html").read_text()
    assert f'data-verdict="{expected}"' in html and "nothing was checked" not in html


# --- output for a person and a CI log ----------------------------------------------------------

def test_without_a_terminal_progress_is_one_stderr_line_per_record_and_summary_is_stdout(
        default_run):
    out, run_dir = default_run
    records = RunDir(run_dir).records()
    progress = [ln for ln in out.stderr.splitlines() if re.match(r"diag run: \[\d+/\d+\] ", ln)]
    assert len(progress) == len(records)
    for line, rec in zip(progress, records):
        assert f" {rec['backend']} {rec['probe']} {rec['case']}" in line
        assert f": {rec['status']} (" in line
    assert "diag run:" not in out.stdout
    assert "diag: results" in out.stdout and f"run folder: {run_dir}" in out.stdout


def test_without_a_terminal_tables_are_not_wrapped_at_80_columns(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(MARKUP_SUITE)
    out = run_diag("run", "--suite", str(suite), "--backend", EMU, "--out",
                   str(tmp_path / "runs"), "--repeats", "1", "--no-report",
                   env={"COLUMNS": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    records = RunDir(next((tmp_path / "runs").glob("*"))).records()
    warned = [r for r in records if r["status"] == "warn"]
    assert warned, "emu-bf16x3 keeps a float32 bound on no 8-term dot product"
    for rec in warned:  # each reason is longer than 80 columns and sits whole on one line
        assert len(rec["reason"]) > 80
        assert any(rec["reason"] in line for line in out.stdout.splitlines())


def test_summary_leads_with_the_bound_ratio_and_shows_no_ulp_beside_it(default_run):
    out, run_dir = default_run
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in out.stdout.splitlines()
            if ln.startswith("│")]
    header = next(ln for ln in out.stdout.splitlines() if ln.startswith("┃"))
    cols = [c.strip() for c in header.split("┃")[1:-1]]
    assert cols[:6] == ["probe", "backend", "dtype", "verdict", "bound ratio", "ULP"]
    groups: dict = {}
    for r in RunDir(run_dir).records():
        if r["status"] != "skip":
            groups.setdefault((r["probe"].split(".", 1)[-1], r["backend"], r["dtype"]),
                              []).append(r)
    summary = [r for r in rows if len(r) == len(cols)][:len(groups)]
    assert len(summary) == len(groups)
    for row in summary:
        recs = groups[tuple(row[:3])]
        ratios = [r["metrics"]["bound_ratio"] for r in recs
                  if isinstance(r["metrics"].get("bound_ratio"), (int, float))]
        if ratios:
            assert row[4] == f"{max(ratios):.3g}" or row[4] == str(max(ratios))
            assert row[5] == "—"


def test_ulp_is_shown_where_no_bound_applies():
    from diag import render

    recs = [_rec("warn", probe="s.greedy", backend="a|b", dtype="bfloat16",
                 metrics={"max_ulp_between": 3}).to_json(),
            _rec("pass", probe="s.mm", backend="x", dtype="float32",
                 metrics={"bound_ratio": 0.5, "max_ulp": 1418371}).to_json()]
    table = render.summary_table(recs)
    cells = {c.header: list(c.cells) for c in table.columns}
    assert cells["ULP"] == ["3", "—"] and cells["bound ratio"] == ["—", "0.5"]


# --- probe names are text, not markup -----------------------------------------------------------

def test_probe_names_with_brackets_print_as_written(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(MARKUP_SUITE)
    out = run_diag("run", "--suite", str(suite), "--backend", EMU, "--out",
                   str(tmp_path / "runs"), "--repeats", "1", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "[/oops] x" in out.stdout and "attn[heads]" in out.stdout
    assert "markup.attn[heads]" in out.stderr  # the progress line names it too


# --- `diag report` on damaged run folders -------------------------------------------------------

def _damage_lines(path: Path, numbers: list[int]) -> None:
    lines = path.read_text().splitlines(keepends=True)
    for n in numbers:
        lines[n - 1] = lines[n - 1][: len(lines[n - 1]) // 2] + "\n"  # cut mid-record
    path.write_text("".join(lines))


def test_report_counts_unreadable_lines_and_exits_2(tmp_path):
    run = _run_folder(tmp_path, [_rec("pass"), _rec("fail"), _rec("pass", case="c2"),
                                 _rec("fail", case="c3"), _rec("pass", case="c4")])
    _damage_lines(run.results_jsonl, [2, 4])  # exactly the two failures
    out = run_diag("report", str(run.path), timeout=60)
    assert out.returncode == 2
    assert f"diag: report: {run.path / 'report.html'}" in out.stdout
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "2 line(s)" in err[0] and "(line 2, 4)" in err[0]
    html = (run.path / "report.html").read_text()
    assert 'id="damage"' in html and "2 line(s) of" in html
    assert "No failures or errors." not in html
    assert "readable records only" in html


def test_report_tolerates_and_mentions_a_torn_last_line(tmp_path):
    run = _run_folder(tmp_path, [_rec("pass"), _rec("fail")])
    text = run.results_jsonl.read_text()
    run.results_jsonl.write_text(text + text.splitlines()[0][:40])  # a write cut short
    out = run_diag("report", str(run.path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "line 3" in out.stderr and "torn" in out.stderr
    html = (run.path / "report.html").read_text()
    assert "torn" in html and 'data-verdict="fail"' in html


def test_truncated_run_json_is_one_line_exit_2(tmp_path):
    run = _run_folder(tmp_path, [_rec("pass")])
    text = run.run_json.read_text()
    run.run_json.write_text(text[: len(text) // 2])
    line = _one_error_line(run_diag("report", str(run.path), timeout=60), 2)
    assert line.startswith(f"diag: {run.run_json}: not valid JSON")


def test_report_out_to_an_unwritable_path_is_one_line_exit_2(tmp_path):
    run = _run_folder(tmp_path, [_rec("pass")])
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a folder must be: unwritable even for root
    target = blocker / "r.html"
    line = _one_error_line(run_diag("report", str(run.path), "--out", str(target),
                                    timeout=60), 2)
    assert line.startswith(f"diag: cannot write the report to '{target}'")


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_run_json_follows_the_umask_like_the_other_files(tmp_path, umask):
    suite = tmp_path / "s.toml"
    suite.write_text(MARKUP_SUITE)
    old = os.umask(umask)
    try:
        out = run_diag("run", "--suite", str(suite), "--backend", EMU, "--out",
                       str(tmp_path / "runs"), "--repeats", "1", timeout=120)
    finally:
        os.umask(old)
    assert out.returncode == 0, out.stderr
    (run_dir,) = list((tmp_path / "runs").glob("*"))
    mode = (run_dir / "run.json").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask
    assert mode == (run_dir / "results.jsonl").stat().st_mode & 0o777
    assert not list(run_dir.glob(".run.json.*"))


# --- SIGTERM ----------------------------------------------------------------------------------

def test_sigterm_is_treated_like_ctrl_c_exit_143(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(MARKUP_SUITE)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmpdir),
           "DIAG_WORKER_FAULT": "hang@c0001"}  # the second case hangs until killed
    proc = subprocess.Popen([diag_script(), "run", "--suite", str(suite), "--backend", EMU,
                             "--out", str(tmp_path / "runs"), "--repeats", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline, results = time.time() + 120, None
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("*/results.jsonl"))
        if found and found[0].read_text().strip():
            results = found[0]
            break
        time.sleep(0.1)
    assert results is not None, "no record appeared"
    run_id = results.parent.name
    assert list(tmpdir.glob(f"diag-{run_id}-*")), "the run's temp folder is where we look"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert f"diag: terminated (SIGTERM); 1 finished record(s) kept in" in err
    assert "Traceback" not in err
    meta = json.loads((results.parent / "run.json").read_text())
    assert meta["state"] == "interrupted"
    assert not list(tmpdir.glob(f"diag-{run_id}-*"))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"diag-{run_id}" not in ps  # the hung worker did not outlive the run


# --- the documented library names ---------------------------------------------------------------

def _documented_names() -> list[str]:
    """Every `diag.<name>[.<name>...]` the README and docs/ mention, schema ids and
    `python -m` module paths left out."""
    texts = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    names = set()
    for path in texts:
        text = path.read_text()
        for m in re.finditer(r"(?<![\w./-])diag(?:\.[A-Za-z_]\w*)+(?![\w/])", text):
            before = text[max(0, m.start() - 10):m.start()]
            if "-m " in before:
                continue
            names.add(m.group(0).rstrip("."))
    return sorted(names)


def test_every_documented_name_works_after_import_diag_without_a_framework():
    # diag.settings.environment: what a run happened in (RunMeta), named by the issue that found it
    # missing; the rest is read from the docs, so a newly documented name is checked too.
    names = sorted(set(_documented_names()) | {"diag.settings.environment.collect"})
    assert {"diag.nodes.scan", "diag.nan.locate", "diag.oracle.matmul", "diag.run"} <= set(names)
    script = f"""
import sys, diag
loaded = [m for m in ("jax", "torch", "torch_xla") if m in sys.modules]
assert not loaded, f"import diag loaded {{loaded}}"
missing = []
for dotted in {names!r}:
    obj = diag
    try:
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
    except AttributeError as e:
        missing.append(f"{{dotted}}: {{e}}")
assert not missing, missing
loaded = [m for m in ("jax", "torch", "torch_xla") if m in sys.modules]
assert not loaded, f"touching the documented names loaded {{loaded}}"
print(len({names!r}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(names))
