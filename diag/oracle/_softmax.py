"""Correctly rounded softmax at numpy speed: float64 + a rigorous bound + a proof per element.

Semantics (last axis; `diag.oracle.mp.softmax_row` is the same definition in mpmath): the
exact ``exp(x_i - max) / sum_j exp(x_j - max)`` of the given inputs, rounded once (nearest-even)
to the output dtype. -inf entries give exactly +0. A row holding NaN or +inf gives NaN everywhere
(the IEEE computation meets inf - inf; such rows are listed in ``nan_rows``). A row that is all
-inf has no defined result: NaN everywhere, listed in ``undefined_rows``.

Why the fast path is exact. Per row, with m the row maximum (exact) and n the row length:

1. ``d_i = fl(x_i - m)`` and its exact error ``t_i`` (TwoSum), so x_i - m = d_i + t_i exactly,
   |t_i| <= 2**-53 |d_i|.
2. ``e_i = fl(fl(exp(d_i)) * (1 + t_i))``. ASSUMPTION, the one thing not proven here: numpy's
   float64 ``exp`` errs by at most `EXP_ULP` ulp (4) in the normal range (glibc documents < 1
   ulp; numpy's SIMD exp is measured at < 1 ulp against mpmath in tests/test_oracle_softmax.py).
   With exp(t) = 1 + t + O(t**2) the relative error of e_i is then at most
   eta = EXP_ULP * 2**-52 + 3 * 2**-53 (the extra 3u: the product, the sum and t**2). Where
   exp(d_i) is subnormal in float64 (d_i < -708) the error is absolute, < 2**-1070.
3. ``S = math.fsum(e)`` is the correctly rounded sum of the e_i, so with S_exact >= 1 (the
   maximum contributes exp(0) = 1): |S - S_exact| <= (eta + u + eta u) S_exact + n 2**-1070.
4. ``y_i = fl(e_i / S)`` has relative error rho <= 1.01 (eta + rel(S) + u) (second-order terms
   covered by the 1.01).
5. As in the matmul oracle (Ziv's strategy), D = 1.25 (rho + 2u) y_i covers rho and the
   rounding of y_i -+ D; if both ends round to the same bits of the output dtype, that is the
   correctly rounded result. y_i >= exp(-200) keeps everything in float64's normal range.
   Elements with d_i < -200 are exactly +0 in every output dtype (y_i <= exp(d_i) < 2**-288,
   below half of any supported dtype's smallest subnormal) and need no proof.

The undecided elements (D ~ 3e-15 relative, so about 5 in 10**8 float32 outputs) are COUNTED
(`OracleResult.fallbacks`) and settled with mpmath (`mp.softmax_row`, a Ziv loop at rising
precision) over their row.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from diag.numerics import round_to_dtype
from diag.oracle import mp

__all__ = ["softmax_core", "EXP_ULP", "SOFTMAX_INPUT_DTYPES", "SOFTMAX_OUTPUT_DTYPES"]

_U = 2.0**-53
#: Assumed worst error of numpy's float64 exp, in ulp (measured < 1; see the module docstring).
EXP_ULP = 4
#: Below this d_i = x_i - max the exact result rounds to +0 in every supported output dtype.
_ZERO_BELOW = -200.0

SOFTMAX_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                        np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
#: float64 output is refused: deciding its rounding needs more than float64 arithmetic.
SOFTMAX_OUTPUT_DTYPES = SOFTMAX_INPUT_DTYPES
_F32 = np.dtype(np.float32)


def _bounds(n: int, slack: float = 1.0) -> float:
    """Relative half-width factor f: the exact y_i lies in y_i (1 +- f) before output rounding.

    Returns f = 1.25 (rho + 2u) from the module docstring, times `slack` (tests inflate it to
    force the mpmath fallback).
    """
    eta = EXP_ULP * 2.0 * _U + 3.0 * _U
    rel_s = (eta + _U + eta * _U) * (1.0 + 1e-12) + n * 2.0**-1070
    rho = 1.01 * (eta + rel_s + _U)
    return 1.25 * (rho + 2.0 * _U) * slack


def _round_pair(lo: np.ndarray, hi: np.ndarray, out_dt: np.dtype):
    """Round both ends to out_dt; return (rounded hi, mask where the ends differ in bits)."""
    if out_dt == _F32:
        a, b = lo.astype(np.float32), hi.astype(np.float32)
        return b, a.view(np.uint32) != b.view(np.uint32)
    a, b = round_to_dtype(lo, out_dt), round_to_dtype(hi, out_dt)
    ut = {1: np.uint8, 2: np.uint16}[out_dt.itemsize]
    return b, a.view(ut) != b.view(ut)


def softmax_core(x: np.ndarray, out_dt: np.dtype, slack: float = 1.0):
    """Correctly rounded softmax over the last axis of a 2-D array [rows, n].

    Args:
        x: [rows, n] array of a dtype in SOFTMAX_INPUT_DTYPES.
        out_dt: output dtype.
        slack: factor on the proven bound (>= 1; tests use large values to force fallbacks).

    Returns:
        (value [rows, n] of out_dt, fallbacks, undefined_rows, nan_rows): fallbacks counts the
        elements settled by mpmath; the row lists are Python ints.
    """
    rows, n = x.shape
    out = np.zeros((rows, n), out_dt)
    if rows == 0 or n == 0:
        return out, 0, [], []
    x64 = x.astype(np.float64)
    nan_row = (np.isnan(x64) | (x64 == np.inf)).any(axis=1)
    undefined = (x64 == -np.inf).all(axis=1)
    bad = nan_row | undefined
    nan_val = np.array(np.nan).astype(out_dt)
    out[bad] = nan_val
    good = np.flatnonzero(~bad)
    f = _bounds(n, slack)
    fallbacks = 0
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for r in good:
            xr = x64[r]
            m = xr.max()
            d = xr - m  # -inf entries stay -inf; exp(-inf) = 0 exactly
            fin = np.isfinite(d)
            t = np.zeros(n)
            # TwoSum error of x - m (exact); only finite entries have one.
            back = d - xr
            t[fin] = ((xr - (d - back)) + (-m - back))[fin]
            e = np.exp(d)
            e += e * t  # exp(d + t) = exp(d) (1 + t + O(t**2))
            s = math.fsum(e.tolist())
            y = e / s
            live = d >= _ZERO_BELOW  # the rest are exactly +0 (already in `out`)
            yl = y[live]
            dd = yl * f
            val, und = _round_pair(yl - dd, yl + dd, out_dt)
            row = out[r]
            row[live] = val
            if und.any():
                idx = np.flatnonzero(live)[und]
                fallbacks += int(idx.size)
                row[idx] = mp.softmax_row(xr, out_dt, idx)
    return out, fallbacks, [int(i) for i in np.flatnonzero(undefined)], \
        [int(i) for i in np.flatnonzero(nan_row)]
