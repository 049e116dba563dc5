"""The tanh-approximate GELU probe: its oracle is correctly rounded, its bound is a bound.

Claims: the fast float64 oracle equals the mpmath reference bit for bit on every bf16 and
every fp16 value and on float32 samples (including tiny, huge and underflowing inputs), also
when its window is inflated so that every element goes through the mpmath fallback; the
float32 bound holds for the chain computed op by op in float32 (numpy), and a chain whose
intermediates are each rounded to bf16 breaks it but keeps the loose (bf16) bound, which is
what makes that case a `warn` and not a `fail`.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from diag import oracle
from diag.oracle._gelu import gelu_mp
from diag.tolerance import tolerance

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


def _bits(a):
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("dtype, bits", [(BF16, np.uint16), (F16, np.uint16)])
def test_oracle_is_mpmath_on_every_16_bit_value(dtype, bits):
    x = np.arange(2**16, dtype=bits).view(dtype)
    fast = oracle.gelu_result(x)
    with np.errstate(invalid="ignore"):
        ref = np.array(gelu_mp(x.astype(np.float64), dtype), dtype=dtype)
    nan = np.isnan(ref.astype(np.float32))
    assert np.array_equal(np.isnan(fast.value.astype(np.float32)), nan)
    assert np.array_equal(_bits(fast.value)[~nan], _bits(ref)[~nan])
    assert fast.method == "f64-exp-bound" and 0 <= fast.fallbacks < x.size // 100


def test_oracle_is_mpmath_on_float32_samples_and_hard_inputs():
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.standard_normal(2000) * 4, rng.standard_normal(200) * 1e-30,
        -np.geomspace(5, 30, 200), np.geomspace(1e-44, 3e38, 200),
        [0.0, -0.0, np.inf, -np.inf, np.nan, -11.5, -12.0],
    ]).astype(np.float32)
    ref = np.array(gelu_mp(x.astype(np.float64), F32), dtype=F32)
    for slack in (1.0, 1e9):  # the second sends every element through mpmath
        fast = oracle.gelu_result(x, _slack=slack)
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(fast.value), nan)
        assert np.array_equal(_bits(fast.value)[~nan], _bits(ref)[~nan])
    assert fast.fallbacks > x.size // 2
    # Limits and signed zeros: -inf -> -0, +inf -> +inf, -0 -> -0.
    minus_zero, plus_inf, minus_inf = ref[-6], ref[-5], ref[-4]
    assert np.signbit(minus_zero) and minus_zero == 0 and plus_inf == np.inf
    assert np.signbit(minus_inf) and minus_inf == 0


def _chain(x, dt):
    """The chain as a model writes it, every op rounded to `dt` (numpy, op by op)."""
    c = lambda v: np.asarray(v, dtype=np.float64).astype(dt)  # noqa: E731
    x = c(x)
    cube = c(c(x.astype(np.float64) * x) * x.astype(np.float64))
    inner = c(x.astype(np.float64) + c(0.044715 * cube.astype(np.float64)).astype(np.float64))
    z = c(math.sqrt(2 / math.pi) * inner.astype(np.float64))
    t = c(np.tanh(z.astype(np.float64)))
    s = c(1.0 + t.astype(np.float64))
    return c(c(0.5 * x.astype(np.float64)).astype(np.float64) * s.astype(np.float64))


def test_float32_chain_keeps_the_bound_and_a_bf16_chain_keeps_only_the_loose_one():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 2048)) * 5).astype(BF16)
    truth = oracle.gelu(x)
    tol = tolerance("gelu", BF16)
    bound, loose = tol.bound(x, truth), tol.loose_bound(x, truth)
    err32 = np.abs(_chain(x, F32).astype(BF16).astype(np.float64) - truth.astype(np.float64))
    err16 = np.abs(_chain(x, BF16).astype(np.float64) - truth.astype(np.float64))
    assert (err32 <= bound).all()
    assert (err16 > bound).any()  # e.g. 1 + tanh(z) rounded to 0 near z = -3
    assert (err16 <= loose).all()
