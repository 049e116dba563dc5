"""Correctly rounded matmul at BLAS speed: float64 + a rigorous bound + a proof per element.

Why this is exact. Inputs are float32, bfloat16, float16 or float8: each product a*b has at most
2 * 24 = 48 significand bits and an exponent in [-298, 256], so it is EXACT in float64 (53 bits,
normal range [-1022, 1023]); a sum of K such products never overflows float64 and never leaves
the range where the error model fl(x + y) = (x + y)(1 + d), |d| <= u = 2**-53, holds (subnormal
sums would be exact anyway). Hence, for ANY summation order or blocking BLAS picks, with or
without FMA, |fl64(A B)_ij - (A B)_ij| <= E * (|A||B|)_ij with E = gamma_K(u).

Ziv's strategy, per element: D = f * (|A||B|)_ij with f covering E, the rounding of D itself and
of approx +- D (see `_bound_factor`). The exact result lies in [approx - D, approx + D]; if both
ends round to the same BITS of the output dtype (rounding is monotone, and bits keep -0 apart
from +0), that is the correctly rounded result. The rest ("undecided", typically a few per
million) are COUNTED (`OracleResult.fallbacks`) and settled by a vectorised error-free TwoSum
tree over their exact products (`_refine`, error ~u**2); the very few left after that (exact
ties, exact cancellation) are summed exactly with math.fsum (`_exact_element`, counted as
`OracleResult.exact`).

Long K. E grows with K; at K = 65536 a plain float64 product leaves ~18 % of fp32 elements
undecided. There K is split into blocks of `KSPLIT_BLOCK`; each block product is a float64 GEMM
of exact scalar products (error gamma_Kb), and the block results are accumulated in double-double
with the error-free TwoSum, so E = gamma_Kb + O(nblocks**2 u**2): 256x smaller at Kb = 256.
This is the K-split half of Ozaki's scheme only: the scalar products are exact, the block GEMMs
are not (the bound covers them), which costs one GEMM instead of the several slice GEMMs a full
Ozaki split needs; the fallback stays rare (~0.1 % of outputs at K = 65536). The bound |A||B| is
taken with an sgemm here (half the memory traffic), with underflow and overflow accounted for
(`_bound_f32`).

float64 output. Here the float64 rounding itself must be decided, so every scalar product (exact)
is accumulated in double-double (K rank-1 passes; slow for long K) and the decision uses the
exact remainder of the final TwoSum.

Special values are settled apart from the arithmetic: rows/columns holding inf or NaN get the
IEEE result of the exact sum (NaN for any NaN product or inf - inf, else the infinity), and an
element whose products are all zero gets -0 only if every product is -0.
"""

from __future__ import annotations

import math
from typing import Optional

import ml_dtypes
import numpy as np

from diag.numerics import round_to_dtype

__all__ = ["matmul_core", "KSPLIT_THRESHOLD", "KSPLIT_BLOCK", "BLOCK_ELEMENTS"]

_U = 2.0**-53  # float64 unit roundoff
#: Contraction length above which K is split and accumulated in double-double.
KSPLIT_THRESHOLD = 1024
#: K-block of the split path (error gamma_Kb per block).
KSPLIT_BLOCK = 256
#: Output elements per row block: temporaries (~2 MB each) stay in cache between passes.
BLOCK_ELEMENTS = 1 << 17
#: Products materialised at once by the refine stage (float64: 2 MB, cache-resident).
REFINE_PRODUCTS = 1 << 18

_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                 np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _gamma(k: int) -> float:
    return k * _U / (1.0 - k * _U)


def _bound_factor(err: float) -> float:
    """f such that fl(|A| @ fl(f |B|)) bounds err * sum|p| plus the rounding of approx +- D.

    With C = computed D >= f sum|p| (1 - gamma_{K+1}) and |approx| <= (1 + err) sum|p|, the ends
    fl(approx -+ D) enclose the exact sum when D (1 - u) >= err sum|p| + u |approx|; f = 1.25
    (err + 2u) gives that for K u <= 0.01 (checked by the caller).
    """
    return 1.25 * (err + 2 * _U)


def _two_sum_acc(hi: np.ndarray, lo: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Return new hi = fl(hi + x); lo += exact error of that addition (TwoSum)."""
    s = hi + x
    a1 = s - x           # the part of s that came from hi
    b1 = s - a1          # the part of s that came from x
    np.subtract(hi, a1, out=a1)  # da = hi - a1
    np.subtract(x, b1, out=b1)   # db = x - b1
    np.add(a1, b1, out=a1)       # e = da + db (exact: hi + x == s + e)
    np.add(lo, a1, out=lo)
    return s


def _decide(approx: np.ndarray, d: np.ndarray, out_dt: np.dtype, out_blk: np.ndarray,
            scratch32: Optional[np.ndarray]) -> np.ndarray:
    """Write round(approx + d) into out_blk; return a bool mask of elements not proven.

    Proven means round(fl(approx - d)) and round(fl(approx + d)) have the same bits.
    """
    if out_dt == _F64:
        return _decide_f64(approx, np.zeros_like(approx), d, out_blk)
    if out_dt == _F32:
        # One pass each: the subtraction is done in float64 and its result rounded (RNE) to f32.
        lo32 = (np.empty(approx.shape, np.float32) if scratch32 is None
                else scratch32[: approx.shape[0]])
        np.subtract(approx, d, out=lo32, dtype=_F64, casting="same_kind")
        np.add(approx, d, out=out_blk, dtype=_F64, casting="same_kind")
        return lo32.view(np.uint32) != out_blk.view(np.uint32)
    lo = round_to_dtype(approx - d, out_dt)
    hi = round_to_dtype(approx + d, out_dt)
    out_blk[...] = hi
    ut = {1: np.uint8, 2: np.uint16}[out_dt.itemsize]
    return lo.view(ut) != hi.view(ut)


def _exact_element(arow: np.ndarray, bcol: np.ndarray, out_dt: np.dtype) -> np.generic:
    """Correctly rounded sum of arow * bcol (finite float64 inputs whose products are exact).

    math.fsum returns s1 = RN64(S) of the exact sum S (Shewchuk's exact partials, correctly
    rounded); fsum(p + [-s1]) is RN64(S - s1), whose SIGN is exact (S - s1 is a nonzero multiple
    of 2**-350 or zero, far above float64's underflow). Rounding s1 to odd with that sticky sign
    gives a 53-bit value that rounds to any format of <= 51 bits exactly as S does.
    """
    p = arow * bcol
    if not p.any():
        neg = p.size > 0 and bool(np.signbit(p).all())
        return np.array(-0.0 if neg else 0.0).astype(out_dt)[()]
    terms = p.tolist()
    s1 = math.fsum(terms)
    if s1 == 0.0:
        return np.array(0.0).astype(out_dt)[()]  # exact cancellation: +0 (S == 0 iff s1 == 0)
    if out_dt == _F64:
        return np.float64(s1)
    terms.append(-s1)
    s2 = math.fsum(terms)
    if s2 != 0.0 and (np.array(s1).view(np.uint64) & 1) == 0:
        s1 = math.nextafter(s1, math.copysign(math.inf, s2))
    return round_to_dtype(np.array(s1), out_dt)[()]


def _zero_signs(a_blk: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
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


def _apply_specials(a64: np.ndarray, b64: np.ndarray, out: np.ndarray) -> None:
    """Overwrite the elements of rows/columns holding inf or NaN with their IEEE result."""
    rows = np.flatnonzero(~np.isfinite(a64).all(axis=1))
    cols = np.flatnonzero(~np.isfinite(b64).all(axis=0))
    if rows.size:
        out[rows] = _merge_specials(out[rows], a64[rows], b64)
    if cols.size:
        out[:, cols] = _merge_specials(out[:, cols], a64, b64[:, cols])


def _bound_f32(abs_a32: np.ndarray, abs_b32: np.ndarray, f: float, k: int):
    """D >= f * sum_k |a_ik b_kj| from an sgemm on |A|, |B| (half the traffic of float64).

    float32 model with underflow: every operation is exact-or-(1 + d), |d| <= 2**-24, except a
    product (or FMA) whose result is subnormal, which errs by <= 2**-150 absolutely. So
    C32 >= (sum|p| - K 2**-150)(1 - gamma_K(2**-24)), and D = f (C32 / (1 - gamma) + K 2**-149)
    bounds it (f's 1.25 slack pays for the float64 roundings here). Returns (D, C32), or
    (None, None) if C32 has an inf (overflow: the caller uses float64 instead).
    """
    c32 = abs_a32 @ abs_b32
    if np.isinf(c32).any():
        return None, None
    g32 = k * 2.0**-24
    scale = f * (1.0 + 2.0**-30) / (1.0 - g32 / (1.0 - g32))
    d = np.multiply(c32, scale, dtype=_F64)
    d += f * k * 2.0**-149
    return d, c32


def matmul_core(a: np.ndarray, b: np.ndarray, out_dt: np.dtype):
    """Correctly rounded a @ b for 2-D a [M, K], b [K, N] of exact-product dtypes.

    Returns:
        (value [M, N] of out_dt, method name, elements the BLAS stage could not prove, elements
        that also escaped the refine stage and were summed exactly with math.fsum).
    """
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), out_dt)
    if m == 0 or n == 0:
        return out, "empty", 0, 0
    if k == 0:
        out[...] = 0  # the empty sum is +0
        return out, "empty", 0, 0
    if k * _U > 1e-2 / 4:
        raise ValueError(f"contraction length K={k} is too long for the float64 bounds")
    finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
    a_raw, b_raw = a, b
    if not finite:
        # Arithmetic runs on finite stand-ins; the affected rows/columns are overwritten below.
        a = np.where(np.isfinite(a), a, np.zeros((), a.dtype))
        b = np.where(np.isfinite(b), b, np.zeros((), b.dtype))
    # Only then can an element have all products zero (|A||B| == 0) and need a sign decision.
    maybe_zero = not (bool(a.all()) and bool(b.all()))

    if out_dt == _F64:
        method = "dd-exact-products"
        kb = 1
        err = 3.0 * (k + 1) ** 2 * _U * _U
    elif k > KSPLIT_THRESHOLD:
        method = "f64-ksplit-dd"
        kb = KSPLIT_BLOCK
        nb = -(-k // kb)
        err = _gamma(kb) + 3.0 * (nb + 1) ** 2 * _U * _U + 1.01 * _U
    else:
        method = "f64-bound"
        kb = k
        err = _gamma(k)
    # float64 output compares against float64 gaps directly: no +-D rounding margin needed.
    f = 1.25 * err if out_dt == _F64 else _bound_factor(err)
    rb = max(1, BLOCK_ELEMENTS // n)
    single = kb == k
    if single:
        a64 = a.astype(np.float64)
        b64 = b.astype(np.float64)
        abs_a = np.abs(a64)
        fb = np.abs(b64) * f  # f |b| >= 2**-200: no underflow (|b| >= 2**-149, f >= 2**-52)
    else:
        abs_a32 = np.abs(a.astype(np.float32))
        abs_b32 = np.abs(b.astype(np.float32))
        # float64 copies are made per block (cache-resident); b once if several row blocks.
        b64 = b.astype(np.float64) if m > rb else None
    scratch32 = np.empty((rb, n), np.float32) if out_dt == _F32 else None
    undecided: list[np.ndarray] = []
    for r0 in range(0, m, rb):
        r1 = min(m, r0 + rb)
        out_blk = out[r0:r1]
        if single:
            d = abs_a[r0:r1] @ fb
            cand = d == 0  # exactly the elements whose products are all zero
            approx = a64[r0:r1] @ b64
            und = _decide(approx, d, out_dt, out_blk, scratch32)
        else:
            d, c32 = _bound_f32(abs_a32[r0:r1], abs_b32, f, k)
            if d is None:
                d = np.abs(a[r0:r1].astype(np.float64)) @ (np.abs(b.astype(np.float64)) * f)
                cand = d == 0
            else:
                cand = c32 == 0  # all products zero, or lost to underflow: checked below
            hi = np.zeros((r1 - r0, n))
            lo = np.zeros((r1 - r0, n))
            for k0 in range(0, k, kb):
                k1 = min(k, k0 + kb)
                a_blk = a[r0:r1, k0:k1].astype(np.float64)
                b_blk = b64[k0:k1] if b64 is not None else b[k0:k1].astype(np.float64)
                if kb == 1:
                    part = np.multiply.outer(a_blk[:, 0], b_blk[0])  # exact products
                else:
                    part = a_blk @ b_blk
                hi = _two_sum_acc(hi, lo, part)
            if out_dt == _F64:
                und = _decide_f64(hi, lo, d, out_blk)
            else:
                approx = np.add(hi, lo, out=hi)
                und = _decide(approx, d, out_dt, out_blk, scratch32)
        if maybe_zero and cand.any():
            a_sign = a[r0:r1].astype(np.float32)
            nonzero = (a_sign != 0).astype(np.float64) @ (b.astype(np.float32) != 0)
            zero = cand & (nonzero == 0)  # every product is exactly zero
            neg = _zero_signs(a_sign, b.astype(np.float32), k)
            out_blk[zero] = np.where(neg[zero], -0.0, 0.0).astype(out_dt)
            und &= ~zero
            und |= cand & ~zero  # tiny products lost to float32 underflow in the bound
        idx = np.flatnonzero(und)
        if idx.size:
            undecided.append(idx + r0 * n)
    fallbacks = exact = 0
    if undecided:
        flat = out.reshape(-1)
        idx = np.concatenate(undecided)
        fallbacks = int(idx.size)
        still = _refine(a, b, idx, out_dt, flat)
        for e in still:
            i, j = divmod(int(e), n)
            flat[e] = _exact_element(a[i].astype(np.float64), b[:, j].astype(np.float64), out_dt)
            exact += 1
    if not finite:
        _apply_specials(a_raw.astype(np.float64), b_raw.astype(np.float64), out)
    return out, method, fallbacks, exact


def _refine(a: np.ndarray, b: np.ndarray, flat_idx: np.ndarray, out_dt: np.dtype,
            flat_out: np.ndarray) -> np.ndarray:
    """Second, vectorised stage for undecided elements; returns the flat indices still undecided.

    The K exact products of each element are summed by a TwoSum tree: sum(p) == root + sum(e)
    EXACTLY over all TwoSum errors e; sum(e) is then taken in float64 with error <=
    gamma_m * sum|e|, which is ~u times smaller than the first stage's bound (sum|e| <= log2(K) u
    sum|p|). Only exact ties, exact cancellations and the like survive to `_exact_element`.
    """
    n = b.shape[1]
    k = a.shape[1]
    rows, cols = np.divmod(flat_idx, n)
    left: list[np.ndarray] = []
    step = max(1, REFINE_PRODUCTS // k)
    for c0 in range(0, flat_idx.size, step):
        c1 = min(flat_idx.size, c0 + step)
        x = a[rows[c0:c1]].astype(np.float64) * b[:, cols[c0:c1]].T.astype(np.float64)
        # x: (c, K) exact products
        all_zero = ~x.any(axis=1)
        all_neg = np.signbit(x).all(axis=1)
        errs = []
        while x.shape[1] > 1:
            if x.shape[1] % 2:
                x = np.concatenate([x, np.zeros((x.shape[0], 1))], axis=1)
            p, q = x[:, 0::2], x[:, 1::2]
            s = p + q
            a1 = s - q
            b1 = s - a1
            errs.append((p - a1) + (q - b1))  # p + q == s + e exactly
            x = s
        hi = x[:, 0].copy()
        if errs:
            e_all = np.concatenate(errs, axis=1)
            lo = e_all.sum(axis=1)
            se = np.abs(e_all).sum(axis=1)
            g = _gamma(e_all.shape[1] + 1)
        else:
            lo = np.zeros_like(hi)
            se = np.zeros_like(hi)
            g = 0.0
        blk = np.empty(hi.shape, out_dt)
        if out_dt == _F64:
            und = _decide_f64(hi, lo, 1.1 * g * se, blk)
        else:
            approx = hi + lo
            # |approx - S| <= u|approx| + gamma_m sum|e|; the slack pays for rounding of d and
            # of approx -+ d (see _bound_factor).
            d = 1.1 * g * se + 3.0 * _U * np.abs(approx)
            und = _decide(approx, d, out_dt, blk, None)
        # IEEE round-to-nearest: a sum of zeros is -0 only if every term is -0.
        blk[all_zero] = np.where(all_neg[all_zero], -0.0, 0.0).astype(out_dt)
        und &= ~all_zero
        flat_out[flat_idx[c0:c1]] = blk
        left.append(flat_idx[c0:c1][und])
    return np.concatenate(left) if left else flat_idx[:0]


def _decide_f64(hi: np.ndarray, lo: np.ndarray, d: np.ndarray, out_blk: np.ndarray) -> np.ndarray:
    """float64 output: S lies in r + e +- d with (r, e) = TwoSum(hi, lo) exact.

    RN64(S) == r if r + e - d > r - gap_down / 2 and r + e + d < r + gap_up / 2; the gaps are
    exact (Sterbenz) and their halves representable, so comparing the ROUNDED e +- d against them
    is rigorous by monotonicity of rounding.
    """
    r = hi + lo
    z = r - hi
    e = (hi - (r - z)) + (lo - z)
    up = np.nextafter(r, np.inf) - r
    down = r - np.nextafter(r, -np.inf)
    ok = ((e + d) < up * 0.5) & ((e - d) > down * -0.5)
    out_blk[...] = r
    return ~ok
