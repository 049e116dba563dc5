"""The fast softmax oracle equals the mpmath reference BIT FOR BIT, and says what it could not prove.

Claims under test: on random rows of float32, bfloat16 and float16 (N(0,1), N(0,5^2)) and on
adversarial rows (logits near 1e4, huge dynamic range, half-masked, one-hot, signed zeros,
subnormal and underflowing results, exact values 1/n, rows whose result lies within ~1e-15 of a
float32 rounding midpoint) `diag.oracle.softmax` returns exactly `diag.oracle.mp.softmax`; the
mpmath fallback is counted and exact; special rows (all -inf, NaN, +inf) follow the documented
semantics; the one unproven assumption of the fast path (numpy's float64 exp errs by < EXP_ULP
ulp) holds with a margin on this machine.
"""

from __future__ import annotations

import math

import ml_dtypes
import mpmath
import numpy as np
import pytest

import diag.oracle as oracle
from diag.errors import UsageError
from diag.oracle import GroundTruthCache, mp
from diag.oracle._softmax import EXP_ULP
from tests.conftest import BF16, DTYPES, IDS, assert_bits_equal



@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("sd", [1.0, 5.0])
def test_random_rows_match_mp_bit_for_bit(dt, sd):
    rng = np.random.default_rng(int(sd * 10) + dt.itemsize)
    x = (rng.standard_normal((3, 700)) * sd).astype(dt)
    res = oracle.softmax_result(x)
    assert res.method == "f64-exp-bound" and res.elements == x.size
    assert_bits_equal(res.value, mp.softmax(x), f"{dt} N(0,{sd}^2)")
    assert res.extra == {"undefined_rows": [], "nan_rows": []}


@pytest.mark.parametrize("out", DTYPES, ids=IDS)
def test_output_dtype_differs_from_input(out):
    x = (np.random.default_rng(3).standard_normal((2, 300)) * 3).astype(BF16)
    assert_bits_equal(oracle.softmax(x, out), mp.softmax(x, out), f"bf16 -> {out}")


def adversarial_rows(dt):
    """(name, row) pairs; every row is cast to dt (the cast is the input, exact by definition)."""
    rng = np.random.default_rng(11)
    fmax = float(ml_dtypes.finfo(dt).max)
    rows = [
        ("near 1e4", 1e4 + rng.standard_normal(64) if dt != np.float16 else
         6e4 + 8 * rng.standard_normal(64)),
        ("huge range", [fmax, -fmax, 0.0, 1e-30, -1e-30, 88.0, fmax / 2, -1.0]),
        ("half masked", np.where(np.arange(64) % 2 == 0, rng.standard_normal(64), -np.inf)),
        ("one-hot", [-np.inf, -np.inf, 3.0, -np.inf]),
        ("signed zeros", [0.0, -0.0, -0.0, 0.0, -0.0]),
        ("all equal", [2.5] * 7),
        # Results below the smallest normal (float32 ~1e-38: d < -87; float16 ~6e-5: d < -9.7)
        # and below half the smallest subnormal (rounds to +0).
        ("subnormal results", [0.0, -87.5, -90.0, -95.0, -100.0, -103.0, -103.3, -104.0,
                               -110.0, -200.0, -1e4, -9.8, -12.0, -15.0, -16.5, -17.3, -18.0]),
        ("bf16 ties", np.round(rng.standard_normal(64) * 4) / 4),
        ("two equal maxima", [1.0, 1.0, -np.inf, 0.0]),
    ]
    return [(name, np.asarray(r, np.float64).astype(dt)) for name, r in rows]


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_adversarial_rows_match_mp(dt):
    for name, row in adversarial_rows(dt):
        assert_bits_equal(oracle.softmax(row[None]), mp.softmax(row[None]), f"{dt} {name}")


def test_subnormal_and_zero_results_are_exercised():
    # The crafted row really reaches float32 subnormals and exact zeros (not just small normals).
    row = dict(adversarial_rows(np.dtype(np.float32)))["subnormal results"]
    y = oracle.softmax(row[None])[0]
    tiny = float(np.finfo(np.float32).smallest_normal)
    assert ((y > 0) & (y < tiny)).sum() >= 3
    assert (y == 0).sum() >= 3 and not np.signbit(y).any()


def test_signed_zero_rows_give_exact_thirds_and_masked_entries_are_plus_zero():
    y = oracle.softmax(np.array([[0.0, -0.0, -0.0], [1.0, -np.inf, -np.inf]], np.float32))
    assert y[0].tolist() == [np.float32(1 / 3)] * 3
    assert y[1, 0] == 1.0 and y[1, 1] == 0 and not np.signbit(y[1, 1:]).any()


# Rows [0, x] whose float32 results lie within ~4e-16 .. 4e-15 (relative) of a float32 rounding
# midpoint: found by scanning 8e7 random float32 x in [-30, 0] with a float64 estimate. The
# expected bits come from mpmath, not from this list.
NEAR_MIDPOINT_X = [-0.5991945266723633, -14.30414867401123, -1.694751501083374,
                   -0.005323601420968771, -1.4276520013809204, -11.226107597351074]


def test_near_midpoint_rows_fall_back_to_mpmath_and_match():
    x = np.array([[0.0, v] for v in NEAR_MIDPOINT_X], np.float32)
    res = oracle.softmax_result(x)
    assert res.fallbacks >= 1  # the float64 interval could not decide these: counted, not hidden
    assert_bits_equal(res.value, mp.softmax(x), "near midpoints")


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_forced_fallback_is_exact_and_counted(dt):
    # A bound inflated by 1e12 leaves most elements undecided: the mpmath path must settle them.
    x = (np.random.default_rng(5).standard_normal((2, 50)) * 2).astype(dt)
    res = oracle.softmax_result(x, _slack=1e12)
    assert res.fallbacks > x.size // 2
    assert_bits_equal(res.value, mp.softmax(x), f"{dt} forced fallback")


def test_numpy_float64_exp_is_within_the_assumed_error():
    # The fast path's one assumption: |exp computed - exp| <= EXP_ULP ulp. Measured < 1 here.
    rng = np.random.default_rng(2)
    d = np.concatenate([-rng.random(3000) * 200, -rng.random(2000) * 2, -rng.random(500) * 1e-6,
                        -rng.random(500) * 708])
    got = np.exp(d)
    worst = 0.0
    with mpmath.workprec(120):
        for a, b in zip(d.tolist(), got.tolist()):
            err = abs(mpmath.mpf(b) - mpmath.exp(mpmath.mpf(a))) / math.ulp(b)
            worst = max(worst, float(err))
    assert worst < 1.0 < EXP_ULP


def test_special_rows_nan_and_undefined():
    x = np.array([[0.0, 1.0, 2.0], [-np.inf] * 3, [np.nan, 0.0, 1.0], [np.inf, 0.0, 1.0],
                  [1.0, -np.inf, np.inf]], np.float32)
    res = oracle.softmax_result(x)
    assert res.extra["undefined_rows"] == [1]
    assert res.extra["nan_rows"] == [2, 3, 4]
    assert np.isnan(res.value[1:]).all() and np.isfinite(res.value[0]).all()
    assert_bits_equal(res.value[0], mp.softmax(x[:1])[0])
    assert np.isnan(mp.softmax(x[1:])).all()


def test_batched_shape_and_empty_rows():
    x = np.random.default_rng(1).standard_normal((2, 3, 40)).astype(np.float32)
    y = oracle.softmax(x)
    assert y.shape == x.shape
    assert_bits_equal(y.reshape(6, 40), oracle.softmax(x.reshape(6, 40)))
    assert oracle.softmax(np.zeros((3, 0), np.float32)).shape == (3, 0)


def test_shift_by_an_exact_constant_changes_nothing():
    # softmax(x + c) == softmax(x) when x + c is exact: the oracle computes the math, not an
    # approximation that drifts with the offset.
    x = (np.round(np.random.default_rng(8).standard_normal((2, 200)) * 64) / 64).astype(np.float32)
    assert_bits_equal(oracle.softmax(x + np.float32(1024)), oracle.softmax(x))


def test_refuses_float64_and_scalars():
    with pytest.raises(UsageError, match="oracle.softmax: input is float64"):
        oracle.softmax(np.zeros((2, 3)))
    with pytest.raises(UsageError, match="output dtype float64"):
        oracle.softmax(np.zeros((2, 3), np.float32), "float64")
    with pytest.raises(UsageError, match="scalar"):
        oracle.softmax(np.float32(1.0))


def test_cache_hit_returns_the_same_bits_and_row_lists(tmp_path):
    cache = GroundTruthCache(tmp_path / "c")
    x = np.array([[0.0, 1.0], [-np.inf, -np.inf]], np.float32)
    first = oracle.softmax_result(x, cache=cache)
    second = oracle.softmax_result(x, cache=cache)
    assert not first.cache_hit and second.cache_hit
    assert_bits_equal(second.value, first.value)
    assert second.extra["undefined_rows"] == [1]
    # A different output dtype is a different entry.
    assert not oracle.softmax_result(x, BF16, cache=cache).cache_hit


def test_bfloat16_results_whose_float32_rounding_is_a_bfloat16_tie_match_mp():
    # Two-entry rows [0, delta] with softmax y_0 = 1 / (1 + exp(delta)) within a float32 ulp of
    # a bfloat16 midpoint: rounding y to float32 first lands ON the midpoint, where rounding
    # again to bfloat16 would go to even whatever side y is on. The oracle must round once.
    rows, landed = [], 0
    for k in range(380):
        mid = 0.25 + k * 2.0**-9 + 2.0**-10  # halfway between bfloat16 neighbours in [1/4, 1)
        delta = np.float32(math.log(1.0 / mid - 1.0))
        y64 = 1.0 / (1.0 + math.exp(float(delta)))
        landed += float(np.float32(y64)) == mid
        rows.append([0.0, float(delta)])
    assert landed >= 10  # the hazard is exercised, not just possible
    x = np.array(rows, np.float32)
    assert_bits_equal(oracle.softmax(x, BF16), mp.softmax(x, BF16), "bf16 ties via float32")
