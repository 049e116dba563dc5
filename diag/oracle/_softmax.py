"""Correctly rounded softmax at numpy speed: float64 + a rigorous bound + a proof per element.

Semantics (last axis; `diag.oracle.mp.softmax_row` is the same definition in mpmath): the
exact ``exp(x_i - max) / sum_j exp(x_j - max)`` of the given inputs, rounded once (nearest-even)
to the output dtype. -inf entries give exactly +0. A row holding NaN or +inf gives NaN everywhere
(the IEEE computation meets inf - inf; such rows are listed in ``nan_rows``). A row that is all
-inf has no defined result: NaN everywhere, listed in ``undefined_rows``.

Why the fast path is exact. Per row, with m the row maximum (exact) and n the row length:

1. ``d_i = fl(x_i - m)`` and its exact error ``t_i``, so x_i - m = d_i + t_i exactly,
   |t_i| <= 2**-53 |d_i|, for every element that matters (d_i >= -200; step 5). The inputs
   carry p <= 24 significand bits, so x_i - m is EXACT in float64 unless the exponents of x_i
   and m differ by more than 52 - p >= 28 (the difference is a multiple of the smaller
   operand's ulp and below 4 times the larger one). `shift_error` takes, per row:
   - when m = 0 or |m| >= 2**-20: t_i = fl(x_i - fl(d_i + m)), Dekker's Fast2Sum with a = -m,
     two operations. It is exact where |x_i| <= |m| (Fast2Sum's condition) and 0 where d_i is
     exact (d_i + m = x_i, a float). What is left, |x_i| > |m| with d_i inexact, needs
     |x_i| > 2**28 |m| >= 256, so d_i < -200: such an element rounds to +0, and its e_i below
     has |e_i| <= 2**-287, as has exp(x_i - m) (there |t_i| <= 3u |d_i| < 2**-41 while
     d_i >= -746, and exp(d_i) < 2**-1069 below), which step 3 covers with n 2**-280;
   - when 0 < |m| < 2**-20: Knuth's TwoSum (six operations, exact for every finite x_i).
   -inf entries give t = NaN and get t = 0 (exp(-inf) = 0 exactly). A block whose t are all
   zero (the common case: every difference exact) skips the product of step 2.
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
   exp(0) = 1): |S - S_exact| <= (eta + rs + eta rs) S_exact + n 2**-280 (the last term: the
   elements of step 1 below exp(-199), and the subnormal exps).
4. ``y_i = fl(e_i / S)`` has relative error rho <= 1.01 (eta + rel(S) + u) (second-order terms
   covered by the 1.01); rho, and so D below, is computed per row from that row's rs.
5. As in the matmul oracle (Ziv's strategy), D = 1.25 (rho + 2u) y_i covers rho and the
   rounding of y_i -+ D; if both ends round to the same bits of the output dtype, that is the
   correctly rounded result. y_i >= exp(-200) keeps everything in float64's normal range.
   Elements with d_i < -200 are exactly +0 in every output dtype (y_i <= exp(d_i) < 2**-288,
   below half of any supported dtype's smallest subnormal) and need no proof.
6. bfloat16 output goes through float32 (`_round_ends`): where both ends round to the same
   float32 w and w is not a bfloat16 midpoint (low 16 bits of w not 0x8000), both ends lie
   strictly between w's float32 neighbours, an interval holding no bfloat16 midpoint but
   possibly w; so RN_bf16 is constant on it and equals RN_bf16(w), ml_dtypes' single RNE of w.
   The other elements (about 1 in 10**7, plus those ties) round both ends from float64 once.

Speed: every pass is a numpy ufunc over a block of rows written into scratch arrays kept from
call to call (`diag.oracle._workspace`): fresh temporaries of this size cost more in page faults
than the arithmetic.

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
from diag.oracle._workspace import scratch

__all__ = [
    "softmax_core",
    "shift_error",
    "shifted_exp",
    "round_pair",
    "EXP_ULP",
    "SOFTMAX_INPUT_DTYPES",
    "SOFTMAX_OUTPUT_DTYPES",
]

_U = 2.0**-53
#: Assumed worst error of numpy's float64 exp, in ulp (measured < 1; see the module docstring).
EXP_ULP = 4
#: Below this d_i = x_i - max the exact result rounds to +0 in every supported output dtype.
_ZERO_BELOW = -200.0
#: Rows whose maximum is 0 or at least this large in magnitude take Fast2Sum (step 1).
FAST2SUM_MIN_MAX = 2.0**-20

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
    rel_s = (eta + rs + eta * rs) * (1.0 + 1e-12) + n * 2.0**-280
    rho = 1.01 * (eta + rel_s + _U)
    return 1.25 * (rho + 2.0 * _U) * slack


#: Elements per block of rows (the scratch arrays of a block stay in cache).
CHUNK_ELEMENTS = 1 << 17


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
    nan_val = np.array(np.nan).astype(out_dt)
    fallbacks = 0
    undefined: list[int] = []
    nan_rows: list[int] = []
    step = max(1, CHUNK_ELEMENTS // n)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            xr = scratch("x", (r1 - r0, n), np.float64)
            np.copyto(xr, x[r0:r1], casting="unsafe")  # exact: every input dtype fits float64
            m = xr.max(axis=1)  # NaN wherever the row holds one (max propagates NaN)
            bad = ~np.isfinite(m)  # NaN, +inf, or a row all -inf
            if bad.any():
                undefined += [r0 + int(i) for i in np.flatnonzero(m == -np.inf)]
                nan_rows += [r0 + int(i) for i in np.flatnonzero(bad & (m != -np.inf))]
                xr[bad] = 0.0  # computed harmlessly, then overwritten with NaN
                m[bad] = 0.0
            blk = out[r0:r1]
            und = _rows(xr, m, blk, slack)
            if bad.any():
                blk[bad] = nan_val
                und[bad] = False
            if und.any():
                for i in np.flatnonzero(und.any(axis=1)):
                    idx = np.flatnonzero(und[i])
                    fallbacks += int(idx.size)
                    row = x[r0 + int(i)].astype(np.float64)
                    blk[i, idx] = mp.softmax_row(row, out_dt, idx)
    return out, fallbacks, undefined, nan_rows


def shift_error(xr: np.ndarray, m: np.ndarray, d: np.ndarray, t: np.ndarray) -> bool:
    """The exact error t of d = fl(x - m), per row, for every element with d >= -200 (step 1).

    Args:
        xr: [c, n] float64 rows (values of an input dtype of at most 24 significand bits).
        m: [c] row maxima (finite).
        d: [c, n] fl(xr - m).
        t: [c, n] float64 output: xr - m == d + t exactly where d >= -200; finite elsewhere,
            0 at -inf entries.

    Returns:
        Whether any t is nonzero.
    """
    mc = m[:, None]
    np.add(d, mc, out=t)
    np.subtract(xr, t, out=t)  # Fast2Sum with a = -m
    tiny = np.flatnonzero((m != 0) & (np.abs(m) < FAST2SUM_MIN_MAX))
    if tiny.size:  # TwoSum: (x - (d - back)) + (-m - back) with back = d - x
        xs, ds, ms = xr[tiny], d[tiny], mc[tiny]
        back = ds - xs
        ts = xs - (ds - back)
        ts += -ms - back
        t[tiny] = ts
    if not t.any():
        return False
    t[np.isnan(t)] = 0.0  # -inf entries (inf - inf): exp(-inf) = 0 exactly
    return bool(t.any())


def shifted_exp(
    xr: np.ndarray, m: np.ndarray, e: np.ndarray, t: np.ndarray, dead: np.ndarray
) -> bool:
    """e_i = fl(fl(exp(d_i)) (1 + t_i)) with d_i + t_i = x_i - m exactly (steps 1 and 2).

    Args:
        xr: [c, n] float64 rows (values of an input dtype of at most 24 significand bits).
        m: [c] row maxima (finite).
        e: [c, n] float64 output, relative error <= eta against exp(x - m) where d >= -200.
        t: [c, n] float64 scratch (holds the t_i on return).
        dead: [c, n] bool output, written only when the result is True: where d < -200.

    Returns:
        Whether any d_i < -200 (those round to +0).
    """
    np.subtract(xr, m[:, None], out=e)  # d; -inf entries stay -inf, and exp(-inf) = 0 exactly
    corrected = shift_error(xr, m, e, t)
    any_dead = bool(e.min() < _ZERO_BELOW)
    if any_dead:
        np.less(e, _ZERO_BELOW, out=dead)
    np.exp(e, out=e)
    if corrected:
        t *= e
        e += t  # exp(d + t) = exp(d) (1 + t + O(t**2))
    return any_dead


def _rows(xr: np.ndarray, m: np.ndarray, out: np.ndarray, slack: float) -> np.ndarray:
    """The fast path on a [c, n] float64 block of rows with finite maxima m.

    Writes the values into `out` ([c, n], contiguous, of the output dtype) and returns the
    bool mask of those not proven (a scratch array, valid until the next block). `xr` is used
    as scratch once the differences are formed.
    """
    shape = xr.shape
    n = shape[1]
    e = scratch("e", shape, np.float64)
    t = scratch("t", shape, np.float64)
    dead = scratch("dead", shape, np.bool_)
    any_dead = shifted_exp(xr, m, e, t, dead)
    # Every e_i <= 2 (d_i <= 0, |t_i| tiny): one pass suffices up to n = 2**16, two beyond.
    hi, lo, err = row_sums(e, 1 if n <= 1 << 16 else 2, max_abs=2.0, work=(xr, t))
    s = hi + lo
    e_s = err + _U * s
    f = _bounds(n, e_s / (s - e_s), slack)
    und = scratch("und", shape, np.bool_)
    if out.dtype in (_F32, _BF16):
        _round_ends(e, ((1.0 - f) / s)[:, None], ((1.0 + f) / s)[:, None], out, und)
    else:
        y = e / s[:, None]
        dd = y * f[:, None]
        out[...], und[...] = round_pair(y - dd, y + dd, out.dtype)
    if any_dead:
        out[dead] = 0  # exactly +0 in every output dtype
        und[dead] = False
    return und


def _round_ends(e, c_lo, c_hi, out: np.ndarray, und: np.ndarray) -> None:
    """Ends e c_lo and e c_hi rounded to out's dtype (float32 or bfloat16): hi into `out`,
    True into `und` where they differ.

    The ends y (1 -+ f) are formed as e_i * fl(fl(1 -+ f) / s): three roundings of u each,
    covered by the 0.25 (rho + 2u) >= 3.75 u of slack in f (step 5); each is rounded from
    float64 to float32 once, straight into its buffer. bfloat16: step 6.
    """
    lo32 = scratch("lo32", e.shape, np.float32)
    hi32 = out if out.dtype == _F32 else scratch("hi32", e.shape, np.float32)
    np.multiply(e, c_lo, out=lo32, dtype=np.float64, casting="same_kind")
    np.multiply(e, c_hi, out=hi32, dtype=np.float64, casting="same_kind")
    bits = hi32.view(np.uint32)
    np.not_equal(lo32.view(np.uint32), bits, out=und)
    if out.dtype == _F32:
        return
    low = np.bitwise_and(bits, np.uint32(0xFFFF), out=lo32.view(np.uint32))
    und |= np.equal(low, np.uint32(0x8000), out=scratch("tie", e.shape, np.bool_))
    np.copyto(out, hi32, casting="unsafe")  # ml_dtypes' RNE from float32
    if und.any():  # round both ends from float64 once
        i = np.nonzero(und)
        lo16 = round_to_dtype(e[i] * c_lo[i[0], 0], _BF16)
        hi16 = round_to_dtype(e[i] * c_hi[i[0], 0], _BF16)
        out[i] = hi16
        und[i] = lo16.view(np.uint16) != hi16.view(np.uint16)
