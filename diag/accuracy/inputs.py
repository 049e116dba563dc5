"""The inputs of a table: every finite 16-bit value in the domain, or float32 samples.

bfloat16 and float16 have 2^16 bit patterns: all the finite ones are measured (both zeros
and the subnormals included), less those outside the function's domain. float32 has 2^32:
a seeded sample instead, of three parts. Uniform random bit patterns of either sign, which is
log-uniform over the whole range (every binade, the subnormal one included, gets the same
share); the neighbourhoods of the row's special points (zeros of the function, overflow and
underflow thresholds: 256 float32 values either side of each), and both ends of the range
(the 512 smallest subnormals, the 512 largest finite values, either sign, and +-0). The seed
is fixed per function, so a table is the same on every machine and every run.
"""

from __future__ import annotations

import hashlib

import numpy as np

from diag.accuracy.functions import ElementwiseFunction
from diag.numerics import from_bits

__all__ = ["SAMPLES", "EXHAUSTIVE", "inputs"]

#: float32 samples drawn per function (log-uniform part), beside the hard cases.
SAMPLES = 1_000_000
#: The dtypes measured at every input.
EXHAUSTIVE = ("bfloat16", "float16")
_NEIGHBOURS = 256
_ENDS = 512


def _exhaustive(dtype: str) -> np.ndarray:
    x = from_bits(np.arange(1 << 16, dtype=np.uint16), dtype)
    return x[np.isfinite(x.astype(np.float32))]


def _seed(fn: ElementwiseFunction) -> int:
    digest = hashlib.sha256(f"diag-accuracy/{fn.name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _hard_cases(fn: ElementwiseFunction) -> np.ndarray:
    """Around each special point and at both ends of float32's range, both signs."""
    steps = np.arange(-_NEIGHBOURS, _NEIGHBOURS + 1, dtype=np.int64)
    parts = [np.array([0.0, -0.0], dtype=np.float32)]
    for point in fn.special:
        centre = np.float32(point)
        bits = np.abs(centre).view(np.int32).astype(np.int64) + steps
        bits = bits[(bits >= 0) & (bits < 0x7F800000)].astype(np.uint32)
        magnitude = bits.view(np.float32)
        parts.append(np.copysign(magnitude, centre) if point else magnitude)
    ends = np.concatenate(
        [np.arange(1, _ENDS + 1), np.arange(0x7F800000 - _ENDS, 0x7F800000)]
    ).astype(np.uint32)
    parts += [ends.view(np.float32), -ends.view(np.float32)]
    return np.concatenate(parts)


def _samples(fn: ElementwiseFunction, n: int) -> np.ndarray:
    """`n` float32 values inside the domain, log-uniform over the whole range, seeded."""
    rng = np.random.default_rng(_seed(fn))
    kept: list[np.ndarray] = []
    have = 0
    while have < n:
        bits = rng.integers(0, 0x7F800000, size=2 * n, dtype=np.uint32)
        sign = rng.integers(0, 2, size=2 * n, dtype=np.uint32) << np.uint32(31)
        x = (bits | sign).view(np.float32)
        x = x[fn.in_domain(x.astype(np.float64))]
        kept.append(x[: n - have])
        have += kept[-1].size
    return np.concatenate(kept)


def inputs(fn: ElementwiseFunction, dtype: str, samples: int = SAMPLES) -> np.ndarray:
    """The inputs of `fn`'s table in `dtype`, in a fixed order.

    Args:
      fn: the function's row (its domain and special points).
      dtype: bfloat16 or float16 (every finite value), float32 (samples).
      samples: how many log-uniform float32 samples, beside the hard cases.

    Returns:
      An array of `dtype`, each input once, the domain's only.
    """
    if dtype in EXHAUSTIVE:
        x = _exhaustive(dtype)
    else:
        x = np.concatenate([_hard_cases(fn), _samples(fn, samples)])
        _, first = np.unique(x.view(np.uint32), return_index=True)
        x = x[np.sort(first)]
    return x[fn.in_domain(x.astype(np.float64))]
