"""A history says since when a record moved: the first run where it crossed its allowance or
its output bits changed, and what differed in the environment between the last good run and
the first bad one. Each expected answer is decided here from the run folders' own records (or
from records written by hand), not from diag's history code.
"""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from conftest import run_diag
from diag.gate import history as hist
from diag.gate import series

SMALL = """
[suite]
name = "small"
seed = 20261123

# The ci suite's bf16 softmax draw: excess precision shows in its bits on jax-cpu 0.10.2.
[[probe]]
name = "softmax_bf16"
op = "softmax"
inputs = "normal"
dtypes = ["bfloat16"]
shapes = [[16, 4096]]
"""

FLAG = "--xla_allow_excess_precision=false"


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def real_history(tmp_path_factory):
    """Four real `diag run --history` runs of a small suite; XLA_FLAGS changes from run 3."""
    tmp = tmp_path_factory.mktemp("hist")
    (tmp / "small.toml").write_text(SMALL)
    db, dirs = tmp / "h.db", []
    env = {"DIAG_CACHE_DIR": str(tmp / "cache")}
    for flags in ("", "", FLAG, FLAG):
        r = run_diag("run", "--suite", str(tmp / "small.toml"), "-b", "jax-cpu", "-o",
                     str(tmp / "runs"), "--history", str(db), "--json",
                     env={**env, "XLA_FLAGS": flags})
        assert r.returncode in (0, 1), r.stderr
        assert "history: run #" in r.stderr  # with --json the line goes to stderr
        dirs.append(Path(json.loads(r.stdout)["run_dir"]))
    return {"db": db, "dirs": dirs, "env": env}


def test_the_first_changed_run_and_the_setting_are_named(real_history):
    db, dirs = real_history["db"], real_history["dirs"]
    # Decided from the records: the first run whose output bits or status differ from run 1's.
    sig = [[(r["status"], tuple(r["metrics"]["output_digests"])) for r in _records(d)]
           for d in dirs]
    first = next((i for i in range(1, 4) if sig[i] != sig[i - 1]), None)
    r = run_diag("history", str(db), "--json")
    data = json.loads(r.stdout)
    assert [run["run_id"] for run in data["runs"]] == [d.name for d in dirs]
    (rec,) = data["records"]
    if first is None:  # the flag did not change these bits on this machine: nothing moved
        assert r.returncode == 0 and rec["changes"] == []
        return
    assert first == 2, "the flag was set from run 3 on; an earlier change is not the flag's"
    assert r.returncode == 1
    change = rec["changes"][0]
    assert change["first_bad_run_id"] == dirs[2].name
    assert change["last_good_run_id"] == dirs[1].name
    names = {e["name"]: e["after"] for e in change["environment"]}
    assert names["settings: env XLA_FLAGS"] == FLAG
    assert len(rec["changes"]) == 1  # runs 3 and 4 have the same flag and bits
    text = run_diag("history", str(db)).stdout
    assert f"first moved in run #3 ({dirs[2].name}" in text
    assert f"settings: env XLA_FLAGS: unset -> {FLAG}" in text


def test_the_report_of_the_changed_run_plots_the_series(real_history):
    dirs = real_history["dirs"]
    if not (dirs[2] / "history.json").exists():
        pytest.skip("nothing moved on this machine (see the test above)")
    (s,) = json.loads((dirs[2] / "history.json").read_text())
    assert s["changes"] == [3] and [p[0] for p in s["points"]] == [1, 2, 3]
    html = (dirs[2] / "report.html").read_text()
    assert 'id="history"' in html and "<svg" in html and 'class="change"' in html
    assert not (dirs[0] / "history.json").exists()  # nothing had moved by run 1


def test_check_with_history_and_html_plots_drifted_records(real_history, tmp_path):
    dirs, db = real_history["dirs"], real_history["db"]
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(dirs[0]), "-o", str(base)).returncode == 0
    html = tmp_path / "d.html"
    r = run_diag("check", str(dirs[3]), "--baseline", str(base), "--history", str(db),
                 "--html", str(html))
    assert f"history: run #4 was already in {db}" in r.stdout  # one copy per run
    # A record that drifted from run 1 to run 4 moved in the history too (the flag changed
    # between): the drift view plots its series; with no drift there is nothing to plot.
    page = html.read_text()
    assert ('id="history"' in page) == (r.returncode == 1)
    if r.returncode == 1:
        assert "small.softmax_bf16 | 16x4096 bfloat16 normal | jax-cpu" in page
        assert page.count('class="change"') == 1


# --- histories written by hand: the drift rule, the filters, bad input --------------------------


def _run_folder(root, n, *, ratio, digest, status="pass", flags=""):
    d = root / f"run{n:03d}"
    d.mkdir(parents=True)
    meta = {"run_id": d.name, "state": "finished", "started": 1e9 + n,
            "suite": {"name": "hand"},
            "environment": {"machine": "x86_64", "packages": {"jax": "0.10.2"},
                            "env": {"XLA_FLAGS": flags}, "git_revision": f"c{n}"},
            "backends": {"jax-cpu": {"framework": {"name": "jax", "version": "0.10.2"}}}}
    (d / "run.json").write_text(json.dumps(meta))
    recs = [{"probe": "hand.mm", "case": "8x8 float32", "backend": "jax-cpu", "op": "matmul",
             "dtype": "float32", "status": status, "kind": "probe",
             "metrics": {"bound_ratio": ratio, "output_digests": [digest]}},
            {"probe": "hand.sm", "case": "4x4 float32", "backend": "jax-cpu", "op": "softmax",
             "dtype": "float32", "status": "pass", "kind": "probe",
             "metrics": {"bound_ratio": 0.1, "output_digests": ["a" * 64]}}]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_a_ratio_inside_its_allowance_is_not_a_move_and_a_crossing_is(tmp_path):
    db = tmp_path / "h.db"
    # bound_ratio 0.2 -> 0.9 stays within 1 (no move); 0.9 -> 1.3 crosses it (a move).
    for n, ratio in enumerate([0.2, 0.9, 1.3, 1.3], 1):
        hist.append(db, _run_folder(tmp_path, n, ratio=ratio, digest="b" * 64))
    found = series.read(db, record="hand.mm")
    (s,) = found.series
    assert [c.after.run for c in s.changes] == [3]
    assert [d.what for d in s.changes[0].drifts] == ["bound_ratio"]
    assert ("code: git commit", "c2", "c3") in s.changes[0].environment
    assert s.values("bound_ratio") == [(1, 0.2), (2, 0.9), (3, 1.3), (4, 1.3)]


def test_bits_that_change_twice_are_two_changes(tmp_path):
    db = tmp_path / "h.db"
    for n, digest in enumerate(["b", "b", "c", "c", "b"], 1):
        hist.append(db, _run_folder(tmp_path, n, ratio=0.5, digest=digest * 64,
                                    flags="--x" if digest == "c" else ""))
    (s,) = series.read(db, record="hand.mm").series
    assert [(c.before.run, c.after.run) for c in s.changes] == [(2, 3), (4, 5)]
    assert s.changes[0].environment[-1] == ("settings: env XLA_FLAGS", "", "--x")
    (steady,) = series.read(db, record="hand.sm").series
    assert steady.changes == []


def test_appending_a_run_twice_keeps_one_copy(tmp_path):
    db, d = tmp_path / "h.db", _run_folder(tmp_path, 1, ratio=0.5, digest="b" * 64)
    assert hist.append(db, d) == (1, True)
    assert hist.append(db, d) == (1, False)
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM records").fetchone() == (2,)


def _append_many(args):
    db, folders = args
    for f in folders:
        hist.append(db, f)


def test_two_writers_at_once_lose_nothing(tmp_path):
    db = tmp_path / "h.db"
    folders = [_run_folder(tmp_path, n, ratio=0.5, digest="b" * 64) for n in range(40)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_append_many, [(db, folders[0::2]), (db, folders[1::2])])
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM runs").fetchone() == (40,)
    assert con.execute("SELECT COUNT(*) FROM records").fetchone() == (80,)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_the_cli_filters_by_record_and_metric(tmp_path):
    db = tmp_path / "h.db"
    for n, ratio in enumerate([0.2, 1.5], 1):
        hist.append(db, _run_folder(tmp_path, n, ratio=ratio, digest="b" * 64))
    r = run_diag("history", str(db), "--record", "hand.sm", "--metric", "bound_ratio")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "steady: hand.sm | 4x4 float32 | jax-cpu" in r.stdout
    assert "bound_ratio: #1 0.1, #2 0.1" in r.stdout
    r = run_diag("history", str(db))
    assert r.returncode == 1
    assert "first moved in run #2 (run002" in r.stdout
    assert "bound_ratio 0.2 -> 1.5 (crossed its allowance 1" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--record", "nothing-like-this"], "no record's key contains 'nothing-like-this'"),
    (["--metric", "no_such_metric"], "no record here has metric 'no_such_metric'"),
])
def test_a_filter_that_matches_nothing_is_one_line_and_exit_2(tmp_path, args, words):
    db = tmp_path / "h.db"
    hist.append(db, _run_folder(tmp_path, 1, ratio=0.5, digest="b" * 64))
    r = run_diag("history", str(db), *args)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("diag: ") and words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("content", [None, b"not a database at all" * 100, "sqlite-other"])
def test_a_file_that_is_not_a_history_is_exit_2(tmp_path, content):
    db = tmp_path / "h.db"
    if content == "sqlite-other":
        sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.commit()
    elif content is not None:
        db.write_bytes(content)
    r = run_diag("history", str(db))
    assert r.returncode == 2
    assert r.stderr.startswith("diag: ") and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("other", ["bytes", "sqlite"])
def test_appending_to_a_file_that_is_not_a_history_keeps_the_verdict(tmp_path, other):
    d = _run_folder(tmp_path, 1, ratio=0.5, digest="b" * 64)
    bad = tmp_path / "bad.db"
    if other == "bytes":
        bad.write_bytes(b"x" * 4096)
    else:  # another program's database: left exactly as it was
        con = sqlite3.connect(bad)
        con.execute("CREATE TABLE t (x)")
        con.commit()
        con.close()
    before = bad.read_bytes()
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(d), "-o", str(base)).returncode == 0
    r = run_diag("check", str(d), "--baseline", str(base), "--history", str(bad))
    assert r.returncode == 2  # the verdict was 0; the history could not be written
    assert "no drift" in r.stdout and "diag: " in r.stderr
    assert "not a diag history" in r.stderr
    assert bad.read_bytes() == before
