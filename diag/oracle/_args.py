"""Argument checks shared by the fast oracle and the mpmath reference, so both refuse the same
inputs with the same words."""

from __future__ import annotations

import numpy as np

from diag.errors import UsageError
from diag.numerics import as_dtype, dtype_name


def check_matmul_args(a, b, out_dtype, who: str, allowed=None):
    """Validate ``a @ b`` operands.

    Args:
        a, b: array-likes, [..., M, K] and [..., K, N].
        out_dtype: the output dtype, or None for the inputs' (then they must agree).
        who: the function name for messages (``oracle.matmul``).
        allowed: input dtypes accepted (None: any dtype diag knows).

    Returns:
        (a, b, out dtype, broadcast batch shape).

    Raises:
        UsageError: unknown or refused dtype, mixed dtypes without `out_dtype`, shapes that do
            not multiply or batch dims that do not broadcast.
    """
    a, b = np.asarray(a), np.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if allowed is None:
            as_dtype(x.dtype)
        elif x.dtype not in allowed:
            raise UsageError(
                f"{who}: input {name} is {x.dtype}; expected one of "
                f"{', '.join(dtype_name(d) for d in allowed)} (float64 inputs have inexact "
                "products in float64: cast the inputs the backend really received)"
            )
    if out_dtype is None:
        if a.dtype != b.dtype:
            raise UsageError(
                f"{who}: inputs are {dtype_name(a.dtype)} and "
                f"{dtype_name(b.dtype)}; pass out_dtype to say which output is meant"
            )
        out_dtype = a.dtype
    out_dt = as_dtype(out_dtype)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise UsageError(
            f"{who}: shapes {a.shape} and {b.shape} do not multiply; "
            "expected [..., M, K] and [..., K, N]"
        )
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise UsageError(f"{who}: batch dims of {a.shape} and {b.shape} do not broadcast") from None
    return a, b, out_dt, batch
