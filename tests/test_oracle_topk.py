"""The top-k oracle is exact in diag's documented total order.

Claims under test: on random rows and on rows with NaN (both signs), +-inf, +-0, all-equal
values and bfloat16's many ties, `diag.oracle.top_k` returns exactly what a brute-force Python
sort under the documented order returns (NaN above +inf, then descending value, -0 equal to +0,
lower index first among equals), for every k including 0 and n, through both the partition path
(small k) and the full sort path; values keep their bits; bad k is refused; the cache stores
values and indices.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import diag.oracle as oracle
from diag.errors import UsageError
from diag.numerics import bits_view
from diag.oracle import GroundTruthCache

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]
IDS = ["float32", "bfloat16", "float16"]


def brute_top_k(row, k):
    """The documented order, spelled out: (is not NaN, -value, index) ascending."""
    vals = [float(v) for v in np.asarray(row).astype(np.float64)]
    order = sorted(range(len(vals)),
                   key=lambda j: (0, 0.0, j) if math.isnan(vals[j]) else (1, -vals[j], j))
    return order[:k]


def special_rows(dt):
    neg_nan = -np.float64(np.nan)
    rows = [
        [1.0, np.nan, 3.0, -0.0, 0.0, 3.0, np.inf, -np.inf, 3.0, 0.0, -0.0, neg_nan],
        [2.0] * 12,
        [-0.0, 0.0] * 6,
        [-np.inf] * 11 + [np.nan],
        [np.inf, -np.inf] * 6,
    ]
    return [np.asarray(r, np.float64).astype(dt) for r in rows]


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_random_rows_match_brute_force_for_every_k_path(dt):
    rng = np.random.default_rng(3)
    # Coarse values: many exact ties in every dtype.
    x = (np.round(rng.standard_normal((4, 200)) * 8) / 8).astype(dt)
    for k in (0, 1, 7, 49, 51, 150, 200):  # 4k < n uses the partition path, else a full sort
        _, idx = oracle.top_k(x, k)
        assert idx.shape == (4, k) and idx.dtype == np.int64
        for r in range(4):
            assert idx[r].tolist() == brute_top_k(x[r], k), (dt, k, r)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_special_rows_match_brute_force_and_keep_bits(dt):
    for row in special_rows(dt):
        for k in (1, 3, 6, 12):
            values, idx = oracle.top_k(row[None], k)
            assert idx[0].tolist() == brute_top_k(row, k), (row, k)
            assert (bits_view(values[0]) == bits_view(row[idx[0]])).all()


def test_order_is_the_documented_one():
    x = np.array([[1.0, np.nan, 3.0, -0.0, 0.0, np.inf, -np.inf]], np.float32)
    values, idx = oracle.top_k(x, 7)
    # NaN above +inf; -0 (index 3) before +0 (index 4) only because of its lower index.
    assert idx[0].tolist() == [1, 5, 2, 0, 3, 4, 6]
    assert np.signbit(values[0, 4]) and not np.signbit(values[0, 5])


def test_batched_input_and_empty_batch():
    x = np.random.default_rng(0).standard_normal((2, 3, 30)).astype(np.float32)
    v, i = oracle.top_k(x, 4)
    assert v.shape == i.shape == (2, 3, 4)
    assert i[1, 2].tolist() == brute_top_k(x[1, 2], 4)
    assert oracle.top_k(np.zeros((0, 5), np.float32), 2)[0].shape == (0, 2)


def test_bad_k_is_refused():
    x = np.zeros((2, 5), np.float32)
    with pytest.raises(UsageError, match="k=6 is outside 0..5"):
        oracle.top_k(x, 6)
    with pytest.raises(UsageError, match="k must be an integer"):
        oracle.top_k(x, 2.0)


def test_cache_stores_values_and_indices(tmp_path):
    cache = GroundTruthCache(tmp_path / "c")
    x = np.array([[0.0, 2.0, 2.0, np.nan, -0.0]], BF16)
    first = oracle.top_k_result(x, 3, cache=cache)
    second = oracle.top_k_result(x, 3, cache=cache)
    assert not first.cache_hit and second.cache_hit
    assert (bits_view(second.value) == bits_view(first.value)).all()
    assert second.extra["indices"].tolist() == [[3, 1, 2]]
    assert second.extra["indices"].dtype == np.int64
    assert not oracle.top_k_result(x, 2, cache=cache).cache_hit  # k is part of the key
