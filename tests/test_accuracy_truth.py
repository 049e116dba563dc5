"""diag's accuracy truth is the exact value rounded once to the dtype, as mpmath decides it.

Claims under test: for every function of the tables, `diag.accuracy.truth.truth` gives, at
each input, the value this test finds with its own reference: the exact value from mpmath at
200 bits (written here from the textbook definitions, not from diag's rows), rounded by
comparing exact rationals with the dtype's two neighbouring values (nearest, ties to the even
bit pattern, Inf from max + half an ulp). Also the ulp it measures errors with is the ulp of
the exact value. The default run checks a strided subset of every bfloat16 and float16 input
and a few hundred float32 samples (hard cases included); the slow run checks every input.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import mpmath
import numpy as np
import pytest

from diag.accuracy.functions import FUNCTIONS
from diag.accuracy.inputs import inputs
from diag.accuracy.truth import compute, round_mpf, truth

MP = mpmath.mp.clone()
MP.prec = 200

DT = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
      "float32": np.dtype(np.float32)}


def reference(name: str, x: float):
    """The exact value at 200 bits, from the definitions (stable forms where they cancel)."""
    x = MP.mpf(x)
    sig = lambda z: 1 / (1 + MP.exp(-z))  # noqa: E731
    return {
        "exp": lambda: MP.exp(x), "log": lambda: MP.log(x), "log1p": lambda: MP.log1p(x),
        "expm1": lambda: MP.expm1(x), "tanh": lambda: MP.tanh(x), "sin": lambda: MP.sin(x),
        "cos": lambda: MP.cos(x), "sqrt": lambda: MP.sqrt(x), "erf": lambda: MP.erf(x),
        "sigmoid": lambda: sig(x), "rsqrt": lambda: 1 / MP.sqrt(x),
        "reciprocal": lambda: 1 / x,
        # x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2
        "gelu": lambda: x * MP.erfc(-x / MP.sqrt(2)) / 2,
        # x/2 (1 + tanh z) = x sigmoid(2z)
        "gelu_tanh": lambda: x * sig(2 * MP.sqrt(2 / MP.pi) * (x + MP.mpf("0.044715") * x**3)),
        "silu": lambda: x * sig(x),
        "softplus": lambda: MP.log(1 + MP.exp(x)),
    }[name]()


def _exact(v) -> Fraction:
    sign, man, exp, _ = v._mpf_
    f = Fraction(man) * (Fraction(2) ** exp)
    return -f if sign else f


def nearest(v, dtype: str) -> float:
    """v rounded to nearest, ties to even, by exact comparison with its two neighbours."""
    dt = DT[dtype]
    finfo = ml_dtypes.finfo(dt)
    big = Fraction(float(finfo.max))
    ulp_top = Fraction(float(finfo.max)) - Fraction(float(np.nextafter(finfo.max, 0, dtype=dt)
                                                          if dt != DT["bfloat16"] else
                                                          _below(finfo.max, dt)))
    if abs(v) > MP.mpf(2) ** 200:  # far past every dtype's max (and too big for Fraction)
        return float("inf") if v > 0 else float("-inf")
    if abs(v) < MP.mpf(2) ** -200:  # far below half of every dtype's smallest subnormal
        return -0.0 if v < 0 else 0.0
    f = _exact(v)
    if abs(f) >= big + ulp_top / 2:
        return float("inf") if f > 0 else float("-inf")
    guess = np.array(float(v)).astype(np.float64)
    c = np.array(guess).astype(dt)  # one candidate; its neighbours are the others
    cands = {float(c), float(_below(c, dt)), float(_above(c, dt))}
    cands = [k for k in cands if np.isfinite(k)]
    best = min(abs(Fraction(k) - f) for k in cands)
    ties = [k for k in cands if abs(Fraction(k) - f) == best]
    if len(ties) > 1:  # the even bit pattern
        ties = [k for k in ties if int(np.array(k).astype(dt).view(f"u{dt.itemsize}")) % 2 == 0]
    out = ties[0]
    return out if out != 0 else (-0.0 if f < 0 else 0.0)


def _step(c, dt, up: bool):
    bits = np.array(c, dtype=dt).view(f"u{dt.itemsize}").astype(np.int64)
    mag = bits & ((1 << (8 * dt.itemsize - 1)) - 1)
    neg = bits != mag
    if mag == 0:
        sign_bit = 0 if up else 1 << (8 * dt.itemsize - 1)
        return np.array(1 | sign_bit, dtype=f"u{dt.itemsize}").view(dt)
    mag = mag + (1 if up != neg else -1)
    return np.array(mag | (bits - (bits & ((1 << (8 * dt.itemsize - 1)) - 1))),
                    dtype=f"u{dt.itemsize}").view(dt)


def _below(c, dt):
    return _step(c, dt, up=False)


def _above(c, dt):
    return _step(c, dt, up=True)


def ulp_exact(v, dtype: str) -> float:
    """2^(max(e, emin) - p + 1) for |v| in [2^e, 2^(e+1)), e from the mpmath value."""
    finfo = ml_dtypes.finfo(DT[dtype])
    p, emin = finfo.nmant + 1, finfo.minexp
    e = int(MP.floor(MP.log(abs(v), 2))) if v else emin
    return 2.0 ** (max(e, emin) - p + 1)


def check(name: str, dtype: str, x: np.ndarray) -> None:
    fn = FUNCTIONS[name]
    got = compute(fn, x.astype(np.float64), dtype, verify=False)
    for i, xi in enumerate(x.astype(np.float64)):
        v = reference(name, float(xi))
        want = nearest(v, dtype)
        # mpmath has no -0: at x = +-0 a zero's sign is IEEE's (f(-0) = -0 for odd f)
        same_sign = xi == 0 or np.signbit(got.rounded[i]) == np.signbit(want)
        assert got.rounded[i] == want and same_sign, (
            f"{name}({xi!r}) {dtype}: diag {got.rounded[i]!r}, mpmath {want!r}")
        if np.isfinite(want) and not got.ambiguous[i]:
            assert got.ulp[i] == ulp_exact(v, dtype), f"ulp of {name}({xi!r}) {dtype}"


def _strided(name: str, dtype: str, step: int) -> np.ndarray:
    x = inputs(FUNCTIONS[name], dtype)
    return x[::step]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_16_bit_truth_matches_mpmath_on_a_strided_subset(name, dtype):
    check(name, dtype, _strided(name, dtype, 211))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_float32_truth_matches_mpmath_on_samples_and_hard_cases(name):
    x = inputs(FUNCTIONS[name], "float32", samples=2000)
    pick = np.concatenate([x[:150], x[-150:]])  # the hard cases first, samples last
    check(name, "float32", pick)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_16_bit_truth_matches_mpmath_at_every_input(name, dtype):
    check(name, dtype, _strided(name, dtype, 1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rounding_of_exact_values_at_ties_subnormals_and_overflow(dtype):
    finfo = ml_dtypes.finfo(DT[dtype])
    p, emin, top = finfo.nmant + 1, finfo.minexp, float(finfo.max)
    half_top = 2.0 ** (finfo.maxexp - 1 - p)
    tiny = 2.0 ** (emin - p + 1)
    cases = [top + half_top, top + half_top * (1 - 2.0**-60), tiny / 2, tiny / 2 * (1 + 2.0**-60),
             tiny * 1.5, tiny * 2.5, 1 + 2.0 ** -p, 1 + 3 * 2.0 ** -p, -(1 + 2.0 ** -p),
             2.0 ** emin * (1 - 2.0 ** -(p + 1)), tiny / 4, 0.1, -1 / 3]
    for c in cases:
        v = MP.mpf(c)
        assert round_mpf(v, dtype) == nearest(v, dtype), (dtype, c)


def test_the_cache_returns_the_table_it_stored(tmp_path):
    from diag.oracle.cache import GroundTruthCache

    fn = FUNCTIONS["tanh"]
    x = inputs(fn, "bfloat16")[::97]
    cache = GroundTruthCache(tmp_path)
    first = truth(fn, x, "bfloat16", cache)
    again = truth(fn, x, "bfloat16", cache)
    assert cache.info()["entries"] == 1
    for a, b in zip((first.rounded, first.exact, first.ulp), (again.rounded, again.exact,
                                                               again.ulp)):
        assert np.array_equal(a, b, equal_nan=True)
