"""Correctly rounded tanh-approximate GELU: float64 + a rigorous bound + mpmath where undecided.

Why this op: it is the bf16 elementwise chain of a transformer's MLP (x^3, a multiply-add,
tanh, 1 + t, two products), the kind of chain where XLA may keep intermediates in float32
(`--xla_allow_excess_precision`, default true) or round each to bf16; measured under
torch_xla 2.9 on CPU, turning it off changes 15695 of 131072 bf16 results of N(0, 3^2) inputs.

Semantics (`gelu_mp` is the same definition in mpmath): the exact
``g(x) = 0.5 x (1 + tanh(k (x + a x^3)))`` with the real constants k = sqrt(2/pi) and
a = 0.044715 (the decimal), on the given input, rounded once (nearest-even) to the output
dtype. NaN gives NaN, +inf gives +inf, -inf gives -0 (the limit).

Why the fast path is exact. With z = k (x + a x^3), 0.5 (1 + tanh z) = 1 / (1 + exp(-2z)), so

    g = x / (1 + w),      w = exp(-2z)   for z >= 0,
    g = x w / (1 + w),    w = exp(2z)    for z < 0,

with w in (0, 1] and no cancellation anywhere (x and a x^3 have the same sign; 1 + w > 1).
In float64 (u = 2**-53):

1. x^2 is exact for inputs of at most 26 significant bits (float32, bf16, fp16); x^3, a x^3,
   the sum, k (...) each round once and the constants k, a once each: z has relative error at
   most 7u (1.01 covers second-order terms).
2. w: numpy's exp errs by at most `EXP_ULP` ulp (the softmax oracle's assumption, measured
   there); the error of z moves the exponent by at most 2|z| 7.07u, so w has relative error
   e_w <= 2 EXP_ULP u + 14.2 |z| u.
3. g has relative error rho <= 1.01 (2 e_w + 3u) for z < 0 (w twice, a product, a sum, a
   division), and rho <= 1.01 (e_w w + 2u) for z >= 0 (w only through 1 + w, where its
   relative error counts w / (1 + w) <= w times: huge |z| costs nothing there).
4. As in the softmax oracle (Ziv): with D = 1.25 (rho + 2u) |g|, if g - D and g + D round to
   the same bits of the output dtype, that is the correctly rounded result; otherwise the
   element is COUNTED (`fallbacks`) and settled with mpmath at rising precision.
   Where 2|z| > 700 and z < 0, |g| < |x| e^-700 < 2**-880: -0 in every output dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import ml_dtypes
import mpmath
import numpy as np

from diag.numerics import as_dtype
from diag.oracle._softmax import EXP_ULP, round_pair
from diag.oracle.mp import round_mpf

__all__ = ["gelu_core", "gelu_mp", "GELU_DTYPES", "GELU_K", "GELU_A"]

_U = 2.0**-53
#: The constants every implementation of the tanh approximation writes down.
GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
GELU_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
_UNDERFLOW_2Z = 700.0
_MP_MAX_PREC = 4096


def gelu_mp(values: Iterable[float], dtype) -> list:
    """Correctly rounded tanh-approximate GELU of each value, with mpmath (slow: the reference).

    A Ziv loop: the value at `prec` bits is within 2**(16 - prec) relative of the exact g
    (a few roundings of exp and of the constants); if both ends of that interval round to the
    same bits of `dtype`, that is the answer, else the precision doubles.
    """
    dt = as_dtype(dtype)
    out: list = []  # numpy scalars of dt
    for v in values:
        v = float(v)
        if math.isnan(v):
            out.append(np.array(np.nan).astype(dt)[()])
            continue
        if math.isinf(v):
            out.append(np.array(v if v > 0 else -0.0).astype(dt)[()])
            continue
        if v == 0.0:
            out.append(np.array(v).astype(dt)[()])  # keeps the sign of zero
            continue
        z0 = GELU_K * (v + GELU_A * v**3)  # only its size matters here
        if z0 < -_UNDERFLOW_2Z:  # |g| < |v| e^-1400: -0 in every dtype (and for round_mpf)
            out.append(np.array(-0.0).astype(dt)[()])
            continue
        prec = 96
        while True:
            with mpmath.workprec(prec):
                x = mpmath.mpf(v)
                z = mpmath.sqrt(2 / mpmath.pi) * (x + mpmath.mpf("0.044715") * x**3)
                g = x / (1 + mpmath.exp(-2 * z))
                tol = mpmath.ldexp(1, 16 - prec)
                lo, hi = round_mpf(g * (1 - tol), dt), round_mpf(g * (1 + tol), dt)
            if lo == hi or prec > _MP_MAX_PREC:
                if lo != hi:  # pragma: no cover - g is transcendental for x != 0
                    raise ArithmeticError(f"gelu_mp: no decision for {v!r} at {prec} bits")
                out.append(hi if hi != 0 or v > 0 else np.array(-0.0).astype(dt)[()])
                break
            prec *= 2
    return out


def gelu_core(x: np.ndarray, out_dt: np.dtype, slack: float = 1.0) -> tuple[np.ndarray, int]:
    """Correctly rounded tanh-approximate GELU of every element.

    Args:
        x: array of a dtype in GELU_DTYPES.
        out_dt: output dtype (one of GELU_DTYPES).
        slack: factor on the proven window (>= 1; tests inflate it to force the fallback).

    Returns:
        (value of out_dt with x's shape, number of elements settled by mpmath).
    """
    with np.errstate(invalid="ignore"):
        x64 = x.astype(np.float64).ravel()
    out = np.zeros(x64.shape, out_dt)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        z = GELU_K * (x64 + GELU_A * (x64 * x64 * x64))
        w = np.exp(-2.0 * np.abs(z))
        g = np.where(z >= 0, x64 / (1.0 + w), x64 * w / (1.0 + w))
        e_w = 2 * EXP_ULP * _U + 14.2 * np.abs(z) * _U + 2.0**-1000
        # z >= 0: w enters only through 1 + w, so its error counts w / (1 + w) <= w times.
        rho = 1.01 * np.where(z >= 0, e_w * w + 2.0 * _U, 2.0 * e_w + 3.0 * _U)
        d = 1.25 * (rho + 2.0 * _U) * np.abs(g) * slack
    finite = np.isfinite(x64)
    tiny = finite & (z < 0) & (2.0 * np.abs(z) > _UNDERFLOW_2Z)
    live = finite & ~tiny
    val, undecided = round_pair(g[live] - d[live], g[live] + d[live], out_dt)
    out[live] = val
    # The window of a zero g is empty: g is exactly +-0 (x = +-0), sign kept.
    zero = live & (g == 0)
    out[zero] = x64[zero].astype(out_dt)
    out[tiny] = np.array(-0.0).astype(out_dt)
    out[np.isnan(x64)] = np.array(np.nan).astype(out_dt)
    out[x64 == np.inf] = np.array(np.inf).astype(out_dt)
    out[x64 == -np.inf] = np.array(-0.0).astype(out_dt)
    idx = np.flatnonzero(live)[undecided & (g[live] != 0)]
    if idx.size:
        out[idx] = gelu_mp(x64[idx], out_dt)
    return out.reshape(x.shape), int(idx.size)
