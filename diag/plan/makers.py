"""The input makers: seeded numpy draws that suite files name by their `inputs` field.

A leaf of the plan (numpy, ml_dtypes and `diag.numerics` only): the run's input store
(`diag.plan.inputs`) and a user function's drawn arguments (`diag.userfn.drawn`) both draw
with these, so the same name and seed give the same bits wherever they are drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from diag import numerics

__all__ = ["INPUT_MAKERS"]


def _normal(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _uniform(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype(dtype)


def _positive(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # No cancellation: every product is positive, so relative error is well defined.
    return rng.uniform(0.0, 1.0, shape).astype(dtype)


def _wide(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Signed values spread over ~2^-12 .. 2^12 (representable in fp16 and bf16 alike):
    # large dynamic range within one dot product, with cancellation.
    mag = np.exp2(rng.uniform(-12.0, 12.0, shape))
    return (np.where(rng.random(shape) < 0.5, -mag, mag)).astype(dtype)


def _normal5(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Logit rows with a wider spread, N(0, 5^2): the row sum is dominated by a few terms.
    return (5.0 * rng.standard_normal(shape)).astype(dtype)


def _near_1e4(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Logits near 1e4: exp overflows unless the row maximum is subtracted first. In bf16 the
    # spacing there is 64, in fp16 8, so rows hold many exact ties.
    return (1e4 + 10.0 * rng.standard_normal(shape)).astype(dtype)


def _masked_half(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Attention-style masking: half of each row is -inf (exactly 0 after softmax).
    x = rng.standard_normal(shape).astype(dtype)
    mask = rng.random(shape) < 0.5
    x[mask] = -np.inf
    return x


def _fully_masked(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # The first half of the rows are all -inf: softmax is 0/0 there, the exact result is
    # undefined and what a backend returns is a hazard to report. The rest are N(0, 1).
    x = rng.standard_normal(shape).astype(dtype)
    x[: max(1, shape[0] // 2)] = -np.inf
    return x


def _ties(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Small integers: exact ties in every dtype, as bf16 logits have.
    return rng.integers(-8, 9, shape).astype(dtype)


def _special(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # N(0, 1) rows with NaN, +inf, -inf, +0 and -0 at random places: where frameworks'
    # orders differ (NaN first or last, -0 against +0).
    x = rng.standard_normal(shape).astype(dtype)
    rows, n = shape
    for value in (np.nan, np.inf, -np.inf, 0.0, -0.0):
        for r in range(rows):
            x[r, rng.integers(0, n, max(1, n // 64))] = value
    return x


def _all_equal(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Constant rows (every element tied); one row of signed zeros.
    x = np.repeat(rng.standard_normal((shape[0], 1)), shape[1], axis=1).astype(dtype)
    x[0] = np.where(rng.random(shape[1]) < 0.5, -0.0, 0.0).astype(dtype)
    return x


def _near_ties(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Sampler logits whose top two are one ulp apart, the larger at either index.

    The exact argmax is unique in every row, but rounding the probabilities (or the logits
    shifted by the row maximum) to a narrow dtype can make the two equal, and then an argmax
    picks the lower index: the incident where a sampler dropped its most probable token.
    Row maxima span 2^-2 ... 2^5, where one bf16 ulp of the logit is and is not resolvable in
    the rounded probabilities.
    """
    rows, n = shape
    x = (rng.standard_normal(shape) - 4.0).astype(dtype)  # the bulk well below the top two
    for r in range(rows):
        top = np.array(np.exp2(rng.uniform(-2.0, 5.0)), dtype=dtype)
        up = _next_up(top)
        i, j = rng.choice(n, size=2, replace=False)
        # Larger value at the lower index in even rows, at the higher one in odd rows.
        lo, hi = (i, j) if i < j else (j, i)
        big, small = (lo, hi) if r % 2 == 0 else (hi, lo)
        x[r, big], x[r, small] = up, top
    return x


def _next_up(v: np.ndarray) -> np.ndarray:
    """The next representable value above a positive finite `v` in its own dtype."""
    bits = numerics.bits_view(np.asarray(v)).copy()
    return numerics.from_bits(bits + 1, numerics.dtype_name(np.asarray(v).dtype))


def _mlp(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Training-step inputs and weights, N(0, 1/fan_in): activations stay O(1).
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)


def _mlp_huge(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # The same scaled by 3e4 (inputs clipped to stay finite): tanh saturates, so logits are
    # sums of +-w2 with a spread of ~3e4 and overflow float16 (max 65504) but not float32,
    # bf16 or the float64 reference. The fp16 loss goes NaN: the NaN hunt names the op.
    big = float(ml_dtypes.finfo(dtype).max)
    return np.clip(3e4 * rng.standard_normal(shape) / np.sqrt(shape[0]), -big, big).astype(dtype)


INPUT_MAKERS: dict[str, Callable] = {
    "normal": _normal,
    "uniform": _uniform,
    "positive": _positive,
    "wide": _wide,
    "normal5": _normal5,
    "near_1e4": _near_1e4,
    "masked_half": _masked_half,
    "fully_masked": _fully_masked,
    "ties": _ties,
    "special": _special,
    "all_equal": _all_equal,
    "near_ties": _near_ties,
    "mlp": _mlp,
    "mlp_huge": _mlp_huge,
}
