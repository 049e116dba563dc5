"""The ground-truth cache returns what was stored, bit for bit, and only for the same question.

Claims: a second identical call is a hit with the same bits and provenance; any change of input
bytes or output dtype is a miss; `clear` removes the files it reports; entries are written
atomically (no temporary files left behind).
"""

from __future__ import annotations

import numpy as np

import diag.oracle as oracle
from diag.numerics import bits_view
from diag.oracle.cache import GroundTruthCache, default_cache_dir


def inputs():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 4)).astype(np.float32)
    b = rng.standard_normal((4, 6)).astype(np.float32)
    a[0, 0] = -0.0
    return a, b


def test_put_get_round_trip_keeps_bits(tmp_path):
    cache = GroundTruthCache(tmp_path)
    value = np.array([[-0.0, np.nan], [np.inf, 1.5]], np.float16)
    key = cache.key("matmul", [value], "float16")
    assert cache.get(key) is None
    cache.put(key, value, {"method": "m", "fallbacks": 3})
    hit = cache.get(key)
    assert (bits_view(hit.value) == bits_view(value)).all() and hit.value.dtype == value.dtype
    assert hit.meta["method"] == "m" and hit.meta["fallbacks"] == 3
    assert not list(tmp_path.rglob(".tmp-*"))


def test_second_call_is_a_hit_with_same_bits(tmp_path):
    cache = GroundTruthCache(tmp_path)
    a, b = inputs()
    first = oracle.matmul_result(a, b, cache=cache)
    second = oracle.matmul_result(a, b, cache=cache)
    assert not first.cache_hit and second.cache_hit
    assert (bits_view(first.value) == bits_view(second.value)).all()
    assert (second.method, second.fallbacks, second.elements) == (
        first.method, first.fallbacks, first.elements)
    assert cache.info()["entries"] == 1


def test_different_question_is_a_miss(tmp_path):
    cache = GroundTruthCache(tmp_path)
    a, b = inputs()
    oracle.matmul_result(a, b, cache=cache)
    a2 = a.copy()
    a2[0, 0] = 0.0  # -0 -> +0: same value, different bytes, different key
    assert not oracle.matmul_result(a2, b, cache=cache).cache_hit
    assert not oracle.matmul_result(a, b, "bfloat16", cache=cache).cache_hit
    assert cache.info()["entries"] == 3


def test_clear_removes_files_and_counts_them(tmp_path):
    cache = GroundTruthCache(tmp_path)
    a, b = inputs()
    oracle.matmul_result(a, b, cache=cache)
    info = cache.info()
    assert info["entries"] == 1 and info["bytes"] > 0 and info["path"] == str(tmp_path)
    assert cache.clear() == 2  # .npy + .json
    assert cache.info()["entries"] == 0 and not list(tmp_path.rglob("*.npy"))
    assert not oracle.matmul_result(a, b, cache=cache).cache_hit


def test_clear_and_info_see_both_arrays_of_a_top_k_result(tmp_path):
    """top-k's truth is two entries (values, and the key with `-indices`): `info` counts
    both and `diag cache clear` removes both, leaving nothing of diag's behind."""
    cache = GroundTruthCache(tmp_path)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    oracle.top_k_result(x, 3, cache=cache)
    assert len(list(tmp_path.rglob("*-indices.npy"))) == 1
    assert cache.info()["entries"] == 2
    assert cache.clear() == 4
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".npy", ".json")]
    assert not oracle.top_k_result(x, 3, cache=cache).cache_hit


def test_corrupt_entry_is_a_miss(tmp_path):
    cache = GroundTruthCache(tmp_path)
    a, b = inputs()
    oracle.matmul_result(a, b, cache=cache)
    for p in tmp_path.rglob("*.npy"):
        p.write_bytes(b"garbage")
    assert not oracle.matmul_result(a, b, cache=cache).cache_hit


def test_default_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DIAG_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("DIAG_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "diag", "oracle")
