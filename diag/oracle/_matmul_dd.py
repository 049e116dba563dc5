"""float64 output of the matmul oracle, and the elementwise bound both outputs share.

float64 output must decide float64's own rounding, so the exact products are accumulated in
double-double (K rank-1 passes, TwoSum; slow for long K, not a speed target) and the decision
uses the exact remainder of the final TwoSum (`decide_f64`). `bound_f32` is the elementwise
bound f |A||B| from an sgemm, with float32's underflow accounted for. Proofs: the docstrings
here and diag/oracle/_matmul.py's.
"""

from __future__ import annotations

import numpy as np

from diag.oracle._matmul_special import zero_signs

__all__ = ["bound_f32", "decide_f64", "stage_dd"]

_U = 2.0**-53
_F64 = np.dtype(np.float64)
#: Output elements per row block (temporaries stay in cache).
BLOCK_ELEMENTS = 1 << 17


def _two_sum_acc(hi: np.ndarray, lo: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Return new hi = fl(hi + x); lo += exact error of that addition (TwoSum)."""
    s = hi + x
    a1 = s - x  # the part of s that came from hi
    b1 = s - a1  # the part of s that came from x
    np.subtract(hi, a1, out=a1)  # da = hi - a1
    np.subtract(x, b1, out=b1)  # db = x - b1
    np.add(a1, b1, out=a1)  # e = da + db (exact: hi + x == s + e)
    np.add(lo, a1, out=lo)
    return s


def bound_f32(abs_a32: np.ndarray, abs_b32: np.ndarray, f: float, k: int):
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


def decide_f64(hi: np.ndarray, lo: np.ndarray, d: np.ndarray, out_blk: np.ndarray) -> np.ndarray:
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


def stage_dd(a: np.ndarray, b: np.ndarray, out: np.ndarray, maybe_zero: bool) -> list[np.ndarray]:
    """float64 output: exact products accumulated in double-double, bound from an sgemm."""
    m, k = a.shape
    n = b.shape[1]
    f = 1.25 * 3.0 * (k + 1) ** 2 * _U * _U
    rb = max(1, BLOCK_ELEMENTS // n)
    abs_a32 = np.abs(a.astype(np.float32))
    abs_b32 = np.abs(b.astype(np.float32))
    b64 = b.astype(np.float64)
    undecided: list[np.ndarray] = []
    for r0 in range(0, m, rb):
        r1 = min(m, r0 + rb)
        out_blk = out[r0:r1]
        d, c32 = bound_f32(abs_a32[r0:r1], abs_b32, f, k)
        if d is None:
            d = np.abs(a[r0:r1].astype(np.float64)) @ (np.abs(b64) * f)
            cand = d == 0
        else:
            cand = c32 == 0  # all products zero, or lost to underflow: checked below
        hi = np.zeros((r1 - r0, n))
        lo = np.zeros((r1 - r0, n))
        a_blk = a[r0:r1].astype(np.float64)
        for kk in range(k):
            hi = _two_sum_acc(hi, lo, np.multiply.outer(a_blk[:, kk], b64[kk]))
        und = decide_f64(hi, lo, d, out_blk)
        if maybe_zero and cand.any():
            a_sign = a[r0:r1].astype(np.float32)
            nonzero = (a_sign != 0).astype(np.float64) @ (b.astype(np.float32) != 0)
            zero = cand & (nonzero == 0)  # every product is exactly zero
            neg = zero_signs(a_sign, b.astype(np.float32), k)
            out_blk[zero] = np.where(neg[zero], -0.0, 0.0)
            und &= ~zero
            und |= cand & ~zero  # tiny products lost to float32 underflow in the bound
        idx = np.flatnonzero(und)
        if idx.size:
            undecided.append(idx + r0 * n)
    return undecided
