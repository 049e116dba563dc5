"""`diag.diverge.decisions` on its own (numpy only): what counts as a flip, forced or made,
the written value of a literal, the verdict, and how the curve draws inf and NaN. Expected
answers come from bf16 values written out here (bf16 has 8 significand bits: its spacing is
2^-7 in [1, 2) and 2^-8 in [0.5, 1))."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from diag.diverge.decisions import judge_decision, verdict, written_literal
from diag.diverge.records import ShadowReport

BF16 = ml_dtypes.bfloat16
STEP = 2.0**-7  # one bf16 step in [1, 2)


def judge(kind, low, exact, *operands):
    return judge_decision(
        kind,
        np.asarray(low),
        np.asarray(exact),
        dtype=np.dtype(BF16),
        operands_low=[],
        operands_exact=[np.asarray(o, np.float64) for o in operands],
    )


def test_a_comparison_closer_than_one_bf16_step_is_forced():
    a, b = np.array([1.0 + STEP / 8, 1.5]), np.array([1.0, 1.0])  # a > b; a rounds to b
    flipped, total, margin, forced = judge("compare", a.astype(BF16) > b, a > b, a, b)
    assert (flipped, total, forced) == (1, 2, True)
    assert margin == pytest.approx(1 / 8)


def test_a_comparison_several_steps_apart_that_flips_is_made():
    a, b = np.array([1.0 + 3 * STEP]), np.array([1.0])  # rounding keeps a > b
    flipped, _, margin, forced = judge("compare", [False], a > b, a, b)
    assert (flipped, forced) == (1, False) and margin == pytest.approx(3.0)


def test_agreeing_decisions_flip_nothing():
    a, b = np.array([1.0, 2.0]), np.array([1.5, 1.5])
    assert judge("compare", a > b, a > b, a, b)[:2] == (0, 2)
    assert judge("argmax", [1], [1], [[1.0, 2.0, 0.0]])[0] == 0


def test_argmax_counts_a_tie_in_float64_as_no_flip():
    x = [[1.0, 1.0, 0.5]]  # two equal maxima: either index is right
    assert judge("argmax", [1], [0], x)[0] == 0
    x = [[1.0, 1.0 + STEP / 4, 0.5]]
    flipped, _, _, forced = judge("argmax", [0], [1], x)
    assert (flipped, forced) == (1, True)
    x = [[1.0, 1.0 + 4 * STEP, 0.5]]
    assert judge("argmax", [0], [1], x)[3] is False


def test_top_k_compares_kept_sets_not_order():
    x = [[3.0, 2.0, 1.0, 1.0 + STEP / 4]]
    assert judge("top_k", [[1, 0]], [[0, 1]], x)[0] == 0  # the same set, other order
    flipped, total, _, forced = judge("top_k", [[0, 1, 2]], [[0, 1, 3]], x)
    assert (flipped, total, forced) == (1, 3, True)
    x = [[3.0, 2.0, 1.0, 1.25]]
    assert judge("top_k", [[0, 1, 2]], [[0, 1, 3]], x)[3] is False


def test_written_literal_is_found_on_the_line(tmp_path):
    src = tmp_path / "s.py"
    src.write_text("x = 1\nmask = cumsum - p > 0.9  # a 2 here\n")
    used = float(np.float64(0.9).astype(BF16))
    assert used != 0.9
    assert written_literal(str(src), 2, used, np.dtype(BF16)) == "0.9"
    assert written_literal(str(src), 2, 0.5, np.dtype(BF16)) is None
    assert written_literal(str(src), 1, used, np.dtype(BF16)) is None


def report(**kw):
    base = dict(
        framework="jax",
        function="f",
        first=None,
        ops=(),
        curve=(),
        n_ops=0,
        result_error=0.0,
        result_threshold=0.0625,
    )
    return ShadowReport(**{**base, **kw})


def test_a_result_past_its_threshold_is_never_clean():
    code, why = verdict(report(result_error=1.27))
    assert code == 1 and "1.27" in why
    assert verdict(report(result_error=0.01)) == (0, "")
    assert verdict(report(result_error=math.nan))[0] == 1


def test_the_curve_says_inf_and_nan_and_never_calls_a_large_error_inf():
    from diag import render

    parts = [str(p) for p in render.diverge_tables(report(curve=(1e-3, 2e3, math.inf)))]
    curve = next(p for p in parts if p.startswith("carried error along"))
    assert "2e+03" in curve or "2000" in curve
    assert "1 inf" in curve and "NaN" not in curve
    parts = [str(p) for p in render.diverge_tables(report(curve=(1e-3, math.nan)))]
    curve = next(p for p in parts if p.startswith("carried error along"))
    assert "1 NaN" in curve and curve.endswith("?")


def test_forced_flips_warn_and_say_what_they_cost_the_result():
    from diag.diverge.decisions import DecisionRecord

    d = DecisionRecord(
        index=0, primitive="gt", kind="compare", source="s.py:3 (f)", library="", path="",
        phase="forward", dtype="bfloat16", flipped=1, total=4, margin_ulps=0.25,
        cause="forced by rounding", cause_op="", verdict="warn", reason="forced",
    )  # fmt: skip
    code, why = verdict(report(decisions=(d,), first_decision=d, result_error=1.27))
    assert code == 0 and "forced by rounding" in why and "1.27" in why
    assert verdict(report(decisions=(d,), first_decision=d))[0] == 0
    made = DecisionRecord(**{**d.__dict__, "verdict": "fail", "cause": "made by the computation"})
    assert verdict(report(decisions=(d, made), first_decision=d))[0] == 1
