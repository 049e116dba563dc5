"""The correctly rounded value of an elementwise function at every input, and its proof.

"Correct" is the exact value f(x), rounded once to the dtype: to nearest, ties to even,
gradual underflow, +-Inf from max + half an ulp on. Each element is decided one of two ways.

**Fast path, with a proof per element.** The float64 formula of the function's row
(`diag.accuracy.functions`) gives `a` with |a - f(x)| <= EPS |f(x)| + ETA, where EPS = 2^-36
and ETA = 2^-1000. The formulas use the platform libm for transcendental functions (glibc
documents <= 3 ulp, 2^-51, for each used here) and IEEE +-*/ and sqrt; their worst
amplification, written beside each formula, keeps them below 2^-40: the bound holds with a
factor of 16 to spare. ETA covers float64's own underflow (a result below 2^-1000 is far
below half the smallest subnormal of every dtype here, 2^-150). So f(x) lies in
[a - r, a + r] with r = 2 (EPS |a| + ETA) (the 2 pays for |f(x)| vs |a| and for the rounding
of a +- r itself). Rounding is monotone: when a - r and a + r round to the same value of the
dtype, every point between them does, f(x) included, and that value is the truth. When both
ends also lie in one binade (or both below the smallest normal), the ulp of f(x) is known too.
A float64 overflow (a = +-Inf) means |f(x)| > 2^1023: the truth is +-Inf. A zero's sign is
the formula's, which IEEE arithmetic carries (sin(-0) = -0; silu(-1000) = -1000 * +0 = -0).

**mpmath for the rest** (Ziv's strategy): an element whose interval straddles a rounding
boundary, or whose formula gave NaN, is evaluated with mpmath at 128 bits, its rounding
decided with an error allowance of 2^-112 relative; undecided, at 256 bits, and so on. An
exact tie would never be decided: none exists for these functions at binary inputs
(transcendental values at non-zero algebraic points; 1/x and sqrt(x) are never a midpoint of
fewer bits than x), and the loop stops with an error past 2048 bits rather than guess.

**Checked on every machine.** The premise of the fast path is the libm's documented
accuracy; a seeded sample of the decided elements of every table is recomputed with mpmath
(`VERIFY`) and any disagreement stops the computation (`TruthError`), so a libm that breaks
it cannot pass silently.

Tables are cached in diag's ground-truth folder (`diag.oracle.cache.GroundTruthCache`),
keyed by the function, the dtype, the input bits and the source of this package's arithmetic.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from diag.accuracy.functions import ElementwiseFunction
from diag.errors import DiagError
from diag.numerics import as_dtype, bits_digest, dtype_name, round_to_dtype
from diag.oracle.cache import GroundTruthCache, source_digest

__all__ = [
    "EPS",
    "ETA",
    "FORMATS",
    "Truth",
    "TruthError",
    "exact_ulp",
    "round_mpf",
    "truth",
    "ulp_of",
]

EPS = 2.0**-36
ETA = 2.0**-1000
#: Decided elements recomputed with mpmath per table, to check the fast path's premise.
VERIFY = 48
#: dtype -> (precision p, smallest normal exponent emin, largest exponent emax).
FORMATS = {"bfloat16": (8, -126, 127), "float16": (11, -14, 15), "float32": (24, -126, 127)}
_MAX_PREC = 2048
_ULP_PREC = 512


class TruthError(DiagError):
    """The ground truth could not be established (a premise of its proof failed)."""

    exit_code = 70


@dataclass(frozen=True)
class Truth:
    """A function's truth at each input.

    Attributes:
      rounded: f(x) rounded once to the dtype (as float64: every value of the dtype is one).
      exact: f(x) to float64 precision (to measure errors at the exact value).
      ulp: ulp(f(x)) in the dtype: 2^(max(e, emin) - p + 1) for |f(x)| in [2^e, 2^(e+1)).
      fallbacks: how many elements the fast path left to mpmath.
      ambiguous: where f(x) lies so close to a power of two 2^k that its binade (so its ulp)
        is not decided yet; `ulp` is then 2^k's. Only an output other than the rounded value
        needs it: `exact_ulp` settles it for those.
    """

    rounded: np.ndarray
    exact: np.ndarray
    ulp: np.ndarray
    fallbacks: int
    ambiguous: np.ndarray


def ulp_of(v: np.ndarray, dtype: str) -> np.ndarray:
    """ulp(v) in `dtype` for float64 values v, by v's binade (subnormal range: the fixed one)."""
    p, emin, _ = FORMATS[dtype]
    return np.ldexp(1.0, (_binade(v, emin) - p + 1).astype(np.int32))


def _binade(v: np.ndarray, emin: int) -> np.ndarray:
    """max(e, emin) for |v| in [2^e, 2^(e+1)); emin for 0."""
    _, k = np.frexp(np.abs(v))  # |v| = m 2^k, m in [0.5, 1): e = k - 1
    return np.where(v == 0, emin, np.maximum(k.astype(np.int64) - 1, emin))


def _mpf_binade(v, emin: int) -> int:
    """max(e, emin) for an mpmath value: e from its exact mantissa and exponent."""
    _, man, exp, bc = v._mpf_
    return max(exp + bc - 1, emin) if man else emin


def fast(fn: ElementwiseFunction, x: np.ndarray, dtype: str) -> tuple[Truth, np.ndarray]:
    """The fast path over float64 inputs: the truth and a mask of the elements it decided."""
    _, emin, _ = FORMATS[dtype]
    with np.errstate(all="ignore"):
        a = fn.approx(x)
        r = 2.0 * (EPS * np.abs(a) + ETA)
        lo, hi = a - r, a + r
        t_lo, t_hi = (round_to_dtype(v, dtype).astype(np.float64) for v in (lo, hi))
        rounded = round_to_dtype(a, dtype).astype(np.float64)
    overflow = np.isinf(a)
    decided = ((t_lo == t_hi) & np.isfinite(a)) | overflow
    ambiguous = (_binade(lo, emin) != _binade(hi, emin)) & ~overflow
    return Truth(rounded, a, ulp_of(a, dtype), 0, ambiguous), decided


def round_mpf(v, dtype: str) -> float:
    """An mpmath value rounded once to `dtype`, to nearest, ties to even, as a Python float.

    Exact integer arithmetic on v's binary mantissa and exponent: IEEE's rounding with an
    unbounded exponent, then +-Inf past the largest finite value (so from max + half an ulp,
    whose tie goes to the even 2^(emax+1)); below 2^emin the ulp stays 2^(emin - p + 1).
    """
    p, emin, emax = FORMATS[dtype]
    sign, man, exp, bc = v._mpf_
    if not man:
        return 0.0
    e = exp + bc - 1
    if e > emax + 1:
        return -math.inf if sign else math.inf
    if e < emin - p - 1:  # below a quarter of the smallest subnormal: rounds to zero
        return -0.0 if sign else 0.0
    q = max(e, emin) - p + 1
    if exp >= q:
        n = man << (exp - q)
    else:
        shift = q - exp
        n, rem = man >> shift, man & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and n & 1):
            n += 1
    if n and n.bit_length() + q > emax + 1:
        return -math.inf if sign else math.inf
    value = math.ldexp(n, q)
    return -value if sign else value


def _mp_value(fn: ElementwiseFunction, x: float, dtype: str, prec: int):
    """f(x) at `prec` bits and an interval [lo, hi] around it that holds the exact value."""
    import mpmath

    ctx = mpmath.mp.clone()
    ctx.prec = prec
    v = fn.exact(ctx, ctx.mpf(x))
    ctx.prec = prec + 64
    slack = abs(v) * ctx.ldexp(1, 16 - prec)
    return v, v - slack, v + slack


def exact_element(fn: ElementwiseFunction, x: float, dtype: str) -> tuple[float, float, float]:
    """(rounded, float64 value, ulp) of f(x) with mpmath, precision raised until the rounding
    is decided; the ulp is of the rounded value's binade when f(x) is within 2^-112 of it."""
    p, emin, _ = FORMATS[dtype]
    prec = 128
    while prec <= _MAX_PREC:
        v, lo, hi = _mp_value(fn, x, dtype, prec)
        t_lo, t_hi = round_mpf(lo, dtype), round_mpf(hi, dtype)
        if t_lo == t_hi:
            value = float(v)
            rounded = math.copysign(t_lo, value) if t_lo == 0 else t_lo
            return rounded, value, math.ldexp(1.0, _mpf_binade(hi, emin) - p + 1)
        prec *= 2
    raise TruthError(
        f"{fn.name}({x!r}) in {dtype}: not decided at {_MAX_PREC} bits; an exact tie would "
        "be a bug in the function's row; report it"
    )


def exact_ulp(fn: ElementwiseFunction, x: float, dtype: str, rounded: float) -> float:
    """ulp(f(x)) where f(x) is within 2^-34 of a power of two 2^k: the binade decided with
    mpmath at up to `_ULP_PREC` bits; closer than that, from the side the function's row says
    f approaches 2^k from (`ElementwiseFunction.approach`)."""
    import mpmath

    p, emin, _ = FORMATS[dtype]
    prec = 128
    while prec <= _ULP_PREC:
        _, lo, hi = _mp_value(fn, x, dtype, prec)
        if _mpf_binade(lo, emin) == _mpf_binade(hi, emin):
            return math.ldexp(1.0, _mpf_binade(lo, emin) - p + 1)
        prec *= 2
    e = _mpf_binade(mpmath.mpf(rounded), emin)
    # f(0) = 2^k (exp, cos, sigmoid) is the power itself, as are algebraic values (approach 0)
    below = fn.approach < 0 and e > emin and x != 0
    return math.ldexp(1.0, e - int(below) - p + 1)


def _verify(fn: ElementwiseFunction, x: np.ndarray, t: Truth, decided: np.ndarray, dtype: str):
    """Recompute `VERIFY` seeded decided elements with mpmath; raise if one disagrees."""
    idx = np.flatnonzero(decided & np.isfinite(t.exact))
    if not idx.size:
        return
    seed = int.from_bytes(hashlib.sha256(f"{fn.name}/{dtype}".encode()).digest()[:4], "little")
    pick = np.random.default_rng(seed).choice(idx, size=min(VERIFY, idx.size), replace=False)
    for i in pick:
        rounded, _, _ = exact_element(fn, float(x[i]), dtype)
        if rounded != t.rounded[i]:
            raise TruthError(
                f"{fn.name}({float(x[i])!r}) in {dtype}: the float64 path gave "
                f"{t.rounded[i]!r}, mpmath {rounded!r}: this machine's libm is less accurate "
                "than the proof assumes; report it with `diag env`"
            )


def compute(fn: ElementwiseFunction, x: np.ndarray, dtype: str, verify: bool = True) -> Truth:
    """The truth at float64 inputs `x` (every one a value of `dtype`), uncached."""
    t, decided = fast(fn, x, dtype)
    if verify:
        _verify(fn, x, t, decided, dtype)
    rest = np.flatnonzero(~decided)
    rounded, exact, ulp = t.rounded.copy(), t.exact.copy(), t.ulp.copy()
    ambiguous = t.ambiguous.copy()
    for i in rest:
        rounded[i], exact[i], ulp[i] = exact_element(fn, float(x[i]), dtype)
        ambiguous[i] = False
    return Truth(rounded, exact, ulp, int(rest.size), ambiguous)


def _key(fn: ElementwiseFunction, x: np.ndarray, dtype: str) -> str:
    import mpmath

    from diag.accuracy import functions

    digest = bits_digest(np.ascontiguousarray(x))
    parts = {
        "function": fn.name,
        "dtype": dtype,
        "inputs": digest,
        "n": int(x.size),
        "source": source_digest(functions, compute),
        "mpmath": mpmath.__version__,
    }
    return GroundTruthCache.derived_key("accuracy", parts)


def truth(
    fn: ElementwiseFunction, x: np.ndarray, dtype: str, cache: GroundTruthCache | None = None
) -> Truth:
    """The truth of `fn` at inputs `x` of `dtype`, from the cache when there.

    Args:
      fn: the function's row.
      x: the inputs (values of `dtype`, any float array that holds them).
      dtype: bfloat16, float16 or float32.
      cache: the ground-truth cache (default: diag's folder, `DIAG_CACHE_DIR`).

    Returns:
      The `Truth`; a cache that cannot be written only costs the next run the time again.
    """
    x64 = np.asarray(x).astype(np.float64)
    cache = cache if cache is not None else GroundTruthCache()
    key = _key(fn, x64, dtype_name(as_dtype(dtype)))
    hit = cache.get(key)
    if hit is not None and hit.value.shape == (4, x64.size):
        rounded, exact, ulp, ambiguous = hit.value
        return Truth(rounded, exact, ulp, int(hit.meta.get("fallbacks", 0)), ambiguous != 0)
    t = compute(fn, x64, dtype)
    table = np.stack([t.rounded, t.exact, t.ulp, t.ambiguous.astype(np.float64)])
    cache.put(key, table, {"fallbacks": t.fallbacks})
    return t
