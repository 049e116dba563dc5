"""Streaming element-wise judging (diag/compare/elementwise.py, chunk by chunk) gives the
whole-array code's numbers, bit for bit, on the arrays where chunking is most likely to go wrong.

Each test builds outputs, truths and bounds with the hazard named in its title (NaN, which
must win a max at its first index; infinities; zero, subnormal and infinite bounds; ratios
that round to exactly 1; ties across chunks; empty arrays; every dtype diag handles; float64
distances too large to sum) and asserts that `compare`, `agreement`, `agree_values` and
`ulp_distance` return exactly what tests/legacy_judge.py (numpy over whole arrays) returns:
floats through JSON text, so NaN, -0.0 and every last bit count.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from diag import numerics
from diag.compare.elementwise import _HIST_CAP, CHUNK, agree_values, agreement, compare
from diag.compare.verdict import format_index
from diag.errors import UsageError
from tests import legacy_judge


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _assert_as_legacy(out, truth, bound):
    """Every element-wise judgement of (out, truth, bound) equals the legacy code's."""
    with np.errstate(all="ignore"):
        got, want = compare(out, truth, bound), legacy_judge.compare(out, truth, bound)
        assert _canon(got) == _canon(want)
        assert _canon(agreement(out, truth, bound)) == _canon(
            legacy_judge.agreement(out, truth, bound))
    new = agree_values(out, truth, ("a", "b"), allowed_ulp=4)
    old = legacy_judge.agree_values(out, truth, ("a", "b"), allowed_ulp=4)
    assert (new.status, new.reason) == old[:2] and _canon(new.metrics) == _canon(old[2])
    np.testing.assert_array_equal(numerics.ulp_distance(out, truth),
                                  legacy_judge.ulp_distance(out, truth))
    return got


def _noisy(dtype, n, seed=3):
    """A truth and an output a few ULPs off it, with NaN, +-inf and signed zeros planted."""
    rng = np.random.default_rng(seed)
    dt = numerics.as_dtype(dtype)
    truth = rng.standard_normal(n).astype(dt)
    bits = numerics.bits_view(truth).copy()
    bits ^= rng.integers(0, 4, n).astype(bits.dtype)
    out = numerics.from_bits(bits, dtype).copy()
    for arr in (truth, out):
        idx = rng.integers(0, n, 12)
        arr[idx[:3]], arr[idx[3:6]], arr[idx[6:9]], arr[idx[9:]] = np.nan, np.inf, -np.inf, -0.0
    bound = np.abs(truth.astype(np.float64)) * 2.0 ** -(numerics.precision_bits(dtype) - 2)
    return out, truth, bound


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16",
                                   "float8_e4m3fn", "float8_e5m2"])
def test_every_dtype_judges_as_the_whole_array_code(dtype):
    # More than two chunks, the last one partial.
    out, truth, bound = _noisy(dtype, 2 * CHUNK + 5)
    metrics = _assert_as_legacy(out, truth, bound)
    assert metrics["unexpected_nonfinite"] > 0 and metrics["frac_not_correctly_rounded"] > 0


def test_the_first_nan_ratio_wins_across_chunks():
    # 0 / 0 ratios (exact element, zero bound) in the second and third chunk, and a larger
    # finite ratio before them: numpy's max is NaN, its argmax the first NaN.
    out, truth, _ = _noisy("float32", 3 * CHUNK, seed=5)
    out, truth = np.nan_to_num(out), np.nan_to_num(truth)
    bound = np.full(out.size, 1.0)
    out[7] = truth[7] + np.float32(100.0)
    first_nan = CHUNK + 11
    for i in (first_nan, 2 * CHUNK + 3):
        out[i], bound[i] = truth[i], 0.0
    metrics = _assert_as_legacy(out, truth, bound)
    assert np.isnan(metrics["bound_ratio"])
    assert metrics["worst"]["index"] == format_index(first_nan, out.shape)


def test_ties_keep_the_earliest_element_across_chunks():
    # Every element is the same error of the same bound: the worst is element 0; the
    # largest ULP distance between two outputs first occurs in the second chunk.
    n = 2 * CHUNK + 9
    truth = np.full(n, 1.0, np.float32)
    out = np.full(n, np.nextafter(np.float32(1), np.float32(2)))
    metrics = _assert_as_legacy(out, truth, np.full(n, 1e-7))
    assert metrics["worst"]["index"] == format_index(0, out.shape) and metrics["bound_exceeded"] == n
    out[CHUNK + 1] = out[-1] = np.float32(1.5)
    got = agreement(out, truth, np.full(n, 1e-7))
    assert got["worst"]["index"] == format_index(CHUNK + 1, out.shape)
    _assert_as_legacy(out, truth, np.full(n, 1e-7))


def test_equal_arrays_agree_bit_for_bit():
    out, truth, bound = _noisy("bfloat16", 1000)
    metrics = _assert_as_legacy(truth.copy(), truth, bound)
    assert metrics["max_ulp"] == 0 and metrics["unexpected_nonfinite"] == 0
    assert agree_values(truth.copy(), truth, ("a", "b"), allowed_ulp=0).status == "pass"


def test_empty_arrays_have_no_worst_element():
    for dtype in ("float32", "float16"):
        empty = np.zeros((0, 3), numerics.as_dtype(dtype))
        metrics = _assert_as_legacy(empty, empty.copy(), np.zeros((0, 3)))
        assert metrics["elements"] == 0 and "worst" not in metrics


def test_infinities_are_expected_only_where_the_truth_has_the_same_one():
    truth = np.array([np.inf, -np.inf, np.inf, 1.0, -0.0, 3.0], np.float32)
    out = np.array([np.inf, np.inf, 1.0, -np.inf, 0.0, np.nan], np.float32)
    metrics = _assert_as_legacy(out, truth, np.full(6, 1e-6))
    assert metrics["unexpected_nonfinite"] == 4 and metrics["inf_count"] == 3


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bounds_at_the_edge_of_the_ratio(dtype):
    # Bounds equal to the error, one float above and below it, zero, subnormal, infinite
    # and NaN: ratios that round to exactly 1, are NaN, or pass the max only in their last
    # bits.
    rng = np.random.default_rng(9)
    dt = numerics.as_dtype(dtype)
    truth = rng.standard_normal(4000).astype(dt)
    out = (truth.astype(np.float64) * (1 + rng.standard_normal(4000) * 1e-6)).astype(dt)
    err = np.abs(out.astype(np.float64) - truth.astype(np.float64))
    picks = [err, np.nextafter(err, 0), np.nextafter(err, np.inf), err * (1 + 2.0**-52),
             np.zeros(4000), np.full(4000, 5e-324), np.full(4000, np.inf), np.full(4000, np.nan)]
    choice = rng.integers(0, len(picks), 4000)
    bound = np.choose(choice, picks)
    _assert_as_legacy(out, truth, bound)
    for pick in picks[:4]:  # one kind throughout: many ratios right at 1
        _assert_as_legacy(out, truth, pick)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_chunks_with_and_without_non_finite_values_as_the_whole_array_code(dtype):
    # compare and agreement skip the NaN masks in a chunk where every value is finite (the
    # common case) and keep them elsewhere: one chunk of each kind, and the hazards of the
    # unmasked chunk's shortcuts (zero truths of either sign, where err / |t| is masked to
    # 0; negative truths, where err / t is negative; equal values; float64 differences of
    # finite values that overflow).
    rng = np.random.default_rng(11)
    dt = numerics.as_dtype(dtype)
    n = 5 * CHUNK
    truth = rng.standard_normal(n).astype(dt)
    out = (truth.astype(np.float64) * (1 + rng.standard_normal(n) * 1e-3)).astype(dt)
    signed_zeros = np.array([0.0, -0.0] * 20, dt)
    truth[CHUNK:CHUNK + 40] = signed_zeros  # chunk 1: zero truths, non-zero outputs (x / 0)
    truth[2 * CHUNK:2 * CHUNK + 40] = signed_zeros  # chunk 2: zeros both sides (0 / 0)
    out[2 * CHUNK:2 * CHUNK + 40] = signed_zeros[::-1]
    out[3 * CHUNK + 7] = np.nan  # chunk 3: one NaN, the rest finite
    if dtype == "float64":  # chunk 4: finite values whose difference overflows float64
        truth[4 * CHUNK:4 * CHUNK + 5], out[4 * CHUNK:4 * CHUNK + 5] = 1e308, -1e308
    bound = np.abs(truth.astype(np.float64)) * 2.0 ** -(numerics.precision_bits(dtype) - 4)
    metrics = _assert_as_legacy(out, truth, bound)
    assert metrics["nan_count"] == 1 and metrics["max_rel_err"] > 0
    for chunk in range(3):  # each takes the unmasked path alone
        part = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
        metrics = _assert_as_legacy(out[part], truth[part], bound[part])
        assert metrics["unexpected_nonfinite"] == 0 and 0 < metrics["max_rel_err"] < np.inf


def test_float64_distances_past_what_sums_exactly():
    # Opposite signs of huge magnitude: distances near 2**63 (saturated below NAN_ULP), a
    # p99 among the large distances, and a mean numpy sums in float64.
    rng = np.random.default_rng(2)
    truth = rng.standard_normal(3000) * 1e300
    out = truth.copy()
    flip = rng.random(3000) < 0.05
    out[flip] = -out[flip]
    metrics = _assert_as_legacy(out, truth, np.abs(truth) * 1e-15)
    assert metrics["max_ulp"] == numerics.NAN_ULP - 1 and metrics["p99_ulp"] > _HIST_CAP


def test_strided_and_broadcast_operands():
    # Transposed and Fortran-ordered views; broadcasting is ulp_distance's.
    rng = np.random.default_rng(4)
    truth = rng.standard_normal((300, 200)).astype(np.float32)
    out = (truth * np.float32(1 + 1e-6)).T.copy().T  # a Fortran-ordered output
    _assert_as_legacy(out.T, truth.T, np.full((200, 300), 1e-7))
    row = truth[:1]
    np.testing.assert_array_equal(numerics.ulp_distance(row, truth),
                                  legacy_judge.ulp_distance(row, truth))


def test_different_dtypes_are_refused_as_before():
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float16)
    with pytest.raises(UsageError, match="dtypes differ"):
        compare(x, y, np.ones(4))
    with pytest.raises(UsageError, match="dtypes differ"):
        agreement(x, y, np.ones(4))
    with pytest.raises(UsageError, match="unsupported dtype"):
        numerics.ulp_distance(np.zeros(2, np.int32), np.zeros(2, np.int32))


