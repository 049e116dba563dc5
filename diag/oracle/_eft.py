"""Vectorised error-free transformations: floats split into pieces that sum exactly.

Why this module exists: the oracles need exact (or rigorously bounded) sums of many float64
terms, row by row, at numpy speed; `math.fsum` over `tolist()` is exact but runs in Python.

The tool is Rump, Ogita and Oishi's extraction ("Accurate floating-point summation part I:
faithful rounding", SIAM J. Sci. Comput. 31(1), 2008, Lemmas 3.3 and 3.4). With eps = 2**-53,
sigma = 2**k and a float p with |p| <= 2**-M sigma (M >= 0, no underflow):

    q = fl(fl(sigma + p) - sigma),  r = fl(p - q)   give   p == q + r EXACTLY,
    q is an integer multiple of eps * sigma, |q| <= 2**-M sigma, |r| <= eps * sigma.

So n <= 2**M such q, all multiples of eps * sigma with |sum| <= sigma, sum EXACTLY in float64
in any order (every partial sum is k * eps * sigma with |k| <= 2**53). One pass turns a row
into one exact float tau plus remainders 2**(M-52) times smaller than the row's largest term;
each further pass peels another ~(52 - M) bits, which is what an ill-conditioned sum needs.

Inputs here are finite and, in diag's use, integer multiples of 2**-298 (products of two
float32 values, or float64 exp values >= 2**-1075 scaled): sigma * eps stays far above the
underflow threshold, or the remainder is already zero (a multiple of a unit >= eps * sigma is
extracted whole).

The Ozaki split (`split_rows`) is the same extraction with a per-row sigma chosen so that the
high parts of two matrices have few enough bits that their product is EXACT in a float64 GEMM
(Ozaki, Ogita, Oishi, Rump, "Error-free transformations of matrix multiplication by using fast
routines of matrix multiplication", Numer. Algorithms 59, 2012).
"""

from __future__ import annotations

import numpy as np

__all__ = ["gamma", "row_sums", "split_bits", "split_rows"]

_U = 2.0**-53


def gamma(n: int) -> float:
    """Higham's gamma_n for float64: n u / (1 - n u), the error factor of an n-term sum."""
    return n * _U / (1.0 - n * _U)


def _two_sum(a: np.ndarray, b: np.ndarray):
    """(s, e) with s = fl(a + b) and a + b == s + e exactly (Knuth's TwoSum, any order)."""
    s = a + b
    z = s - a
    e = (a - (s - z)) + (b - z)
    return s, e


def row_sums(
    x: np.ndarray,
    passes: int,
    max_abs: float | None = None,
    work: tuple[np.ndarray, np.ndarray] | None = None,
):
    """Row sums of a finite float64 [c, n] array with a rigorous error bound.

    Args:
        x: [c, n] finite float64 terms (n <= 2**50). Not modified.
        passes: extraction passes; each takes ~(52 - log2 n) more leading bits of the row
            exactly (see the module docstring).
        max_abs: a known bound on every |x| (saves the first pass's search for the largest,
            and the remainders' bound then comes from sigma, not from summing |r|).
        work: optional two float64 scratch arrays of x's shape (not x itself): the passes run
            in them instead of fresh temporaries (a caller that keeps them pays no page faults).

    Returns:
        (hi, lo, err), float64 [c] arrays: each exact row sum S satisfies
        |S - (hi + lo)| <= err, where hi + lo is the exact (unrounded) sum of the two floats.
        The exact parts tau_1..tau_p are accumulated in (hi, lo) with TwoSum; err covers the
        float64 sum of the remainders (gamma_n sum|r|) and the roundings of lo.
    """
    c, n = x.shape
    m_bits = max(0, int(n - 1).bit_length())  # 2**m_bits >= n
    hi = np.zeros(c)
    lo = np.zeros(c)
    err = np.zeros(c)
    q_buf, r_buf = work if work is not None else (np.empty_like(x), np.empty_like(x))
    r = x
    for p in range(passes):
        if p == 0 and max_abs is not None:
            mu = np.full(c, float(max_abs))
        else:
            mu = np.abs(r, out=q_buf).max(axis=1) if n else np.zeros(c)
        sigma = np.ldexp(1.0, np.frexp(mu)[1] + m_bits)[:, None]  # >= 2**m_bits * mu
        q = np.add(r, sigma, out=q_buf)
        q -= sigma
        r = np.subtract(r, q, out=r_buf)
        tau = q.sum(axis=1)  # exact: Lemma 3.4
        hi, e = _two_sum(hi, tau)
        lo = lo + e
        err += _U * np.abs(lo)  # rounding of lo + e
    s_r = r.sum(axis=1)
    lo_new = lo + s_r
    # float64 sum of n remainders in any order: gamma_{n-1} sum|r|; sum|r| itself is computed
    # with relative error gamma_n (positive terms), covered by the factor 1.01 (n u <= 2**-3).
    # Lemma 3.3: |r| <= eps sigma after each pass, so n eps sigma bounds sum|r| without a pass.
    abs_r = (
        (n * _U) * sigma[:, 0]
        if max_abs is not None and passes == 1
        else np.abs(r, out=q_buf).sum(axis=1)
    )
    err += 1.01 * gamma(max(n, 1)) * abs_r + _U * np.abs(lo_new)
    return hi, lo_new, err


def split_bits(k: int) -> int:
    """rho such that the `split_rows(., rho)` high parts of A [m, k] and B^T give an EXACT A1 @ B1.

    A high part of row i is an integer multiple of w_i = 2**(e_i + rho - 53) with magnitude
    <= 2**e_i + w_i (mu_i < 2**e_i), i.e. at most 2**(53 - rho) + 1 units; so every partial sum
    of k products is an integer times w_i v_j bounded by k (2**(53 - rho) + 1)**2 < 2**53 when
    2 (53 - rho) + log2 k <= 51: any summation order is exact.
    """
    return (54 + int(k - 1).bit_length()) // 2 + 1


def split_rows(x: np.ndarray, rho: int):
    """Split each row of a finite float64 [r, k] array: x == hi + lo exactly.

    hi holds the bits of x down to 2**(e_i + rho - 53), where 2**(e_i - 1) <= max_j |x_ij| <
    2**e_i; |lo| <= 2**(e_i + rho - 53) (Lemma 3.3 with sigma_i = 2**(e_i + rho)).
    """
    mu = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    sigma = np.ldexp(1.0, np.frexp(mu)[1] + rho)[:, None]
    hi = (x + sigma) - sigma
    return hi, x - hi
