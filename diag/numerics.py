"""Floating-point facts diag relies on, in one place: dtypes, ULPs, unit roundoff, bounds, rounding.

Every comparison diag makes is expressed in units of the output dtype (ULPs) and against the
textbook error bound of the arithmetic a backend claims to use. Getting those units wrong is
silent, so they live here, are tested against mpmath, and are imported by the oracle, the
comparison code and the report alike.

Numerical traps written down where they bite:

* float64 -> bfloat16 through float32 rounds twice (ml_dtypes and torch both do it):
  ``1 + 2**-8 + 2**-30`` becomes ``1.0`` instead of ``1 + 2**-7``. `round_to_dtype` rounds to odd
  into float32 first, which makes the second rounding correct (24 >= 8 + 2 bits).
* ml_dtypes turns the exact tie ``464`` into NaN for float8_e4m3fn; with round-half-even and an
  unbounded exponent it rounds to ``448`` (even), which is finite, so `round_to_dtype` returns 448.
* Bits are compared, not values, wherever the sign of zero matters: ``-0.0 == 0.0``.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from diag.errors import UsageError

__all__ = [
    "DTYPES",
    "NAN_ULP",
    "as_dtype",
    "dtype_name",
    "is_supported",
    "precision_bits",
    "unit_roundoff",
    "gamma",
    "ulp_distance",
    "round_to_dtype",
    "bits_view",
    "bits_digest",
    "from_bits",
    "fmt",
]

DTypeLike = str | np.dtype | type

#: Names diag accepts for its floating-point dtypes, mapped to the numpy / ml_dtypes dtype.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_ALIASES = {
    "f64": "float64",
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "half": "float16",
    "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

#: `ulp_distance` when exactly one side is NaN: 2**62. It is larger than the distance between
#: any two non-NaN values of a dtype up to 32 bits (at most 2 * 0x7F800000 < 2**33), so a NaN
#: mismatch always sorts above every numeric one; float64 distances saturate below it.
NAN_ULP = 2**62


def as_dtype(dtype: DTypeLike) -> np.dtype:
    """The numpy dtype for a diag dtype name or a numpy / ml_dtypes dtype.

    Args:
        dtype: "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64"
            (or a short alias such as "bf16"), or a dtype / scalar type of one of those.

    Returns:
        The `np.dtype`.

    Raises:
        UsageError: the dtype is not one diag handles.
    """
    if isinstance(dtype, str):
        key = _ALIASES.get(dtype.lower(), dtype.lower())
        if key in DTYPES:
            return DTYPES[key]
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"not a dtype: {dtype!r}; expected one of {', '.join(DTYPES)}") from None
    if dt not in _NAMES:
        raise UsageError(f"unsupported dtype {dt}; expected one of {', '.join(DTYPES)}")
    return dt


def is_supported(dtype: DTypeLike) -> bool:
    """Whether `as_dtype` accepts `dtype`."""
    try:
        as_dtype(dtype)
    except UsageError:
        return False
    return True


def dtype_name(dtype: DTypeLike) -> str:
    """The canonical diag name of a dtype ("bfloat16", not "bf16" or "<V2")."""
    return _NAMES[as_dtype(dtype)]


_PRECISION_BITS: dict = {}


def precision_bits(dtype: DTypeLike) -> int:
    """Significand bits p including the implicit bit (float32: 24, bfloat16: 8, float16: 11);
    cached per dtype (the diverge shadow asks for it on every op)."""
    try:
        return _PRECISION_BITS[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    p = int(ml_dtypes.finfo(as_dtype(dtype)).nmant) + 1
    try:
        _PRECISION_BITS[dtype] = p
    except TypeError:
        pass
    return p


def unit_roundoff(dtype: DTypeLike) -> float:
    """Unit roundoff u = 2**-p of round-to-nearest (float32 2**-24, bf16 2**-8, fp16 2**-11)."""
    return 2.0 ** -precision_bits(dtype)


def gamma(k, dtype: DTypeLike):
    """Higham's gamma_k = k u / (1 - k u); inf where k u >= 1.

    gamma_k bounds the relative error of k successive roundings; a K-term dot product computed
    in any order has |error| <= gamma_K * sum_k |a_k b_k| (products rounded too).

    Args:
        k: a count (int or integer array).
        dtype: the dtype whose unit roundoff applies.

    Returns:
        A float (scalar k) or float64 array.
    """
    u = unit_roundoff(dtype)
    ku = np.asarray(k, dtype=np.float64) * u
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(ku < 1.0, ku / (1.0 - ku), np.inf)
    return float(g) if g.ndim == 0 else g


def bits_view(arr) -> np.ndarray:
    """The same bytes viewed as unsigned integers of the same width (bf16 -> uint16, ...).

    Used to ship arrays between processes and to compare values bit for bit (-0.0 != 0.0,
    NaN payloads kept).
    """
    arr = np.asarray(arr)
    return arr.view(_UINT[arr.dtype.itemsize])


def bits_digest(arr) -> str:
    """sha256 of an array's raw bits: equal digests mean bit-identical values (NaN payloads,
    -0 and all)."""
    import hashlib

    # The buffer itself, not a bytes copy of it (an output can be hundreds of MB).
    # (numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12.)
    view = memoryview(np.ascontiguousarray(bits_view(arr)))  # type: ignore[arg-type]
    return hashlib.sha256(view.cast("B")).hexdigest()


def from_bits(bits, dtype: DTypeLike) -> np.ndarray:
    """Inverse of `bits_view`: reinterpret unsigned integers as `dtype` (widths must match).

    Raises:
        UsageError: the bit array's width differs from the dtype's.
    """
    dt = as_dtype(dtype)
    bits = np.asarray(bits)
    if bits.dtype != np.dtype(_UINT[dt.itemsize]):
        raise UsageError(
            f"from_bits: {bits.dtype} bits cannot hold {dtype_name(dt)}; "
            f"expected {np.dtype(_UINT[dt.itemsize])}"
        )
    return bits.view(dt)


def _magnitude_and_sign(x: np.ndarray):
    bits = bits_view(x).astype(np.uint64)
    width = 8 * x.dtype.itemsize
    sign_mask = np.uint64(1) << np.uint64(width - 1)
    return bits & (sign_mask - np.uint64(1)), (bits & sign_mask) != 0


def ulp_distance(x, y) -> np.ndarray:
    """Number of representable values between x and y, elementwise, in their common dtype.

    Works on the ordered-integer view of the bits: +0 and -0 are the same point, neighbours are 1
    apart, the distance across zero adds both sides, +-inf sit one step beyond the largest
    finite value. Both NaN -> 0 (agree); exactly one NaN -> `NAN_ULP`.

    Args:
        x: array of float32, bfloat16, float16, float8_* or float64.
        y: array of the same dtype, broadcastable against x.

    Returns:
        int64 array (float64 distances saturate at NAN_ULP - 1).

    Raises:
        UsageError: the dtypes differ or are not supported.
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype:
        raise UsageError(
            f"ulp_distance: dtypes differ ({x.dtype} vs {y.dtype}); cast one side "
            "to the other's dtype first"
        )
    as_dtype(x.dtype)
    x, y = np.broadcast_arrays(x, y)
    shape = x.shape
    # 1-d views: numpy scalars (0-d inputs) would warn on the uint64 wrap-around that
    # np.where's unused branch computes, and cannot take item assignment.
    x, y = x.reshape(-1), y.reshape(-1)
    if x.dtype.itemsize <= 4:
        return _ulp_distance_narrow(x, y).reshape(shape)
    mx, sx = _magnitude_and_sign(x)
    my, sy = _magnitude_and_sign(y)
    same = sx == sy
    # Same sign: |mx - my|. Opposite signs: the path crosses zero, mx + my (< 2**64 in uint64).
    dist = np.where(same, np.where(mx > my, mx - my, my - mx), mx + my)
    dist = np.minimum(dist, np.uint64(NAN_ULP - 1)).astype(np.int64)
    with np.errstate(invalid="ignore"):
        xn, yn = np.isnan(x.astype(np.float64)), np.isnan(y.astype(np.float64))
    dist[xn & yn] = 0
    dist[xn ^ yn] = NAN_ULP
    return dist.reshape(shape)


_INT = {1: np.int8, 2: np.int16, 4: np.int32}


def _ordered(x: np.ndarray) -> np.ndarray:
    """The ordered-integer view of a float of at most 32 bits, in a signed integer of its
    width: the magnitude bits, negated for a negative sign, so +0 and -0 are both 0 and
    neighbours differ by 1. With s = bits >> (width - 1) (0, or -1 for a negative sign),
    (bits ^ (s & magnitude mask)) - s is -magnitude for a negative value and bits otherwise."""
    bits = x.view(_INT[x.dtype.itemsize])
    s = bits >> (8 * x.dtype.itemsize - 1)
    mask = np.array(np.iinfo(bits.dtype).max, bits.dtype)
    out = np.bitwise_and(s, mask)
    np.bitwise_xor(bits, out, out=out)
    np.subtract(out, s, out=out)
    return out


def ordered_distance(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|ordered x - ordered y| in int64 for 1-d arrays of a dtype of at most 32 bits: their
    `ulp_distance` where neither is NaN (a NaN is just a bit pattern here)."""
    dist = np.subtract(_ordered(x), _ordered(y), dtype=np.int64)
    np.abs(dist, out=dist)
    return dist


def _ulp_distance_narrow(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`ulp_distance` of 1-d arrays of a dtype of at most 32 bits, in int64 throughout.

    The same numbers as the uint64 path of float64 (|ordered x - ordered y| is |mx - my| for
    equal signs and mx + my across zero, below 2**33, so never saturated), in a third of its
    passes and without float64 copies: it is the inner loop of every comparison diag makes.
    """
    dist = ordered_distance(x, y)
    with np.errstate(invalid="ignore"):
        xn, yn = np.isnan(x), np.isnan(y)
    if xn.any() or yn.any():
        dist[xn & yn] = 0
        dist[xn ^ yn] = NAN_ULP
    return dist


def _round_to_odd_f32(x64: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: truncate, then set the last bit if inexact.

    Rounding to odd into p >= q + 2 bits and then to nearest into q bits equals one rounding to
    nearest into q bits (Boldo & Melquiond), also in the subnormal range of the q-bit format as
    long as float32 keeps >= 2 extra bits there (true for bf16, fp16, fp8).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        y = x64.astype(np.float32)  # round to nearest even
        back = y.astype(np.float64)
    inexact = (back != x64) & ~np.isnan(x64)
    yb = y.view(np.uint32)
    even = (yb & np.uint32(1)) == 0
    # RNE landed on an even neighbour: the odd neighbour on x's side is one step away in the
    # sign-magnitude bit order (towards larger magnitude if |x| > |y|). If RNE landed on an odd
    # value it already is the round-to-odd result. inf (even, from overflow) steps to max finite
    # (odd); 0 (from underflow) steps to the smallest subnormal with x's sign.
    fix = inexact & even
    if fix.any():
        step = np.where(np.abs(x64) > np.abs(back), np.uint32(1), np.uint32(0xFFFFFFFF))
        yb = yb.copy()
        yb[fix] += step[fix]
    return yb.view(np.float32)


def round_to_dtype(x, dtype: DTypeLike) -> np.ndarray:
    """Round float64 values ONCE, to nearest, ties to even, into `dtype`.

    IEEE semantics: gradual underflow, signed zeros kept, overflow -> inf (float8_e4m3fn has no
    inf: overflow -> NaN, as ml_dtypes does, but the exact tie +-464 rounds to +-448).

    Args:
        x: values; anything numpy converts exactly to float64 (float64, float32, ...).
        dtype: target dtype (float64, float32, bfloat16, float16, float8_e4m3fn, float8_e5m2).

    Returns:
        Array of `dtype` with x's shape.
    """
    dt = as_dtype(dtype)
    x64 = np.asarray(x).astype(np.float64)
    if dt == np.float64:
        return x64.copy()
    if dt == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            return x64.astype(np.float32)  # IEEE conversion: a single RNE rounding
    with np.errstate(over="ignore", invalid="ignore"):
        out = _round_to_odd_f32(x64).astype(dt)
    if dt == np.dtype(ml_dtypes.float8_e4m3fn):
        # ml_dtypes sends the tie 464 (between 448, even, and 480, not finite) to NaN.
        tie = np.abs(x64) == 464.0
        if tie.any():
            out[tie] = np.copysign(448.0, x64[tie]).astype(dt)
    return out


def fmt(value: Any, digits: int = 3, *, compact: bool = True) -> str:
    """The one way diag writes a number for a person: reasons, the terminal and the report.

    Args:
        value: an int, a float, one of the strings ``"nan"``/``"inf"``/``"-inf"`` that records
            use for non-finite floats (JSON has no such numbers), another string (shown as
            is), a bool or None.
        digits: significant digits of a float.
        compact: the report's cell form: integral floats below 1e6 as integers, exponents
            without padding (``1.5e-5``). False keeps Python's ``.{digits}g`` form (``1.5e-05``),
            which reasons and the terminal table have always shown.

    Returns:
        The text: "—" for a missing value, "NaN", "inf" and "-inf" for non-finite floats.
    """
    if value is None or (isinstance(value, str) and value == ""):
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value)).lower()
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if not compact:
        return f"{x:.{digits}g}"
    if x.is_integer() and abs(x) < 1e6:
        return str(int(x))
    text = f"{x:.{digits}g}"
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    return text
