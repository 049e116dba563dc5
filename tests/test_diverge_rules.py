"""The rules diag.diverge judges by (diag/diverge/_rules.py, docs/diverge.md), on arrays whose
answers are known: ULP sizes, the own-error bound per op class, the carried-error threshold,
and the ledger's choice of `first` for each rule.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from diag import numerics
from diag.diverge.ledger import Ledger
from diag.diverge.rules import carried_error, op_class, own_error, ulp_of
from diag.tolerance.diverge import DIVERGE_LIBRARY_ULP as LIBRARY_ULP
from diag.tolerance.diverge import DIVERGE_ROUNDED_ULP as ROUNDED_ULP
from diag.tolerance.diverge import diverge_carried_threshold as carried_threshold
from diag.tolerance.diverge import diverge_tap_allowance as tap_allowance

F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


def test_ulp_of_matches_the_spacing_of_the_dtype():
    x = np.random.default_rng(0).normal(0, 1e3, 1000)
    want = np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)
    assert np.array_equal(ulp_of(x, F32), want)
    assert ulp_of(np.array([0.0, 1e-45]), F32).tolist() == [2.0 ** -149] * 2  # subnormal step
    assert ulp_of(np.array([1.0, 256.0, 257.0]), BF16).tolist() == [2.0 ** -7, 2.0, 2.0]


def test_thresholds_are_half_the_significand_and_taps_two_thirds():
    assert carried_threshold("float32") == 2.0 ** -12
    assert carried_threshold("bfloat16") == 2.0 ** -4
    assert carried_threshold("float16") == pytest.approx(2.0 ** -5.5)
    assert tap_allowance("float32") == pytest.approx(2.0 ** -16)
    assert tap_allowance("bfloat16") == pytest.approx(2.0 ** (-16 / 3))


def test_a_correctly_rounded_result_is_within_every_bound():
    r = np.random.default_rng(1).normal(0, 1, 4096)
    y = r.astype(np.float32).astype(np.float64)
    for cls in ("rounded", "library", "structural", "composite"):
        ulps, ratio = own_error(y, r, F32, cls)
        assert ulps <= 0.5 and ratio <= 0.5 / ROUNDED_ULP


def test_an_op_computed_in_bf16_where_float32_is_claimed_breaks_its_bound():
    r = np.random.default_rng(2).normal(0, 1, 4096)
    y = r.astype(ml_dtypes.bfloat16).astype(np.float64)  # 8 bits where 24 were claimed
    ulps, ratio = own_error(y, r, F32, "rounded")
    want = float(np.max(numerics.ulp_distance(y.astype(np.float32), r.astype(np.float32))))
    assert abs(ulps - want) <= 0.5 and ratio > 1000
    assert own_error(y, r, F32, "library")[1] == pytest.approx(ratio * ROUNDED_ULP / LIBRARY_ULP,
                                                             rel=1e-6)


def test_a_reduction_is_judged_by_gamma_n_times_the_sum_of_magnitudes():
    x = np.random.default_rng(3).uniform(-1, 1, 1000)
    exact = float(x.sum())
    mag, n = float(np.abs(x).sum()), 1000
    bound = numerics.gamma(n, F32) * mag
    y = np.array(exact + 0.5 * bound)  # inside the textbook bound, beyond gamma_n |sum|
    calls = []

    def facts():
        calls.append(1)
        return np.array(mag), np.array(float(n))

    _, ratio = own_error(y, np.array(exact), F32, "reduction", facts=facts, terms=n)
    assert calls and 0.45 < ratio < 0.5  # the full bound was needed, and clears it
    y = np.array(exact + 3 * bound)
    assert own_error(y, np.array(exact), F32, "reduction", facts=facts, terms=n)[1] > 2.9


def test_carried_error_is_normwise_and_infinite_for_an_overflow():
    s = np.array([1000.0, 1e-3])
    y = np.array([1000.0, 2e-3])  # the small element is 100% off, the tensor 1e-6
    rel, _ = carried_error(y, s, F32)
    assert rel == pytest.approx(1e-3 / 1000.0)
    assert carried_error(np.array([np.inf]), np.array([7e4]), np.dtype(np.float16))[0] == math.inf
    assert carried_error(np.array([np.inf]), np.array([np.inf]), np.dtype(np.float16))[0] == 0


def test_op_classes_are_data():
    assert [op_class(n) for n in ("add", "exp", "dot_general", "reshape", "aten._softmax")] == [
        "rounded", "library", "reduction", "structural", "composite"]


def _measure(ledger, name, y, r, s, carried_in, threshold):
    return ledger.measure(name, name, y, r, s, F32, carried_in, threshold,
                          lambda: ("here.py:1 (f)", ""), "", "forward")


def test_the_ledger_names_the_op_that_breaks_its_bound_first():
    r = np.random.default_rng(4).normal(0, 1, 64)
    thr = carried_threshold("float32")
    led = Ledger()
    exact = r.astype(np.float32).astype(np.float64)
    _measure(led, "add", exact, r, r, [(0.0, thr)], thr)
    assert led.first is None
    low = r.astype(ml_dtypes.bfloat16).astype(np.float64)
    _measure(led, "mul", low, r, r, [(0.0, thr)], thr)
    assert led.first.primitive == "mul" and "own error" in led.first.reason
    rep = led.report("jax", "f", 0.0)
    assert rep.first.own_ratio > 1 and rep.first.source == "here.py:1 (f)"


def test_the_ledger_names_where_the_carried_error_crossed_not_where_it_travelled():
    thr = carried_threshold("float32")
    led = Ledger()
    s = np.array([1.0])
    # A structural op never starts a divergence; an op whose inputs already crossed neither.
    _measure(led, "reshape", np.array([1.1]), np.array([1.1]), s, [(0.0, thr)], thr)
    _measure(led, "add", np.array([1.1]), np.array([1.1]), s, [(0.1, thr)], thr)
    assert led.first is None
    _measure(led, "sub", np.array([1.1]), np.array([1.1]), s, [(1e-7, thr)], thr)
    assert led.first.primitive == "sub" and led.first.carried == pytest.approx(0.1)
    # A composite op's own error is shown but does not decide (its bound is a guess).
    led = Ledger()
    r = np.random.default_rng(5).normal(0, 1, 64)
    _measure(led, "aten._fused_thing", r + 1e-3, r, r + 1e-3, [(0.0, thr)], thr)
    assert led.entries[0].own_ratio > 1 and led.first is None
    # An upcast value keeps the threshold of the narrow dtype it came from.
    led = Ledger()
    _measure(led, "convert_element_type", np.array([1.001]), np.array([1.001]), s,
             [(1e-3, carried_threshold("float16"))], carried_threshold("float16"))
    assert led.first is None
