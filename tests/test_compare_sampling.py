"""The sampling checks fail on broken implementations and pass on correct ones.

Claims under test, each as a should-fail / should-pass pair on real computed metrics:
softmax: a float32 softmax passes the worst-case float32 bound; one that sums in bfloat16, or
skips the max subtraction at logits near 1e4, fails; fully masked rows are a hazard (warn, with
what the backend returned), never a fail. top-k: the exact top-k and implementations that order
ties, NaN or signed zeros differently pass (semantics reported, observed from the output); one
that drops the maximum, repeats an index, returns values that are not x[idx], is unsorted, or
has an out-of-range index fails; recall counts ties by value; approximate top-k is judged
against its recall target per row and on average. greedy: every path that picks the exact argmax
passes; an argmax over logits rounded to fewer bits (the incident: near-tied logits become
equal and the first wins) fails with the disagreeing rows and their logits; batch dependence is
reported.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import diag.oracle as oracle
from diag.compare.topk import check_top_k, describe_topk_semantics, judge_top_k
from diag.probes.greedy_token import check_greedy, judge_greedy
from diag.probes.softmax import compare_softmax, judge_softmax
from diag.tolerance import softmax_ulp_tolerance
from diag.errors import UsageError
from tests.conftest import needs_jax

BF16 = np.dtype(ml_dtypes.bfloat16)


# --- softmax ----------------------------------------------------------------------------------

def f32_softmax(x):
    """A correct float32 softmax: subtract the max, exp, sum and divide, all in float32."""
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True, dtype=np.float32)


def bf16_sum_softmax(x):
    """Broken: the row sum is accumulated in bfloat16 (stagnates once the sum is large)."""
    e = np.exp(x.astype(np.float32) - x.max(axis=-1, keepdims=True)).astype(BF16)
    s = np.zeros(x.shape[0], BF16)
    for j in range(x.shape[1]):
        s = (s + e[:, j]).astype(BF16)
    return (e.astype(np.float32) / s.astype(np.float32)[:, None]).astype(np.float32)


def test_float32_softmax_should_pass():
    x = (np.random.default_rng(0).standard_normal((4, 4096)) * 5).astype(np.float32)
    truth = oracle.softmax(x)
    m = compare_softmax(f32_softmax(x), truth, x)
    status, reason = judge_softmax(m, "float32")
    assert status == "pass", reason
    assert 0 < m["max_ulp"] < 200 and m["bound_ratio"] < 0.1
    assert m["sum_to_one_max_err"] < 1e-5 and m["hazard"] is None
    json.dumps(m)


def test_bf16_summed_softmax_should_fail():
    x = np.random.default_rng(1).standard_normal((4, 1024)).astype(np.float32)
    m = compare_softmax(bf16_sum_softmax(x), oracle.softmax(x), x)
    status, reason = judge_softmax(m, "float32")
    assert status == "fail" and m["bound_exceeded"] > 0 and m["bound_ratio"] > 10
    assert "exceeds the float32 arithmetic bound" in reason and "allowed ±" in reason
    assert m["sum_to_one_max_err"] > 1e-3  # taken exactly: the broken sum shows here too


def test_softmax_without_max_subtraction_near_1e4_should_fail():
    x = (1e4 + np.random.default_rng(2).standard_normal((2, 256))).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)  # overflows to inf: inf / inf = NaN
        naive = e / e.sum(axis=-1, keepdims=True)
    m = compare_softmax(naive, oracle.softmax(x), x)
    status, reason = judge_softmax(m, "float32")
    assert status == "fail" and m["unexpected_nonfinite"] == x.size
    assert "NaN/Inf where the exact result is finite" in reason
    assert judge_softmax(compare_softmax(f32_softmax(x), oracle.softmax(x), x), "float32")[0] \
        == "pass"


@pytest.mark.parametrize("fill,kind", [(np.nan, "nan"), (0.0, "zeros"), (1 / 8, "uniform")])
def test_fully_masked_rows_are_a_hazard_not_a_fail(fill, kind):
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    x[1] = -np.inf
    x[2, :4] = -np.inf  # half masked: defined, judged as usual
    truth = oracle.softmax(x)
    out = f32_softmax(x)
    out[1] = fill
    m = compare_softmax(out, truth, x)
    status, reason = judge_softmax(m, "float32")
    assert status == "warn", reason
    assert m["hazard"]["fully masked (all -inf)"]["returned"] == {kind: 1}
    assert m["defined_rows"] == 3 and f"returns {kind} in 1 (first: row 1)" in reason


def test_narrow_elementwise_softmax_warns_not_fails():
    # x - max and exp rounded to bf16 (as jax's bf16 softmax on CPU), sum in float32: beyond
    # the float32 bound, within the bound of that narrower arithmetic -> warn.
    x = (np.random.default_rng(4).standard_normal((4, 2048)) * 5).astype(BF16)
    xf = x.astype(np.float32)
    d = (xf - xf.max(axis=-1, keepdims=True)).astype(BF16).astype(np.float32)
    e = np.exp(d).astype(BF16).astype(np.float32)
    out = (e / e.sum(axis=-1, keepdims=True)).astype(BF16)
    m = compare_softmax(out, oracle.softmax(x), x)
    status, reason = judge_softmax(m, "bfloat16")
    assert status == "warn" and m["bound_exceeded"] > 0 and m["narrow_bound_exceeded"] == 0
    assert "consistent with x - max, exp and the division done in bfloat16" in reason


def test_ulp_tolerance_grows_with_row_length():
    assert softmax_ulp_tolerance("float32", 1024) < softmax_ulp_tolerance("float32", 32768)
    assert softmax_ulp_tolerance("bfloat16", 32768) < softmax_ulp_tolerance("float32", 32768)


@needs_jax
def test_jax_float32_softmax_should_pass():
    import jax

    x = (np.random.default_rng(5).standard_normal((2, 4096)) * 5).astype(np.float32)
    out = np.asarray(jax.nn.softmax(x, axis=-1))
    status, reason = judge_softmax(compare_softmax(out, oracle.softmax(x), x), "float32")
    assert status == "pass", reason


# --- top-k ------------------------------------------------------------------------------------

def rows_with_ties(n_rows=6, n=300, seed=0):
    return (np.round(np.random.default_rng(seed).standard_normal((n_rows, n)) * 4) / 4
            ).astype(np.float32)


def test_exact_top_k_should_pass():
    x = rows_with_ties()
    v, i = oracle.top_k(x, 20)
    m = check_top_k(x, v, i, 20)
    assert judge_top_k(m, approx=False)[0] == "pass"
    assert m["recall_min"] == 1.0 and m["invalid_rows"] == m["wrong_rows"] == 0
    assert m["semantic_diff_rows"] == 0
    json.dumps(m)


def broken(kind, x, k):
    v, i = oracle.top_k(x, k)
    v, i = v.copy(), i.copy()
    if kind == "drops the max":
        i[:, :-1], v[:, :-1] = i[:, 1:].copy(), v[:, 1:].copy()
        nxt = oracle.top_k(x, k + 1)
        i[:, -1], v[:, -1] = nxt[1][:, k], nxt[0][:, k]
    elif kind == "duplicate index":
        i[:, 1], v[:, 1] = i[:, 0], v[:, 0]
    elif kind == "values not x[idx]":
        v[:, 3] = np.nextafter(v[:, 3], np.float32(-np.inf))
    elif kind == "unsorted":
        v[:, [0, 5]], i[:, [0, 5]] = v[:, [5, 0]], i[:, [5, 0]]
    elif kind == "index out of range":
        i[:, -1] = x.shape[-1]
    return v, i


@pytest.mark.parametrize("kind,field", [
    ("drops the max", "wrong_rows"), ("duplicate index", "duplicate_rows"),
    ("values not x[idx]", "value_mismatch_rows"), ("unsorted", "unsorted_rows"),
    ("index out of range", "out_of_range_rows")])
def test_broken_top_k_should_fail(kind, field):
    x = np.random.default_rng(1).standard_normal((5, 400)).astype(np.float32)
    v, i = broken(kind, x, 10)
    m = check_top_k(x, v, i, 10)
    status, reason = judge_top_k(m, approx=False)
    assert status == "fail", reason
    assert m[field] == 5
    if kind == "drops the max":
        assert m["misses_max_rows"] == 5 and m["recall_min"] == 0.9
        assert "misses the row maximum" in reason


def test_top_k_check_takes_the_truth_it_is_given():
    """Truth flows forward: check_top_k reports the exact top-k the runner handed it (here a
    marked copy whose values differ from the oracle's in the last column) and the probe's
    evaluate hands it the cached oracle result, so nothing recomputes the truth."""
    from diag.compare.outcome import Outcome
    from diag.plan.registry import PROBES

    x = np.random.default_rng(2).standard_normal((3, 50)).astype(np.float32)
    v, i = broken("drops the max", x, 4)
    tv, ti = oracle.top_k(x, 4)
    marked = tv.copy()
    marked[:, -1] = -123.0
    m = check_top_k(x, v, i, 4, truth=(marked, ti))
    assert m["wrong_examples"][0]["expected"][-1] == -123.0
    assert check_top_k(x, v, i, 4)["wrong_examples"][0]["expected"][-1] != -123.0
    result = oracle.top_k_result(x, 4)
    result.value[:, -1] = -123.0  # what a cached truth says is what the verdict shows
    ev = PROBES["top_k"].evaluate(Outcome(inputs=[x], outputs=[v, i], names=["values", "indices"],
                                          truth=result, params={"k": 4}))
    assert ev.status == "fail" and ev.metrics["wrong_examples"][0]["expected"][-1] == -123.0


def test_recall_counts_ties_by_value_and_never_rewards_missing_a_larger_value():
    x = np.array([[5.0, 3.0, 3.0, 3.0]], np.float32)
    # Returning a different 3 than the oracle is as good: recall 1, not wrong.
    m = check_top_k(x, np.array([[5.0, 3.0]], np.float32), np.array([[0, 3]]), 2)
    assert m["recall_min"] == 1.0 and judge_top_k(m, approx=False)[0] == "pass"
    assert m["semantic_diff_rows"] == 1
    # {3, 3} instead of {5, 3}: recall 1/2 and wrong (5 is larger than a returned 3).
    m = check_top_k(x, np.array([[3.0, 3.0]], np.float32), np.array([[1, 2]]), 2)
    assert m["recall_min"] == 0.5 and m["wrong_rows"] == 1 and m["misses_max_rows"] == 1


def test_other_tie_nan_and_zero_orders_are_semantics_not_errors():
    x = np.array([[1.0, np.nan, 3.0, -0.0, 0.0, 3.0, np.inf, 3.0]], np.float32)
    # NaN ranked smallest, ties highest index first, +0 ranked above -0 (a numpy-style order).
    order = [6, 7, 5, 2, 0, 4, 3, 1]
    v, i = x[:, order], np.array([order])
    m = check_top_k(x, v, i, 8)
    status, reason = judge_top_k(m, approx=False)
    assert status == "pass", reason
    assert m["semantics"] == ["+0 ranked above -0", "NaN ranked smallest",
                              "ties: highest index first"]
    assert m["semantic_diff_rows"] == 1 and "order semantics" in reason
    # The same with k = 4: NaN left out is also "ranked smallest", not a miss.
    m = check_top_k(x, v[:, :4], i[:, :4], 4)
    assert judge_top_k(m, approx=False)[0] == "pass" and m["recall_min"] == 1.0
    assert describe_topk_semantics(x, *oracle.top_k(x, 8)) == [
        "-0 and +0 ranked equal (index order)", "NaN ranked largest", "ties: lowest index first"]


def test_nan_in_the_middle_is_not_sorted():
    x = np.array([[1.0, np.nan, 3.0, 2.0]], np.float32)
    m = check_top_k(x, x[:, [2, 1, 3, 0]], np.array([[2, 1, 3, 0]]), 4)
    assert judge_top_k(m, approx=False)[0] == "fail" and m["unsorted_rows"] == 1


def bucket_topk(x, k, buckets):
    """An approx_max_k in the style of the TPU algorithm: max of each bucket (j mod buckets),
    then the top k of those maxima. Always returns the row maximum."""
    rows, n = x.shape
    idx = np.empty((rows, k), np.int64)
    for r in range(rows):
        cols = np.arange(n).reshape(-1, buckets)
        best = cols[np.argmax(x[r][cols], axis=0), np.arange(buckets)]
        idx[r] = best[np.argsort(-x[r][best], kind="stable")[:k]]
    return np.take_along_axis(x, idx, axis=1), idx


def test_approx_top_k_judged_against_its_recall_target():
    x = np.random.default_rng(7).standard_normal((16, 4096)).astype(np.float32)
    v, i = bucket_topk(x, 16, 256)  # 256 buckets for k = 16: mean recall ~0.96
    m = check_top_k(x, v, i, 16, recall_target=0.9)
    assert m["misses_max_rows"] == 0 and 0.9 <= m["recall_mean"] < 1.0
    assert m["misses_larger_rows"] > 0 and m["wrong_rows"] == 0  # misses are recall, not wrong
    status, reason = judge_top_k(m, approx=True, recall_target=0.9)
    assert m["rows_below_target"] > 0 and m["recall_min"] < 0.9
    assert status == "warn" and f"min recall {m['recall_min']:.4g}" in reason
    # The same output promised 0.99: mean below target -> fail.
    m99 = check_top_k(x, v, i, 16, recall_target=0.99)
    status, reason = judge_top_k(m99, approx=True, recall_target=0.99)
    assert status == "fail" and "below the promised 0.99" in reason
    # As an exact top-k it is wrong.
    assert judge_top_k(check_top_k(x, v, i, 16), approx=False)[0] == "fail"


def test_approx_top_k_some_rows_below_target_warns():
    x = np.random.default_rng(8).standard_normal((8, 1024)).astype(np.float32)
    v, i = oracle.top_k(x, 10)
    bad_v, bad_i = broken("drops the max", x, 10)
    v, i = v.copy(), i.copy()
    v[0], i[0] = bad_v[0], bad_i[0]  # row 0 misses its max: wrong even for an approx op
    m = check_top_k(x, v, i, 10, recall_target=0.95)
    assert judge_top_k(m, approx=True, recall_target=0.95)[0] == "fail"
    # Replace the 10th-largest instead of the max: recall 0.9 in one row, mean 0.9875.
    v, i = oracle.top_k(x, 11)
    v, i = np.concatenate([v[:, :9], v[:, 10:]], 1), np.concatenate([i[:, :9], i[:, 10:]], 1)
    v[1:], i[1:] = oracle.top_k(x[1:], 10)
    m = check_top_k(x, v, i, 10, recall_target=0.95)
    status, reason = judge_top_k(m, approx=True, recall_target=0.95)
    assert status == "warn" and m["rows_below_target"] == 1 and m["recall_min"] == 0.9
    assert "1 / 8 rows fall below it" in reason and "at row 0" in reason


def test_approx_top_k_with_more_candidates_judges_the_best_k():
    # aggregate_to_topk=False: L > k unsorted candidates; the best k of them are judged.
    x = np.random.default_rng(9).standard_normal((4, 2048)).astype(np.float32)
    v, i = bucket_topk(x, 256, 256)
    perm = np.random.default_rng(0).permutation(256)
    m = check_top_k(x, v[:, perm], i[:, perm], 16, recall_target=0.95)
    assert m["returned"] == 256 and m["unsorted_rows"] == 0
    assert judge_top_k(m, approx=True, recall_target=0.95)[0] in ("pass", "warn")
    rnd = np.random.default_rng(1).choice(2048, (4, 256))  # completely wrong candidates
    m = check_top_k(x, np.take_along_axis(x, rnd, 1), rnd, 16, recall_target=0.95)
    assert judge_top_k(m, approx=True, recall_target=0.95)[0] == "fail"


def test_check_top_k_refuses_too_few_columns():
    x = np.zeros((2, 10), np.float32)
    with pytest.raises(UsageError, match="fewer than k"):
        check_top_k(x, x[:, :3], np.zeros((2, 3), np.int64), 4)


# --- greedy tokens ----------------------------------------------------------------------------

def near_tie_logits(rows=64, vocab=512, seed=0):
    """bf16 logits whose top two are one bf16 ulp apart, the larger at either index."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)).astype(BF16)
    bits = x.view(np.uint16)
    for r in range(rows):
        a, b = sorted(rng.choice(vocab, 2, replace=False))
        m = np.abs(x[r].astype(np.float32)).max() + 1
        base = np.array(m, np.float32).astype(BF16).view(np.uint16)
        hi_at = a if r % 2 else b  # the true maximum at the lower or the higher index
        bits[r, a] = bits[r, b] = base
        bits[r, hi_at] = base + 1
    return x


def incident_argmax(x):
    """Broken: argmax after rounding the logits to float8 (fewer bits): near-ties become equal
    and the first index wins, exactly the dropped-token incident."""
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32).argmax(axis=-1)


def test_greedy_correct_paths_should_pass():
    x = near_tie_logits()
    exact = x.astype(np.float32).argmax(axis=-1)
    m = check_greedy(x, {"jit/argmax": exact, "eager/top_k": exact,
                         "batch1/argmax": exact, "batch8/argmax": exact})
    status, reason = judge_greedy(m)
    assert status == "pass", reason
    assert m["unique_rows"] == 64 and m["tied_rows"] == 0
    json.dumps(m)


def test_greedy_incident_argmax_should_fail_with_its_rows_and_logits():
    x = near_tie_logits()
    exact = x.astype(np.float32).argmax(axis=-1)
    m = check_greedy(x, {"jit/argmax": exact, "jit/argmax_lowprec": incident_argmax(x)})
    status, reason = judge_greedy(m)
    assert status == "fail" and m["disagreeing_paths"] == ["jit/argmax_lowprec"]
    p = m["paths"]["jit/argmax_lowprec"]
    # Wrong only where the true maximum sits at the higher index (odd rows are right) and
    # float8 rounding merged the pair: most of those 32 rows.
    wrong = np.flatnonzero(incident_argmax(x) != exact)
    assert p["disagree"] == wrong.size > 16 and (wrong % 2 == 0).all()
    ex = p["examples"][0]
    assert ex["chosen"] != ex["expected"] and ex["top3"][0]["index"] == ex["expected"]
    b0, b1 = (int(t["bits"], 16) for t in ex["top3"][:2])
    assert b0 - b1 == 1  # one bf16 ulp apart, shown as bits
    assert f"jit/argmax_lowprec {wrong.size} of 64 rows" in reason


def test_greedy_batch_dependence_is_reported():
    x = near_tie_logits(rows=16)
    exact = x.astype(np.float32).argmax(axis=-1)
    x[3, :] = 0  # row 3: every logit tied, any token is a maximum
    flipped = exact.copy()
    flipped[3] = 7
    exact[3] = 0
    m = check_greedy(x, {"batch1/argmax": exact, "batch8/argmax": flipped,
                         "batch64/argmax": exact})
    status, reason = judge_greedy(m)
    assert status == "warn" and m["tied_rows"] == 1
    assert m["batch_dependence"]["argmax"]["rows_differ"] == 1
    assert "depends on the batch size in 1 / 16 rows" in reason
    # On a row with a unique maximum the batch-dependent choice is also plainly wrong: fail.
    flipped[5] = (flipped[5] + 1) % x.shape[1]
    m = check_greedy(x, {"batch1/argmax": exact, "batch8/argmax": flipped})
    assert judge_greedy(m)[0] == "fail" and m["batch_dependence"]["argmax"]["rows_differ"] == 2


def test_greedy_non_maximal_token_on_a_tied_row_fails():
    x = np.zeros((2, 4), BF16)
    x[0, 1] = x[0, 2] = 1.0
    m = check_greedy(x, {"argmax": np.array([0, 0])})
    assert m["tied_rows"] == 2 and m["paths"]["argmax"]["wrong_on_tie"] == 1
    assert judge_greedy(m)[0] == "fail"


def test_check_greedy_refuses_wrong_shapes():
    with pytest.raises(UsageError, match="3 tokens for 2 rows"):
        check_greedy(np.zeros((2, 4), BF16), {"argmax": np.zeros(3, np.int64)})
