"""Decisions in a JAX sampler (issue 33): the shadow compares every comparison, argmax and top-k
cut with float64 and says whether a flip was forced by rounding or made by the computation.

The samplers are written as flax/gemma samplers are (`jax.nn.softmax`, a full `jax.lax.top_k`,
`jnp.cumsum`, a 0.9 top-p literal, greedy `argmax`, temperature division) and run in bfloat16
under `jax.jit` on 32k-token logits. Every expected answer comes from an independent float64
numpy computation here: the kept set or token of the float64 sampler against the one the
jitted bf16 sampler returns, and "forced" when rounding the float64 operands of every flipped
element once to bf16 ties or reverses them.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_diag

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import diag.diverge  # noqa: E402

BF16 = ml_dtypes.bfloat16
VOCAB = 32_000
TOP_P = 0.9
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@jax.jit
def top_p_sampler(logits, temperature):
    logits = logits / temperature
    probs = jax.nn.softmax(logits, axis=-1)
    probs_sorted, indices = jax.lax.top_k(probs, k=probs.shape[-1])
    cumsum = jnp.cumsum(probs_sorted, axis=-1)
    mask = cumsum - probs_sorted > 0.9
    greedy = jnp.argmax(logits, axis=-1)
    return greedy, mask, indices


@jax.jit
def argsort_top_p_sampler(logits, temperature):
    """Top-p through an argsort and `take_along_axis`, as ports of transformers' warper do."""
    probs = jax.nn.softmax(logits / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    probs_sorted = jnp.take_along_axis(probs, order, axis=-1)
    cumsum = jnp.cumsum(probs_sorted, axis=-1)
    return cumsum - probs_sorted > 0.9, order


@partial(jax.jit, static_argnames="k")
def top_k_sampler(logits, temperature, k):
    _, indices = jax.lax.top_k(logits / temperature, k=k)
    return indices


@jax.jit
def greedy_logprob(logits, temperature):
    return jnp.argmax(jax.nn.log_softmax(logits / temperature, axis=-1), axis=-1)


# -- float64 truth -----------------------------------------------------------------------


def rd(x):
    """Round float64 values once to bf16 (and back to float64)."""
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


def f64(x):
    return np.asarray(x).astype(np.float64)


def top_p_truth(x, t):
    """(greedy, mask in float64 sorted order, order, cumsum - p) of the float64 sampler."""
    z = f64(x) / float(f64(t))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ps = np.take_along_axis(p, order, -1)
    before = np.cumsum(ps, -1) - ps
    return z.argmax(-1), before > TOP_P, order, before


def forced_compare(a, b):
    """Per element: one rounding of the float64 operands ties or reverses a - b."""
    return np.sign(rd(a) - rd(b)) != np.sign(a - b)


def shadow(fn, *args, **kw):
    return diag.diverge.shadow(fn, *args, **kw)


def decisions_of(report, primitive):
    return [d for d in report.decisions if d.primitive == primitive]


def bf16(x):
    return jnp.asarray(x, jnp.bfloat16)


def background(mean, scale, seed=0):
    return np.random.default_rng(seed).normal(mean, scale, (1, VOCAB))


# -- top-p cut ----------------------------------------------------------------------------


TOP_P_CASES = {
    # flat over 32k tokens: the cut lands among thousands of tiny probabilities
    "flat": (background(0.0, 2.0), 1.0),
    "flat_hot": (background(0.0, 2.0, seed=1) * 50 + 300, 50.0),
    # logits ~1e2-1e4 with a temperature: the division's rounding moves the mass
    "large": (background(2000.0, 3.0, seed=2), 0.7),
    # one token holds most of the mass: nothing near the cut
    "peaked": (np.concatenate([[12.0], background(-5.0, 1.0, seed=3)[0, 1:]])[None], 1.0),
}


@pytest.mark.parametrize("case", sorted(TOP_P_CASES))
def test_a_top_p_cut_is_flagged_exactly_when_the_kept_set_differs(case):
    x, t = TOP_P_CASES[case]
    logits, temp = bf16(x), bf16(t)
    greedy, mask, indices = (np.asarray(v) for v in top_p_sampler(logits, temp))
    g64, mask64, order, before = top_p_truth(logits, temp)
    kept = set(indices[0][~mask[0]].tolist())
    kept64 = set(order[0][~mask64[0]].tolist())
    report = shadow(top_p_sampler, logits, temp)
    cut = [d for d in report.decisions if d.primitive == "gt"]
    assert bool(cut) == (kept != kept64), (case, len(kept), len(kept64))
    assert (greedy[0] != g64[0]) == bool(decisions_of(report, "argmax"))
    assert [(lit.written, lit.used) for lit in report.literals] == [
        ("0.9", repr(float(rd(0.9))))
    ]
    if cut:
        d = cut[0]
        assert d.kind == "threshold" and d.source.endswith("(top_p_sampler)")
        flipped = mask[0] != mask64[0]
        assert d.flipped == int(flipped.sum())
        # the literal is taken at its written value: only the cumsum side is rounded
        t = before[0][flipped]
        forced = bool(np.all(np.sign(rd(t) - TOP_P) != np.sign(t - TOP_P)))
        assert (d.cause == "forced by rounding") == forced
        assert d.verdict == ("warn" if forced else "fail")
        if not forced:
            assert d.cause_op and report.failed
            # the rounded literal alone explains a flip: a once-rounded value against the
            # literal as used decides otherwise than float64 against the written one
            alone = np.sign(rd(t) - float(rd(TOP_P))) != np.sign(t - TOP_P)
            assert d.cause_op.startswith("the literal 0.9") == bool(alone.any())
    elif report.first is None and not report.decisions:
        assert not report.failed


@pytest.mark.parametrize("case", ["flat", "peaked"])
def test_an_argsort_is_judged_by_the_cut_taken_on_it(case):
    """The bf16 permutation differs from float64's among near-equal probabilities; that alone
    is no finding: the cut taken on the sorted values is."""
    x, t = TOP_P_CASES[case]
    logits, temp = bf16(x), bf16(t)
    mask, order_low = (np.asarray(v) for v in argsort_top_p_sampler(logits, temp))
    _, mask64, order, _ = top_p_truth(logits, temp)
    kept = set(order_low[0][~mask[0]].tolist())
    kept64 = set(order[0][~mask64[0]].tolist())
    report = shadow(argsort_top_p_sampler, logits, temp)
    assert bool(report.decisions) == (kept != kept64)
    assert {d.primitive for d in report.decisions} <= {"gt"}
    assert (kept != kept64) == (case == "flat")


def test_the_flat_case_is_a_real_knife_edge():
    """The data above is not vacuous: the float64 and bf16 kept sets differ on it."""
    logits, temp = bf16(TOP_P_CASES["flat"][0]), bf16(1.0)
    _, mask, indices = (np.asarray(v) for v in top_p_sampler(logits, temp))
    _, mask64, order, _ = top_p_truth(logits, temp)
    assert set(indices[0][~mask[0]].tolist()) != set(order[0][~mask64[0]].tolist())


def test_a_peaked_distribution_stays_clean():
    x, t = TOP_P_CASES["peaked"]
    report = shadow(top_p_sampler, bf16(x), bf16(t))
    assert report.first is None and report.decisions == () and not report.failed


# -- greedy -------------------------------------------------------------------------------


def leaders():
    """Two bf16 neighbours as leaders, the larger one later; the rest of the mass far below."""
    x = background(-5.0, 1.0)
    x[0, 100], x[0, 200] = 5.625, 5.65625
    return x


def test_a_greedy_near_tie_is_forced_by_rounding():
    logits, temp = bf16(leaders()), bf16(0.7)
    low = int(np.asarray(top_p_sampler(logits, temp)[0])[0])
    z = f64(logits) / float(f64(temp))
    exact = int(z.argmax())
    report = shadow(top_p_sampler, logits, temp)
    found = decisions_of(report, "argmax")
    assert bool(found) == (low != exact)
    assert low != exact, "the leaders must flip in bf16 for this test to say anything"
    forced = rd(z[0, low]) >= rd(z[0, exact])
    d = found[0]
    assert (d.cause == "forced by rounding") == forced and d.flipped == 1
    assert d.source.endswith("(top_p_sampler)") and 0 < d.margin_ulps < 1
    assert not report.failed or report.first is not None


def test_a_greedy_flip_made_by_the_division_fails_and_names_it():
    logits, temp = bf16(leaders()), bf16(0.7)
    low = int(np.asarray(greedy_logprob(logits, temp))[0])
    z = f64(logits) / float(f64(temp))
    lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    exact = int(lp.argmax())
    report = shadow(greedy_logprob, logits, temp)
    found = decisions_of(report, "argmax")
    assert bool(found) == (low != exact) and found
    forced = rd(lp[0, low]) >= rd(lp[0, exact])
    d = found[0]
    assert (d.cause == "forced by rounding") == forced
    if not forced:
        assert d.verdict == "fail" and report.failed
        assert "div at" in d.cause_op  # the temperature division, named in the chain


# -- top-k --------------------------------------------------------------------------------


def near_tie_at_the_cut(base, k=50):
    """(logits, temperature): k - 1 tokens far above, then two bf16 neighbours near `base`
    competing for the last slot (the larger one later), and a temperature under which both
    quotients round to one bf16 value."""
    x = background(0.0, 1.0, seed=4)
    x[0, 1000 : 1000 + k - 1] = 2 * base
    b = float(rd(base))
    a = next(v for v in f64(bf16(b + np.arange(1, 64) * b / 256)) if v > b)
    x[0, 10], x[0, 20] = b, a
    temps = f64(bf16(np.linspace(0.5, 2.0, 400)))
    t = next(t for t in temps if rd(a / t) == rd(b / t))
    return x, t


@pytest.mark.parametrize("base,k", [(100.0, 50), (1000.0, 50), (8000.0, 40), (None, 50)])
def test_a_top_k_kept_set_is_compared_as_a_set(base, k):
    if base is None:  # random logits ~1e3: no tie at the cut
        x, t = background(1000.0, 20.0, seed=4), 0.7
    else:
        x, t = near_tie_at_the_cut(base, k)
    logits, temp = bf16(x), bf16(t)
    low = np.asarray(top_k_sampler(logits, temp, k=k))[0]
    z = f64(logits)[0] / float(f64(temp))
    kth = np.sort(z)[::-1][k - 1]
    wrong = z[low] < kth  # kept although float64 ranks it below the k-th value
    assert wrong.any() == (base is not None), "the data must (not) put a tie at the cut"
    report = shadow(top_k_sampler, logits, temp, k=k)
    found = decisions_of(report, "top_k")
    assert bool(found) == bool(wrong.any())
    if found:
        assert found[0].flipped == int(wrong.sum()) and found[0].kind == "top_k"
        forced = bool(np.all(rd(z[low][wrong]) >= rd(kth)))
        assert (found[0].cause == "forced by rounding") == forced
        assert not report.failed or not forced or report.first is not None


# -- where / select_n and the result ----------------------------------------------------


def test_a_where_on_a_flipped_comparison_is_never_clean():
    """bf16 `jnp.where(s > t, s, -s)`: the regression where the shadow took the other branch
    and diag said `exit 0, result carries 1.27`."""

    @jax.jit
    def f(x, y):
        s = x * y - 0.3
        return jnp.where(s > 0.0, s, -s)

    rng = np.random.default_rng(5)
    x = bf16(rng.uniform(0.5, 1.0, 4096))
    y = bf16(0.3 / f64(bf16(rng.uniform(0.5, 1.0, 4096))))
    low = np.asarray(f(x, y)).astype(np.float64)
    s64 = f64(x) * f64(y) - 0.3
    out64 = np.where(s64 > 0, s64, -s64)
    flipped = (np.asarray(x * y - bf16(0.3)).astype(np.float64) > 0) != (s64 > 0)
    report = shadow(f, x, y)
    carried = np.max(np.abs(low - out64)) / np.max(np.abs(out64))
    assert report.result_error == pytest.approx(carried, rel=1e-6)
    found = decisions_of(report, "gt")
    assert bool(found) == bool(flipped.any()) and found
    forced = bool(np.all(forced_compare(s64[flipped], np.zeros(flipped.sum()))))
    assert (found[0].cause == "forced by rounding") == forced
    if carried > report.result_threshold:
        assert report.failed or found[0].verdict == "warn"


def test_a_result_past_its_threshold_fails_even_when_no_op_crossed_it():
    """An index made by a float-to-int conversion picks another element: no op breaks its
    bound and no comparison flips, yet the result is wrong."""

    @jax.jit
    def f(table, x, y):
        i = (x * y).astype(jnp.int32)
        return table[i]

    # bf16 x, y whose float64 product is just below 1 and rounds up to 1.0 in bf16
    xs = f64(bf16(np.linspace(1.0, 2.0, 4001)))
    ys = f64(bf16(1.0 / xs))
    pick = np.flatnonzero((xs * ys < 1.0) & (rd(xs * ys) == 1.0))[0]
    table, x, y = bf16(np.arange(8.0) * 10 + 1), bf16(xs[pick]), bf16(ys[pick])
    low = float(np.asarray(f(table, x, y)))
    exact = float(f64(table)[int(f64(x) * f64(y))])
    report = shadow(f, table, x, y)
    carried = abs(low - exact) / abs(exact)
    assert report.result_error == pytest.approx(carried, rel=1e-6)
    assert carried > report.result_threshold, "the data must put the index on the edge"
    assert report.first is None and report.failed
    code, why = diag.diverge.decisions.verdict(report)
    assert code == 1 and "over the threshold" in why


# -- the CLI ------------------------------------------------------------------------------


def example_truth(name):
    """The expected exit status of examples/diverge_sampler.py:NAME, from float64 numpy."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import diverge_sampler as ds
    finally:
        sys.path.remove(str(EXAMPLES))
    fn, (logits, temp) = getattr(ds, name)()
    if fn is ds.greedy_logprob:
        z = f64(logits) / float(f64(temp))
        lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        low, exact = int(np.asarray(fn(logits, temp))[0]), int(lp.argmax())
        if low == exact:
            return 0, False
        return (0, True) if rd(lp[0, low]) >= rd(lp[0, exact]) else (1, True)
    greedy, kept = (np.asarray(v) for v in fn(logits, temp))
    g64, mask64, order, before = top_p_truth(logits, temp)
    kept64 = np.zeros(VOCAB, bool)
    kept64[order[0][~mask64[0]]] = True
    changed = bool((kept[0] != kept64).any()) or greedy[0] != g64[0]
    return None, changed


@pytest.mark.parametrize("name", ["made", "made_greedy", "forced", "clean"])
def test_the_sampler_example_exit_status(name):
    expect, changed = example_truth(name)
    r = run_diag("diverge", f"{EXAMPLES}/diverge_sampler.py:{name}", "--json", timeout=180)
    doc = json.loads(r.stdout)
    rep = doc["report"]
    assert bool(rep["decisions"]) == changed
    causes = {d["cause"] for d in rep["decisions"]}
    fails = bool(rep["first"]) or "made by the computation" in causes
    assert r.returncode == (1 if fails else 0) and doc["failed"] == fails
    if expect is not None:
        assert r.returncode == expect
    if changed and not fails:
        assert "forced by rounding" in doc["verdict"] and "exit 0" in doc["verdict"]
    if not changed:
        assert r.returncode == 0 and rep["first"] is None


def test_a_decision_downstream_of_a_flip_follows_it():
    """A second comparison whose operand differs only because the shadow followed the first
    flip takes that flip's cause and verdict instead of blaming the `where` between them."""

    @jax.jit
    def f(x, y):
        s = x * y - 0.3
        sign = jnp.where(s > 0.0, 1.0, -1.0)
        return (sign * 2.0 > 1.0).sum()

    rng = np.random.default_rng(5)
    x = bf16(rng.uniform(0.5, 1.0, 4096))
    y = bf16(0.3 / f64(bf16(rng.uniform(0.5, 1.0, 4096))))
    s64 = f64(x) * f64(y) - 0.3
    flipped = (np.asarray(x * y - bf16(0.3)).astype(np.float64) > 0) != (s64 > 0)
    assert flipped.any()
    report = shadow(f, x, y)
    first, *rest = report.decisions
    assert first.flipped == int(flipped.sum()) and rest
    second = rest[0]
    assert second.flipped == first.flipped
    assert second.cause_op.startswith(f"follows the flipped gt at {first.source}")
    assert (second.verdict, second.cause) == (first.verdict, first.cause)
