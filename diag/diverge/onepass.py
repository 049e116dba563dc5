"""Every per-op figure of the shadow in one pass over the op's arrays (numba).

`diag.diverge.rules` states the figures as array expressions; numpy evaluates each one as a
pass of its own over float64 arrays the size of the op's output (the difference, its ULPs,
the floor, the bound, the ratio, then the carried error and the error that came in: about
twenty passes). A weight gradient of a 1024-wide layer is 1M elements, and those passes were
most of what the PyTorch shadow cost on a training step (about 15 ms per weight gradient,
against 0.9 ms for the product itself). numba compiles the same arithmetic into one loop that
reads y, r and s once. No other library of the field fuses a handful of reductions over
three arrays without a compiler toolchain at run time (XLA would, but JAX is optional for a
PyTorch user and costs a compilation per shape).

The figures are the same numbers, bit for bit: each element's bound is formed by the same
IEEE operations in the same order as in `rules.own_error_diff` (the ULP from the exponent
bits, `2 ulp + tiny`, `g |r| + floor`, a composite op's `+ g max|r|`, `err / bound`), and a
maximum does not depend on the order of its elements. What the loop does not cover (an
output, reference or shadow that is not finite, a NaN in sum|terms|, a float64 output, a
count of terms that differs per element) returns None and goes the numpy way (`rules`,
`chunked`), which gives the same figures for every input.

The first call of each signature compiles (about a second) and the compiled code is cached on
disk next to this module (numba's `cache=True`; a read-only install caches in the user's
cache folder).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from diag import numerics
from diag.diverge.rules import cheap_gamma, composite_gamma, facts_gamma
from diag.tolerance.diverge import DIVERGE_LIBRARY_ULP, DIVERGE_ROUNDED_ULP

#: The float64 exponent field; the bits of 1/x for a power of two x are _INV less those of x
#: (biased exponents 1023 + E and 1023 - E sum to 2046).
_EXP = 0x7FF0000000000000
_INV = 0x7FE0000000000000
#: Output dtypes the loop takes (significand bits): a float64 output's ULP is subnormal-safe
#: only in `rules.ulp_of`.
_NARROW = {np.dtype(np.float32): 24, np.dtype(np.float16): 11, numerics.as_dtype("bfloat16"): 8}
#: Bound multiplier of one ULP per class (`rules`: 2 ULP rounded/structural, 16 library).
_ULPS = {
    "rounded": float(DIVERGE_ROUNDED_ULP),
    "structural": float(DIVERGE_ROUNDED_ULP),
    "reduction": float(DIVERGE_ROUNDED_ULP),
    "library": float(DIVERGE_LIBRARY_ULP),
    "composite": float(DIVERGE_ROUNDED_ULP),
}


class Once:
    """`facts` evaluated at most once (it costs evaluations of the op): the one pass and,
    where it gives up, the numpy rules read the same sum|terms|."""

    def __init__(self, facts):
        self._facts, self._got = facts, None

    @property
    def computed_in(self):
        return getattr(self._facts, "computed_in", None)

    def __call__(self):
        if self._got is None:
            self._got = self._facts()
        return self._got


class Figures(NamedTuple):
    """One op output's figures (`rules.own_error_diff` and `carried_error_diff`'s inputs)."""

    own_diff: float  # max |y - r|
    ulps: float  # max |y - r| / ulp(r)
    ratio: float  # max |y - r| / bound
    carried_diff: float  # max |y - s|
    shadow_max: float  # max |s|
    came: float  # max |r - s|


@intrinsic
def _as_float(typingctx, bits):  # pragma: no cover - compiled
    """The float64 whose bits are the int64 `bits` (an ULP from its exponent field)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def _as_bits(typingctx, x):  # pragma: no cover - compiled
    """The int64 bits of the float64 `x`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def _loop(y, r, s, mag, use_mag, use_r, shift, tinybits, tiny, k, g, c):  # pragma: no cover
    """(max |y-r|, max |y-r|/ulp, max |y-r|/bound, max |y-s|, max |s|, max |r-s|, finite):
    bound = k ulp(r) + tiny, plus g |r| (`use_r`) or g mag (`use_mag`), plus `c` (a
    composite op's g max|r|; 0 adds nothing to a positive bound).

    ulp(r) = 2^(E - p + 1) for the exponent E of max(|r|, tiny) (`rules._ulp_finite`); 1/ulp
    is a power of two too, so e / ulp is e * (1/ulp), the same number. Every figure is a
    maximum of non-negative float64s, taken on their bits as int64 (the order of
    non-negative floats is that of their bits, and a NaN's lie above +inf's once its sign
    bit is cleared: x86 gives 0 * inf a negative NaN, so the ratio goes through abs), so the
    loop has no branch and no floating-point comparison: LLVM turns it into vector code
    (3.4x the scalar loop on 1M elements, 0.9 ms, at the speed of memory) with no fast-math
    licence, and each number is the IEEE one. `error_model="numpy"`: a division needs no
    zero check (a bound is at least `tiny`)."""
    n = y.size
    top = 0
    ulps = 0
    ratio = 0
    cmax = 0
    smax = 0
    came = 0
    for i in range(n):
        yi = np.float64(y[i])
        ri = r[i]
        si = s[i]
        e = abs(yi - ri)
        bits = _as_bits(ri) & _EXP
        bits = (bits if bits > tinybits else tinybits) - shift
        bound = k * _as_float(bits) + tiny
        if use_r:
            bound = g * abs(ri) + bound
        elif use_mag:
            bound = g * abs(np.float64(mag[i])) + bound
        bound = bound + c
        top = max(top, _as_bits(e))
        ulps = max(ulps, _as_bits(e * _as_float(_INV - bits)))
        ratio = max(ratio, _as_bits(abs(e / bound)))  # a NaN made here may carry a sign bit
        cmax = max(cmax, _as_bits(abs(yi - si)))
        smax = max(smax, _as_bits(abs(si)))
        came = max(came, _as_bits(abs(ri - si)))
    finite = top < _EXP and cmax < _EXP and smax < _EXP  # NaN and inf: all exponent bits
    return (
        _as_float(top),
        _as_float(ulps),
        _as_float(ratio),
        _as_float(cmax),
        _as_float(smax),
        _as_float(came),
        finite,
    )


_NONE = np.zeros(1, np.float32)
#: Elements of the evenly strided sample whose cheap ratio sends a reduction to sum|terms|
#: at once (`rules.own_error_diff`'s sample: a matrix product's nearly cancelling elements
#: are almost always beyond gamma_n |r|, and the whole pass against it would be wasted).
_SAMPLE = 2048


def op_figures(
    y: np.ndarray,
    r: np.ndarray,
    s: np.ndarray,
    dtype,
    cls: str,
    *,
    facts=None,
    terms: float = 1,
    longest: int = 1,
) -> Figures | None:
    """`figures` with a composite op's normwise constant (`_composite`) or a reduction's
    rule: the cheap bound gamma_n |r| first, sum|terms| from `facts` only where it does not
    clear the op (`rules.own_error_diff`; an evenly strided sample that already passes it
    sends the op to sum|terms| at once, as there). The figures do not depend on whether the
    sample did: a sample beyond the cheap bound means the whole output is."""
    if cls == "composite":
        return _composite(y, r, s, dtype, longest)
    if cls != "reduction":
        return figures(y, r, s, dtype, cls)
    g = cheap_gamma(terms, dtype)
    if not math.isfinite(g) or _format(dtype) is None or not (y.shape == r.shape == s.shape):
        return None
    # flattened (and widened where the loop needs it) once for the sample and both passes
    shape, y, r, s = y.shape, _flat(y), _flat(r, np.float64), _flat(s, np.float64)
    if facts is not None and y.size > 4 * _SAMPLE:
        step = y.size // _SAMPLE
        first = figures(y[::step], r[::step], s[::step], dtype, cls, g=g)
        if first is not None and first.ratio > 1.0:
            return _against_terms(y, r, s, shape, dtype, facts, terms, None)
    got = figures(y, r, s, dtype, cls, g=g)
    if got is None or got.ratio <= 1.0 or facts is None:
        return got
    return _against_terms(y, r, s, shape, dtype, facts, terms, got)


def _composite(y, r, s, dtype, longest: int) -> Figures | None:
    """A composite op's figures: the bound adds gamma_(m+4) max|r| to every element's
    (`rules.own_error_diff`, the same operations in the same order)."""
    g = composite_gamma(longest, dtype)
    if not math.isfinite(g) or not r.size:
        return None
    return figures(y, r, s, dtype, "composite", c=g * max(float(r.max()), -float(r.min())))


def _against_terms(y, r, s, shape, dtype, facts, terms, got: Figures | None) -> Figures | None:
    """The figures with the ratio against gamma_n sum|terms| (None: a count per element, or
    a sum|terms| not in the output's `shape`); `y`, `r`, `s` flat."""
    mag, cnt = facts()
    if np.shape(mag) != shape:
        return None
    if np.ndim(cnt) > 0:  # one count per element: the same everywhere (a matmul) or not
        cnt = np.asarray(cnt)
        if not cnt.size or cnt.min() != cnt.max():
            return None
        cnt = float(cnt.flat[0])
    g = facts_gamma(cnt, terms, dtype, facts)
    full = figures(y, r, s, dtype, "reduction", g=g, mag=_flat(mag))
    if full is None or got is None:
        return full
    return got._replace(ratio=full.ratio)


def figures(
    y: np.ndarray,
    r: np.ndarray,
    s: np.ndarray,
    dtype,
    cls: str,
    *,
    g: float = 0.0,
    mag: np.ndarray | None = None,
    c: float = 0.0,
) -> Figures | None:
    """The figures of one op output in one pass, or None where the numpy way must give them.

    Args:
        y, r, s: the output (its own dtype or float64), the float64 reference, the float64
            shadow; one shape.
        dtype: the output's dtype.
        cls: the op's class (`rules.op_class`).
        g: a reduction's gamma: the bound adds g |r| (the cheap bound), or g |mag| when
            `mag` (sum|terms|, one per element) is given.
        c: a composite op's g max|r|, added to every element's bound.
    """
    fmt = _format(dtype)
    k = _ULPS.get(cls)
    if fmt is None or k is None or y.size == 0 or not (y.shape == r.shape == s.shape):
        return None
    if mag is not None and np.shape(mag) != y.shape:
        return None
    shift, tinybits, tiny = fmt
    yf, rf, sf = _flat(y), _flat(r, np.float64), _flat(s, np.float64)
    use_r = cls == "reduction" and mag is None
    mf = _NONE if mag is None else _flat(mag)
    got = _loop(yf, rf, sf, mf, mag is not None, use_r, shift, tinybits, tiny, k, float(g), c)
    if not got[6] or not math.isfinite(got[1]) or not math.isfinite(got[2]):
        return None
    return Figures(*(float(x) for x in got[:6]))


_FORMATS: dict = {}


def _format(dtype) -> tuple[int, int, float] | None:
    """(the exponent shift from |r| to its ULP, the bits and value of the smallest normal)
    of an output dtype the loop takes, cached per dtype; None for the others."""
    got = _FORMATS.get(dtype, False)
    if got is False:
        try:
            p = _NARROW.get(np.dtype(dtype))
        except TypeError:
            p = None
        got = None
        if p is not None:
            tiny = float(ml_dtypes.finfo(numerics.as_dtype(dtype)).smallest_normal)
            got = ((p - 1) << 52, int(np.float64(tiny).view(np.int64)), tiny)
        _FORMATS[dtype] = got
    return got


def _flat(x: np.ndarray, want=None) -> np.ndarray:
    """`x` as a flat C-ordered array the loop takes: float16 and bfloat16 as float32 (exact),
    float32 and float64 as they are."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if want is not None and x.dtype != want:
        x = x.astype(want)
    elif x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    return np.ascontiguousarray(x).reshape(-1)
