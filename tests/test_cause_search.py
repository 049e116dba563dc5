"""The cause search's rules, on stand-in re-runners and ledgers (no framework needed), and its
JAX re-runner on small functions whose answers are decided here in float64:

* a claim only when a re-run confirms it; the first candidate that repairs is the cause;
* no claim when none does (the best candidate's effect is said) or when the failure does not
  reproduce op by op; never more than 10 re-runs; a re-run that raises repairs nothing;
* several narrowing casts to one dtype are tried together (a module's ``dtype=``);
* a promoted run's output is measured in the dtype the function returns;
* candidates come from the dataflow: an op whose rounding a later op amplifies ranks first;
* promoting one op of a float32 function does not compute the rest in float64 (a false lead
  in a deep model): ``log(1 - sigmoid(z))`` after a dense layer names the sigmoid.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from diag.diverge.cause import MAX_RERUNS, Failing, Site, errors, repair_for, search
from diag.diverge.ranking import candidates


class FakeRerun:
    """Outputs per promoted set: `fixes` maps a frozenset of site keys to the output."""

    def __init__(self, base: np.ndarray, fixes: dict, raises: frozenset = frozenset()):
        self.base, self.fixes, self.raises = base, fixes, raises
        self.calls: list[frozenset] = []
        self.packages: dict = {}

    def __call__(self, sites: frozenset):
        self.calls.append(sites)
        if sites & self.raises:
            raise RuntimeError("autograd refused a wider gradient")
        return [("", self.fixes.get(sites, self.base))]


REF = np.linspace(1.0, 2.0, 8)
BAD = REF * 1.5
GOOD = REF * (1 + 1e-6)
FAIL = [Failing("", REF, 2.0**-12)]


def _site(name: str, **kw) -> Site:
    return Site(name, f"f.py:{len(name)} (f)", "", "forward", "float32", **kw)


def test_the_first_candidate_whose_rerun_repairs_is_the_cause():
    a, b, c = _site("a"), _site("bb"), _site("ccc")
    rerun = FakeRerun(BAD, {frozenset({c.key}): GOOD})
    cause = search(rerun, [a, b, c], FAIL)
    assert cause.confirmed and cause.cause == "f.py:3 (f)"
    assert cause.cause_ops == ("ccc at f.py:3 (f)",)
    assert cause.reruns == 3 and len(rerun.calls) == 4  # the baseline is not counted


def test_the_repair_is_timed_beside_the_function_as_written_outside_the_budget():
    a, b = _site("a"), _site("bb")
    rerun = FakeRerun(BAD, {frozenset({b.key}): GOOD})
    cause = search(rerun, [a, b], FAIL, timings=3)
    assert cause.confirmed and cause.reruns == 2
    # baseline, a, b (confirms), then three timed runs of as written and repaired,
    # alternately, outside the budget; the baseline and the confirming run, timed as they
    # ran, are one sample more of each
    assert rerun.calls[3:] == [frozenset(), frozenset({b.key})] * 3
    assert cause.time_before_s > 0 and cause.repair_time_s > 0
    assert "(fastest of 4)" in cause.text
    assert search(FakeRerun(BAD, {frozenset({b.key}): GOOD}), [b], FAIL).repair_time_s is None
    unconfirmed = search(FakeRerun(BAD, {}), [a], FAIL, timings=3)
    assert unconfirmed.repair_time_s is None and unconfirmed.fields()["repair_time_s"] is None
    assert cause.error_after == pytest.approx(1e-6 * 2 / 2, rel=1e-3)
    assert cause.error_before == pytest.approx(0.5, rel=1e-9)


def test_no_claim_when_nothing_repairs_and_never_more_than_ten_reruns():
    sites = [_site("x" * k) for k in range(1, 30)]
    half = REF * 1.2
    rerun = FakeRerun(BAD, {frozenset({sites[4].key}): half})
    cause = search(rerun, sites, FAIL)
    assert not cause.confirmed and cause.cause == "" and cause.cause_ops == ()
    assert len(rerun.calls) - 1 == cause.reruns <= MAX_RERUNS
    assert cause.text.startswith("no cause: none of the 7 likeliest ops")
    assert "the best, xxxxx at f.py:5 (f)" in cause.text
    assert cause.error_after == pytest.approx(0.2, rel=1e-9)  # the best candidate's effect


def test_no_claim_when_the_failure_does_not_reproduce_op_by_op():
    rerun = FakeRerun(GOOD, {})
    cause = search(rerun, [_site("a")], FAIL)
    assert not cause.confirmed and cause.reruns == 0
    assert "does not reproduce" in cause.text


def test_a_rerun_that_raises_repairs_nothing():
    a, b = _site("a"), _site("bb")
    rerun = FakeRerun(BAD, {frozenset({a.key}): GOOD, frozenset({b.key}): GOOD}, frozenset({a.key}))
    cause = search(rerun, [a, b], FAIL)
    assert cause.confirmed and cause.cause_ops == ("bb at f.py:2 (f)",)


def test_narrowing_casts_to_one_dtype_are_tried_together():
    casts = [_site("c" * k, tags=frozenset({"narrowing"})) for k in (1, 2, 3)]
    together = frozenset(s.key for s in casts)
    rerun = FakeRerun(BAD, {together: GOOD})
    cause = search(rerun, casts, FAIL)
    assert cause.confirmed and len(cause.cause_ops) == 3 and cause.reruns == 3
    assert "drop the cast" in cause.repair


def test_a_promoted_output_is_measured_in_the_dtype_the_function_returns():
    ref = np.full(4, 1.0 + 2.0**-10)  # not a bfloat16 number: rounding it costs 2^-10
    import ml_dtypes

    wide = [("", ref.copy())]
    exact = errors(wide, [Failing("", ref, 0.1)])[0]
    rounded = errors(wide, [Failing("", ref, 0.1)], {"": np.dtype(ml_dtypes.bfloat16)})[0]
    assert exact == 0.0
    assert rounded == pytest.approx(2.0**-10 / (1 + 2.0**-10))


@dataclasses.dataclass
class E:
    """A stand-in ledger entry with the fields the ranking reads."""

    primitive: str
    producers: tuple = ()
    cls: str = "rounded"
    dtype: str = "bfloat16"
    own_ulps: float = 0.5
    carried: float = 2e-3
    carried_in: float = 0.0
    threshold: float = 0.0625
    own_ratio: float = 0.25
    path: str = ""
    phase: str = "forward"
    tags: frozenset = frozenset()

    def where(self):
        return f"r.py:{self.primitive} (f)", ""


def test_an_op_whose_rounding_a_later_op_amplifies_ranks_before_the_others():
    entries = [
        E("other", carried=1e-3),  # 0: an unrelated product, not amplified
        E("mul"),  # 1: the angle, exact to half an ULP
        E("cat", (1,), cls="structural"),  # 2: moves it
        E("cos", (2,), cls="library", carried=1.3, carried_in=2e-3),  # 3: a wrong value
        E("add", (3, 0), carried=0.9, carried_in=1.3),  # 4: the output
    ]
    sites, readers = candidates(entries, [4], 0.0625)
    names = [s.primitive for s in sites]
    assert names.index("mul") < names.index("other")
    assert "cat" not in names  # ops that only move values are never candidates
    assert readers[next(s.key for s in sites if s.primitive == "mul")] >= {"cos"}


def test_repairs_in_the_users_terms():
    sig = Site("logistic", "m.py:3 (f)", "", "forward", "float32")
    assert "log_sigmoid" in repair_for(sig, {"sub", "log"})
    assert "row max" in repair_for(Site("aten.exp", "", "", "forward", "float16"), set())
    carry = Site("add", "", "", "forward", "bfloat16", path="jit[f]/scan[12]")
    assert "carry in float32" in repair_for(carry, set())
    born = Site("aten.mul", "", "", "forward", "float16", tags=frozenset({"birth"}))
    assert "overflows float16" in repair_for(born, set())


def test_promoting_one_op_of_a_float32_function_does_not_compute_the_rest_in_float64():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from diag.diverge import Failing as F
    from diag.diverge import explain
    from diag.userfn.tree import numpy_leaves

    def head(w1, w2, x):
        h = jnp.tanh(x @ w1)
        z = h @ w2
        return jnp.log(1 - jax.nn.sigmoid(z))

    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(16, 32)).astype(np.float32)
    w2 = (rng.normal(size=(32,)) * 3).astype(np.float32)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    z = np.tanh(x.astype(np.float64) @ w1) @ w2
    # 1 - sigmoid(z) is 0 in float32 past z = 17, in float64 past z = 37
    assert 17.0 < z.max() < 37.0
    want = -np.logaddexp(0.0, z)  # log(1 - sigmoid(z)) in float64
    assert np.isinf(np.asarray(head(w1, w2, x))).any()  # the float32 function fails
    _, cause = explain(head, (w1, w2, x), {}, [F("", want, 2.0**-12)], numpy_leaves)
    assert cause is not None and cause.confirmed, cause
    assert cause.cause_ops[0].startswith("logistic at test_cause_search.py:")
    assert "log_sigmoid" in cause.repair and cause.error_after <= 2.0**-12
    assert math.isinf(cause.error_before)
    # what the repair costs in time: the run as written and repaired, timed op by op
    assert cause.time_before_s > 0 and cause.repair_time_s > 0
    assert cause.time_before_spread_s >= 0 and cause.repair_time_spread_s >= 0
    assert "as written" in cause.text and "repaired (" in cause.text
    fields = cause.fields()
    assert fields["time_before_s"] == cause.time_before_s
    assert fields["repair_time_s"] == cause.repair_time_s


def _greedy(h, w):
    import jax.numpy as jnp

    logits = jnp.zeros((h.shape[0], w.shape[1]), jnp.bfloat16)
    for i in range(h.shape[1]):
        logits = logits + h[:, i : i + 1] * w[i]  # a dot product accumulated in bf16
    return jnp.argmax(logits, -1)


def test_a_greedy_token_moved_by_a_bf16_accumulation_names_it_and_the_repair_restores_it():
    """An integer output (a decision): repaired when every token equals the float64 one."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from diag.userfn import judge, reference
    from diag.userfn.host import failing_outputs, first_op_and_cause

    r = np.random.default_rng(0)
    h = jnp.asarray(r.normal(size=(64, 48)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(48, 500)) * 0.5, jnp.bfloat16)
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    want = np.argmax(h64 @ w64, -1)
    assert (np.asarray(_greedy(h, w)) != want).any()  # bf16 accumulation moves a token
    f32 = np.argmax(np.asarray(h, np.float32) @ np.asarray(w, np.float32), -1)
    assert (f32 == want).all()  # accumulated in float32 every token is float64's

    ref = reference(_greedy, (h, w), {}, "jax")
    failing = failing_outputs(judge(_greedy(h, w), ref), ref)
    assert [f.allowance for f in failing] == [0.0]
    _, cause = first_op_and_cause(_greedy, (h, w), {}, 0.0, failing, "jax")
    line = _greedy.__code__.co_firstlineno + 5  # the accumulation line
    assert cause is not None and cause.confirmed, cause
    assert cause.cause.startswith(f"test_cause_search.py:{line} (_greedy)")
    assert cause.error_after == 0.0 < cause.error_before
    assert "values that differ from the reference" in cause.text
