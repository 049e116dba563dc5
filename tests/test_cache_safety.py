"""The ground-truth cache can never change a verdict, stop a run, or delete a user's files.

Claims, each through the real `diag` script or the library call a user makes:
* a cache that cannot be written (DIAG_CACHE_DIR beneath a regular file, or a HOME where
  ``~/.cache`` cannot be created: both fail for root too, unlike chmod) is one warning line on
  stderr, once per process, and the run gives the same verdicts as with a working cache;
* `diag cache clear` refuses (exit 2, one line) a folder diag did not mark as its cache, and in
  a marked one deletes only diag's entry files;
* a flipped byte in an entry is caught by its checksum: the next read recomputes and returns the
  right truth (and the run's verdicts are those of a clean cache);
* cache files follow the umask (not mkstemp's 0600).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

import diag.oracle as oracle
from diag.numerics import bits_view
from diag.oracle.cache import MARKER, GroundTruthCache, NotACache
from tests.conftest import assert_bits_equal, run_diag

SUITE = """
[suite]
name = "cachecheck"
seed = 3

[[probe]]
name = "mm"
op = "matmul"
dtypes = ["float32", "bfloat16"]
shapes = [[8, 16, 8], [4, 4, 4]]
"""
# numpy emulation: a real backend worker that needs no framework and is deterministic.
BACKEND = "emu-bf16x1"


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "cachecheck.toml"
    path.write_text(SUITE)
    return str(path)


def _run(suite, out, env):
    proc = run_diag("run", "--suite", suite, "--backend", BACKEND, "--no-report", "--json",
                    "--out", str(out), env=env, timeout=120)
    data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    assert data is not None, proc.stdout + proc.stderr
    return proc, data


def _verdicts(data):
    """What a run concluded, per record: comparable across runs (no timings, no cache flag)."""
    return sorted((r["probe"], r["case"], r["status"], r["reason"],
                   json.dumps(r["metrics"], sort_keys=True)) for r in data["records"])


def _cache_warnings(stderr):
    return [line for line in stderr.splitlines() if "ground-truth cache" in line]


def _entries(root: Path):
    return sorted(p for p in root.glob("??/*") if p.suffix in (".npy", ".json"))


# --- unwritable cache: warn once, go on uncached ---------------------------------------------

def test_run_with_cache_dir_beneath_a_file_warns_once_and_gives_the_same_verdicts(
        tmp_path, suite):
    good, good_data = _run(suite, tmp_path / "a", {"DIAG_CACHE_DIR": str(tmp_path / "ok")})
    assert _entries(tmp_path / "ok"), "the writable cache was not used"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad, bad_data = _run(suite, tmp_path / "b", {"DIAG_CACHE_DIR": str(blocker / "cache")})
    assert bad.returncode == good.returncode, bad.stderr
    warnings = _cache_warnings(bad.stderr)
    assert len(warnings) == 1, bad.stderr  # 4 cases, one line
    assert warnings[0].startswith(f"diag: ground-truth cache {blocker / 'cache'} is not "
                                  "writable") and "going on uncached" in warnings[0]
    assert "Traceback" not in bad.stderr
    assert _verdicts(bad_data) == _verdicts(good_data)
    assert not any(r["oracle"]["cache_hit"] for r in bad_data["records"])
    assert bad_data["state"] == "finished"


def test_run_with_a_home_where_dot_cache_cannot_be_created_goes_on_uncached(
        tmp_path, suite, monkeypatch):
    monkeypatch.delenv("DIAG_CACHE_DIR")  # the default ~/.cache/diag/oracle is under test
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    proc, data = _run(suite, tmp_path / "runs", {"HOME": str(home)})
    warnings = _cache_warnings(proc.stderr)
    assert len(warnings) == 1 and str(home / ".cache" / "diag" / "oracle") in warnings[0], \
        proc.stderr
    assert proc.returncode == data["exit_code"] and data["state"] == "finished"
    assert len(data["records"]) == 4


def test_unwritable_cache_is_logged_once_per_folder_and_process(tmp_path, caplog):
    blocker = tmp_path / "f"
    blocker.write_text("")
    a = np.eye(3, dtype=np.float32)
    caplog.set_level(logging.WARNING, logger="diag.oracle.cache")
    results = [oracle.matmul_result(a, a * k, cache=GroundTruthCache(blocker / "c"))
               for k in (1, 2, 3)]  # three cache objects, one folder
    assert [r.cache_hit for r in results] == [False] * 3
    assert_bits_equal(results[1].value, oracle.matmul_result(a, a * 2).value, "uncached truth")
    lines = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert len(lines) == 1 and str(blocker / "c") in lines[0]


# --- cache clear: only diag's marked folder, only diag's files -------------------------------

def _user_folder(root: Path) -> list[Path]:
    files = [root / "configs" / "train.json", root / "data" / "embeddings.npy",
             root / "notes.txt"]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"user data " + f.name.encode())
    return files


def test_cache_clear_refuses_a_folder_diag_did_not_create(tmp_path):
    user = tmp_path / "project"
    files = _user_folder(user)
    # Even a file named exactly like an entry is not diag's without the marker.
    lookalike = user / "ab" / ("ab" + "0" * 62 + ".npy")
    lookalike.parent.mkdir()
    lookalike.write_bytes(b"user")
    proc = run_diag("cache", "clear", "--cache-dir", str(user))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"diag: {user} is not a diag cache folder")
    assert all(f.read_bytes().startswith(b"user data") for f in files + [])
    assert lookalike.exists()


def test_cache_clear_in_diags_folder_removes_only_diags_entries(tmp_path, suite):
    cache = tmp_path / "gt"
    proc, _ = _run(suite, tmp_path / "runs", {"DIAG_CACHE_DIR": str(cache)})
    entries = _entries(cache)
    assert (cache / MARKER).is_file() and len(entries) == 8, proc.stderr  # 4 cases x 2 files
    # A user's files that strayed into the cache folder, some named almost like entries.
    strays = _user_folder(cache) + [entries[0].parent / "mine.npy",
                                    entries[0].with_suffix(".txt"),
                                    cache / "golden" / "cpu-cpu" / "g.json"]
    for f in strays[3:]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"user data")
    out = run_diag("cache", "clear", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    assert f"removed {len(entries)} cached file(s)" in out.stdout + out.stderr
    assert not any(p.exists() for p in entries)
    assert all(p.read_bytes().startswith(b"user data") for p in strays)
    assert (cache / MARKER).is_file()
    info = run_diag("cache", "info", "--json", "--cache-dir", str(cache))
    assert info.returncode == 0
    assert json.loads(info.stdout)["entries"] == 0 and json.loads(info.stdout)["marked"]


def test_cache_clear_of_a_folder_that_does_not_exist_removes_nothing(tmp_path):
    proc = run_diag("cache", "clear", "--cache-dir", str(tmp_path / "never"))
    assert proc.returncode == 0 and "removed 0 cached file(s)" in proc.stdout + proc.stderr


def test_cache_info_counts_only_diags_files(tmp_path):
    user = tmp_path / "project"
    _user_folder(user)
    proc = run_diag("cache", "info", "--json", "--cache-dir", str(user))
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {"path": str(user), "marked": False, "entries": 0,
                                       "bytes": 0}


def test_writing_marks_a_new_folder_and_an_old_diag_cache_but_not_a_users_folder(tmp_path):
    a = np.eye(2, dtype=np.float32)
    new = GroundTruthCache(tmp_path / "new")
    oracle.matmul_result(a, a, cache=new)
    assert new.marked
    old = tmp_path / "old"  # what an older diag left: entry folders only, no marker
    (old / "ab").mkdir(parents=True)
    oracle.matmul_result(a, a, cache=GroundTruthCache(old))
    assert GroundTruthCache(old).marked
    user = tmp_path / "user"
    _user_folder(user)
    oracle.matmul_result(a, a, cache=GroundTruthCache(user))
    assert not GroundTruthCache(user).marked
    with pytest.raises(NotACache):
        GroundTruthCache(user).clear()


# --- checksums: a flipped byte is recomputed, never a false verdict --------------------------

def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the top byte of the last element: sign/exponent bits change the value
    path.write_bytes(bytes(data))


def test_flipped_byte_in_an_entry_is_recomputed_with_a_warning(tmp_path, caplog):
    cache = GroundTruthCache(tmp_path)
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((6, 5)).astype(np.float32),
            rng.standard_normal((5, 7)).astype(np.float32))
    first = oracle.matmul_result(a, b, cache=cache)
    (npy,) = tmp_path.rglob("*.npy")
    _flip_last_byte(npy)
    stored = np.load(npy)
    assert (stored != bits_view(first.value)).sum() == 1  # the entry now holds a wrong value
    caplog.set_level(logging.WARNING, logger="diag.oracle.cache")
    second = oracle.matmul_result(a, b, cache=cache)
    assert not second.cache_hit
    assert_bits_equal(second.value, first.value, "recomputed truth")
    assert any("failed its checksum" in r.getMessage() and str(npy) in r.getMessage()
               for r in caplog.records)
    third = oracle.matmul_result(a, b, cache=cache)  # the recomputation replaced the entry
    assert third.cache_hit
    assert_bits_equal(third.value, first.value, "rewritten entry")


def test_flipped_byte_in_an_entrys_metadata_is_a_miss(tmp_path):
    cache = GroundTruthCache(tmp_path)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    first = oracle.matmul_result(a, a.T, cache=cache)
    (meta,) = tmp_path.rglob("*.json")
    text = meta.read_text()
    assert '"fallbacks": 0' in text
    meta.write_text(text.replace('"fallbacks": 0', '"fallbacks": 1'))  # still valid JSON
    again = oracle.matmul_result(a, a.T, cache=cache)
    assert not again.cache_hit and again.fallbacks == first.fallbacks


def test_run_over_a_corrupted_cache_gives_the_verdicts_of_a_clean_one(tmp_path, suite):
    env = {"DIAG_CACHE_DIR": str(tmp_path / "gt")}
    clean, clean_data = _run(suite, tmp_path / "runs", env)
    npys = sorted((tmp_path / "gt").rglob("*.npy"))
    assert len(npys) == 4
    for p in npys:
        _flip_last_byte(p)
    again, again_data = _run(suite, tmp_path / "runs", env)
    assert again.returncode == clean.returncode
    assert _verdicts(again_data) == _verdicts(clean_data)
    assert not any(r["oracle"]["cache_hit"] for r in again_data["records"])
    assert sum("failed its checksum" in line for line in again.stderr.splitlines()) == 4
    _, third = _run(suite, tmp_path / "runs", env)
    assert all(r["oracle"]["cache_hit"] for r in third["records"])
    assert _verdicts(third) == _verdicts(clean_data)


# --- permissions: the umask decides ---------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_cache_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        cache = GroundTruthCache(tmp_path / "c")
        oracle.matmul_result(np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32),
                             cache=cache)
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "c").rglob("*") if p.is_file()]
    assert len(files) == 3  # .npy, .json, marker
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask}


def test_run_writes_cache_files_by_the_umask(tmp_path, suite):
    old = os.umask(0o002)  # the child `diag` inherits it
    try:
        proc, _ = _run(suite, tmp_path / "runs", {"DIAG_CACHE_DIR": str(tmp_path / "gt")})
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "gt").rglob("*") if p.is_file()]
    assert len(files) == 9, proc.stderr
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o664}


def test_an_unchanged_entry_is_hashed_once_per_cache_object_and_a_changed_one_again(
        tmp_path, monkeypatch, caplog):
    """A run reads each truth once per backend: the second read of an entry whose files are
    unchanged skips the sha256 pass; an entry rewritten in place since is verified again and
    its flipped byte caught."""
    import time

    import diag.oracle.cache as cache_module

    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((6, 5)).astype(np.float32),
            rng.standard_normal((5, 7)).astype(np.float32))
    first = oracle.matmul_result(a, b, cache=GroundTruthCache(tmp_path))
    hashed = []
    real = cache_module._checksum
    monkeypatch.setattr(cache_module, "_checksum",
                        lambda meta, bits: hashed.append(1) or real(meta, bits))
    cache = GroundTruthCache(tmp_path)  # a new run's cache object
    for _ in range(3):
        again = oracle.matmul_result(a, b, cache=cache)
        assert again.cache_hit
        assert_bits_equal(again.value, first.value, "cached truth")
    assert len(hashed) == 1
    time.sleep(0.05)  # file times move in clock ticks: a later write gets a later mtime
    (npy,) = tmp_path.rglob("*.npy")
    _flip_last_byte(npy)
    caplog.set_level(logging.WARNING, logger="diag.oracle.cache")
    fourth = oracle.matmul_result(a, b, cache=cache)
    assert not fourth.cache_hit
    assert len(hashed) == 3  # verified again (and failed), then the rewritten entry's sum
    assert_bits_equal(fourth.value, first.value, "recomputed truth")
    assert any("failed its checksum" in r.getMessage() for r in caplog.records)
