"""Decisions on real samplers: transformers' logits warpers on bf16/fp16 logits under
`diag.diverge.shadow`.

Claims under test: where the low-precision kept set or picked token differs from the float64
truth (the same warper called on float64 logits), diag names the first flipped decision, the
transformers line that took it (``logits_process.py:NNN``) and the user line that called the
warper, and its cause; it says "forced by rounding" exactly when rounding the float64 operands
of the flipped elements once to the dtype already ties or reverses them (decided here with
ml_dtypes on the float64 computation), "made by the computation" otherwise, naming what moved
the value across; where the two agree it reports no decision. Kept sets are compared as the
multiset of kept logit values: tokens with equal logits may be kept in either order.
"""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

import diag  # noqa: E402
from diag.diverge.decisions import FORCED, MADE  # noqa: E402
from tests.test_diverge_jax import line_of  # noqa: E402

V = 32000
_ML = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}


def lib_line(cls, text: str) -> str:
    """``logits_process.py:NNN (__call__)`` of the line of `cls.__call__` holding `text`."""
    lines, start = inspect.getsourcelines(cls.__call__)
    k = next(i for i, s in enumerate(lines) if text in s)
    return f"logits_process.py:{start + k} (__call__)"


def rnd(x, dtype) -> np.ndarray:
    """float64 values rounded once to `dtype` (a torch dtype), back in float64."""
    return np.asarray(x, np.float64).astype(_ML[dtype]).astype(np.float64)


def forced(a, b, dtype) -> bool:
    """Whether one rounding of the float64 operands ties or reverses every pair a vs b."""
    a, b = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return bool(np.all(np.sign(rnd(a, dtype) - rnd(b, dtype)) != np.sign(a - b)))


def kept_values(scores: torch.Tensor, logits: np.ndarray) -> list[np.ndarray]:
    """Per row, the sorted logit values of the tokens a warper kept (finite scores)."""
    keep = torch.isfinite(scores).numpy()
    return [np.sort(logits[i][keep[i]]) for i in range(logits.shape[0])]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def logits_of(rng, scale: float, dtype, rows: int = 1) -> tuple[torch.Tensor, np.ndarray]:
    """Logits in `dtype` and their exact float64 values."""
    low = torch.tensor(rng.normal(0.0, scale, (rows, V))).to(dtype)
    return low, low.double().numpy()


def check_clean(rep) -> None:
    assert rep.decisions == () and rep.first_decision is None


# -- top-k after a temperature: near ties one ulp apart, logits ~1e3 ------------------------


def temp_top_k(logits):
    scores = lp.TemperatureLogitsWarper(0.7)(None, logits)
    return lp.TopKLogitsWarper(40)(None, scores)


def adjacent_pair(dtype, lo: float, hi: float, t: float, collapse: bool) -> tuple[float, float]:
    """Two neighbouring values of `dtype` in [lo, hi) whose quotients by `t`, once rounded to
    `dtype`, are equal (`collapse`) or not."""
    v = np.float64(lo)
    while v < hi:
        w = float(np.nextafter(_ML[dtype](v), _ML[dtype](np.inf)))
        if (rnd(w / t, dtype) == rnd(v / t, dtype)) == collapse:
            return w, float(v)
        v = w
    raise AssertionError("no such pair")


def near_tie_logits(rng, dtype, collapse: bool, t: float = 0.7, base: float = 1e3):
    """Logits ~`base` whose 40th and 41st largest are one ulp of `dtype` apart, and whose
    quotients by `t` tie in `dtype` (`collapse`) or not; the other 39 of the top 40 distinct."""
    lo = base * (0.6 if dtype == torch.bfloat16 else 1.5)
    k40, k41 = adjacent_pair(dtype, lo, 4.0 * base, t, collapse)
    x = rng.normal(0.0, 2.0, (1, V))
    cols = rng.permutation(V)[:41]
    x[0, cols[:39]] = k40 + 40.0 + 8.0 * np.arange(39)
    x[0, cols[39]], x[0, cols[40]] = k40, k41
    low = torch.tensor(x).to(dtype)
    return low, low.double().numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("collapse", [True, False])
@pytest.mark.parametrize("base", [1e2, 1e3, 8e3])
def test_temperature_then_top_k_names_the_cut_and_whether_rounding_forced_it(
    dtype, collapse, base
):
    low, x = near_tie_logits(np.random.default_rng(int(collapse)), dtype, collapse, base=base)
    got = kept_values(temp_top_k(low), x)
    want = kept_values(temp_top_k(torch.tensor(x)), x)
    rep = diag.diverge.shadow(temp_top_k, low)
    assert same(got, want) != collapse  # the premise: a tie after the division keeps both
    if same(got, want):
        check_clean(rep)
        assert not rep.failed
        return
    d = rep.first_decision
    assert d is not None and d.primitive in ("aten.topk", "aten.lt")
    assert d.library == lib_line(lp.TopKLogitsWarper, "scores < torch.topk")
    assert d.source == line_of(temp_top_k, "TopKLogitsWarper(40)")
    # independently: the float64 scores x / 0.7 of the tokens kept one way and not the other,
    # against the float64 40th largest score
    xs = x[0] / 0.7
    kth = np.sort(xs)[::-1][39]
    keep_low = np.isfinite(temp_top_k(low).double().numpy()[0])
    flipped = keep_low != (xs >= kth)
    assert flipped.any()
    assert d.cause == (FORCED if forced(xs[flipped], kth, dtype) else MADE)
    assert (d.verdict == "warn") == (d.cause == FORCED)
    if d.cause == MADE:
        assert "aten.div" in d.cause_op and lib_line(lp.TemperatureLogitsWarper, "/") in d.cause_op


def test_top_k_on_the_logits_themselves_is_clean():
    """No arithmetic before the cut: the bf16 values are the float64 values, whatever ties."""
    low, x = near_tie_logits(np.random.default_rng(9), torch.bfloat16, collapse=True)
    warper = lp.TopKLogitsWarper(40)
    assert same(kept_values(warper(None, low), x), kept_values(warper(None, torch.tensor(x)), x))
    rep = diag.diverge.shadow(lambda s: warper(None, s), low)
    check_clean(rep)
    assert not rep.failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_p_on_a_128k_vocabulary(dtype):
    """Llama-3-sized vocabulary (128256): the knife edge, as in the 32k cases."""
    low = torch.tensor(np.random.default_rng(7).normal(0.0, 1.5, (1, 128256))).to(dtype)
    x = low.double().numpy()
    got = kept_values(top_p(low), x)
    want = kept_values(top_p(torch.tensor(x)), x)
    rep = diag.diverge.shadow(top_p, low)
    if same(got, want):
        check_clean(rep)
        return
    d = rep.first_decision
    assert d.primitive == "aten.le" and d.kind == "threshold"
    s = np.sort(x[0])
    p = np.exp(s - s.max())
    c64 = np.cumsum(p / p.sum())
    c_low = torch.sort(low[0])[0].softmax(-1).cumsum(-1)
    flipped = (c_low <= (1 - 0.9)).numpy() != (c64 <= 1 - 0.9)
    t = 1 - 0.9
    want_forced = bool(np.all(np.sign(rnd(c64[flipped], dtype) - t) != np.sign(c64[flipped] - t)))
    assert d.flipped == int(flipped.sum()) and d.cause == (FORCED if want_forced else MADE)


# -- greedy after a temperature ------------------------------------------------------------


def greedy(logits):
    return torch.argmax(lp.TemperatureLogitsWarper(0.7)(None, logits), dim=-1)


@pytest.mark.parametrize("gap_ulps", [1, 3])
def test_greedy_after_a_bf16_temperature(gap_ulps):
    """Two top logits `gap_ulps` ulps apart at ~1e3: after / 0.7 in bf16 they may tie."""
    rng = np.random.default_rng(gap_ulps)
    x = rng.normal(0.0, 2.0, (2, V))
    x[:, 5] = 1000.0
    x[:, 11] = 1000.0 + 4.0 * gap_ulps  # bf16 spacing at 1000 is 4; a tie picks index 5
    low = torch.tensor(x).to(torch.bfloat16)
    x = low.double().numpy()
    token = greedy(low).numpy()
    truth = np.argmax(x / 0.7, axis=-1)
    rep = diag.diverge.shadow(greedy, low)
    if np.array_equal(x[np.arange(2), token], x[np.arange(2), truth]):
        check_clean(rep)
        assert not rep.failed
        return
    d = rep.first_decision
    assert d.primitive == "aten.argmax" and d.source == line_of(greedy, "torch.argmax")
    rows = np.nonzero(token != truth)[0]
    xs = x / 0.7
    want = forced(xs[rows, truth[rows]], xs[rows, token[rows]], torch.bfloat16)
    assert d.cause == (FORCED if want else MADE) and d.flipped == len(rows)
    assert rep.failed == (not want)


# -- top-p at the knife edge ---------------------------------------------------------------


def top_p(logits):
    return lp.TopPLogitsWarper(0.9)(None, logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_top_p_knife_edge_names_the_threshold_and_its_cause(dtype, seed):
    """Tail probabilities ~1/V sum across 1 - top_p between two representable cumulative
    values: the cut goes by what the dtype can hold of the cumulative sum and of 0.1."""
    low, x = logits_of(np.random.default_rng(seed), 1.0, dtype)
    got = kept_values(top_p(low), x)
    want = kept_values(top_p(torch.tensor(x)), x)
    rep = diag.diverge.shadow(top_p, low)
    if same(got, want):
        check_clean(rep)
        return
    d = rep.first_decision
    assert d is not None and d.primitive == "aten.le" and d.kind == "threshold"
    assert d.library == lib_line(lp.TopPLogitsWarper, "cumulative_probs <= (1 - self.top_p)")
    # independently, in sorted order: the float64 cumulative probabilities against 1 - 0.9,
    # and the low-precision ones as the warper computes them
    s = np.sort(x[0])
    p = np.exp(s - s.max())
    c64 = np.cumsum(p / p.sum())
    sl = torch.sort(low[0])[0]
    c_low = sl.softmax(-1).cumsum(-1)
    flipped = (c_low <= (1 - 0.9)).numpy() != (c64 <= 1 - 0.9)
    assert flipped.any() and d.flipped == int(flipped.sum())
    # the written 1 - 0.9 is exact: only the cumulative probabilities are rounded
    t = 1 - 0.9
    want = bool(np.all(np.sign(rnd(c64[flipped], dtype) - t) != np.sign(c64[flipped] - t)))
    assert d.cause == (FORCED if want else MADE)
    if d.cause == MADE:
        assert "0.09999999999999998" in d.cause_op or "logits_process.py" in d.cause_op
    # the literal 1 - 0.9 the comparison used in the dtype
    used = float(torch.tensor(1 - 0.9, dtype=dtype))
    assert any(
        lit.written == repr(1 - 0.9) and lit.used == repr(used) for lit in rep.literals
    )


# -- min-p after a temperature: the bf16 division moves probabilities across ---------------


def temp_min_p(logits):
    scores = lp.TemperatureLogitsWarper(0.7)(None, logits)
    return lp.MinPLogitsWarper(0.05)(None, scores)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_min_p_after_a_temperature_names_the_division(dtype):
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 2.0, (1, V))
    x[0, :64] = 200.0 + rng.uniform(-4.0, 4.0, 64)  # logits ~1e2: the cut falls among these
    low = torch.tensor(x).to(dtype)
    x = low.double().numpy()
    got = kept_values(temp_min_p(low), x)
    want = kept_values(temp_min_p(torch.tensor(x)), x)
    rep = diag.diverge.shadow(temp_min_p, low)
    if same(got, want):
        check_clean(rep)
        return
    d = rep.first_decision
    assert d.primitive == "aten.lt"
    assert d.library == lib_line(lp.MinPLogitsWarper, "tokens_to_remove = probs < scaled_min_p")
    xs = x[0] / 0.7
    p = np.exp(xs - xs.max())
    p /= p.sum()
    thr = 0.05 * p.max()
    keep_low = np.isfinite(temp_min_p(low).double().numpy()[0])
    flipped = keep_low != (p >= thr)
    want = forced(p[flipped], thr, dtype)
    assert d.cause == (FORCED if want else MADE)
    if not want:
        assert d.cause_op.startswith("aten.div at " + lib_line(lp.TemperatureLogitsWarper, "/"))


# -- a composed sampler: warpers, then the greedy pick ---------------------------------------


def warp(logits):
    scores = lp.TemperatureLogitsWarper(0.7)(None, logits)
    scores = lp.TopKLogitsWarper(50)(None, scores)
    return lp.TopPLogitsWarper(0.9)(None, scores)


def sampler(logits):
    return torch.argmax(warp(logits), dim=-1)


def sampler_logits(dtype, collapse: bool) -> tuple[torch.Tensor, np.ndarray]:
    """Two rows of logits whose top two are neighbouring bf16 values ~1e3 (the larger at the
    higher index) that tie after the division by 0.7 in bf16 (`collapse`) or not."""
    hi, lo = adjacent_pair(torch.bfloat16, 600.0, 4000.0, 0.7, collapse)
    x = np.random.default_rng(5).normal(0.0, 3.0, (2, V)) + lo - 20.0
    x[:, 3], x[:, 17] = lo, hi
    low = torch.tensor(x).to(dtype)
    return low, low.double().numpy()


@pytest.mark.parametrize(
    "dtype, collapse",
    [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)],
)
def test_composed_sampler_names_what_changed_the_token_or_the_kept_set(dtype, collapse):
    """Warpers then argmax: every difference in the token or the kept set is named at a
    transformers or user line; float32 logits agree with float64 and nothing is reported."""
    low, x = sampler_logits(dtype, collapse)
    rows = np.arange(2)
    token, truth = sampler(low).numpy(), sampler(torch.tensor(x)).numpy()
    token_differs = not np.array_equal(x[rows, token], x[rows, truth])
    kept_differs = not same(kept_values(warp(low), x), kept_values(warp(torch.tensor(x)), x))
    if dtype == torch.bfloat16 and collapse:
        assert token_differs  # the premise: the tie picks index 3, float64 picks 17
    rep = diag.diverge.shadow(sampler, low)
    if not token_differs and not kept_differs:
        check_clean(rep)
        return
    d = rep.first_decision
    assert d is not None and d.library.startswith("logits_process.py:")
    assert d.source in {line_of(warp, w) for w in ("Temperature", "TopK", "TopP")}
    if token_differs:
        pick = [r for r in rep.decisions if r.primitive == "aten.argmax"]
        assert pick and pick[0].source == line_of(sampler, "torch.argmax")
        assert pick[0].flipped == int((x[rows, token] != x[rows, truth]).sum())


# -- the example, through the real `diag diverge` script -------------------------------------


def test_the_hf_sampler_example_exits_1_on_a_made_flip_and_0_on_a_forced_one():
    """(Its `clean` target is the in-process float32 cases above.)"""
    import json
    from pathlib import Path

    from tests.conftest import run_diag

    ex = Path(__file__).resolve().parent.parent / "examples" / "diverge_hf_sampler.py"
    r = run_diag("diverge", f"{ex}:made", "--json", timeout=240)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    d = doc["report"]["first_decision"]
    assert d["primitive"] == "aten.le" and d["cause"] == MADE and doc["failed"]
    assert d["library"] == lib_line(lp.TopPLogitsWarper, "cumulative_probs <= (1 - self.top_p)")
    r = run_diag("diverge", f"{ex}:forced", timeout=240)
    assert r.returncode == 0, r.stderr
    assert "forced by rounding" in r.stdout and "aten.argmax" in r.stdout


# -- the mechanism on small functions: masks follow the float64 decision --------------------


def lost_then_compared(x):
    a = (x + 256.0) - 256.0  # bf16: x + 256 keeps multiples of 2
    return torch.where(a >= x, x, -x)


def test_a_bf16_where_takes_the_float64_branch_in_the_shadow_and_names_the_add():
    x = torch.tensor(np.random.default_rng(0).uniform(0.5, 8.0, 256)).to(torch.bfloat16)
    xe = x.double().numpy()
    a_low = ((xe + 256.0).astype(ml_dtypes.bfloat16).astype(np.float64) - 256.0)
    flips = ~(a_low >= xe)  # float64: a == x, so every element is True
    assert flips.any()  # the premise
    rep = diag.diverge.shadow(lost_then_compared, x)
    d = rep.first_decision
    assert d.primitive == "aten.ge" and d.source == line_of(lost_then_compared, "a >= x")
    assert d.flipped == int(flips.sum()) and d.cause == MADE and d.verdict == "fail"
    assert d.cause_op == "aten.add at " + line_of(lost_then_compared, "(x + 256.0) - 256.0")
    # the shadow took the float64 branch: the result carries the sign flips (2 |x| / max |x|)
    want = np.max(np.where(flips, 2 * np.abs(xe), 0.0)) / np.max(np.abs(xe))
    assert rep.result_error == pytest.approx(want) and rep.failed


def nudged(x, y):
    return torch.where(x * 1.001 > y, x, -x)


def test_a_compare_closer_than_bf16_resolves_is_forced_and_exits_0():
    x = torch.ones(64, dtype=torch.bfloat16)
    rep = diag.diverge.shadow(nudged, x, x.clone())
    a = rnd(1.001, torch.bfloat16)
    assert not a > 1.0 and 1.001 > 1.0  # the premise: bf16 ties what float64 does not
    d = rep.first_decision
    assert d.primitive == "aten.gt" and d.flipped == 64 and d.cause == FORCED
    assert forced(np.full(64, 1.001), np.ones(64), torch.bfloat16)
    assert rep.result_error > rep.result_threshold and not rep.failed  # a warning: exit 0


def sorted_pick(x, y):
    order = torch.sort(x / 0.7, descending=True)[1]
    return torch.gather(y, -1, order[..., :1])


def test_a_sort_permutation_is_reported_where_it_changes_a_pick():
    hi, lo = adjacent_pair(torch.bfloat16, 600.0, 4000.0, 0.7, collapse=True)
    x = torch.tensor([[lo, hi, 1.0, 2.0]]).to(torch.bfloat16)  # the tie sorts lo first
    y = torch.tensor([[10.0, 20.0, 30.0, 40.0]])
    picked = sorted_pick(x, y).item()
    truth = sorted_pick(x.double(), y).item()
    rep = diag.diverge.shadow(sorted_pick, x, y)
    if picked == truth:
        check_clean(rep)
        return
    d = rep.first_decision
    assert d.primitive == "aten.gather" and d.cause == FORCED
    assert "aten.sort" in d.cause_op and d.source == line_of(sorted_pick, "torch.gather")


def lost_then_selected(x):
    a = (x + 256.0) - 256.0
    return x[a >= x].sum()


def test_values_picked_by_a_flipped_mask_restart_the_shadow_and_the_mask_is_named():
    """Boolean indexing with a mask float64 decides otherwise picks another number of values:
    no element-wise shadow exists; the decision is the finding and the note says so."""
    x = torch.tensor(np.random.default_rng(0).uniform(0.5, 8.0, 256)).to(torch.bfloat16)
    xe = x.double().numpy()
    a_low = (xe + 256.0).astype(ml_dtypes.bfloat16).astype(np.float64) - 256.0
    assert (~(a_low >= xe)).any()  # the premise, as in the `where` case
    rep = diag.diverge.shadow(lost_then_selected, x)
    d = rep.first_decision
    assert d.primitive == "aten.ge" and d.cause == MADE and rep.failed
    assert d.flipped == int((~(a_low >= xe)).sum())
    assert "flipped mask" in rep.note


# -- more of transformers' warpers: a finding wherever the kept set differs ------------------


@pytest.mark.parametrize(
    "make, both_ways",
    [
        (lambda: lp.EtaLogitsWarper(3e-4), True),
        (lambda: lp.EpsilonLogitsWarper(3e-4), True),
        (lambda: lp.TopHLogitsWarper(0.5), True),
        # its sort of |log p + H| feeds a gather: a permutation that differs may still end in
        # the same kept set, so only one way is claimed
        (lambda: lp.TypicalLogitsWarper(0.9), False),
    ],
)
def test_other_warpers_report_a_decision_wherever_the_kept_set_differs(make, both_ways):
    low = torch.tensor(np.random.default_rng(0).normal(0.0, 2.0, (2, V))).to(torch.bfloat16)
    x = low.double().numpy()
    warper = make()
    differs = not same(kept_values(warper(None, low), x),
                       kept_values(warper(None, torch.tensor(x)), x))
    rep = diag.diverge.shadow(lambda s: warper(None, s), low)
    if differs:
        d = rep.first_decision
        assert d is not None and d.library.startswith("logits_process.py:")
    elif both_ways:
        check_clean(rep)
