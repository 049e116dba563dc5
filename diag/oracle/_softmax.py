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
3. ``S`` is the row sum of the e_i by vectorised extraction (`diag.oracle._eft.row_sums`,
   Rump-Ogita-Oishi: the leading bits of every e_i are summed EXACTLY, the remainders, 2**-35
   times smaller or less, in float64 with error gamma_n sum|r|), which returns S_hat with a
   rigorous |S_hat - sum e_i| <= E_S per row; rs = E_S / (S_hat - E_S) is its relative error
   (~u, as for a correctly rounded sum). With S_exact >= 1 (the maximum contributes
   exp(0) = 1): |S - S_exact| <= (eta + rs + eta rs) S_exact + n 2**-1070.
4. ``y_i = fl(e_i / S)`` has relative error rho <= 1.01 (eta + rel(S) + u) (second-order terms
   covered by the 1.01); rho, and so D below, is computed per row from that row's rs.
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

import ml_dtypes
import numpy as np

from diag.numerics import round_to_dtype
from diag.oracle import mp
from diag.oracle._eft import row_sums

__all__ = ["softmax_core", "round_pair", "EXP_ULP", "SOFTMAX_INPUT_DTYPES", "SOFTMAX_OUTPUT_DTYPES"]

_U = 2.0**-53
#: Assumed worst error of numpy's float64 exp, in ulp (measured < 1; see the module docstring).
EXP_ULP = 4
#: Below this d_i = x_i - max the exact result rounds to +0 in every supported output dtype.
_ZERO_BELOW = -200.0

SOFTMAX_INPUT_DTYPES = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
)
#: float64 output is refused: deciding its rounding needs more than float64 arithmetic.
SOFTMAX_OUTPUT_DTYPES = SOFTMAX_INPUT_DTYPES
_F32 = np.dtype(np.float32)
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bounds(n: int, rs: np.ndarray, slack: float = 1.0) -> np.ndarray:
    """Relative half-width factors f per row: the exact y_i lies in y_i (1 +- f) before rounding.

    Args:
        n: row length.
        rs: per row, the relative error of the computed sum S (module docstring, step 3).
        slack: factor on the proven bound (>= 1; tests inflate it to force the mpmath fallback).

    Returns:
        f = 1.25 (rho + 2u) * slack per row (module docstring, steps 2-5).
    """
    eta = EXP_ULP * 2.0 * _U + 3.0 * _U
    rel_s = (eta + rs + eta * rs) * (1.0 + 1e-12) + n * 2.0**-1070
    rho = 1.01 * (eta + rel_s + _U)
    return 1.25 * (rho + 2.0 * _U) * slack


#: Elements per chunk of rows (float64 temporaries of ~2 MB stay in cache).
CHUNK_ELEMENTS = 1 << 18


def round_pair(lo: np.ndarray, hi: np.ndarray, out_dt: np.dtype):
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
    out = np.empty((rows, n), out_dt)  # every element is written below
    if rows == 0 or n == 0:
        return out, 0, [], []
    nan_row = (np.isnan(x) | (x == np.inf)).any(axis=1)
    undefined = (x == -np.inf).all(axis=1)
    bad = nan_row | undefined
    nan_val = np.array(np.nan).astype(out_dt)
    out[bad] = nan_val
    good = np.flatnonzero(~bad)
    fallbacks = 0
    step = max(1, CHUNK_ELEMENTS // n)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for c0 in range(0, good.size, step):
            rows_c = good[c0 : c0 + step]
            # Contiguous rows (no NaN/undefined row in between) are sliced, not gathered.
            sel = (
                slice(int(rows_c[0]), int(rows_c[-1]) + 1)
                if rows_c[-1] - rows_c[0] == rows_c.size - 1
                else rows_c
            )
            xr = x[sel].astype(np.float64)
            blk = out[sel] if isinstance(sel, slice) else np.empty(xr.shape, out_dt)
            und = _rows(xr, blk, slack)
            if not isinstance(sel, slice):
                out[sel] = blk
            if und.any():
                for i in np.flatnonzero(und.any(axis=1)):
                    idx = np.flatnonzero(und[i])
                    fallbacks += int(idx.size)
                    out[rows_c[i], idx] = mp.softmax_row(xr[i], out_dt, idx)
    return (
        out,
        fallbacks,
        [int(i) for i in np.flatnonzero(undefined)],
        [int(i) for i in np.flatnonzero(nan_row)],
    )


def _bf16(v32: np.ndarray, exact64) -> np.ndarray:
    """RN_bf16(v) of float64 values v given v32 = RN_f32(v); exact64(index) recomputes v.

    Rounding twice (to float32, then to bfloat16 by ml_dtypes' single RNE) equals rounding once
    unless v32 lands EXACTLY on a bfloat16 midpoint (low 16 bits 0x8000: bfloat16 is float32's
    top half, subnormals included): RN_f32 is monotone and every midpoint is a float32, so v and
    v32 lie on the same side of every other midpoint. Those few ties are rounded once from v.
    """
    b = v32.astype(_BF16)
    tie = (v32.view(np.uint32) & np.uint32(0xFFFF)) == np.uint32(0x8000)
    if tie.any():
        i = np.nonzero(tie)
        b[i] = round_to_dtype(exact64(i), _BF16)
    return b


def _rows(xr: np.ndarray, out: np.ndarray, slack: float) -> np.ndarray:
    """The fast path on a [c, n] float64 block of rows without NaN/+inf and not all -inf.

    Writes the values into `out` ([c, n], contiguous, of the output dtype) and returns the
    bool mask of those not proven.
    """
    out_dt = out.dtype
    n = xr.shape[1]
    m = xr.max(axis=1, keepdims=True)
    d = xr - m  # -inf entries stay -inf; exp(-inf) = 0 exactly
    # TwoSum error of x - m (exact); -inf entries give NaN here and get t = 0 (t is otherwise
    # finite and tiny, so its sum is NaN exactly when one entry is).
    back = d - xr
    t = d - back
    np.subtract(xr, t, out=t)
    np.subtract(-m, back, out=back)
    t += back  # (x - (d - back)) + (-m - back), in place: fewer fresh temporaries
    if np.isnan(t.sum()):
        t[np.isnan(t)] = 0.0
    e = np.exp(d)
    t *= e
    e += t  # exp(d + t) = exp(d) (1 + t + O(t**2))
    # Every e_i <= 2 (d_i <= 0, |t_i| tiny): one pass suffices up to n = 2**16, two beyond.
    hi, lo, err = row_sums(e, 1 if n <= 1 << 16 else 2, max_abs=2.0)
    s = hi + lo
    e_s = err + _U * s
    f = _bounds(n, e_s / (s - e_s), slack)
    c_lo, c_hi = ((1.0 - f) / s)[:, None], ((1.0 + f) / s)[:, None]
    if out_dt in (_F32, _BF16):
        # The ends y (1 -+ f) as e_i * fl(fl(1 -+ f) / s): three roundings of u each, covered by
        # the 0.25 (rho + 2u) >= 3.75 u of slack in f (step 5); each end is rounded from
        # float64 to float32 once, straight into its buffer.
        lo32 = np.empty(e.shape, np.float32)
        hi32 = out if out_dt == _F32 else np.empty(e.shape, np.float32)
        np.multiply(e, c_lo, out=lo32, dtype=np.float64, casting="same_kind")
        np.multiply(e, c_hi, out=hi32, dtype=np.float64, casting="same_kind")
        if out_dt == _F32:
            und = lo32.view(np.uint32) != out.view(np.uint32)
        else:
            lo16 = _bf16(lo32, lambda i: e[i] * c_lo[i[0], 0])
            out[...] = _bf16(hi32, lambda i: e[i] * c_hi[i[0], 0])
            und = lo16.view(np.uint16) != out.view(np.uint16)
    else:
        y = e / s[:, None]
        dd = y * f[:, None]
        out[...], und = round_pair(y - dd, y + dd, out_dt)
    if d.min() < _ZERO_BELOW:
        dead = d < _ZERO_BELOW  # exactly +0 in every output dtype
        out[dead] = 0
        und &= ~dead
    return und
