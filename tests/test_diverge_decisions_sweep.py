"""A randomized sweep of real samplers on knife-edge logits: diag's decision findings against
a float64 truth computed here.

Samplers: transformers' `TopPLogitsWarper` (bf16 and fp16), `TemperatureLogitsWarper` then
`TopKLogitsWarper` (near ties on a grid of adjacent bf16 values at 1e2-8e3), then
`MinPLogitsWarper` (logits ~2e2), all under the PyTorch shadow; and the flax/gemma-style JAX
sampler of examples/diverge_sampler.py (softmax, a full `top_k`, cumsum, a 0.9 cut, argmax)
on flat, two-leader and hot-head 32k rows under jit.

Claims under test, per case: diag reports a decision exactly when the low-precision kept set
(as the multiset of kept logit values: equal logits may be kept either way) or picked token
differs from the float64 one (the warper on float64 logits; a float64 numpy sampler for JAX);
and the verdict (`failed`, exit 1) is "made" exactly when some flipped element is not forced
by one rounding of its float64 operands (decided here: the operands rounded once to the dtype
tie or reverse it; a literal such as 1 - 0.9 is taken at its written value; a token the
low-precision order moved across the cut is forced only when each kept token's once-rounded
probability is no smaller than every dropped one's; for JAX the cut is taken as the positions
between the two kept counts, an approximation where a bf16 cumsum makes the mask no prefix).
The default set runs 4 seeds of each (~15 s); the slow set 30 (~40 s).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import diag

V = 32000
FAST, SLOW = range(4), range(4, 30)


def seeds():
    return [*FAST, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW)]


def rnd(x, dtype) -> np.ndarray:
    return np.asarray(x, np.float64).astype(dtype).astype(np.float64)


def tie_or_reversed(a, b, dtype) -> np.ndarray:
    """Per pair: one rounding of the float64 a, b to `dtype` ties or reverses a vs b."""
    return np.sign(rnd(a, dtype) - rnd(b, dtype)) != np.sign(np.asarray(a) - np.asarray(b))


def check(rep, differ: bool, made: bool) -> None:
    """diag's findings against the truth: a decision iff the outputs differ; a failing one
    (exit 1) iff some flip was made. (A value finding, an op whose carried error passed its
    threshold, is judged by other rules and may fail a case whose decisions agree.)"""
    if not differ:
        assert rep.decisions == ()
        assert not rep.failed or rep.first is not None
        return
    assert rep.decisions and rep.first_decision is not None
    fails = any(d.verdict == "fail" for d in rep.decisions)
    assert fails == made, [d.reason for d in rep.decisions]
    assert rep.failed or not made


# -- transformers' warpers under the PyTorch shadow ------------------------------------------


torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")
ML = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}


def top_p(s):
    return lp.TopPLogitsWarper(0.9)(None, s)


def temp_top_k(s):
    return lp.TopKLogitsWarper(40)(None, lp.TemperatureLogitsWarper(0.7)(None, s))


def temp_min_p(s):
    return lp.MinPLogitsWarper(0.05)(None, lp.TemperatureLogitsWarper(0.7)(None, s))


def torch_logits(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "top_p":  # tail probabilities ~1/V summing across 0.1
        return rng.normal(0.0, rng.uniform(0.5, 2.5), (1, V))
    x = rng.normal(0.0, 2.0, (1, V))
    if kind == "top_k":  # 48 top logits on 8 adjacent bf16 values: the 40th falls among ties
        v = [ml_dtypes.bfloat16(rng.choice([1e2, 1e3, 8e3]))]
        for _ in range(7):
            v.append(np.nextafter(v[-1], ml_dtypes.bfloat16(np.inf)))
        x[0, rng.permutation(V)[:48]] = rng.choice(np.array(v, np.float64), 48)
    else:  # min_p: the cut falls among 64 logits ~2e2
        x[0, :64] = 200.0 + rng.uniform(-4.0, 4.0, 64)
    return x


def torch_truth(kind: str, x: np.ndarray, keep_low: np.ndarray, dtype) -> bool:
    """Whether some flipped token is not forced by one rounding (the flip was made)."""
    keep64 = np.isfinite(FN[kind](torch.tensor(x)).numpy()[0])
    fl = keep_low != keep64
    dt = ML[dtype]
    if kind == "top_p":  # in ascending order the warper cuts a prefix: the positions
        # between the two cuts flipped; their float64 cumulative probabilities vs 1 - 0.9 exactly
        s = np.sort(x[0])
        p = np.exp(s - s.max())
        c = np.cumsum(p / p.sum())
        a, b = sorted((V - int(keep_low.sum()), V - int(keep64.sum())))
        t = 1 - 0.9
        return not bool(np.all(np.sign(rnd(c[a:b], dt) - t) != np.sign(c[a:b] - t)))
    xs = x[0] / 0.7
    if kind == "top_k":  # each flipped score against the float64 40th largest
        return not bool(np.all(tie_or_reversed(xs[fl], np.sort(xs)[-40], dt)))
    p = np.exp(xs - xs.max())
    p /= p.sum()
    return not bool(np.all(tie_or_reversed(p[fl], 0.05 * p.max(), dt)))


FN = {"top_p": top_p, "top_k": temp_top_k, "min_p": temp_min_p}
CASES = [("top_p", torch.bfloat16), ("top_p", torch.float16), ("top_k", torch.bfloat16)]
CASES += [("min_p", torch.bfloat16)]


@pytest.mark.parametrize("kind, dtype", CASES, ids=lambda c: str(c).split(".")[-1])
@pytest.mark.parametrize("seed", seeds())
def test_warper_findings_agree_with_float64(kind, dtype, seed):
    low = torch.tensor(torch_logits(kind, seed)).to(dtype)
    x = low.double().numpy()
    keep_low = np.isfinite(FN[kind](low).double().numpy()[0])
    keep64 = np.isfinite(FN[kind](torch.tensor(x)).numpy()[0])
    differ = not np.array_equal(np.sort(x[0][keep_low]), np.sort(x[0][keep64]))
    rep = diag.diverge.shadow(FN[kind], low)
    check(rep, differ, differ and torch_truth(kind, x, keep_low, dtype))


# -- the JAX sampler of examples/diverge_sampler.py -------------------------------------------


def example():
    jax = pytest.importorskip("jax")
    path = Path(__file__).resolve().parent.parent / "examples" / "diverge_sampler.py"
    spec = importlib.util.spec_from_file_location("diverge_sampler_example", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return jax, mod


def jax_logits(seed: int) -> tuple[np.ndarray, float]:
    """Flat rows (the cut among ~1/V probabilities), two leaders 1-2 bf16 steps apart over a
    low background (a greedy near tie after the temperature), or a hot head of 40 tokens."""
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(1000 + seed)
    t = float(bf(rng.choice([0.7, 1.0, 1.3])))
    if seed % 3 == 0:
        return rng.normal(0.0, rng.uniform(0.5, 3.0), (1, V)), t
    if seed % 3 == 1:
        x = rng.normal(-5.0, 1.0, (1, V))
        t = float(bf(0.7))  # quotients 8-11.4: bf16 steps of 1/16 there, 1/32 at the logits
        a = b = bf(rng.uniform(5.6, 8.0))
        for _ in range(int(rng.integers(1, 3))):
            b = np.nextafter(b, bf(np.inf))
        i, j = sorted(rng.permutation(V)[:2])
        x[0, i], x[0, j] = float(a), float(b)  # the larger later: a tie picks the smaller
        return x, t
    x = rng.normal(0.0, 1.0, (1, V))
    x[0, rng.permutation(V)[:40]] += rng.uniform(6.0, 9.0)
    return x, t


def jax_truth(x: np.ndarray, t: float, keep: np.ndarray, token: int) -> tuple[bool, bool]:
    """(differ, made) of the sampler's kept mask and greedy token against float64."""
    bf = ml_dtypes.bfloat16
    z = x[0] / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    e = np.cumsum(p[order]) - p[order]  # exclusive cumulative sums, float64 order
    keep64 = np.zeros(V, bool)
    keep64[order[~(e > 0.9)]] = True
    g64 = int(np.argmax(z))
    kept_differ = not np.array_equal(np.sort(x[0][keep]), np.sort(x[0][keep64]))
    token_differ = x[0, token] != x[0, g64]
    made = False
    if kept_differ:
        # the cut: positions between the two kept counts, their exclusive sums vs 0.9 exactly
        a, b = sorted((int(keep.sum()), int(keep64.sum())))
        made = not bool(np.all(np.sign(rnd(e[a:b], bf) - 0.9) != np.sign(e[a:b] - 0.9)))
        # the order: the tokens kept are a top set of the once-rounded probabilities
        pr = rnd(p, bf)
        if keep.any() and (~keep).any():
            made |= bool(pr[keep].min() < pr[~keep].max())
    if token_differ:
        made |= not bool(tie_or_reversed(z[g64], z[token], bf))
    return kept_differ or token_differ, made


@pytest.mark.parametrize("seed", seeds())
def test_jax_sampler_findings_agree_with_float64(seed):
    jax, ex = example()
    x, t = jax_logits(seed)
    low = jax.numpy.asarray(x, jax.numpy.bfloat16)
    temp = jax.numpy.asarray(t, jax.numpy.bfloat16)
    token, keep = ex.sample(low, temp)
    x = np.asarray(low).astype(np.float64)
    differ, made = jax_truth(x, t, np.asarray(keep)[0], int(np.asarray(token)[0]))
    rep = diag.diverge.shadow(ex.sample, low, temp)
    check(rep, differ, made)


def argsort_top_p(logits, temperature):
    """The example's top-p cut written with an argsort instead of a full top_k."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(logits / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    ps = jnp.take_along_axis(probs, order, axis=-1)
    mask = jnp.cumsum(ps, axis=-1) - ps > 0.9
    return jnp.argmax(logits, axis=-1), jnp.take_along_axis(~mask, jnp.argsort(order), axis=-1)


@pytest.mark.parametrize("ranking", ["top_k", "argsort"])
def test_jax_order_of_a_full_ranking_is_reported_where_it_changes_the_kept_mask(ranking):
    """The bf16 softmax rounds distinct logits (-5.25, -5.21875, -5.1875 against a leader
    ~5.6) to one probability: the full `top_k` (or argsort) orders them by index, so the kept
    mask (read back in vocabulary order) holds other tokens than the same mask read in
    float64's order.
    diag reports it at the `gather` that reads it, made (the once-rounded float64
    probabilities of the tokens moved do not tie), with as many elements as moved."""
    jax, ex = example()
    jnp = jax.numpy
    fn = ex.sample if ranking == "top_k" else jax.jit(argsort_top_p)
    low = jnp.asarray(ex._leaders(), jnp.bfloat16)
    temp = jnp.asarray(1.0, jnp.bfloat16)
    with jax.disable_jit():  # op by op, as the shadow runs it: the program's own bf16 pieces
        keep = np.asarray(fn(low, temp)[1])[0]
        ps = jnp.sort(jax.nn.softmax(low / temp, axis=-1), axis=-1)[..., ::-1]
        mask = np.asarray(~(jnp.cumsum(ps, axis=-1) - ps > 0.9))[0]  # in bf16 order
    z = np.asarray(low).astype(np.float64)[0]
    p = np.exp(z - z.max())
    p /= p.sum()
    rank = np.empty(V, np.int64)
    rank[np.argsort(-p, kind="stable")] = np.arange(V)  # float64's order
    moved = keep != mask[rank]  # the same mask read in float64's order
    assert moved.any()  # the premise: the order alone changes the kept tokens
    pr = rnd(p, ml_dtypes.bfloat16)
    assert pr[keep & moved].min() < pr[~keep & moved].max()  # not a tie once rounded
    rep = diag.diverge.shadow(fn, low, temp)
    (g,) = [d for d in rep.decisions if d.primitive == "gather"]
    assert g.kind == "select" and g.flipped == int(moved.sum()) and g.verdict == "fail"
    assert g.cause_op.startswith(f"the order of {ranking}") and rep.failed
