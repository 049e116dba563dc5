"""Correctly rounded matmul at BLAS speed: one float64 GEMM, a rigorous bound, a proof per element.

Why this is exact. Inputs are float32, bfloat16, float16 or float8: each product a*b has at most
2 * 24 = 48 significand bits and an exponent in [-298, 256], so it is EXACT in float64 (53 bits,
normal range [-1022, 1023]); a sum of K such products never overflows float64 and never leaves
the range where the error model fl(x + y) = (x + y)(1 + d), |d| <= u = 2**-53, holds (subnormal
sums would be exact anyway). Hence, for ANY summation order or blocking BLAS picks, with or
without FMA, |fl64(A B)_ij - (A B)_ij| <= E * (|A||B|)_ij with E = gamma_K(u).

The bound is rank one. Cauchy-Schwarz gives (|A||B|)_ij <= ||a_i||_2 ||b_j||_2, and the norms
cost O(MK + KN), not a second GEMM. The squares are exact in float64 and their sums err by
gamma_K, so the computed norms' product is at least (1 - gamma_K)(1 - u)**3 >= 0.997 of the
true one for K u <= 0.0025 (checked): the factor 1.01 covers it and the rounding of the outer
product. For N(0,1) data the bound is ~1.6x |A||B|; where it is looser the next stages catch
the extra undecided elements (they are counted, never hidden).

Ziv's strategy, per element: D = f * ||a_i|| ||b_j|| with f covering E, the rounding of D
itself and of approx +- D (see `_bound_factor`). The exact result lies in [approx - D,
approx + D]; if both ends round to the same BITS of the output dtype (rounding is monotone, and
bits keep -0 apart from +0), that is the correctly rounded result. An element whose products
are all zero has D == 0 exactly when its row or column is zero: its sign is settled apart
(`zero_signs`); any other exact zero straddles +-0 and stays undecided.

Long K (K > KSPLIT_THRESHOLD). E = gamma_K grows with K; K is split into nb blocks of Kb ~
sqrt(K) (`_kblock`), each block a float64 GEMM of exact products (error gamma_Kb), and the nb
block results are added in float64 in any order (gamma_{nb-1} of their absolute values), so
E = gamma_Kb + gamma_{nb-1} (1 + gamma_Kb): ~500 u at K = 65536 instead of 65536 u, for one
GEMM's flops and one addition per block.

Undecided elements (typically 1e-4 of them, all of an ill-conditioned row) go through three
exact stages, each COUNTED in `OracleResult.fallbacks` / `exact`:
1. Rows with many undecided elements (ill-conditioned rows): Ozaki's split (`_ozaki`), A = A1 +
   A2 and B = B1 + B2 with A1, B1 short enough that A1 B1 is EXACT in a float64 GEMM
   (`diag.oracle._eft.split_bits`); the rest, A1 B2 + A2 B, is 2**-17 times smaller and its
   GEMM error is bounded as above. Three GEMMs on those rows only.
2. Scattered elements: the exact products summed by vectorised extraction (`_refine`,
   `diag.oracle._eft.row_sums`: one pass, then three for what is still undecided; each pass
   takes ~38 more bits exactly, enough for condition numbers ~1e30).
3. What is left (exact ties, sums beyond that) is summed exactly with math.fsum
   (`_exact_element`).

float64 output (diag/oracle/_matmul_dd.py). Here the float64 rounding itself must be decided: every
product (exact)
is accumulated in double-double (K rank-1 passes; slow for long K, not a target) and the
decision uses the exact remainder of the final TwoSum.

Special values are settled apart from the arithmetic (`diag.oracle._matmul_special`): rows/
columns holding inf or NaN get the IEEE result of the exact sum (NaN for any NaN product or
inf - inf, else the infinity), and an element whose products are all zero gets -0 only if every
product is -0.
"""

from __future__ import annotations

import math
from typing import cast

import ml_dtypes
import numpy as np

from diag.numerics import round_to_dtype
from diag.oracle._eft import gamma as _gamma
from diag.oracle._eft import row_sums, split_bits, split_rows
from diag.oracle._matmul_dd import bound_f32, decide_f64, stage_dd
from diag.oracle._matmul_special import apply_specials, zero_signs

__all__ = ["BLOCK_ELEMENTS", "KSPLIT_THRESHOLD", "MATMUL_INPUT_DTYPES", "matmul_core"]

_U = 2.0**-53  # float64 unit roundoff
#: Contraction length above which K is split into blocks of ~sqrt(K).
KSPLIT_THRESHOLD = 1024
#: Output elements per row block of the short-K path: temporaries (~1 MB) stay in cache.
BLOCK_ELEMENTS = 1 << 17
#: Products materialised at once by the refine stage (float64: 2 MB, cache-resident).
REFINE_PRODUCTS = 1 << 18
#: Costs in units of one multiply-add of a float64 GEMM (measured within 2x on a 2-core AMD
#: EPYC, one BLAS thread): one product through the refine stage (gather + ~15 array passes),
#: and one element of a row or column through Ozaki's split (conversion, split, norms). A row
#: goes to Ozaki's split when its undecided elements cost more to refine than its share of
#: the split's GEMMs and passes.
REFINE_COST = 100
OZAKI_LINE_COST = 140
#: A row block with more than 1/TIGHT_FRACTION of its elements undecided by the rank-one bound
#: is decided again with the elementwise bound |A||B| (one sgemm).
TIGHT_FRACTION = 64

MATMUL_INPUT_DTYPES = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _bound_factor(err: float) -> float:
    """f such that fl(|A| @ fl(f |B|)) bounds err * sum|p| plus the rounding of approx +- D.

    With C = computed D >= f sum|p| (1 - gamma_{K+1}) and |approx| <= (1 + err) sum|p|, the ends
    fl(approx -+ D) enclose the exact sum when D (1 - u) >= err sum|p| + u |approx|; f = 1.25
    (err + 2u) gives that for K u <= 0.01 (checked by the caller). The rank-one bound adds its
    own 1.01 (module docstring).
    """
    return 1.25 * (err + 2 * _U)


def _kblock(k: int) -> int:
    """K-block of the split path: a power of two near sqrt(K), at least 256."""
    return max(256, 1 << ((int(k - 1).bit_length() + 1) // 2))


def _norms(x: np.ndarray, axis: int) -> np.ndarray:
    """float64 2-norms of the rows (axis=1) or columns (axis=0) of x; squares exact.

    Summed over row chunks of ~1M elements (contiguous reads); the chunks' partial sums add in
    another order, which the gamma_K bound of the module docstring allows.
    """
    acc = np.zeros(x.shape[1 - axis])
    step = max(1, min(x.shape[0], (1 << 20) // max(1, x.shape[1])))
    buf = np.empty((step, x.shape[1]))
    for s0 in range(0, x.shape[0], step):
        h = min(step, x.shape[0] - s0)
        p64 = buf[:h]
        np.copyto(p64, x[s0 : s0 + h])
        if axis == 1:
            acc[s0 : s0 + h] = np.einsum("ij,ij->i", p64, p64)
        else:
            acc += np.einsum("ij,ij->j", p64, p64)
    return np.sqrt(acc)


def _decide(
    approx: np.ndarray,
    d: np.ndarray,
    out_dt: np.dtype,
    out_blk: np.ndarray,
    scratch32: np.ndarray | None,
) -> np.ndarray:
    """Write round(approx + d) into out_blk; return a bool mask of elements not proven.

    Proven means round(fl(approx - d)) and round(fl(approx + d)) have the same bits.
    """
    if out_dt == _F64:
        return decide_f64(approx, np.zeros_like(approx), d, out_blk)
    if out_dt == _F32:
        # One pass each: the subtraction is done in float64 and its result rounded (RNE) to f32.
        lo32 = (
            np.empty(approx.shape, np.float32)
            if scratch32 is None
            else scratch32[: approx.shape[0]]
        )
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
        return cast(np.generic, np.array(-0.0 if neg else 0.0).astype(out_dt)[()])
    terms = p.tolist()
    s1 = math.fsum(terms)
    if s1 == 0.0:
        # exact cancellation: +0 (S == 0 iff s1 == 0)
        return cast(np.generic, np.array(0.0).astype(out_dt)[()])
    if out_dt == _F64:
        return np.float64(s1)
    terms.append(-s1)
    s2 = math.fsum(terms)
    if s2 != 0.0 and (np.array(s1).view(np.uint64) & 1) == 0:
        s1 = math.nextafter(s1, math.copysign(math.inf, s2))
    return cast(np.generic, round_to_dtype(np.array(s1), out_dt)[()])


def _first_stage(
    a: np.ndarray, b: np.ndarray, out: np.ndarray, na: np.ndarray, nb: np.ndarray
) -> list[np.ndarray]:
    """One float64 GEMM (K-split above KSPLIT_THRESHOLD) + the rank-one bound; returns the
    flat indices of the elements not proven, per row block."""
    m, k = a.shape
    n = b.shape[1]
    out_dt = out.dtype
    if k > KSPLIT_THRESHOLD:
        kb = _kblock(k)
        nblk = -(-k // kb)
        err = _gamma(kb) + _gamma(nblk - 1) * (1.0 + _gamma(kb))
        # Many rows per K-block GEMM keep BLAS efficient; the partial sums stay ~16 MB.
        rb = max(1, min(m, (1 << 21) // n))
    else:
        kb, err = k, _gamma(k)
        # Blocks stay in cache, but not so thin that each GEMM call re-packs B for few rows.
        rb = max(1, BLOCK_ELEMENTS // n, min(512, k // 2))
    fa = na * (1.01 * _bound_factor(err))
    rb = min(rb, m)
    scratch32 = np.empty((rb, n), np.float32) if out_dt == _F32 else None
    undecided: list[np.ndarray] = []
    abs_b32: list[np.ndarray] = []  # made once, if a block needs the tight bound
    # Temporaries are allocated once and reused: on a shared VM, touching fresh pages costs
    # about as much as the arithmetic on them.
    approx_buf, d_buf = np.empty((rb, n)), np.empty((rb, n))
    if kb == k:
        a_buf, b64 = np.empty((rb, kb)), b.astype(np.float64)
    else:
        # K blocks per batched GEMM, their operands and partial products ~4 MB in all (measured
        # for [64,65536]x[65536,64], one thread: 16 blocks at a time 28 ms, 1 at a time 32 ms,
        # all 256 at once 36 ms, against 25 ms for one float64 GEMM).
        g = max(1, min(-(-k // kb), (1 << 19) // (rb * kb + kb * n + rb * n)))
        bufs = (np.empty((g, rb, kb)), np.empty((g, kb, n)), np.empty((g, rb, n)))
    for r0 in range(0, m, rb):
        r1 = min(m, r0 + rb)
        h = r1 - r0
        approx = approx_buf[:h]
        if kb == k:
            np.copyto(a_buf[:h], a[r0:r1])
            np.matmul(a_buf[:h], b64, out=approx)
        else:
            _ksplit_product(a[r0:r1], b, kb, approx, bufs)
        d = np.multiply(fa[r0:r1, None], nb[None, :], out=d_buf[:h])
        und = _decide(approx, d, out_dt, out[r0:r1], scratch32)
        if und.sum() * TIGHT_FRACTION > und.size:
            if not abs_b32:
                abs_b32.append(np.abs(b.astype(np.float32)))
            und = _retry_tight(a[r0:r1], abs_b32[0], b, approx, err, out[r0:r1], scratch32)
        idx = np.flatnonzero(und)
        if idx.size:
            undecided.append(idx + r0 * n)
    return undecided


def _ksplit_product(
    a_rows: np.ndarray, b: np.ndarray, kb: int, approx: np.ndarray, bufs: tuple
) -> None:
    """approx = the sum of the float64 GEMMs a_rows[:, blk] @ b[blk] over K blocks of kb.

    Each block's product is computed alone (error gamma_kb) and the nb products are added in
    float64 in some order and grouping (gamma_{nb-1}, whatever the order). Up to g blocks go to
    BLAS as one batched matmul (numpy loops over them in C), so a small output does not pay
    Python's per-call cost for each of its 256 blocks.
    """
    a_buf, b_buf, part = bufs  # [g, rb, kb], [g, kb, n], [g, rb, n] float64
    h, k = a_rows.shape
    n = b.shape[1]
    g = a_buf.shape[0]
    full = (k // kb) * kb
    approx[...] = 0.0
    for k0 in range(0, full, g * kb):
        gg = min(g, (full - k0) // kb)
        k1 = k0 + gg * kb
        np.copyto(a_buf[:gg, :h], a_rows[:, k0:k1].reshape(h, gg, kb).transpose(1, 0, 2))
        np.copyto(b_buf[:gg], b[k0:k1].reshape(gg, kb, n))
        np.matmul(a_buf[:gg, :h], b_buf[:gg], out=part[:gg, :h])
        approx += part[0, :h] if gg == 1 else part[:gg, :h].sum(axis=0)
    if full < k:
        w = k - full
        np.copyto(a_buf[0, :h, :w], a_rows[:, full:])
        np.copyto(b_buf[0, :w], b[full:])
        np.matmul(a_buf[0, :h, :w], b_buf[0, :w], out=part[0, :h])
        approx += part[0, :h]


def _retry_tight(
    a_blk: np.ndarray,
    abs_b32: np.ndarray,
    b: np.ndarray,
    approx: np.ndarray,
    err: float,
    out_blk: np.ndarray,
    scratch32,
) -> np.ndarray:
    """Decide a block again with the elementwise bound f |A||B| (an sgemm, `bound_f32`).

    For blocks the rank-one bound leaves largely undecided (sparse or structured inputs, where
    Cauchy-Schwarz is loose and many sums are exact zeros of disjoint supports). Elements
    whose products are all zero are found by an indicator GEMM and get their IEEE sign.
    """
    k = a_blk.shape[1]
    out_dt = out_blk.dtype
    f = _bound_factor(err)
    d, c32 = bound_f32(np.abs(a_blk.astype(np.float32)), abs_b32, f, k)
    if d is None:
        d = np.abs(a_blk.astype(np.float64)) @ (np.abs(b.astype(np.float64)) * f)
        cand = d == 0
    else:
        cand = c32 == 0  # all products zero, or lost to underflow: checked below
    und = _decide(approx, d, out_dt, out_blk, scratch32)
    if cand.any():
        a_sign, b_sign = a_blk.astype(np.float32), b.astype(np.float32)
        nonzero = (a_sign != 0).astype(np.float64) @ (b_sign != 0)
        zero = cand & (nonzero == 0)  # every product is exactly zero
        neg = zero_signs(a_sign, b_sign, k)
        out_blk[zero] = np.where(neg[zero], -0.0, 0.0).astype(out_dt)
        und &= ~zero
        und |= cand & ~zero  # tiny products lost to float32 underflow in the bound
    return und


def _settle_zero_lines(
    a: np.ndarray, b: np.ndarray, out: np.ndarray, na: np.ndarray, nb: np.ndarray, und: np.ndarray
) -> np.ndarray:
    """Signed zeros of zero rows/columns (D == 0 there); returns the undecided flat indices left."""
    k, n = a.shape[1], b.shape[1]
    zr, zc = np.flatnonzero(na == 0), np.flatnonzero(nb == 0)
    if zr.size:
        neg = zero_signs(a[zr].astype(np.float32), b.astype(np.float32), k)
        out[zr] = np.where(neg, -0.0, 0.0).astype(out.dtype)
    if zc.size:
        neg = zero_signs(a.astype(np.float32), b[:, zc].astype(np.float32), k)
        out[:, zc] = np.where(neg, -0.0, 0.0).astype(out.dtype)
    if und.size and (zr.size or zc.size):
        r, c = np.divmod(und, n)
        und = und[(na[r] != 0) & (nb[c] != 0)]
    return und


def _ozaki(a: np.ndarray, b: np.ndarray, out_dt: np.dtype):
    """Rows of A [r, K] times columns of B [K, c] by Ozaki's split; returns (value, undecided).

    A = A1 + A2, B = B1 + B2 exactly (`split_rows`), E1 = A1 @ B1 EXACT (`split_bits`), and
    R = A1 @ B2 + A2 @ B in float64 with |R - R_exact| <= gamma_K (|A1||B2| + |A2||B|) + u|R|,
    bounded by Cauchy-Schwarz as in the first stage. The sum E1 + R is then decided like the
    first stage's approx, with the bound now ~2**-17 of it.
    """
    k = a.shape[1]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    rho = split_bits(k)
    a1, a2 = split_rows(a64, rho)
    b1t, b2t = split_rows(np.ascontiguousarray(b64.T), rho)
    b1, b2 = b1t.T, b2t.T
    e1 = a1 @ b1
    r = a1 @ b2
    r += a2 @ b64
    bound = np.multiply.outer(_norms(a1, 1), _norms(b2, 0)) + np.multiply.outer(
        _norms(a2, 1), _norms(b64, 0)
    )
    approx = e1 + r
    d = 1.1 * (1.01 * _gamma(k + 1) * bound + _U * np.abs(r)) + 3.0 * _U * np.abs(approx)
    blk = np.empty(approx.shape, out_dt)
    und = _decide(approx, d, out_dt, blk, None)
    # A zero here may be a sum of signed zeros (d == 0 too): the refine stage knows the signs.
    und |= approx == 0
    return blk, und


def _ozaki_rows(a: np.ndarray, b: np.ndarray, und: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Send the undecided elements of heavy rows through `_ozaki`; return those still left."""
    k, n = a.shape[1], b.shape[1]
    rows = und // n
    counts = np.bincount(rows, minlength=a.shape[0])
    ncols = np.unique(und % n).size
    gain = counts * REFINE_COST - (3 * ncols + OZAKI_LINE_COST)  # per row, in units of K
    heavy = np.flatnonzero(gain > 0)
    if heavy.size == 0 or gain[heavy].sum() <= OZAKI_LINE_COST * ncols:
        return und
    in_heavy = np.isin(rows, heavy)
    sel = und[in_heavy]
    cols = np.unique(sel % n)
    left = [und[~in_heavy]]
    step = max(1, (1 << 22) // k)  # columns of B per chunk (three float64 copies of ~32 MB)
    pos_r = np.searchsorted(heavy, sel // n)
    for c0 in range(0, cols.size, step):
        cc = cols[c0 : c0 + step]
        vals, und_blk = _ozaki(a[heavy], b[:, cc], flat.dtype)
        mine = (sel % n >= cc[0]) & (sel % n <= cc[-1])
        pr, pc = pos_r[mine], np.searchsorted(cc, sel[mine] % n)
        flat[sel[mine]] = vals[pr, pc]
        left.append(sel[mine][und_blk[pr, pc]])
    return np.concatenate(left)


def _refine(
    a: np.ndarray, b: np.ndarray, flat_idx: np.ndarray, out_dt: np.dtype, flat_out: np.ndarray
) -> np.ndarray:
    """Exact products of each undecided element summed by extraction; returns those left.

    `row_sums` gives S in hi + lo +- err (exact parts plus a bounded remainder): one pass
    first (~38 bits beyond float64's), three for what is still undecided.
    """
    n = b.shape[1]
    k = a.shape[1]
    rows, cols = np.divmod(flat_idx, n)
    left: list[np.ndarray] = []
    step = max(1, REFINE_PRODUCTS // k)
    # Gathering columns of B is strided (~10x a contiguous row): copy B^T once if many.
    bt = np.ascontiguousarray(b.T) if flat_idx.size * 8 > n else b.T
    for c0 in range(0, flat_idx.size, step):
        c1 = min(flat_idx.size, c0 + step)
        x = a[rows[c0:c1]].astype(np.float64) * bt[cols[c0:c1]].astype(np.float64)
        all_zero = ~x.any(axis=1)
        all_neg = cast(np.ndarray, np.signbit(x).all(axis=1))  # x is 2-D: an array
        blk = np.empty(c1 - c0, out_dt)
        und = np.ones(c1 - c0, bool)
        for passes in (1, 3):
            sub = np.flatnonzero(und)
            hi, lo, err = row_sums(x[sub], passes)
            val = np.empty(sub.size, out_dt)
            if out_dt == _F64:
                u2 = decide_f64(hi, lo, 1.01 * err, val)
            else:
                approx = hi + lo
                u2 = _decide(approx, 1.1 * err + 3.0 * _U * np.abs(approx), out_dt, val, None)
            blk[sub] = val
            und[sub] = u2
            if not und.any():
                break
        # IEEE round-to-nearest: a sum of zeros is -0 only if every term is -0.
        blk[all_zero] = np.where(all_neg[all_zero], -0.0, 0.0).astype(out_dt)
        und &= ~all_zero
        flat_out[flat_idx[c0:c1]] = blk
        left.append(flat_idx[c0:c1][und])
    return np.concatenate(left) if left else flat_idx[:0]


def matmul_core(a: np.ndarray, b: np.ndarray, out_dt: np.dtype):
    """Correctly rounded a @ b for 2-D a [M, K], b [K, N] of exact-product dtypes.

    Returns:
        (value [M, N] of out_dt, method name, elements the BLAS stage could not prove, elements
        that also escaped the Ozaki and refine stages and were summed exactly with math.fsum).
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
    if out_dt == _F64:
        method = "dd-exact-products"
        maybe_zero = not (bool(a.all()) and bool(b.all()))
        parts = stage_dd(a, b, out, maybe_zero)
        und = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    else:
        method = "f64-ksplit" if k > KSPLIT_THRESHOLD else "f64-bound"
        na, nb = _norms(a, 1), _norms(b, 0)
        parts = _first_stage(a, b, out, na, nb)
        und = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        und = _settle_zero_lines(a, b, out, na, nb, und)
    fallbacks = int(und.size)
    exact = 0
    if fallbacks:
        flat = out.reshape(-1)
        if out_dt != _F64:
            und = _ozaki_rows(a, b, und, flat)
        still = _refine(a, b, und, out_dt, flat)
        for e in still:
            i, j = divmod(int(e), n)
            flat[e] = _exact_element(a[i].astype(np.float64), b[:, j].astype(np.float64), out_dt)
            exact += 1
    if not finite:
        apply_specials(a_raw.astype(np.float64), b_raw.astype(np.float64), out)
    return out, method, fallbacks, exact
