"""IEEE special values of a matmul's exact sum: rows/columns holding inf or NaN, and signed zeros.

Settled apart from the arithmetic (the fast paths run on finite stand-ins): a NaN product
(NaN input, inf * 0) or inf + -inf gives NaN, else any infinite product gives that infinity;
an element whose products are all zero is -0 only if every product is -0 (IEEE
round-to-nearest). Indicator matmuls count products by class EXACTLY (integer counts <= K <
2**53 in float64).
"""

from __future__ import annotations

import numpy as np

from diag.numerics import round_to_dtype

__all__ = ["zero_signs", "apply_specials"]


def zero_signs(a_blk: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Mask of elements whose K products all carry a negative sign (IEEE: -0 sum of zeros)."""
    sa = np.signbit(a_blk).astype(np.float64)
    sb = np.signbit(b).astype(np.float64)
    # Counts are integers <= K < 2**53: exact in float64.
    neg = sa @ (1.0 - sb) + (1.0 - sa) @ sb
    return neg == k


def _specials(x: np.ndarray, y: np.ndarray):
    """IEEE class of sum_k x_ik y_kj for rows x / columns y holding inf or NaN.

    Returns (nan, pinf, ninf) bool arrays. Indicator matmuls count products by class exactly.
    """
    f = np.float64
    xnan, ynan = np.isnan(x), np.isnan(y)
    xpi, xni = (x == np.inf).astype(f), (x == -np.inf).astype(f)
    ypi, yni = (y == np.inf).astype(f), (y == -np.inf).astype(f)
    xz, yz = (x == 0).astype(f), (y == 0).astype(f)
    xp, xn = (x > 0).astype(f), (x < 0).astype(f)
    yp, yn = (y > 0).astype(f), (y < 0).astype(f)
    nan = xnan.any(axis=1)[:, None] | ynan.any(axis=0)[None, :]
    nan |= ((xpi + xni) @ yz + xz @ (ypi + yni)) > 0  # inf * 0
    pinf = (xpi @ yp + xni @ yn + xp @ ypi + xn @ yni) > 0
    ninf = (xpi @ yn + xni @ yp + xp @ yni + xn @ ypi) > 0
    nan |= pinf & ninf  # inf + -inf
    return nan, pinf, ninf


def _merge_specials(cur: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    nan, pinf, ninf = _specials(x, y)
    val = np.where(nan, np.nan, np.where(pinf, np.inf, -np.inf))
    return np.where(nan | pinf | ninf, round_to_dtype(val, cur.dtype), cur)


def apply_specials(a64: np.ndarray, b64: np.ndarray, out: np.ndarray) -> None:
    """Overwrite the elements of rows/columns holding inf or NaN with their IEEE result."""
    rows = np.flatnonzero(~np.isfinite(a64).all(axis=1))
    cols = np.flatnonzero(~np.isfinite(b64).all(axis=0))
    if rows.size:
        out[rows] = _merge_specials(out[rows], a64[rows], b64)
    if cols.size:
        out[:, cols] = _merge_specials(out[:, cols], a64, b64[:, cols])
