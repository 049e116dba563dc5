"""The builtin workloads' seeded weights: one definition for the jax and torch versions."""

from __future__ import annotations

import math

import numpy as np

from diag.numerics import as_dtype

__all__ = ["weights"]


def weights(seed: int, shapes, dtype) -> list[np.ndarray]:
    """Host numpy weights, each ``standard_normal(shape) / sqrt(shape[0])`` in `dtype`."""
    rng = np.random.default_rng([seed, 0x90DE])
    return [(rng.standard_normal(s) / math.sqrt(s[0])).astype(as_dtype(dtype)) for s in shapes]
