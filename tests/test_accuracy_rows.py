"""A row counts what it says: wrong outputs, non-finite mistakes, flushes, errors in ulps.

Claims under test: given outputs that this test builds from its own mpmath reference (the
correctly rounded bfloat16 value of exp at a few hundred inputs, then a known set of
mistakes: one step off, a flush to zero, a NaN, an Inf), `diag.accuracy.measure.measure`
counts exactly those mistakes, reports the largest error at the exact value the test
computes, names that input, and bins every output in its histogram. A baseline check names
a row whose figures changed and only that row; rows on one side only are not changes.
"""

from __future__ import annotations

import ml_dtypes
import mpmath
import numpy as np
import pytest

from diag.accuracy.baseline import baseline, check
from diag.accuracy.functions import FUNCTIONS
from diag.accuracy.measure import measure
from diag.accuracy.truth import truth

MP = mpmath.mp.clone()
MP.prec = 160
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_nearest(v) -> float:
    """mpmath's 8-bit nearest-even rounding in the normal range, 2^-133 steps below it."""
    if abs(v) < MP.mpf(2) ** -126:
        return float(MP.nint(v * MP.mpf(2) ** 133) * MP.mpf(2) ** -133)
    ctx = MP.clone()
    ctx.prec = 8
    return float(ctx.mpf(v))


def _step(value: float, up: bool) -> float:
    """The next bfloat16 value above or below a positive one (its bit pattern +- 1)."""
    bits = int(np.array(value, dtype=BF16).view(np.uint16)) + (1 if up else -1)
    return float(np.array(bits, dtype=np.uint16).view(BF16))


@pytest.fixture()
def exp_case(tmp_path):
    from diag.oracle.cache import GroundTruthCache

    # inputs whose exp is normal, subnormal (x near -90) and ordinary
    x = np.array([-0.5, 0.25, 1.0, 3.0, -2.0, 5.5, -90.0, -91.0, 10.0, 0.0], dtype=BF16)
    exact = [MP.exp(MP.mpf(float(v))) for v in x]
    right = np.array([bf16_nearest(v) for v in exact])
    t = truth(FUNCTIONS["exp"], x, "bfloat16", GroundTruthCache(tmp_path))
    return x, exact, right, t


def test_correct_outputs_make_a_clean_row(exp_case):
    x, _, right, t = exp_case
    row = measure(FUNCTIONS["exp"], x, right, t, backend="b", dtype="bfloat16")
    assert (row.not_correctly_rounded, row.nonfinite_wrong, row.flushed) == (0, 0, 0)
    assert row.max_ulp <= 0.5 and row.worst_inputs == []
    assert sum(c for _, c in row.histogram) == x.size == row.histogram[0][1]


def test_each_kind_of_mistake_is_counted_once(exp_case):
    x, exact, right, t = exp_case
    y = right.copy()
    y[1] = _step(right[1], up=True)  # one step off
    y[6] = 0.0  # exp(-90) is a bf16 subnormal: flushed
    y[3] = np.nan  # non-finite where the truth is finite
    y[8] = np.inf
    row = measure(FUNCTIONS["exp"], x, y, t, backend="b", dtype="bfloat16")
    assert row.not_correctly_rounded == 4
    assert row.nonfinite_wrong == 2
    assert row.flushed == 1
    # errors at the exact value: |y - e^x| / ulp(e^x), e from the exact value's binade
    def err(i):
        e = max(int(MP.frexp(exact[i])[1]) - 1, -126)
        return float(abs(MP.mpf(y[i]) - exact[i]) / MP.mpf(2) ** (e - 7))

    want = max(err(1), err(6))
    assert row.max_ulp == pytest.approx(want, rel=1e-9)
    assert row.worst_input["input"] == float(x[6 if err(6) > err(1) else 1])
    assert row.worst_input["correct"] == right[6 if err(6) > err(1) else 1]
    assert sum(c for _, c in row.histogram) == x.size - 2  # the two non-finite are not binned


def test_a_check_names_the_changed_row_only(exp_case):
    x, _, right, t = exp_case
    a = measure(FUNCTIONS["exp"], x, right, t, backend="b", dtype="bfloat16")
    other = measure(FUNCTIONS["exp"], x, right, t, backend="c", dtype="bfloat16")
    y = right.copy()
    y[0] = _step(right[0], up=False)
    changed = measure(FUNCTIONS["exp"], x, y, t, backend="b", dtype="bfloat16")
    found = check([changed, other], baseline([a]))
    assert list(found.changed) == ["b exp bfloat16"] and found.exit_code == 1
    assert found.new == ["c exp bfloat16"] and found.missing == []
    assert check([a], baseline([a, other])).exit_code == 0
