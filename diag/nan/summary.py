"""Host-side summaries of an op's operands, shared by the JAX and PyTorch hunters (numpy only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from diag.nan.report import TensorSummary


def _inexact(a: np.ndarray) -> bool:
    if a.dtype.kind in "fc":
        return True
    # ml_dtypes floats (bfloat16, float8_*) report kind 'V'.
    try:
        import ml_dtypes

        ml_dtypes.finfo(a.dtype)
        return True
    except (ImportError, ValueError, TypeError):
        return False


def summarize(a: np.ndarray) -> TensorSummary:
    """Shape, dtype, NaN-ignoring min/max, and counts of zeros, negatives, NaNs and Infs."""
    a = np.asarray(a)
    shape, dtype = tuple(int(d) for d in a.shape), str(a.dtype)
    if a.dtype == np.bool_ or not (_inexact(a) or a.dtype.kind in "iu"):
        return TensorSummary(shape, dtype)
    x = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
    if x.dtype.kind == "c":
        nan = np.isnan(x)
        inf = np.isinf(x)
        x = np.abs(x)
    else:
        nan, inf = np.isnan(x), np.isinf(x)
    rest = x[~nan]
    lo = float(rest.min()) if rest.size else None
    hi = float(rest.max()) if rest.size else None
    return TensorSummary(
        shape,
        dtype,
        lo,
        hi,
        int((x == 0).sum()),
        int((x < 0).sum()),
        int(nan.sum()),
        int(inf.sum()),
    )


def first_bad_index(a: np.ndarray, kind: str = "NaN") -> tuple[int, ...] | None:
    """Index of the first element (C order) of `kind` (``NaN`` or ``Inf``), else of any
    non-finite element; None when all are finite."""
    a = np.asarray(a)
    if not _inexact(a):
        return None
    x = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
    bad = np.isnan(x) if kind == "NaN" else np.isinf(x)
    if not bad.any():
        bad = ~np.isfinite(x)
        if not bad.any():
            return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.ravel())), a.shape))


def values_at(
    inputs: Sequence[np.ndarray], out_shape: tuple[int, ...], index: tuple[int, ...] | None
) -> tuple[Any, ...] | None:
    """Each input's element at `index` when the op is elementwise (inputs broadcast to it)."""
    if index is None:
        return None
    vals = []
    for a in inputs:
        a = np.asarray(a)
        try:
            v = np.broadcast_to(a, tuple(out_shape))[index]
        except ValueError:  # not elementwise: a reduction, a matmul, a reshape
            return None
        v = v.item() if hasattr(v, "item") else v
        vals.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
    return tuple(vals)
