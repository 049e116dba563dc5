"""The rules `diag.diverge` judges by: each op's own error bound, the carried-error threshold.

The numbers (ULP allowances, thresholds) live in `diag.tolerance` (its diverge section); this
module applies them.

Both frameworks' evaluators hand this module three float64 arrays per op output: what the op
returned in its own dtype (`y`), the float64 evaluation of the same op on the same (already
rounded) inputs (`r`), and the float64 shadow carried from the function's inputs (`s`). Only
numpy here: the figures are the same whichever framework computed them.

Own error, per element: |y - r| against a bound B that depends on the op's class:

* ``rounded`` (add, mul, div, sqrt, casts, ...): IEEE 754 asks for the correctly rounded result,
  0.5 ULP. diag allows `DIVERGE_ROUNDED_ULP` = 2 ULP of the output dtype: XLA rewrites a
  division by a broadcast value as a multiplication by its reciprocal (two roundings, up to 1.5
  ULP; 1.41
  measured on XLA CPU), and a bf16/fp16 op computed in float32 and rounded once more can land
  one neighbour away (double rounding).
* ``library`` (exp, log, tanh, erf, GELU, ...): no library documents a ULP bound; diag allows
  `DIVERGE_LIBRARY_ULP` (16) ULPs, four times the exp allowance of its softmax bound
  (`diag.tolerance.SOFTMAX_EXP_ULP`), after measuring XLA's float32 erf at 4.9 ULP.

Every class also allows an absolute error of the dtype's smallest normal number: XLA's CPU and
GPU backends flush subnormal inputs and outputs to zero (FTZ/DAZ), an error below every normal
value that is not a loss of precision of the op.
* ``reduction`` (sums, dot products, matmuls, convolutions): Higham's gamma_n * sum|terms| in
  the output dtype (any summation order), plus the final rounding. The sum of magnitudes is
  the same op evaluated in float64 on |inputs|, and n per element is the op on ones (a sum of
  n ones is n), so one rule covers every reduction without knowing its layout. Both cost an
  evaluation of the op, so they are computed only for an op that the cheaper bound
  gamma_n * |result| (n from the shapes) does not already clear.
* ``structural`` (reshape, slice, gather, concatenate, max, ...): moves or selects values; it
  adds no error (bound 1 ULP, to be safe) and cannot be where a divergence starts.
* ``composite`` (anything else: a fused softmax or layer norm): no per-element textbook bound is
  known to diag; it allows gamma_m * max|r| + 1 ULP, normwise, with m the longest input axis
  plus 4 (the longest reduction the op could do plus the elementwise steps around it).

The own-error ratio is max |y - r| / B: above 1 the op computed with less precision than its
dtype claims (a bf16 accumulator where float32 was claimed, a fast-math approximation).

Carried error: the normwise relative error of the value against its float64 shadow,
``max|y - s| / max|s|``. The normwise form is the textbook one for tensors (Higham, ch. 6): an
element that is nearly zero in a centred tensor (x - mean) does not make the whole tensor
"wrong". The threshold is `diag.tolerance.diverge.diverge_carried_threshold`: sqrt(u) of the
value's dtype (float32 2.4e-4,
float16 2.2e-2, bfloat16 6.25e-2): the value has lost half of its significand bits. A
well-conditioned chain of k correctly rounded ops carries at most about k*u (worst case; the
usual random-walk growth is sqrt(k)*u), so the threshold allows u^(-1/2) such ops from the
inputs on in the worst case (4096 in float32, 16 in bfloat16, 45 in float16) and their square
in the usual case; only an ill-conditioned step (cancellation, overflow, a lost small addend) or
a long chain of lost bits crosses it. (A benign cancellation such as Adam's bias correction
1 - 0.999^t, which loses 9 bits in float32 at step 1, stays below it.)

Two implementations compared tap by tap (`diag.tolerance.diverge.diverge_tap_allowance`) may differ
by u^(2/3) (float32
1.5e-5): each is within about k*u of the truth, so the two within 2k*u, which allows
u^(-1/3)/2 worst-case ops between them (128 in float32); a port of the same math agrees far
more closely (3.5e-7 measured on examples/diverge_port.py), a different formula (GELU's tanh
approximation: 1.8e-4) does not. An output that is non-finite where its shadow is finite carries an
infinite error (fp16 exp overflowing to inf).

`first` is the earliest op whose own error exceeds its bound, or whose output carries an error
past the threshold while none of its float inputs did (the op where the value left the true
result; structural ops only pass errors on and are never it). A composite op's own error is
shown but never decides: its bound is a guess, and a fused kernel that cancels internally (a
layer norm's backward) is better judged by what it did to the carried error.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from diag import numerics
from diag.tolerance.diverge import (
    DIVERGE_COMPOSITE_EXTRA_STEPS,
    DIVERGE_LIBRARY_ULP,
    DIVERGE_ROUNDED_ULP,
)

# Op classes by primitive name: JAX jaxpr primitives and aten op names (without the overload).
_ROUNDED = """
add sub mul div neg abs sqrt sign floor ceil round convert_element_type square add_any
nextafter rem clamp copysign sub_ rsub add_ mul_ div_ _to_copy to copy_ addcmul addcdiv lerp
reciprocal fill_ where fmod remainder trunc
"""
_LIBRARY = """
exp exp2 expm1 log log1p tanh logistic erf erfc erf_inv sin cos tan asin acos atan atan2 sinh
cosh asinh acosh atanh pow rsqrt cbrt integer_pow lgamma digamma igamma igammac sigmoid gelu
gelu_backward silu silu_backward softplus softplus_backward tanh_backward sigmoid_backward
erfinv elu elu_backward mish mish_backward log_sigmoid_forward log_sigmoid_backward
"""
_REDUCTION = """
reduce_sum dot_general cumsum cumlogsumexp conv_general_dilated sum mean mm bmm addmm matmul
mv dot addmv baddbmm addbmm convolution convolution_backward cumsum_ linear
"""
_STRUCTURAL = """
reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice dynamic_update_slice
gather scatter scatter-add scatter_add concatenate pad rev copy copy_p select_n reduce_max
reduce_min max min argmax argmin sort iota stop_gradient reduce_precision cond while scan pjit
clone contiguous cat stack index index_select select slice_scatter select_scatter
slice_backward select_backward index_put index_put_ expand permute view t unsqueeze
maximum minimum amax amin zeros_like ones_like zeros ones full fill new_zeros new_ones
new_empty empty empty_like scalar_tensor lift_fresh detach alias masked_fill constant_pad_nd
_unsafe_view unbind split split_with_sizes narrow flip roll repeat tile expand_copy
masked_fill_ zero_ relu threshold_backward eq ne gt lt ge le isnan isfinite logical_not
"""

CLASSES: dict[str, str] = {}
for _cls, _names in (
    ("rounded", _ROUNDED),
    ("library", _LIBRARY),
    ("reduction", _REDUCTION),
    ("structural", _STRUCTURAL),
):
    for _n in _names.split():
        CLASSES[_n] = _cls


def op_class(name: str) -> str:
    """`rounded`, `library`, `reduction`, `structural` or `composite` for a primitive name."""
    return CLASSES.get(name, "composite")


def _smallest_normal(dtype) -> float:
    return _format(dtype)[1]


def ulp_of(x: np.ndarray, dtype) -> np.ndarray:
    """Size of one ULP of `dtype` at float64 values `x` (subnormal spacing below the normals)."""
    p, tiny, big = _format(dtype)
    ax = np.abs(x)
    ax = np.where(np.isfinite(ax), np.maximum(ax, tiny), big)
    # frexp: ax = m 2^e with m in [0.5, 1), so one ULP is 2^(e - p)
    return np.ldexp(1.0, np.frexp(ax)[1] - p)


_FORMATS: dict = {}


def _format(dtype) -> tuple[int, float, float]:
    """(significand bits, smallest normal, largest finite) of `dtype`, cached per dtype."""
    got = _FORMATS.get(dtype)
    if got is None:
        import ml_dtypes

        fi = ml_dtypes.finfo(numerics.as_dtype(dtype))
        got = _FORMATS[dtype] = (
            numerics.precision_bits(dtype),
            float(fi.smallest_normal),
            float(fi.max),
        )
    return got


def absdiff(y: np.ndarray, r: np.ndarray) -> np.ndarray:
    """|y - r|, 0 where both are the same infinity or both NaN, inf where only one is finite."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(y - r)
    if np.isfinite(d).all():
        return d
    same = (y == r) | (np.isnan(y) & np.isnan(r))
    d = np.where(same, 0.0, d)
    return np.where(np.isnan(d), np.inf, d)


def own_error(
    y: np.ndarray, r: np.ndarray, dtype, cls: str, *, facts=None, terms: float = 1, longest: int = 1
) -> tuple[float, float]:
    """(max error in ULPs of `dtype`, ratio of the error to the op's own bound): `own_error_diff`
    without the difference."""
    ulps, ratio, _ = own_error_diff(y, r, dtype, cls, facts=facts, terms=terms, longest=longest)
    return ulps, ratio


def own_error_diff(
    y: np.ndarray,
    r: np.ndarray,
    dtype,
    cls: str,
    *,
    facts=None,
    terms: float = 1,
    longest: int = 1,
    beyond: bool = False,
) -> tuple[float, float, float | None]:
    """(max error in ULPs of `dtype`, ratio of the error to the op's own bound, max |y - r|
    when it is finite, else None: what `max_absdiff(y, r)` gives, without another pass).

    It runs once per op output (or part of one), so the common case (every difference
    finite) takes a few passes into reused scratch buffers; anything non-finite goes through
    `_own_error_exact`, which gives the same figures for every input.

    Args:
        y: the op's output, as float64 (or a float dtype that widens to float64 exactly).
        r: the op evaluated in float64 on the same inputs.
        dtype: the output's dtype.
        cls: the op's class (`op_class`).
        facts: for reductions, a callable returning (the op in float64 on |inputs|, the op on
            ones): sum|terms| and the terms per element; called only when the cheap bound
            below does not already clear the op (it costs evaluations of the op). One whose
            `computed_in` is a narrower dtype summed in it: the bound is shrunk by its
            gamma_{n+2}, the largest relative error such a sum of non-negative terms has.
        terms: for reductions, a first count of terms (the longest input axis or the input to
            output size ratio, whichever is larger).
        longest: for composite ops, the longest axis of any input.
        beyond: the cheap bound is passed somewhere in the whole output, of which this is a
            part (`diag.diverge.chunked`): a reduction's ratio is the one against sum|terms|.
    """
    if y.size == 0:
        return 0.0, 0.0, 0.0
    exact = (y, r, dtype, cls), {"facts": facts, "terms": terms, "longest": longest}
    buf = _scratch(np.shape(y), 4)  # err, |r|, scratch, ulp
    err = buf[0]
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(y, r, out=err, dtype=np.float64)
    np.abs(err, out=err)
    top = float(err.max())  # NaN or inf if any difference is: then y or r is not finite
    if not math.isfinite(top):
        return (*_own_error_exact(*exact[0], **exact[1]), None)
    if top == 0.0:
        return 0.0, 0.0, 0.0
    # Here y and r are finite, so every bound below is positive and err / bound needs no
    # guard for 0 / 0 (a scaling coefficient that is inf goes the exact way).
    tmp = buf[2]
    r_ulp = _ulp_finite(r, dtype, out=buf[3])
    ulps = float(np.divide(err, r_ulp, out=tmp).max())
    floor = np.multiply(r_ulp, DIVERGE_ROUNDED_ULP, out=r_ulp)  # r_ulp is not needed after
    if cls == "reduction":
        floor += _smallest_normal(dtype)
        g = cheap_gamma(terms, dtype)
        if not math.isfinite(g):
            return (*_own_error_exact(*exact[0], **exact[1]), top)
        # |r| <= sum|terms|: gamma_n |r| is a lower bound of the textbook bound
        # (`_own_error_exact`); only an op beyond it pays for sum|terms|.
        if facts is not None and (beyond or _beyond_in_sample(err, r, g, floor)):
            return ulps, _facts_ratio(err, facts, terms, dtype, floor, tmp), top
        ratio = _max_ratio(err, _scaled(np.abs(r, out=buf[1]), g, floor, tmp))
        if ratio <= 1.0 or facts is None:
            return ulps, ratio, top
        return ulps, _facts_ratio(err, facts, terms, dtype, floor, tmp), top
    if cls == "library":
        bound = np.multiply(floor, DIVERGE_LIBRARY_ULP / DIVERGE_ROUNDED_ULP, out=floor)
        bound += _smallest_normal(dtype)  # LIBRARY_ULP * r_ulp + tiny
    elif cls == "composite":
        floor += _smallest_normal(dtype)
        g = composite_gamma(longest, dtype)
        if not math.isfinite(g):
            return (*_own_error_exact(*exact[0], **exact[1]), top)
        floor += g * max(float(r.max()), -float(r.min()))  # max |r|
        bound = floor
    else:
        floor += _smallest_normal(dtype)
        bound = floor
    return ulps, _max_ratio(err, bound), top


_POOL = threading.local()
#: Scratch buffers above this many elements are not kept between ops.
_POOL_MAX = 1 << 20


def _scratch(shape: tuple, k: int) -> list[np.ndarray]:
    """k float64 scratch arrays of `shape`, reused from op to op.

    A fresh array per pass would cost more than the pass: several live temporaries of a few
    hundred KiB each make glibc's malloc return the memory to the system when they are freed
    and fault it in again on the next op (measured: 425 us for three 512 KiB arrays, 13 us
    for the pass itself). One set per thread, kept only up to `_POOL_MAX` elements.
    """
    n = math.prod(shape)
    if n > _POOL_MAX:
        return [np.empty(shape) for _ in range(k)]
    have = getattr(_POOL, "bufs", None)
    if have is None or have[0].size < n or len(have) < k:
        have = _POOL.bufs = [np.empty(max(n, 1024)) for _ in range(k)]
    return [b[:n].reshape(shape) for b in have[:k]]


def release_scratch() -> None:
    """Drop this thread's scratch buffers (a shadow run is over)."""
    _POOL.bufs = None


def _gamma1(k: float, dtype) -> float:
    """`numerics.gamma` of one count, in Python floats (the same IEEE double operations)."""
    ku = float(k) * 2.0 ** -_format(dtype)[0]
    return ku / (1.0 - ku) if ku < 1.0 else math.inf


def _scaled(mag: np.ndarray, g: float, floor: np.ndarray, out: np.ndarray) -> np.ndarray:
    """g * mag + floor with the roundings of the exact path, into `out`."""
    np.multiply(mag, g, out=out)
    out += floor
    return out


#: Elements of a reduction's output that `_beyond_in_sample` looks at.
_SAMPLE = 2048


def _beyond_in_sample(err: np.ndarray, r: np.ndarray, g: float, floor: np.ndarray) -> bool:
    """Whether some element of an evenly strided sample is beyond the cheap bound g |r| +
    floor, computed with the same roundings as the full pass: then the op's ratio is the one
    against sum|terms| and the full pass over the cheap bound would be wasted (a matmul's
    elements that nearly cancel are almost always beyond it). False says nothing."""
    if err.size <= 4 * _SAMPLE or not r.flags.c_contiguous:
        return False
    step = err.size // _SAMPLE
    e, m, f = (np.ravel(a)[::step] for a in (err, r, floor))
    bound = np.multiply(np.abs(m), g)
    bound += f
    return float(np.divide(e, bound, out=bound).max()) > 1.0


def _max_ratio(err: np.ndarray, bound: np.ndarray) -> float:
    """max(err / bound) for a positive bound (overwritten): what `_ratio` gives when no
    0 / 0 or 0 / NaN can occur."""
    np.divide(err, bound, out=bound)
    return float(bound.max())


def _facts_ratio(
    err: np.ndarray, facts, terms: float, dtype, floor: np.ndarray, out: np.ndarray | None = None
) -> float:
    """A reduction's ratio against gamma_n * sum|terms| (`facts`), n per element or one n."""
    mag, cnt = facts()
    g = facts_gamma(cnt, terms, dtype, facts)
    if out is not None and isinstance(g, float) and math.isfinite(g):
        # r is finite here, so mag = sum|terms| is finite or +inf: the bound is positive
        ratio = _max_ratio(err, _scaled(np.abs(mag, out=out), g, floor, out))
        if not math.isnan(ratio):  # a NaN in mag: only `_ratio` says what it means
            return ratio
    return _ratio(err, g * np.abs(mag) + floor)


def cheap_gamma(terms: float, dtype) -> float:
    """A reduction's gamma_n for the cheap bound gamma_n |r|, n the first count of terms."""
    return _gamma1(max(terms, 1.0), dtype)


def composite_gamma(longest: int, dtype) -> float:
    """A composite op's gamma_(m+4): m the longest input axis (the longest reduction the op
    could do), four more roundings for what it does around it."""
    return _gamma1(longest + DIVERGE_COMPOSITE_EXTRA_STEPS, dtype)


def facts_gamma(cnt, terms: float, dtype, facts) -> Any:
    """A reduction's gamma_n against sum|terms| (one float, or one per element when `cnt`
    is an array). A sum|terms| that `facts` computed in a narrower dtype (`computed_in`)
    is short of the exact one by gamma_{n+2} of that dtype at most (a sum of non-negative
    terms): the gamma is shrunk by that factor, so the ratio is never understated."""
    low = getattr(facts, "computed_in", None)
    if np.ndim(cnt) == 0:  # one count: Python floats, the same IEEE operations, cached
        key = (float(cnt), float(terms), dtype, low)
        got = _FACTS_GAMMA.get(key)
        if got is None:
            n1 = max(float(cnt), float(terms), 1.0)
            got = _gamma1(n1, dtype)
            if low is not None and low != np.float64:
                got = got / (1.0 + _gamma1(n1 + 2.0, low))
            if len(_FACTS_GAMMA) > 4096:
                _FACTS_GAMMA.clear()
            _FACTS_GAMMA[key] = got
        return got
    n = np.maximum(np.maximum(np.asarray(cnt, dtype=np.float64), terms), 1.0)
    g = numerics.gamma(n, dtype)
    if low is not None and low != np.float64:
        g = g / (1.0 + numerics.gamma(np.max(n) + 2.0, low))
    return g


#: `facts_gamma` of one count, per (count, terms, dtype, dtype sum|terms| was computed in):
#: a layer's products repeat every step with the same shapes.
_FACTS_GAMMA: dict = {}


def _ulp_finite(x: np.ndarray, dtype, out: np.ndarray) -> np.ndarray:
    """`ulp_of` for finite float64 `x`, from its exponent bits (frexp and ldexp cost ten
    times more). One ULP of a = max(|x|, tiny) = m 2^e (m in [0.5, 1)) is 2^(e - p): the
    float64 with the biased exponent of a less p - 1 and a zero significand. The exponent
    field of a is the larger of those of |x| and tiny (a power of two), read as integers
    without the sign; the result is a normal float64 whenever the dtype's smallest normal is
    at least 2^(p - 1022) (every dtype but float64 itself)."""
    p, tiny, _ = _format(dtype)
    if tiny < 2.0 ** (p - 1022) or x.dtype != np.float64:
        out[...] = ulp_of(x, dtype)
        return out
    bits = out.view(np.int64)
    np.bitwise_and(x.view(np.int64), 0x7FF0000000000000, out=bits)
    np.maximum(bits, np.float64(tiny).view(np.int64), out=bits)
    bits -= (p - 1) << 52
    return out


def _own_error_exact(
    y: np.ndarray, r: np.ndarray, dtype, cls: str, *, facts=None, terms: float = 1, longest: int = 1
) -> tuple[float, float]:
    """`own_error` step by step, for any input (infinities and NaNs included)."""
    r_ulp = ulp_of(r, dtype)
    err = absdiff(y, r)
    if np.isinf(y).any():
        # The float64 reference rounded to the dtype is what a correctly rounded op returns:
        # an overflow to inf there is the correct answer (the carried error says what it cost).
        with np.errstate(over="ignore", invalid="ignore"):
            rr = numerics.round_to_dtype(r, dtype).astype(np.float64)
        err = np.where(np.isinf(rr) & (rr == y), 0.0, err)
    ulps = float(np.max(err / r_ulp))
    floor = DIVERGE_ROUNDED_ULP * r_ulp + _smallest_normal(dtype)
    if cls == "reduction":
        # |r| <= sum|terms|: gamma_n |r| is a lower bound of the textbook bound. An op within
        # it is within the bound; only one beyond it pays for sum|terms| (the reported ratio
        # is then exact; below 1 it may overstate the true ratio, never understate it).
        ratio = _ratio(err, numerics.gamma(max(terms, 1.0), dtype) * np.abs(r) + floor)
        if ratio <= 1.0 or facts is None:
            return ulps, ratio
        return ulps, _facts_ratio(err, facts, terms, dtype, floor)
    if cls == "library":
        bound = DIVERGE_LIBRARY_ULP * r_ulp + _smallest_normal(dtype)
    elif cls == "composite":
        scale = float(np.max(np.abs(np.where(np.isfinite(r), r, 0.0)))) if r.size else 0.0
        bound = numerics.gamma(longest + DIVERGE_COMPOSITE_EXTRA_STEPS, dtype) * scale + floor
    else:
        bound = floor
    return ulps, _ratio(err, bound)


def max_absdiff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| in float64 (`absdiff`'s rules where either is not finite), into a reused
    scratch buffer."""
    if not a.size:
        return 0.0
    d = _scratch(np.broadcast_shapes(np.shape(a), np.shape(b)), 1)[0]
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(a, b, out=d, dtype=np.float64)
    m = float(np.abs(d, out=d).max())
    return m if math.isfinite(m) else float(absdiff(a, b).max())


def _ratio(err: np.ndarray, bound: np.ndarray) -> float:
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.max(np.where(err == 0, 0.0, err / bound)))


def carried_error(
    y: np.ndarray, s: np.ndarray, dtype, diff: float | None = None
) -> tuple[float, float]:
    """(normwise relative error of `y` against its shadow `s`, the same in ULPs of `dtype`).

    Args:
        diff: max |y - s| when already known and finite (`own_error_diff`'s when the shadow is
            the reference), which saves a pass.
    """
    ratio, ulps, _ = carried_error_diff(y, s, dtype, diff)
    return ratio, ulps


def carried_error_diff(
    y: np.ndarray, s: np.ndarray, dtype, diff: float | None = None, scale: float | None = None
) -> tuple[float, float, float]:
    """`carried_error` and max |y - s| (inf where a difference is not finite); `scale`:
    max |s| when already known with a finite `diff` (`diag.diverge.onepass`)."""
    if y.size == 0:
        return 0.0, 0.0, 0.0
    if diff is not None and math.isfinite(diff):
        num = diff
    else:
        err = _scratch(np.shape(y), 1)[0]
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(y, s, out=err, dtype=np.float64)
        np.abs(err, out=err)
        num = float(err.max())
    if math.isfinite(num):  # then y and s are finite: no element needs the exact handling
        if num == 0.0:
            return 0.0, 0.0, 0.0
        den = max(float(s.max()), -float(s.min())) if scale is None else scale
    else:
        err = absdiff(y, s)
        num = float(np.max(err))
        fin = np.abs(s[np.isfinite(s)])
        den = float(np.max(fin)) if fin.size else 0.0
    if num == 0.0:
        return 0.0, 0.0, 0.0
    if den == 0.0 or not math.isfinite(num):
        return math.inf, math.inf, num
    return num / den, num / _ulp_scalar(den, dtype), num


def _ulp_scalar(x: float, dtype) -> float:
    """`ulp_of` of one float, without numpy's per-call cost."""
    p, tiny, big = _format(dtype)
    ax = abs(x)
    ax = max(ax, tiny) if math.isfinite(ax) else big
    return math.ldexp(1.0, math.frexp(ax)[1] - p)
