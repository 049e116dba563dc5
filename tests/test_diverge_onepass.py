"""The shadow's one-pass figures (`diag.diverge.onepass`) against the rules written out here.

Every expected figure is computed in the test from its definition (docs/diverge.md, "How an
op is judged"): the ULP of a float64 value in the output's format from `math.frexp`, the
bounds of each class, the maxima over elements; and a matrix product's sum|terms| in float64
by numpy, for the float32 sum PyTorch's shadow uses instead.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diag.diverge import onepass, rules, torch_facts

# (significand bits, smallest normal) of the output formats the pass takes
FORMATS = {np.float32: (24, 2.0**-126), np.float16: (11, 2.0**-14)}


def _ulp(x: float, fmt) -> float:
    p, tiny = FORMATS[fmt]
    a = max(abs(x), tiny)
    return math.ldexp(1.0, math.frexp(a)[1] - p)


def _expected(y, r, s, fmt, k, g=0.0, mag=None, use_r=False, c=0.0):
    """(max|y-r|, max|y-r|/ulp, max|y-r|/bound, max|y-s|, max|s|, max|r-s|) element by
    element, bound = k ulp(r) + tiny (+ g|r| or g|mag|) (+ c), in the order the rules state
    it."""
    tiny = FORMATS[fmt][1]
    top = ulps = ratio = cmax = smax = came = 0.0
    for i, (yi, ri, si) in enumerate(zip(y.tolist(), r.tolist(), s.tolist())):
        e, u = abs(yi - ri), _ulp(ri, fmt)
        bound = k * u + tiny
        if use_r:
            bound = g * abs(ri) + bound
        elif mag is not None:
            bound = g * abs(float(mag[i])) + bound
        bound = bound + c if c else bound
        top, ulps, ratio = max(top, e), max(ulps, e / u), max(ratio, e / bound)
        cmax, smax, came = max(cmax, abs(yi - si)), max(smax, abs(si)), max(came, abs(ri - si))
    return top, ulps, ratio, cmax, smax, came


def _arrays(n: int, fmt, seed: int):
    """An output, its reference and shadow with the cases that matter: values near zero
    (cancellation), subnormal references, exact zeros, large magnitudes."""
    rng = np.random.default_rng(seed)
    r = rng.normal(0, 1, n) * np.exp(rng.uniform(-8, 8, n))
    r[::11] = rng.normal(0, 1e-30, r[::11].size)  # below float16/float32 normals
    r[::13] = 0.0
    y = r.astype(fmt).astype(np.float64)  # the output as rounded
    y[::7] = np.nextafter(y[::7].astype(fmt), fmt(np.inf)).astype(np.float64)  # one ULP off
    s = r * (1 + rng.normal(0, 1e-6, n))
    return y.astype(fmt), r, s


@pytest.mark.parametrize("fmt", [np.float32, np.float16])
@pytest.mark.parametrize("cls,k", [("rounded", 2.0), ("library", 16.0), ("structural", 2.0)])
def test_the_elementwise_figures_are_the_rule_written_out(fmt, cls, k):
    y, r, s = _arrays(3001, fmt, 1)
    got = onepass.figures(y, r, s, fmt, cls)
    want = _expected(y.astype(np.float64), r, s, fmt, k)
    assert got is not None
    assert tuple(got) == pytest.approx(want, rel=1e-15, abs=0)


def test_a_reductions_cheap_bound_and_its_bound_against_sum_terms():
    y, r, s = _arrays(5000, np.float32, 2)
    g = 64 * 2.0**-24 / (1 - 64 * 2.0**-24)
    cheap = onepass.figures(y, r, s, np.float32, "reduction", g=g)
    assert tuple(cheap) == pytest.approx(
        _expected(y.astype(np.float64), r, s, np.float32, 2.0, g=g, use_r=True), rel=1e-15, abs=0
    )
    mag = np.abs(r) * 3.0 + 1e-3
    full = onepass.figures(y, r, s, np.float32, "reduction", g=g, mag=mag.astype(np.float32))
    want = _expected(y.astype(np.float64), r, s, np.float32, 2.0, g=g, mag=mag.astype(np.float32))
    assert tuple(full) == pytest.approx(want, rel=1e-15, abs=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["y", "r", "s"])
def test_anything_not_finite_is_left_to_the_numpy_rules(bad, where):
    y, r, s = _arrays(100, np.float32, 3)
    {"y": y, "r": r, "s": s}[where][17] = bad
    assert onepass.figures(y, r, s, np.float32, "rounded") is None


def test_what_the_pass_does_not_take_goes_the_numpy_way():
    y, r, s = _arrays(100, np.float32, 4)
    assert onepass.figures(y.astype(np.float64), r, s, np.float64, "rounded") is None
    assert onepass.figures(y[:50], r, s, np.float32, "rounded") is None  # shapes differ


@pytest.mark.parametrize("fmt", [np.float32, np.float16])
def test_a_composite_ops_normwise_bound_is_the_rule_written_out(fmt):
    """A fused op (a layer norm, an attention kernel): every element's bound adds
    gamma_(m+4) max|r|, m its longest input axis; gamma_k = k u / (1 - k u)."""
    y, r, s = _arrays(3001, fmt, 5)
    u = 2.0 ** -FORMATS[fmt][0]
    ku = (300 + 4) * u
    c = ku / (1 - ku) * float(np.max(np.abs(r)))
    got = onepass.op_figures(y, r, s, fmt, "composite", longest=300)
    want = _expected(y.astype(np.float64), r, s, fmt, 2.0, c=c)
    assert got is not None
    assert tuple(got) == pytest.approx(want, rel=1e-15, abs=0)
    # and the numpy rules give the same ULPs and ratio
    ulps, ratio, _ = rules.own_error_diff(y, r, fmt, "composite", longest=300)
    assert (got.ulps, got.ratio) == (ulps, ratio)


def test_a_reductions_gamma_of_one_count_is_higham_s_written_out():
    """gamma_n = n u / (1 - n u), n the larger of the count and the first count of terms; a
    float32 sum|terms| shrinks it by 1 + gamma_{n+2}(2^-24) (the same number on every call)."""

    class Float32Sum:
        computed_in = np.dtype(np.float32)

    for cnt, terms in ((64.0, 1.0), (257.0, 1024.0), (1025.0, 3.0)):
        n = max(cnt, terms)
        g = n * 2.0**-24 / (1 - n * 2.0**-24)
        assert rules.facts_gamma(cnt, terms, np.dtype(np.float32), None) == g
        shrink = (n + 2) * 2.0**-24 / (1 - (n + 2) * 2.0**-24)
        for _ in range(2):
            got = rules.facts_gamma(cnt, terms, np.dtype(np.float32), Float32Sum())
            assert got == g / (1 + shrink)


def test_a_float32_sum_of_terms_never_understates_the_ratio_and_is_within_its_gamma():
    """A weight gradient h^T g whose elements nearly cancel: the ratio against the float32
    sum|terms| is at or above the one against the float64 sum (numpy, in the test), and above
    it by no more than 1 + gamma_{n+2}(2^-24)."""
    rng = np.random.default_rng(5)
    n = 64
    h, g = rng.normal(0, 1, (n, 300)), rng.normal(0, 1e-3, (n, 200))
    h32, g32 = torch.tensor(h, dtype=torch.float32), torch.tensor(g, dtype=torch.float32)
    y = (h32.T @ g32).numpy()
    a, b = h32.double().numpy().T, g32.double().numpy()
    r = a @ b
    mag64 = np.abs(a) @ np.abs(b)
    func = torch.ops.aten.mm.default
    facts = torch_facts.facts(
        func, (torch.from_numpy(a), torch.from_numpy(b)), {}, 0, {}, ((h32.T, g32), {})
    )
    assert facts.computed_in == np.float32
    gam = n * 2.0**-24 / (1 - n * 2.0**-24)
    err = np.abs(y.astype(np.float64) - r)
    ulp = np.vectorize(lambda x: _ulp(x, np.float32))(r)
    exact = float(np.max(err / (gam * mag64 + 2 * ulp + 2.0**-126)))
    got = onepass.op_figures(y, r, r, np.float32, "reduction", facts=facts, terms=n)
    assert got is not None
    assert (err > gam * np.abs(r) + 2 * ulp + 2.0**-126).any()  # the cheap bound does not clear it
    shrink = 1 + (n + 2) * 2.0**-24 / (1 - (n + 2) * 2.0**-24)
    assert exact <= got.ratio <= exact * shrink * (1 + 1e-12)
    # and the numpy rules give the same ratio from the same facts
    assert rules.own_error(y, r, np.float32, "reduction", facts=facts, terms=n)[1] == pytest.approx(
        got.ratio, rel=1e-15
    )


def test_a_sum_of_terms_past_float32s_range_is_redone_in_float64():
    """|a| |b| summed in float32 overflows where the float64 sum (numpy, in the test) does
    not: the facts give the float64 sum and say so, so the bound is not shrunk."""
    a = torch.full((2, 4), 3e19, dtype=torch.float32)
    b = torch.full((4, 3), 2e19, dtype=torch.float32)
    b[1::2] *= -1  # the products cancel: the op's own output stays finite
    func = torch.ops.aten.mm.default
    wide = (a.double(), b.double())
    facts = torch_facts.facts(func, wide, {}, 0, {}, ((a, b), {}))
    assert isinstance(facts, torch_facts.Float32Terms)
    mag, cnt = facts()
    want = np.abs(a.double().numpy()) @ np.abs(b.double().numpy())  # 2.4e39 each
    assert (want > np.finfo(np.float32).max).all()  # past float32, within float64
    assert facts.computed_in == np.float64
    assert np.array_equal(mag, want) and cnt == 4.0


def test_a_nan_in_sum_of_terms_is_left_to_the_numpy_rules():
    """A sum|terms| with a NaN (an inf times a zero among the terms) has no ratio the pass can
    state: it gives up on the whole output, and the rules say what it means (the ratio there
    is NaN: `rules._ratio`)."""
    y, r, s = _arrays(1000, np.float32, 6)
    mag = np.abs(r) * 2.0 + 1.0
    mag[500] = np.nan
    g = 64 * 2.0**-24 / (1 - 64 * 2.0**-24)
    assert onepass.figures(y, r, s, np.float32, "reduction", g=g, mag=mag) is None
    ulps, ratio, _ = rules.own_error_diff(
        y, r, np.float32, "reduction", facts=lambda: (mag, 64.0), terms=64, beyond=True
    )
    assert math.isnan(ratio) and math.isfinite(ulps)
    # a bound made NaN in the pass itself (0 * inf: x86 gives it the sign bit) counts too
    inf_mag = np.abs(r) + 1.0
    inf_mag[3] = np.inf
    assert onepass.figures(y, r, s, np.float32, "reduction", g=0.0, mag=inf_mag) is None
