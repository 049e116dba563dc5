"""The JAX cause search's re-runs start downstream of the promoted op, from the values the run
as written kept (`diag.diverge.jax_restart`), and compute what a whole re-run computes:

* for every candidate the shadow ranks, a re-run that starts downstream returns the same
  outputs, bit for bit, as a whole re-run with the same op promoted;
* the promotion has its effect there (the promoted output is not the baseline's), measured
  against float64 computed here;
* a re-run starts at the first op of the promoted site, not of its primitive (another
  line's `mul` earlier does not hold it back); it enters a jitted call and starts inside it;
  one promoting an op that a loop body holds starts at the loop (it runs the loop whole); of
  two sites the earlier decides; a site the baseline never ran changes nothing;
* it says how long the part it skipped took in the baseline run.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy


@jax.jit
def _inner(h):
    a = jnp.sin(h) * 3.0
    return jnp.exp(a.astype(jnp.bfloat16)).astype(jnp.float32)  # exp in bfloat16


def _f(x):
    h = jnp.tanh(x) + 1.0
    y = _inner(h)

    def step(c, v):
        return jnp.maximum(c * 0.5, v), c  # a loop whose carry is bfloat16

    c, _ = jax.lax.scan(step, y[0].astype(jnp.bfloat16), y.astype(jnp.bfloat16))
    return jnp.log(y) - h, c


def _sites():
    from diag.diverge.jax_shadow import shadow
    from diag.diverge.ranking import candidates

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    keep: dict = {}
    shadow(_f, (x,), {}, keep=keep)
    starts = sorted({i for s in keep["sources"] for i in s})
    return x, candidates(keep["ledger"].entries, starts, 2.0**-12, limit=50)[0]


def test_a_rerun_that_starts_downstream_computes_what_a_whole_rerun_computes():
    from diag.diverge.attribution import positional
    from diag.diverge.jax_cause import Rerun

    x, sites = _sites()
    assert {"exp", "mul", "tanh", "add"} <= {s.primitive for s in sites}
    restarted = Rerun(_f, (x,), {}, positional)
    base = restarted(frozenset())  # keeps its values
    skipped = {}
    for s in sites:
        keys = frozenset({s.key})
        whole = Rerun(_f, (x,), {}, positional)(keys)  # no baseline kept: runs whole
        got = restarted(keys)
        skipped[s.primitive] = max(skipped.get(s.primitive, 0.0), restarted.skipped_s)
        for (p, a), (q, b) in zip(got, whole):
            assert p == q and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    assert skipped["exp"] > 0 and skipped["tanh"] == 0  # tanh is the first op: a whole run

    # the exp in bfloat16 promoted, computed here in float64: the re-run moves toward it
    exp_site = next(s for s in sites if s.primitive == "exp")
    h = np.tanh(np.asarray(x, np.float64)) + 1.0
    a = np.asarray(jnp.asarray(np.sin(h) * 3.0, jnp.float32).astype(jnp.bfloat16), np.float64)
    want = np.log(np.exp(a)) - h
    got = dict(restarted(frozenset({exp_site.key})))["[0]"]
    before = dict(base)["[0]"]
    assert np.abs(got - want).max() < np.abs(before - want).max()


def test_a_rerun_enters_a_jitted_call_and_runs_a_loop_whole():
    from diag.diverge.attribution import positional
    from diag.diverge.jax_cause import Rerun

    x, sites = _sites()
    r = Rerun(_f, (x,), {}, positional)
    r(frozenset())
    kept = r.kept
    assert kept is not None
    names = [e.primitive.name for e in kept.jaxprs[kept.top].eqns]
    key = {s.primitive: s.key for s in sites if "(step)" not in s.source}
    loop = next(s.key for s in sites if "(step)" in s.source)  # the `mul` of `step`

    starts, skipped = kept.plan(frozenset({key["exp"]}), r.site_of)
    assert starts[kept.top] == names.index("jit") and len(starts) == 2  # inside the call
    inner = next(k for k in starts if k != kept.top)
    assert [e.primitive.name for e in kept.jaxprs[inner].eqns][starts[inner]] == "exp"
    assert starts[inner] > 0 and skipped > 0
    # an op of the loop's body (the call's `mul` is another site): a re-run starts at the
    # loop and runs it whole
    assert kept.plan(frozenset({loop}), r.site_of)[0] == {kept.top: names.index("scan")}
    # the first equation: a whole run; so with a site the baseline never ran and it
    assert kept.plan(frozenset({key["tanh"]}), r.site_of) == ({}, 0.0)
    never = ("exp", "elsewhere.py:1 (g)", "", "forward")
    assert kept.plan(frozenset({never, key["tanh"]}), r.site_of) == ({}, 0.0)
    # of two sites the earlier decides: the `sub` at the end waits for the exp in the call
    both = kept.plan(frozenset({key["exp"], key["sub"]}), r.site_of)[0]
    assert both == starts and kept.plan(frozenset({key["sub"]}), r.site_of)[0] == {
        kept.top: names.index("sub")
    }
