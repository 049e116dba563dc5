"""Ill-conditioned long-K dot products: the matmul oracle still equals mpmath bit for bit.

Claims under test: on dot products of chosen condition number 1e5..1e30 (Ogita, Rump and
Oishi's GenDot generator, "Accurate sum and dot product", SIAM J. Sci. Comput. 26(6), 2005,
Algorithm 6.1, written here for float32 inputs), every element of the product, the
ill-conditioned diagonal and the mixed off-diagonal alike, equals `diag.oracle.mp.matmul`; the
elements the float64 bound cannot decide are counted; forcing Ozaki's split for every undecided
row gives the same bits; and the error-free pieces the oracle is built on are exact
(extraction sums, the Ozaki split's high-part product).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

import diag.oracle as oracle
from diag.oracle import mp
from diag.oracle._eft import row_sums, split_bits, split_rows
from tests.conftest import assert_bits_equal


def _f32(v: float) -> float:
    return float(np.float32(v))


def gendot(n: int, cond: float, rng: np.random.Generator):
    """float32 vectors x, y of length n whose dot product has condition ~cond.

    Algorithm 6.1 of Ogita-Rump-Oishi: the first half gets random signs and exponents up to
    log2(cond)/2 (the first one above it, the last 0); each later y_i is chosen so that the
    running exact dot product shrinks, with exponents falling linearly to 0; then both are
    permuted alike. The running dot product is taken exactly (products of float32 values are
    exact in float64, math.fsum is correctly rounded).
    """
    n2 = n // 2
    b = math.log2(cond)
    e = np.rint(rng.random(n2) * b / 2).astype(int)
    e[0], e[-1] = round(b / 2) + 1, 0
    x = [_f32(v) for v in (2 * rng.random(n2) - 1) * np.ldexp(1.0, e)]
    y = [_f32(v) for v in (2 * rng.random(n2) - 1) * np.ldexp(1.0, e)]
    prods = [p * q for p, q in zip(x, y)]
    for ei in np.rint(np.linspace(b / 2, 0, n - n2)).astype(int):
        xi = _f32((2 * rng.random() - 1) * 2.0 ** int(ei))
        yi = _f32(((2 * rng.random() - 1) * 2.0 ** int(ei) - math.fsum(prods)) / xi)
        x.append(xi)
        y.append(yi)
        prods.append(xi * yi)
    perm = rng.permutation(n)
    return np.array(x, np.float32)[perm], np.array(y, np.float32)[perm]


def condition(x: np.ndarray, y: np.ndarray) -> float:
    """2 sum|x_i y_i| / |sum x_i y_i| (the paper's definition), from exact products."""
    p = x.astype(np.float64) * y.astype(np.float64)
    return 2 * math.fsum(np.abs(p).tolist()) / abs(math.fsum(p.tolist()))


CONDS = (1e5, 1e10, 1e20, 1e30)


def gendot_matrices(k: int, seed: int):
    """A [4, k] and B [k, 4] whose diagonal products have condition ~CONDS."""
    rng = np.random.default_rng(seed)
    pairs = [gendot(k, c, rng) for c in CONDS]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs], axis=1)


def test_gendot_reaches_the_requested_condition():
    rng = np.random.default_rng(0)
    for c in CONDS:
        got = condition(*gendot(4096, c, rng))
        assert c / 1e3 < got < c * 1e3, (c, got)


@pytest.mark.parametrize("k", [4096, 1000])
def test_gendot_products_match_mp_bit_for_bit(k):
    a, b = gendot_matrices(k, seed=k)
    res = oracle.matmul_result(a, b)
    assert res.method == ("f64-ksplit" if k > 1024 else "f64-bound")
    assert_bits_equal(res.value, mp.matmul(a, b), f"GenDot K={k}")
    # cond >= 1e10 puts the float64 bound (~1e-13 of sum|p|) far above a float32 ulp of the
    # result: those diagonal elements cannot be decided by the first stage, and are counted.
    assert res.fallbacks >= sum(c >= 1e10 for c in CONDS)
    # Three extraction passes take ~110 bits: even cond 1e30 needs no math.fsum.
    assert res.exact == 0


def test_forcing_ozaki_split_on_every_undecided_row_gives_the_same_bits(monkeypatch):
    a, b = gendot_matrices(2048, seed=3)
    monkeypatch.setattr("diag.oracle._matmul.REFINE_COST", 10**9)
    monkeypatch.setattr("diag.oracle._matmul.OZAKI_LINE_COST", 0)
    assert_bits_equal(oracle.matmul(a, b), mp.matmul(a, b), "GenDot via Ozaki")


def test_ozaki_split_decides_moderately_ill_conditioned_rows_alone(monkeypatch):
    # cond ~1e6..1e8 (asked 1e5..3e6): beyond the K-split bound (~3e-14 sum|p| at K=2048, a float32 ulp is
    # ~6e-8 of the result), within the split's (~1e-18 sum|p|). With Ozaki forced, the refine
    # stage must receive nothing, so every undecided element was decided by the split.
    rng = np.random.default_rng(8)
    pairs = [gendot(2048, c, rng) for c in (1e5, 3e5, 1e6, 3e6)]
    a = np.stack([p[0] for p in pairs])
    b = np.stack([p[1] for p in pairs], axis=1)
    refined = []

    def spy(x, passes):
        refined.append(x.shape[0])
        return row_sums(x, passes)

    monkeypatch.setattr("diag.oracle._matmul.REFINE_COST", 10**9)
    monkeypatch.setattr("diag.oracle._matmul.OZAKI_LINE_COST", 0)
    monkeypatch.setattr("diag.oracle._matmul.row_sums", spy)
    res = oracle.matmul_result(a, b)
    assert_bits_equal(res.value, mp.matmul(a, b), "moderate GenDot via Ozaki")
    assert res.fallbacks >= 4 and sum(refined) == 0, (res.fallbacks, refined)


def test_ozaki_high_parts_multiply_exactly_in_float64():
    # Wide exponent range per row: the high parts still multiply exactly in any order.
    rng = np.random.default_rng(4)
    k = 3000
    a = (rng.standard_normal((3, k)) * np.ldexp(1.0, rng.integers(-40, 40, (3, k))))
    b = (rng.standard_normal((k, 2)) * np.ldexp(1.0, rng.integers(-40, 40, (k, 2))))
    a, b = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    rho = split_bits(k)
    a1, a2 = split_rows(a, rho)
    b1t, b2t = split_rows(b.T.copy(), rho)
    assert (a1 + a2 == a).all() and (b1t + b2t == b.T).all()
    got = a1 @ b1t.T
    for i in range(3):
        for j in range(2):
            with mpmath.workprec(4000):
                exact = mpmath.fsum(mpmath.mpf(float(p)) * mpmath.mpf(float(q))
                                    for p, q in zip(a1[i], b1t[j]))
            assert mpmath.mpf(float(got[i, j])) == exact, (i, j)


@pytest.mark.parametrize("passes", [1, 3])
def test_extraction_row_sums_bound_the_exact_sum(passes):
    rng = np.random.default_rng(5)
    rows = []
    for c in CONDS:
        x, y = gendot(1500, c, rng)
        rows.append(x.astype(np.float64) * y.astype(np.float64))  # exact products
    x = np.stack(rows)
    hi, lo, err = row_sums(x, passes)
    for i in range(x.shape[0]):
        with mpmath.workprec(4000):
            exact = mpmath.fsum(mpmath.mpf(float(v)) for v in x[i])
            miss = abs(exact - mpmath.mpf(float(hi[i])) - mpmath.mpf(float(lo[i])))
        assert miss <= err[i], (i, passes)
        if passes == 3:
            # Three passes take ~3 * 40 bits: the bound is tiny next to the exact sum.
            assert err[i] <= 1e-15 * abs(float(exact)), (i, err[i], float(exact))


def test_block_diagonal_inputs_are_settled_by_the_elementwise_bound():
    # Disjoint supports make most sums exact zeros, where the rank-one bound is useless; the
    # elementwise retry (an sgemm and an indicator GEMM) decides them without fallbacks.
    rng = np.random.default_rng(6)
    a = np.zeros((64, 64), np.float32)
    b = np.zeros((64, 64), np.float32)
    for blk in range(4):
        s = slice(16 * blk, 16 * blk + 16)
        a[s, s] = rng.standard_normal((16, 16))
        b[s, s] = rng.standard_normal((16, 16))
    a[5] = -0.0
    res = oracle.matmul_result(a, b)
    assert_bits_equal(res.value, mp.matmul(a, b), "block diagonal")
    assert res.fallbacks < a.size // 100
