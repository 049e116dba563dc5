"""The mpmath reference the fast oracle is proven against: exact sums, one rounding, no shortcuts.

It is deliberately simple and slow. Every product of two inputs is formed exactly as an `mpf`,
the sum is taken with `mpmath.fsum` at a working precision computed from the exponents of the
terms so that no bit is lost (the sum is exact), and the exact result is rounded ONCE to the
output dtype with round-half-even done on the integer significand. Going through `float()` and
then casting would round twice (to float64 first) and can land on the wrong neighbour; the test
suite shows one such case.

IEEE special values follow the semantics of the exact sum: any NaN product (NaN input, inf * 0)
or inf + -inf gives NaN; otherwise any infinite product gives that infinity; an exact zero is
+0 unless every term is -0.

`softmax` is the reference for the softmax oracle: exact differences ``x_j - max``, mpmath
``exp`` and ``fsum`` at a working precision P with a proven-enough guard (Ziv's loop: the result
is accepted only when the value widened by the error allowance rounds to one value of the output
dtype; otherwise P doubles). A softmax value is never a rounding midpoint of a binary format
unless it is exactly representable (e**d for a nonzero rational d is transcendental), so the
loop ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import cast

import ml_dtypes
import mpmath
import numpy as np

from diag.errors import UsageError
from diag.numerics import as_dtype
from diag.oracle._args import check_matmul_args

__all__ = ["dot", "round_mpf", "matmul", "softmax", "softmax_row"]


def _format(dt: np.dtype):
    fi = ml_dtypes.finfo(dt)
    p = int(fi.nmant) + 1
    emin = int(fi.minexp)  # exponent of the smallest normal
    has_inf = dt != np.dtype(ml_dtypes.float8_e4m3fn)
    return p, emin, float(fi.max), has_inf


def _scalar(v, dt: np.dtype) -> np.generic:
    """`v` as a numpy scalar of `dt` (numpy's stubs type the 0-d index `[()]` as an array)."""
    return cast(np.generic, np.array(v).astype(dt)[()])


def round_mpf(x: mpmath.mpf, dtype) -> np.generic:
    """Round an exact `mpf` to `dtype` once, to nearest, ties to even (IEEE overflow/underflow).

    Args:
        x: an exact mpmath value (finite, inf or nan).
        dtype: output dtype (float64, float32, bfloat16, float16, float8_*).

    Returns:
        A numpy scalar of `dtype`. A zero `x` gives +0 (signed zeros are decided by the caller,
        who knows the terms).
    """
    dt = as_dtype(dtype)
    if mpmath.isnan(x):
        return _scalar(np.nan, dt)
    p, emin, fmax, has_inf = _format(dt)
    overflow = np.inf if has_inf else np.nan
    if mpmath.isinf(x):
        return _scalar(math.copysign(overflow, float(x)), dt)
    if x == 0:
        return _scalar(0.0, dt)
    sign, man, exp, _ = x._mpf_  # x = (-1)**sign * man * 2**exp exactly, man odd
    neg, m = bool(sign), int(man)
    e = exp + m.bit_length() - 1  # floor(log2 |x|)
    q = max(e, emin) - (p - 1)  # exponent of the last significand bit kept (gradual underflow)
    if exp >= q:
        n = m << (exp - q)
    else:
        shift = q - exp
        n = m >> shift
        rem = m - (n << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and n & 1):
            n += 1
    # Overflow is judged after rounding with an unbounded exponent, as IEEE 754 does.
    if n and n.bit_length() + q > 1024:
        v = overflow
    else:
        v = math.ldexp(n, q)  # exact: n < 2**(p+1), q >= emin - p + 1
        if v > fmax:
            v = overflow
    # v is representable in dt (or inf/nan), so this cast does not round.
    return _scalar(-v if neg else v, dt)


def dot(a: Iterable[float], b: Iterable[float]) -> tuple[mpmath.mpf, float | None]:
    """Exact sum of a_k * b_k.

    Args:
        a: K values (anything `float()` converts exactly).
        b: K values.

    Returns:
        (exact, special): `exact` is the exact mpf sum of the finite products; `special` is
        None, or the IEEE result (nan, inf, -inf, -0.0, 0.0) when it is decided by special
        values or by an exact zero, whose sign the mpf cannot carry.
    """
    af = [float(x) for x in a]
    bf = [float(y) for y in b]
    prods = [x * y for x, y in zip(af, bf)]  # Python floats: only used for IEEE specials/signs
    if any(math.isnan(p) for p in prods):
        return mpmath.mpf(0), math.nan
    pos = any(p == math.inf for p in prods)
    neg = any(p == -math.inf for p in prods)
    if pos and neg:
        return mpmath.mpf(0), math.nan
    if pos or neg:
        return mpmath.mpf(0), math.inf if pos else -math.inf
    # Exact products: mpf(float) is exact; a product of two 53-bit significands needs 106 bits.
    with mpmath.workprec(120):
        terms = [mpmath.mpf(x) * mpmath.mpf(y) for x, y in zip(af, bf)]
    nz = [t for t in terms if t != 0]
    if not nz:
        # IEEE round-to-nearest: a sum of zeros is -0 only if every term is -0.
        all_neg = len(prods) > 0 and all(math.copysign(1.0, p) < 0 for p in prods)
        return mpmath.mpf(0), (-0.0 if all_neg else 0.0)
    # Working precision that makes the sum exact: the span from the lowest set bit of any term
    # to the top of the largest, plus carry room for len(nz) additions.
    lo = min(t.man_exp[1] for t in nz)
    hi = max(t.man_exp[1] + abs(int(t.man_exp[0])).bit_length() for t in nz)
    prec = hi - lo + len(nz).bit_length() + 2
    with mpmath.workprec(prec):
        s = mpmath.fsum(nz)
    if s == 0:
        return s, 0.0  # exact cancellation of nonzero terms: +0 in round-to-nearest
    return s, None


def _element(a2: np.ndarray, b2: np.ndarray, i: int, j: int, dt: np.dtype) -> np.generic:
    s, special = dot(a2[i, :].astype(np.float64), b2[:, j].astype(np.float64))
    if special is not None:
        return _scalar(special, dt)
    return round_mpf(s, dt)


def matmul(a, b, out_dtype=None, elements: Iterable[Sequence[int]] | None = None) -> np.ndarray:
    """Correctly rounded matmul computed with mpmath, element by element (slow: the reference).

    Args:
        a: [..., M, K] array (float32, bfloat16, float16, float8_*; float64 too).
        b: [..., K, N] array; batch dims broadcast as in numpy.
        out_dtype: dtype of the result; default the inputs' dtype.
        elements: optional output indices (tuples over the full output shape, batch dims
            included) to compute instead of the whole product, for sampling large outputs.

    Returns:
        The full [..., M, N] result, or, with `elements`, a 1-D array with one value per index.

    Raises:
        UsageError: shapes do not multiply, dtypes are unknown or differ without `out_dtype`.
    """
    a, b, dt, batch = check_matmul_args(a, b, out_dtype, "mp.matmul")
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    out_shape = batch + (a.shape[-2], b.shape[-1])
    if elements is None:
        out = np.empty(out_shape, dt)
        for idx in np.ndindex(*out_shape):
            out[idx] = _element(a[idx[:-2]], b[idx[:-2]], idx[-2], idx[-1], dt)
        return out
    vals = []
    for element in elements:
        idx = tuple(int(t) for t in element)
        if len(idx) != len(out_shape):
            raise UsageError(
                f"mp.matmul: element index {idx} does not match output shape {out_shape}"
            )
        vals.append(_element(a[idx[:-2]], b[idx[:-2]], idx[-2], idx[-1], dt))
    return np.array(vals, dtype=dt)


#: Guard bits over log2(row length) that `softmax_row` allows for mpmath's own rounding: exp
#: is accurate to a few ulp of the working precision, the sum of n positive terms to n ulp.
_SOFTMAX_GUARD = 8
#: Precision above which `softmax_row` gives up (never reached: see the module docstring).
_SOFTMAX_MAX_PREC = 1 << 14


def softmax_row(row: Sequence[float], dtype, elements: Iterable[int] | None = None) -> list:
    """Correctly rounded softmax of one row, computed with mpmath (slow: the reference).

    Semantics (the oracle documents the same): -inf entries give exactly +0; a row holding NaN
    or +inf gives NaN everywhere (the IEEE computation meets inf - inf); a row that is all
    -inf (or empty of finite values) has no defined result and gives NaN everywhere.

    Args:
        row: the row's values (float32/bfloat16/float16 values, as Python floats or float64).
        dtype: output dtype.
        elements: optional indices to compute; default every element.

    Returns:
        A list of numpy scalars of `dtype`, one per requested element.
    """
    dt = as_dtype(dtype)
    if dt == np.dtype(np.float64):
        raise UsageError(
            "mp.softmax_row: float64 output is not supported (results below "
            "exp(-200) are returned as +0, exact only for narrower dtypes)"
        )
    xs = [float(v) for v in row]
    idx = list(range(len(xs))) if elements is None else [int(i) for i in elements]
    nan = _scalar(np.nan, dt)
    zero = _scalar(0.0, dt)
    if any(math.isnan(v) or v == math.inf for v in xs) or all(v == -math.inf for v in xs):
        return [nan for _ in idx]
    m = max(xs)
    # x_j - m exactly (a float64 difference needs at most ~1100 bits); -inf entries drop out.
    with mpmath.workprec(64):
        d = {j: mpmath.fsub(v, m, exact=True) for j, v in enumerate(xs) if v != -math.inf}
    n = len(d)
    prec = 80 + n.bit_length()
    while prec <= _SOFTMAX_MAX_PREC:
        # Terms below the cut add < n 2**-(prec + 2 log2 n + 16) <= 2**-(prec + 16) relative to
        # the sum (>= 1, the maximum gives exp(0)): inside `tol`. Their own results are below
        # exp(-200) < 2**-288, +0 in every dtype diag has; exp of such huge negative d would
        # also need astronomically many bits to round.
        cut = -max(200.0, (prec + 2 * n.bit_length() + 16) * math.log(2))
        with mpmath.workprec(prec):
            e = {j: mpmath.exp(t) for j, t in d.items() if t >= cut}
            s = mpmath.fsum(e.values())
            tol = mpmath.ldexp(1, n.bit_length() + _SOFTMAX_GUARD - prec)
            out, ok = [], True
            for i in idx:
                if i not in e or d[i] < -200:
                    out.append(zero)
                    continue
                y = e[i] / s
                lo, hi = round_mpf(y * (1 - tol), dt), round_mpf(y * (1 + tol), dt)
                if lo != hi:
                    ok = False
                    break
                out.append(hi)
        if ok:
            return out
        prec *= 2
    raise ArithmeticError(f"mp.softmax_row: no decision at {prec} bits")  # pragma: no cover


def softmax(x, out_dtype=None) -> np.ndarray:
    """Correctly rounded softmax over the last axis, row by row with mpmath (slow: the reference).

    Args:
        x: [..., n] array of float32, bfloat16, float16 (or float8) values.
        out_dtype: output dtype; default x's dtype.

    Returns:
        Array of `out_dtype` with x's shape; see `softmax_row` for special values.

    Raises:
        UsageError: x is 0-d or of a dtype diag does not know.
    """
    x = np.asarray(x)
    as_dtype(x.dtype)
    if x.ndim == 0:
        raise UsageError("mp.softmax: x is a scalar; expected [..., n]")
    dt = as_dtype(out_dtype if out_dtype is not None else x.dtype)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.empty(rows.shape, dt)
    for r in range(rows.shape[0]):
        if rows.shape[1]:
            out[r] = softmax_row(rows[r], dt)
    return out.reshape(x.shape)
