"""The per-op figures of a large output, computed a cache-sized part at a time.

`diag.diverge.rules.own_error_diff` makes about fifteen passes over float64 arrays the size of
the op's output (the difference, its ULPs, the floor, the bound, the ratio). A weight gradient
of a 1024-wide layer is 1M elements, 8 MiB per array: every pass goes to memory, and these
passes were most of the PyTorch shadow's cost on an MLP training step (18 ms of the 150 ms of
a step at d=1024, for each of its three weight gradients). Part by part, the arrays stay in
the core's cache.

Every figure is a maximum over elements of a per-element quantity (the error, its ULPs, its
ratio to a per-element bound), so the maximum of the parts' maxima is the same number, bit
for bit. What is not per element is kept whole: a reduction's choice between the cheap bound
gamma_n |r| and sum|terms| is made for the whole output (the parts' cheap ratios first, then,
when their maximum passes 1, every part against sum|terms|); a composite op's bound scales
with max |r| of the whole output and is not split; anything non-finite, or a reduction whose
gamma_n is infinite, goes the whole way (`rules.own_error_diff` on the whole arrays).
"""

from __future__ import annotations

import math

import numpy as np

from diag import numerics
from diag.diverge.rules import max_absdiff, own_error_diff

#: Elements per part: a float64 part is 256 KiB; the rules' four scratch arrays, the output
#: and its reference stay within a core's 2 MiB L2 cache.
PART = 1 << 15
#: Elements of the strided sample whose cheap ratio decides up front that a reduction's
#: ratio is the one against sum|terms| (`rules.own_error_diff`'s `beyond`).
SAMPLE = 2048


def own_error_parts(
    y: np.ndarray, r: np.ndarray, dtype, cls: str, *, facts=None, terms: float = 1, longest: int = 1
) -> tuple[float, float, float | None]:
    """`rules.own_error_diff`, the same figures, part by part where the output is large."""
    whole = {"facts": facts, "terms": terms, "longest": longest}
    if not _splits(y, r) or cls == "composite":
        return own_error_diff(y, r, dtype, cls, **whole)
    reduction = cls == "reduction"
    if reduction and max(terms, 1.0) * 2.0 ** -numerics.precision_bits(dtype) >= 1.0:
        return own_error_diff(y, r, dtype, cls, **whole)  # gamma_n is infinite: the exact way
    yf, rf = y.reshape(-1), r.reshape(-1)
    if reduction and facts is not None and _sample_beyond(yf, rf, dtype, terms):
        got = _against_terms(yf, rf, dtype, facts, terms, y.shape)
        if got is None:
            return own_error_diff(y, r, dtype, cls, **whole)
        return got
    parts = [own_error_diff(yf[s], rf[s], dtype, cls, terms=terms) for s in _spans(yf.size)]
    if any(top is None for _, _, top in parts):
        return own_error_diff(y, r, dtype, cls, **whole)
    ulps, ratio = _most(p[0] for p in parts), _most(p[1] for p in parts)
    top = _most(float(p[2]) for p in parts if p[2] is not None)
    if not reduction or facts is None or ratio <= 1.0:
        return ulps, ratio, top
    got = _against_terms(yf, rf, dtype, facts, terms, y.shape)
    if got is None:
        return own_error_diff(y, r, dtype, cls, **whole)
    return ulps, got[1], top


def max_absdiff_parts(a: np.ndarray, b: np.ndarray) -> float:
    """`rules.max_absdiff`, the same figure, part by part where the arrays are large."""
    if not _splits(a, b):
        return max_absdiff(a, b)
    af, bf = a.reshape(-1), b.reshape(-1)
    return _most(max_absdiff(af[s], bf[s]) for s in _spans(af.size))


def _splits(y: np.ndarray, r: np.ndarray) -> bool:
    """Whether two arrays of one shape are large enough to split and flat in memory."""
    return (
        y.size >= 2 * PART and y.shape == r.shape and y.flags.c_contiguous and r.flags.c_contiguous
    )


def _spans(n: int) -> list[slice]:
    return [slice(i, i + PART) for i in range(0, n, PART)]


def _sample_beyond(yf: np.ndarray, rf: np.ndarray, dtype, terms: float) -> bool:
    """Whether an evenly strided sample already passes the cheap bound (then the whole
    output's ratio is the one against sum|terms|, and the cheap pass would be wasted): the
    sample's own cheap ratio, from `rules.own_error_diff` itself (the same roundings)."""
    step = max(yf.size // SAMPLE, 1)
    ys, rs = np.ascontiguousarray(yf[::step]), np.ascontiguousarray(rf[::step])
    _, ratio, top = own_error_diff(ys, rs, dtype, "reduction", terms=terms)
    return top is not None and ratio > 1.0


def _against_terms(yf, rf, dtype, facts, terms, shape) -> tuple[float, float, float] | None:
    """(ULPs, ratio against gamma_n sum|terms|, max |y - r|) part by part, or None when
    sum|terms| is not one per element in the output's layout or something is not finite."""
    mag, cnt = facts()
    if np.shape(mag) != tuple(shape):
        return None
    mag = np.ascontiguousarray(mag).reshape(-1)  # float32 stays so (`_Part`)
    per = np.ndim(cnt) > 0
    if per:
        if np.shape(cnt) != tuple(shape):
            return None
        cnt = np.ascontiguousarray(cnt).reshape(-1)
    parts = []
    for s in _spans(yf.size):
        part = (mag[s], cnt[s] if per else cnt)
        got = own_error_diff(
            yf[s], rf[s], dtype, "reduction", facts=_Part(part, facts), terms=terms, beyond=True
        )
        if got[2] is None:
            return None
        parts.append(got)
    return (
        _most(p[0] for p in parts),
        _most(p[1] for p in parts),
        _most(float(p[2]) for p in parts if p[2] is not None),
    )


def _most(values) -> float:
    """The largest of the parts' figures, NaN if any is (as numpy's max of the whole)."""
    vals = list(values)
    return math.nan if any(v != v for v in vals) else max(vals)


class _Part:
    """One part's (sum|terms|, terms), as `facts` gives them, with the dtype the whole was
    summed in (`rules.own_error_diff`'s `computed_in`)."""

    def __init__(self, part: tuple, whole):
        self.part = part
        self.computed_in = getattr(whole, "computed_in", None)

    def __call__(self) -> tuple:
        return self.part
