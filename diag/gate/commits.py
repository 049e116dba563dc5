"""Bisection over the commits of the user's repository (`diag bisect --git GOOD..BAD
FILE.py:FUNCTION`): the user's function run at each tried commit.

Each commit is checked out in a worktree of its own (`git worktree add --detach`) in a
temporary folder, never in the user's: their checkout, index and branch stay as they are,
and every worktree is removed when the step ends, whatever happens. The function runs in a
fresh `diag run` process per commit, from that worktree, so a module the function imports
from the repository is that commit's (one process would keep the first commit's modules).

A dirty repository is refused: the function would run at the commits as committed, not as
the user sees it, and a bisection that ignores uncommitted edits names the wrong commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from diag.gate.bisect import BisectError, Observation, observation

__all__ = ["commit_range", "observer", "repository", "subject"]


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=120, check=False
        )
    except FileNotFoundError:
        raise BisectError("git is not installed: --git needs it") from None


def repository(file: str) -> tuple[Path, str]:
    """(the repository holding `file`, the file's path inside it).

    Raises:
      BisectError: the file is not in a git repository, or the repository is dirty.
    """
    path = Path(file).resolve()
    if not path.is_file():
        raise BisectError(f"{file}: no such file")
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise BisectError(f"{file}: not in a git repository; --git bisects a repository's commits")
    repo = Path(top.stdout.strip())
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    if dirty.stdout.strip():
        first = dirty.stdout.strip().splitlines()[0]
        raise BisectError(
            f"{repo}: the repository has uncommitted changes ({first.strip()}, ...); "
            "commit or stash them first: the function runs at each commit as committed"
        )
    return repo, str(path.relative_to(repo))


def commit_range(repo: Path, spec: str) -> list[str]:
    """The commits of `GOOD..BAD`: GOOD, then each commit on the path from it to BAD, oldest
    first (abbreviated to 12 hex digits).

    Raises:
      BisectError: not GOOD..BAD, an unknown commit, or GOOD not an ancestor of BAD.
    """
    good, sep, bad = spec.partition("..")
    if not sep or not good or not bad:
        raise BisectError(f"--git expects GOOD..BAD (two commits), got {spec!r}")
    ends = []
    for end in (good, bad):
        r = _git(repo, "rev-parse", "--verify", "--quiet", f"{end}^{{commit}}")
        if r.returncode != 0:
            raise BisectError(f"--git {spec}: {end!r} is not a commit of {repo}")
        ends.append(r.stdout.strip())
    if _git(repo, "merge-base", "--is-ancestor", ends[0], ends[1]).returncode != 0:
        raise BisectError(f"--git {spec}: {good} is not an ancestor of {bad}")
    path = _git(repo, "rev-list", "--reverse", "--ancestry-path", f"{ends[0]}..{ends[1]}")
    return [c[:12] for c in (ends[0], *path.stdout.split())]


def subject(repo: Path, commit: str) -> str:
    """A commit's one-line subject, as `git log --oneline` shows it."""
    return _git(repo, "log", "-1", "--format=%s", commit).stdout.strip()


def observer(
    repo: Path,
    rel: str,
    function: str,
    backends: list[str] | None,
    out: Path,
    log: Callable[[str], None] = print,
) -> Callable[[str, list[str] | None], Observation]:
    """`observe(commit, keys)` for `diag.gate.bisect.bisect`: `diag run FILE.py:FUNCTION` in
    a worktree of `repo` at that commit (its records in a run folder under `out`)."""
    out = out.resolve()  # the child runs in the worktree, which goes when the step ends

    def observe(commit: str, keys: list[str] | None) -> Observation:
        tmp = Path(tempfile.mkdtemp(prefix="diag-bisect-"))
        tree = tmp / commit[:12]
        added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
        try:
            if added.returncode != 0:
                raise BisectError(f"cannot check out {commit[:12]}: {added.stderr.strip()}")
            if not (tree / rel).is_file():
                raise BisectError(f"{rel} does not exist at commit {commit[:12]}")
            log(f"diag bisect: commit {commit[:12]}: running {rel}:{function}")
            cmd = [sys.executable, "-m", "diag.cli", "run", f"{rel}:{function}"]  # cwd: tree
            cmd += ["--json", "--no-report", "-o", str(out)]
            cmd += [f"--backend={b}" for b in backends or []]
            proc = subprocess.run(
                cmd, cwd=tree, capture_output=True, text=True, env=_env(), check=False
            )
            try:
                data = json.loads(proc.stdout)
            except json.JSONDecodeError:
                why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise BisectError(f"at commit {commit[:12]}: `diag run` failed: {why}") from None
            return observation(commit[:12], data.get("records") or [], data.get("run_dir") or "")
        finally:
            _git(repo, "worktree", "remove", "--force", str(tree))
            _git(repo, "worktree", "prune")
            shutil.rmtree(tmp, ignore_errors=True)

    return observe


def _env() -> dict[str, str]:
    """This environment, with diag's own checkout first on PYTHONPATH (the child must run the
    same diag, installed or not)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
