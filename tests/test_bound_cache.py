"""Arrays that never change between runs are kept in the ground-truth cache, and a cached copy
changes no value: a matmul's error bound and large seeded inputs.

A later run maps the stored bytes instead of computing them again; the values are bit-identical
to a fresh computation, a different claim, dtype or input set is a different entry, and a
corrupt or truncated entry is computed again, never read. Real suite cases, real bounds.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import shutil

import numpy as np
import pytest

from diag import numerics
from diag.compare.outcome import Outcome
from diag.plan.inputs import STORE_INPUT_BYTES, CostMemo, InputStore
from diag.oracle.cache import GroundTruthCache
from diag.plan.registry import PROBES
from diag.run.store import CaseStore
from diag.plan.suite import load_suite
from diag.tolerance import tolerance
from tests.conftest import needs_jax, run_diag

#: Store every shared array, however fast: what is stored is under test here, not the rule.
ALWAYS = {"store_min_seconds": 0.0, "store_rate": math.inf}


def _suite(tmp_path, shapes, dtypes=("float32",), name="s", seed=7):
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[suite]\nname = "{name}"\nseed = {seed}\n\n[[probe]]\nname = "mm"\n'
                    f'op = "matmul"\ninputs = "normal"\ndtypes = {json.dumps(list(dtypes))}\n'
                    f'shapes = {json.dumps(shapes)}\n')
    return load_suite(str(path)).cases


def _judge(tmp_path, work: str, cache, **rule) -> CaseStore:
    """A run's case store: its own work folder, the cache folder shared by runs."""
    (tmp_path / work).mkdir()
    return CaseStore(tmp_path / work, str(cache), **rule)


def _judge_truth_as_output(judge: CaseStore, case):
    """matmul's verdict on the truth itself as a backend's output (a pass), through the
    run's memo; returns the Evaluation (its context returns the bound)."""
    truth = judge.truth.get(case)
    outcome = Outcome(inputs=judge.inputs.get(case), outputs=[truth.value], names=["out"],
                      truth=truth, params=case.params, shared=judge.shared(case))
    return PROBES["matmul"].evaluate(outcome)


def _fresh_bound(case, cache_dir):
    work = cache_dir.parent / f"fresh-{case.id}"
    work.mkdir(exist_ok=True)
    judge = CaseStore(work, str(cache_dir))
    truth = judge.truth.get(case).value
    return tolerance("matmul", truth.dtype).bound(judge.inputs.get(case), truth, case.params)


def _entries(cache_dir, kind):
    return [p for p in cache_dir.glob("??/*.json") if json.loads(p.read_text()).get("kind") == kind]


def _is_mapped(a) -> bool:
    """Whether `a`'s memory is a file map (np.load(mmap_mode=...)), not the process's own."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(numerics.bits_view(a), numerics.bits_view(b))


def test_a_warm_judge_maps_the_bound_an_earlier_run_stored(tmp_path):
    (case,) = _suite(tmp_path, [[32, 2048, 48]])
    cache = tmp_path / "cache"
    first = _judge(tmp_path, "w1", cache, **ALWAYS)
    ev1 = _judge_truth_as_output(first, case)
    assert first.stored == {"hit": 0, "stored": 1, "computed": 0}
    (entry,) = _entries(cache, "shared")
    assert json.loads(entry.read_text())["name"] == "bound-float32"

    second = _judge(tmp_path, "w2", cache, **ALWAYS)
    ev2 = _judge_truth_as_output(second, case)
    assert second.stored == {"hit": 1, "stored": 0, "computed": 0}
    # Mapped read-only from the stored file, not computed and not copied into memory.
    assert _is_mapped(ev2.context()) and not _is_mapped(ev1.context())
    assert not ev2.context().flags.writeable
    fresh = _fresh_bound(case, cache)
    assert _same_bits(ev2.context(), fresh) and _same_bits(ev1.context(), fresh)
    assert json.dumps(ev1.metrics, sort_keys=True) == json.dumps(ev2.metrics, sort_keys=True)
    assert ev1.status == ev2.status == "pass"
    # A later backend of the same run gets it from the memo: no second map.
    _judge_truth_as_output(second, case)
    assert second.stored["hit"] == 1


def test_a_fast_small_bound_is_not_stored(tmp_path):
    (case,) = _suite(tmp_path, [[4, 4, 4]])
    judge = _judge(tmp_path, "w", tmp_path / "cache")  # the shipped rule
    _judge_truth_as_output(judge, case)
    assert judge.stored == {"hit": 0, "stored": 0, "computed": 1}
    assert _entries(tmp_path / "cache", "shared") == []


def test_a_different_claim_dtype_or_input_set_is_a_different_entry(tmp_path):
    cases = _suite(tmp_path, [[16, 64, 16], [16, 64, 8]], dtypes=("float32", "bfloat16"))
    judge = _judge(tmp_path, "w", tmp_path / "cache", **ALWAYS)
    compute = lambda: None  # noqa: E731  (keys only: the source of this module is keyed)
    keys = {judge.shared_key(c, f"bound-{claim}", compute)
            for c in cases for claim in ("float32", "bfloat16")}
    assert len(keys) == 2 * len(cases) == 8
    # Stable across runs: a new judge of the same case finds the same key.
    again = _judge(tmp_path, "w2", tmp_path / "cache", **ALWAYS)
    assert again.shared_key(cases[0], "bound-float32", compute) in keys
    # A different seed draws different inputs: a different key.
    (reseeded,) = [c for c in _suite(tmp_path, [[16, 64, 16]], name="t", seed=8)]
    assert reseeded.seed != cases[0].seed
    assert again.shared_key(reseeded, "bound-float32", compute) not in keys
    # And through the real path: the bf16 case stores its own entry, with its own values.
    for c in cases[:2]:
        _judge_truth_as_output(judge, c)
    assert judge.stored["stored"] == 2 and len(_entries(tmp_path / "cache", "shared")) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta"])
def test_a_corrupt_entry_is_computed_again_and_replaced(tmp_path, caplog, damage):
    (case,) = _suite(tmp_path, [[32, 1024, 32]])
    cache = tmp_path / "cache"
    _judge_truth_as_output(_judge(tmp_path, "w1", cache, **ALWAYS), case)
    (meta,) = _entries(cache, "shared")
    npy = meta.with_suffix(".npy")
    if damage == "flip":
        raw = bytearray(npy.read_bytes())
        raw[-3] ^= 0x01
        npy.write_bytes(bytes(raw))
    elif damage == "truncate":
        npy.write_bytes(npy.read_bytes()[:-100])
    else:
        meta.write_text(meta.read_text().replace('"bound-float32"', '"bound-float16"'))
    caplog.set_level(logging.WARNING, logger="diag.oracle.cache")
    judge = _judge(tmp_path, "w2", cache, **ALWAYS)
    _judge_truth_as_output(judge, case)
    assert judge.stored == {"hit": 0, "stored": 1, "computed": 0}
    assert "failed its checksum" in caplog.text
    # The entry was rewritten whole: the next run maps it, and it holds the right bits.
    third = _judge(tmp_path, "w3", cache, **ALWAYS)
    ev = _judge_truth_as_output(third, case)
    assert third.stored["hit"] == 1 and _same_bits(ev.context(), _fresh_bound(case, cache))


def test_large_seeded_inputs_are_mapped_from_the_cache_by_later_runs(tmp_path):
    big, small = _suite(tmp_path, [[4096, 1024, 1], [64, 64, 64]])
    assert 4096 * 1024 * 4 >= STORE_INPUT_BYTES > 2 * 64 * 64 * 4
    cache = GroundTruthCache(tmp_path / "cache")
    fresh = InputStore(tmp_path / "plain")  # no cache: drawn from the seed
    (tmp_path / "plain").mkdir()
    want = fresh.get(big)
    first = InputStore(tmp_path / "w1", cache)
    (tmp_path / "w1").mkdir()
    first.get(big)
    assert len(_entries(cache.root, "inputs")) == 2
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.root.glob("??/*.npy")}

    work = tmp_path / "w2"
    work.mkdir()
    second = InputStore(work, cache)
    got = second.get(big)
    assert all(_same_bits(g, w) for g, w in zip(got, want))
    assert all(_is_mapped(g) and not g.flags.writeable for g in got)
    # The workers map the cache's files; the work folder holds none of them.
    assert all(p.startswith(str(cache.root)) for p in second.paths(big))
    assert second.digests(big) == [numerics.bits_digest(w) for w in want]
    assert not list(work.glob("in-*"))
    # Small sets are drawn again (milliseconds) and written to the work folder as before.
    assert all(p.startswith(str(work)) for p in second.paths(small))
    # Deleting the run's work folder leaves the cache as it was; nothing rewrote it.
    shutil.rmtree(work)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in cache.root.glob("??/*.npy")} == files
    third = InputStore(tmp_path / "w3", cache)
    assert all(_same_bits(g, w) for g, w in zip(third.get(big), want))


@needs_jax
def test_cli_runs_keep_inputs_in_the_cache_dir_they_are_given(tmp_path):
    """`--cache-dir` and `DIAG_CACHE_DIR` both decide where entries go; a second run reads
    the first's entries (none rewritten) and judges exactly as it did."""
    _suite(tmp_path, [[4096, 1024, 1]])
    cache = tmp_path / "cache"
    r1 = run_diag("run", "--suite", str(tmp_path / "s.toml"), "--backend", "jax-cpu",
                  "--cache-dir", str(cache), "--out", str(tmp_path / "runs1"))
    assert r1.returncode == 0, r1.stderr
    assert len(_entries(cache, "inputs")) == 2
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.glob("??/*.npy")}
    r2 = run_diag("run", "--suite", str(tmp_path / "s.toml"), "--backend", "jax-cpu",
                  "--out", str(tmp_path / "runs2"), env={"DIAG_CACHE_DIR": str(cache)})
    assert r2.returncode == 0, r2.stderr
    # (Only the first run's files: whether a bound is worth storing is timed, run by run.)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files} == files
    recs = [[json.loads(line) for line in next(d.glob("*/results.jsonl")).read_text().splitlines()]
            for d in (tmp_path / "runs1", tmp_path / "runs2")]
    assert [r["oracle"]["cache_hit"] for r in recs[1]] == [True]
    assert [(r["status"], r["metrics"]) for r in recs[0]] == \
        [(r["status"], r["metrics"]) for r in recs[1]]


def test_a_corrupt_input_entry_is_drawn_again_and_replaced(tmp_path, caplog):
    (big,) = _suite(tmp_path, [[4096, 1024, 1]])
    cache = GroundTruthCache(tmp_path / "cache")
    for work in ("w1", "w2", "w3"):
        (tmp_path / work).mkdir()
    want = InputStore(tmp_path / "w1", cache).get(big)
    first = max(_entries(cache.root, "inputs"), key=lambda p: p.with_suffix(".npy").stat().st_size)
    npy = first.with_suffix(".npy")
    raw = bytearray(npy.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    npy.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="diag.oracle.cache")
    again = InputStore(tmp_path / "w2", cache)
    got = again.get(big)
    assert "failed its checksum" in caplog.text
    assert all(_same_bits(g, w) for g, w in zip(got, want))
    assert again.digests(big) == [numerics.bits_digest(w) for w in want]
    # Rewritten whole: the next run maps it without a warning.
    caplog.clear()
    third = InputStore(tmp_path / "w3", cache)
    assert all(_same_bits(g, w) for g, w in zip(third.get(big), want))
    assert "failed its checksum" not in caplog.text
    assert all(p.startswith(str(cache.root)) for p in third.paths(big))


def _write_and_read(root, key: str, times: int) -> int:
    """One 'run' storing and reading back the same entry `times` times; returns how many
    reads gave the whole, verified value."""
    cache = GroundTruthCache(root)
    value = np.linspace(0.0, 1.0, 1 << 16)
    whole = 0
    for _ in range(times):
        cache.put_mapped(key, value, {"kind": "shared"})
        entry = cache.get_mapped(key)
        whole += entry is not None and _same_bits(entry.value, value)
    return whole


def test_runs_storing_the_same_entry_at_once_never_read_half_of_one(tmp_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    key = GroundTruthCache.derived_key("shared", {"test": "concurrent"})
    # Separate processes started afresh, as runs are: a fork of this process could inherit
    # the threads of a framework another test imported, and deadlock.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(4, mp_context=spawn) as pool:
        reads = list(pool.map(_write_and_read, [tmp_path] * 4, [key] * 4, [25] * 4))
    assert reads == [25] * 4
    assert not list(tmp_path.glob("??/.tmp-*"))  # every temporary name was moved into place
    assert GroundTruthCache(tmp_path).get_mapped(key) is not None


def test_a_large_bound_not_stored_is_computed_again_for_a_later_backend(tmp_path):
    """A bound too cheap for the cache on disk (a K=4 product's) is computed again for a later
    backend once the memo has let it go, bit-identical, and nothing is written for it: not
    to the cache, not to the run's work folder."""
    (case,) = _suite(tmp_path, [[1024, 4, 512]])  # a 4 MB float64 bound
    never = {"store_min_seconds": math.inf}
    judge = _judge(tmp_path, "w", tmp_path / "cache", **never)
    first = _judge_truth_as_output(judge, case)
    assert judge.stored == {"hit": 0, "stored": 0, "computed": 1}
    judge._shared = CostMemo(0)  # the memo has let everything go, as between backends
    ev = _judge_truth_as_output(judge, case)
    assert judge.stored == {"hit": 0, "stored": 0, "computed": 2}
    assert not _is_mapped(ev.context()) and _entries(tmp_path / "cache", "shared") == []
    assert not list(judge.work.glob("shared-*"))
    assert _same_bits(ev.context(), first.context())
    assert _same_bits(ev.context(), _fresh_bound(case, tmp_path / "cache"))
