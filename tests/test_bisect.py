"""Bisection names the first release or commit where records change: the search finds a
planted change in at most ceil(log2 N) + 2 runs, says when the bad end changed again, and
refuses what it cannot do (ends that do not differ, an unknown version or commit, a release
that does not install, a dirty repository) in one line with exit 2, leaving nothing behind.
Each expected answer is planted by the test, or decided by running the record under each
release here.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from conftest import run_diag
from diag.gate import releases
from diag.gate.bisect import BisectError, Observation, bisect, max_runs

# --- the search, with points whose outputs the test plants -----------------------------------


def _observer(states: list[str], calls: list):
    def observe(point: str, keys):
        calls.append((point, keys))
        i = int(point)
        return Observation(point, {"r | c | b": ("pass", (states[i],)), "s | c | b": ("pass", ("x",))})

    return observe


@pytest.mark.parametrize("n", range(2, 18))
def test_a_single_change_is_found_at_every_position_within_the_run_budget(n):
    for at in range(1, n):
        calls: list = []
        states = ["a"] * at + ["b"] * (n - at)
        found = bisect([str(i) for i in range(n)], _observer(states, calls))
        assert found.first_bad == str(at) and found.last_good == str(at - 1)
        assert found.changed == ["r | c | b"] and found.later == []
        assert len(calls) <= math.ceil(math.log2(n)) + 2 == max_runs(n)
        # Both ends ran every record; every later step ran only the differing one.
        assert [k for _, k in calls[:2]] == [None, None]
        assert all(k == ["r | c | b"] for _, k in calls[2:])


def test_a_record_that_changes_twice_names_the_first_change_and_the_second():
    calls: list = []
    found = bisect([str(i) for i in range(9)], _observer(list("aaaabbbcc"), calls))
    assert found.first_bad == "4"
    assert found.later == ["r | c | b"]
    assert "as at the bad end" not in " ".join(s.evidence[0] for s in found.steps if s.point == "4")


def test_ends_that_do_not_differ_are_refused():
    with pytest.raises(BisectError, match="no record differs between 0 and 3"):
        bisect(["0", "1", "2", "3"], _observer(list("aaaa"), []))


def test_a_record_that_errors_at_a_step_stops_the_search():
    from diag.gate.bisect import observation

    with pytest.raises(BisectError, match="did not run"):
        observation("0.10.1", [{"probe": "p", "case": "c", "backend": "b", "status": "error",
                                "reason": "worker crashed"}])


# --- releases: the versions between the ends, and what does not install --------------------


def test_the_releases_between_the_ends_are_ordered_from_good_to_bad():
    versions = ["0.9.0", "0.10.0", "0.10.1", "0.10.2", "0.11.0"]
    assert releases.between("jax", versions, "0.10.0", "0.10.2") == ["0.10.0", "0.10.1", "0.10.2"]
    assert releases.between("jax", versions, "0.11.0", "0.10.1") == ["0.11.0", "0.10.2", "0.10.1"]
    with pytest.raises(BisectError, match="--good 0.10.7: jax has no such release"):
        releases.between("jax", versions, "0.10.7", "0.10.2")


def test_a_release_that_does_not_install_leaves_nothing(tmp_path):
    with pytest.raises(BisectError, match="jax==0.0.999 does not install"):
        releases.environment("jax", "0.0.999", root=tmp_path, log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_version_is_one_line_and_exit_2(tmp_path):
    r = run_diag("bisect", "--package", "jax", "--good", "0.0.999", "--bad", "0.10.2",
                 "-o", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("diag:")]
    assert len(lines) == 1 and "0.0.999" in lines[0]
    assert not (Path(tmp_path / "gt-cache") / "venvs").exists()


def test_workers_under_another_python_import_this_checkout_of_diag():
    """A release's environment has no diag installed: its workers find this checkout (and
    its probes) through PYTHONPATH."""
    import os

    from diag.worker.host import worker_env

    first = Path(worker_env({})["PYTHONPATH"].split(os.pathsep)[0])
    assert (first / "diag" / "__init__.py").is_file()
    assert (first / "probes" / "__init__.py").is_file()


# --- commits: a repository the test makes, a change planted at a known commit -----------------

FN = """import numpy as np
import jax.numpy as jnp

SCALE = {scale}


def fn(x):
    return jnp.tanh(x) * SCALE


def make():
    return fn, (np.linspace(-3, 3, 256, dtype=np.float32),)
"""


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                               "PATH": "/usr/bin:/bin"}).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """Six commits; the function's output changes at commit 3 (SCALE 1.0 -> 1 + 2**-10),
    the others change only a note."""
    root = tmp_path_factory.mktemp("repo") / "proj"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    commits = []
    for i in range(6):
        (root / "f.py").write_text(FN.format(scale="1.0" if i < 3 else "1.0 + 2**-10"))
        (root / "NOTES").write_text(f"note {i}\n")
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "-m", f"commit {i}")
        commits.append(_git(root, "rev-parse", "HEAD"))
    return root, commits


def test_git_bisect_names_the_planted_commit_and_leaves_the_checkout_alone(repo, tmp_path):
    root, commits = repo
    r = run_diag("bisect", "--git", f"{commits[0]}..{commits[5]}", "f.py:make", "-b", "jax-cpu",
                 "--json", "-o", str(tmp_path / "out"), cwd=root)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["first_bad"] == commits[3][:12] and found["last_good"] == commits[2][:12]
    assert found["runs"] <= math.ceil(math.log2(6)) + 2
    assert found["changes_again_later"] == []
    assert _git(root, "rev-parse", "HEAD") == commits[5]
    assert _git(root, "status", "--porcelain") == ""
    assert len(_git(root, "worktree", "list").splitlines()) == 1


def test_a_dirty_repository_is_refused(repo, tmp_path):
    root, commits = repo
    (root / "f.py").write_text(FN.format(scale="2.0"))
    try:
        r = run_diag("bisect", "--git", f"{commits[0]}..{commits[5]}", "f.py:make", cwd=root,
                     env={"DIAG_CACHE_DIR": str(tmp_path)})
    finally:
        _git(root, "checkout", "--", "f.py")
    assert r.returncode == 2
    assert r.stderr.startswith("diag: ") and "uncommitted changes" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spec, words", [
    ("{0}", "expects GOOD..BAD"),
    ("{0}..nosuchcommit", "'nosuchcommit' is not a commit"),
    ("{5}..{0}", "is not an ancestor of"),
])
def test_a_bad_range_is_one_line_and_exit_2(repo, spec, words):
    root, commits = repo
    r = run_diag("bisect", "--git", spec.format(*commits), "f.py:make", cwd=root)
    assert r.returncode == 2 and words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_commits_whose_function_does_not_change_are_refused(repo, tmp_path):
    root, commits = repo
    r = run_diag("bisect", "--git", f"{commits[0]}..{commits[2]}", "f.py:make", "-b",
                 "jax-cpu", "-o", str(tmp_path), cwd=root)
    assert r.returncode == 2 and "no record differs between" in r.stderr
    assert len(_git(root, "worktree", "list").splitlines()) == 1


# --- a real bisection across jax releases ---------------------------------------------------


def _softmax_records(python: str, out: Path) -> dict:
    r = run_diag("run", "--suite", "ci", "-b", "jax-cpu", "--python", f"jax={python}",
                 "--json", "--no-report", "-o", str(out), timeout=900)
    recs = json.loads(r.stdout)["records"]
    return {(x["probe"], x["case"]): (x["status"], x["metrics"]["output_digests"])
            for x in recs if x["probe"] == "ci.softmax_bf16"}


@pytest.mark.slow
def test_a_real_bisection_names_the_jax_release_where_softmax_bits_change(tmp_path):
    r = run_diag("bisect", "--package", "jax", "--good", "0.10.0", "--bad", "0.10.2",
                 "--record", "softmax_bf16", "--json", "-o", str(tmp_path / "out"),
                 timeout=1800)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["points"] == ["0.10.0", "0.10.1", "0.10.2"]
    assert found["runs"] <= max_runs(3)
    # Decided here: the whole ci suite under each release, its softmax_bf16 records compared.
    seen = {}
    for v in found["points"]:
        python = releases.venv_folder("jax", v, tmp_path / "gt-cache" / "venvs") / "bin/python"
        got = subprocess.run([str(python), "-c", "import jax; print(jax.__version__)"],
                             capture_output=True, text=True).stdout.strip()
        assert got == v
        seen[v] = _softmax_records(str(python), tmp_path / "runs")
    first = next(v for v in found["points"][1:] if seen[v] != seen["0.10.0"])
    assert found["first_bad"] == first
    changed = sorted(f"{p} | {c} | jax-cpu" for (p, c) in seen[first]
                     if seen[first][(p, c)] != seen["0.10.0"][(p, c)])
    assert found["changed"] == changed
    again = sorted(f"{p} | {c} | jax-cpu" for (p, c) in seen[first]
                   if seen[first][(p, c)] != seen["0.10.2"][(p, c)])
    assert found["changes_again_later"] == again


@pytest.mark.parametrize("args, words", [
    (["--package", "jax"], "needs --package P --good V --bad W"),
    (["--package", "numpy", "--good", "1", "--bad", "2"], "diag bisects jax, torch, torch-xla"),
    (["--git", "a..b"], "--git needs FILE.py:FUNCTION"),
])
def test_bad_usage_is_one_line_and_exit_2(tmp_path, args, words):
    r = run_diag("bisect", *args, "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_lists_history_and_bisect():
    out = run_diag("--help").stdout
    assert "history" in out and "bisect" in out
