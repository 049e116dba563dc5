"""The softmax oracle's cheaper passes keep it exact: shift errors, reused scratch, blocks.

Claims under test: `shift_error` gives the EXACT error of d = fl(x - max) (checked with
fractions) on rows where that difference is inexact, in both of its branches (Fast2Sum for rows
whose maximum is 0 or >= 2**-20, TwoSum below); such rows, and rows split over several blocks
or larger than the kept scratch, equal `diag.oracle.mp.softmax` bit for bit; two threads
sharing the module do not see each other's scratch arrays.
"""

from __future__ import annotations

import threading
from fractions import Fraction

import mpmath
import numpy as np
import pytest

import diag.oracle as oracle
from diag.oracle import mp
from diag.oracle._softmax import EXP_ULP, FAST2SUM_MIN_MAX, shift_error, shifted_exp
from tests.conftest import BF16, assert_bits_equal


def _rows_with_inexact_shifts(dt, rng):
    """Rows whose differences x - max are NOT all representable in float64, per branch (the
    exponent gaps exceed 44, as bfloat16 needs; float32 needs 28)."""
    n = 40
    tiny = (rng.random(n) + 0.5) * 1e-20  # Fast2Sum rows: |x| far below |max|
    big = -(rng.random(2 * n) * 150 + 20)  # TwoSum rows: |x| far above a tiny |max|
    rows = [
        np.concatenate([[3.7], tiny, -tiny]),  # max 3.7: x - 3.7 inexact for the tiny x
        np.concatenate([[1e-14], big]),  # 0 < max < 2**-20: TwoSum
        np.concatenate([[-1e-14], big]),  # (a negative max >= 2**-20 meets no inexact d >= -200)
        np.concatenate([[0.0], big[:n], -tiny]),  # max 0: every difference exact
        np.concatenate([[1.0], -1e6 * (rng.random(2 * n) + 1)]),  # |x| > 2**28 |max|: d < -200
    ]
    return np.array(rows).astype(dt)


@pytest.mark.parametrize("dt", [np.dtype(np.float32), BF16], ids=["float32", "bfloat16"])
def test_shift_error_is_exact_in_both_branches(dt):
    x = _rows_with_inexact_shifts(dt, np.random.default_rng(4))
    xr = x.astype(np.float64)
    m = xr.max(axis=1)
    d = xr - m[:, None]
    t = np.empty_like(d)
    assert shift_error(xr, m, d, t)
    assert np.isfinite(t).all()
    inexact = {"fast2sum": 0, "twosum": 0}
    for i, j in np.ndindex(*x.shape):
        exact = Fraction(float(xr[i, j])) - Fraction(float(m[i]))
        if d[i, j] >= -200:
            assert Fraction(float(d[i, j])) + Fraction(float(t[i, j])) == exact, (i, j)
        if Fraction(float(d[i, j])) != exact:
            branch = "twosum" if 0 < abs(m[i]) < FAST2SUM_MIN_MAX else "fast2sum"
            inexact[branch] += 1
    # Both branches really met inexact differences (the test can fail, not only pass).
    assert inexact["fast2sum"] >= 20 and inexact["twosum"] >= 20, inexact


@pytest.mark.parametrize("dt", [np.dtype(np.float32), BF16], ids=["float32", "bfloat16"])
def test_shifted_exp_is_within_eta_of_the_exact_exp(dt):
    # The t correction matters here: dropping it errs by up to 2**-47 ~ 64u at d ~ -100.
    x = _rows_with_inexact_shifts(dt, np.random.default_rng(5))
    xr = x.astype(np.float64)
    m = xr.max(axis=1)
    e, t, dead = np.empty_like(xr), np.empty_like(xr), np.zeros(xr.shape, bool)
    assert shifted_exp(xr, m, e, t, dead)  # the last row lies below -200
    eta = EXP_ULP * 2.0**-52 + 3 * 2.0**-53
    worst = 0.0
    with mpmath.workprec(200):
        for i, j in np.ndindex(*x.shape):
            d = mpmath.mpf(float(xr[i, j])) - mpmath.mpf(float(m[i]))  # exact at 200 bits
            assert bool(dead[i, j]) == (d < -200)
            if d >= -200:
                want = mpmath.exp(d)
                worst = max(worst, float(abs(mpmath.mpf(float(e[i, j])) - want) / want))
    assert worst <= eta, (worst, eta)


@pytest.mark.parametrize("dt", [np.dtype(np.float32), BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("out", [np.dtype(np.float32), BF16], ids=["to-float32", "to-bfloat16"])
def test_rows_with_inexact_shifts_match_mp(dt, out):
    x = _rows_with_inexact_shifts(dt, np.random.default_rng(6))
    assert_bits_equal(oracle.softmax(x, out), mp.softmax(x, out), f"{dt} -> {out}")


def test_blocks_and_unkept_scratch_match_mp_and_keep_row_lists(monkeypatch):
    # Blocks of 2 rows and scratch never kept: special rows fall in different blocks.
    monkeypatch.setattr("diag.oracle._softmax.CHUNK_ELEMENTS", 2 * 30)
    monkeypatch.setattr("diag.oracle._workspace.KEEP_ELEMENTS", 30)
    x = (np.random.default_rng(2).standard_normal((7, 30)) * 4).astype(np.float32)
    x[1] = -np.inf
    x[4, 3] = np.nan
    x[5, 0] = np.inf
    x[6, ::2] = -np.inf
    res = oracle.softmax_result(x)
    assert res.extra == {"undefined_rows": [1], "nan_rows": [4, 5]}
    good = [0, 2, 3, 6]
    assert_bits_equal(res.value[good], mp.softmax(x[good]), "blocks")
    assert np.isnan(res.value[[1, 4, 5]]).all()


def test_kept_scratch_serves_shapes_in_turn_and_threads_apart():
    rng = np.random.default_rng(9)
    inputs = [(rng.standard_normal(s) * 3).astype(np.float32) for s in [(6, 200), (2, 37),
                                                                        (40, 9), (3, 500)]]
    want = [mp.softmax(x) for x in inputs]
    for x, w in zip(inputs * 2, want * 2):  # shrinking and growing the kept buffers
        assert_bits_equal(oracle.softmax(x), w, str(x.shape))
    errors: list[str] = []

    def work(k):
        for _ in range(30):
            x = inputs[k]
            if oracle.softmax(x).view(np.uint32).tolist() != want[k].view(np.uint32).tolist():
                errors.append(f"thread {k} {x.shape}")

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
