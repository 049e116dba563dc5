"""Judge a user's function's outputs against its float64 reference, leaf by leaf.

Float leaves: the normwise relative error max |y - r| / max |r| (`diag.diverge`'s carried
error, the same figure its shadow reports per op) against `userfn_output_allowance` of the
dtype the leaf is computed in. Integer and boolean leaves (token ids, indices, masks): exact
agreement with the reference; an element that differs where the reference's own decision
moves when the inputs move by one rounding (`Reference.perturbed`) is forced by rounding
(``warn``), as the greedy-token probe holds a sampler to what rounded probabilities resolve;
any other differing element fails.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from diag import numerics
from diag.diverge.rules import carried_error
from diag.status import Status
from diag.tolerance.userfn import userfn_agreement_allowance, userfn_output_allowance
from diag.userfn.reference import Reference
from diag.userfn.tree import leaf_name, numpy_leaves

STATUSES = (Status.PASS, Status.WARN, Status.FAIL, Status.ERROR)


@dataclasses.dataclass(frozen=True)
class OutputVerdict:
    """One output leaf's verdict.

    Attributes:
        path: the leaf's path (``[0]``, ``['logits']``; ``""`` for a lone array).
        status: ``pass``, ``warn``, ``fail`` or ``error``.
        error: float leaf: normwise relative error against the reference; integer leaf: the
            share of elements that differ.
        allowed: what `error` may be (integer leaves: 0).
        reason: one line a person can act on.
    """

    path: str
    status: str
    error: float
    allowed: float
    reason: str

    @property
    def name(self) -> str:
        return leaf_name(self.path)


def _is_int(a: np.ndarray) -> bool:
    return a.dtype.kind in "biu"


def _float_verdict(path: str, y: np.ndarray, r: np.ndarray, dtype: str) -> OutputVerdict:
    allowed = userfn_output_allowance(dtype)
    y64 = np.atleast_1d(y.astype(np.float64))  # a scalar (a loss) as one element
    r64 = np.atleast_1d(np.ascontiguousarray(r, dtype=np.float64))
    err, _ = carried_error(y64, r64, dtype)
    if np.isnan(y64).any() and not np.isnan(r64).any():
        err = math.inf
    status = Status.PASS if err <= allowed else Status.FAIL
    where = ""
    if status == Status.FAIL and y64.size:
        diff = np.where(np.isnan(y64) != np.isnan(r64), np.inf, np.abs(y64 - r64))
        i = np.unravel_index(int(np.nanargmax(diff)), y64.shape)
        where = (
            f"; largest at {tuple(int(v) for v in i)}: {numerics.fmt(float(y64[i]))} vs "
            f"{numerics.fmt(float(r64[i]))}"
        )
    rel = "within" if status == Status.PASS else "beyond"
    return OutputVerdict(
        path,
        status,
        err,
        allowed,
        f"{leaf_name(path)} ({dtype}): normwise error {numerics.fmt(err)} {rel} "
        f"{numerics.fmt(allowed)} allowed (sqrt(u) of {dtype}){where}",
    )


def _int_verdict(
    path: str, y: np.ndarray, r: np.ndarray, moved: list[np.ndarray], input_dtype: str
) -> OutputVerdict:
    r = r.astype(np.int64)
    y = y.astype(np.int64)
    differ = y != r
    n_bad = int(differ.sum())
    if not n_bad:
        return OutputVerdict(
            path,
            Status.PASS,
            0.0,
            0.0,
            f"{leaf_name(path)}: all {y.size} values equal the reference",
        )
    forced = np.zeros_like(differ)
    for m in moved:
        m = m.astype(np.int64).reshape(r.shape)
        forced |= m != r
    forced &= differ
    n_forced = int(forced.sum())
    unforced = differ & ~forced
    first = np.argwhere(unforced if unforced.any() else differ)[0]
    at = tuple(int(v) for v in first)
    head = (
        f"{leaf_name(path)}: {n_bad} of {y.size} values differ from the reference (first at "
        f"{at}: {int(y[at])}, reference {int(r[at])})"
    )
    share = n_bad / max(y.size, 1)
    if n_forced == n_bad:
        return OutputVerdict(
            path,
            Status.WARN,
            share,
            0.0,
            f"{head}; each is forced by rounding: the reference's own choice there moves when "
            f"the inputs move by one rounding of {input_dtype}",
        )
    tail = f"; {n_forced} of them forced by rounding" if n_forced else ""
    return OutputVerdict(path, Status.FAIL, share, 0.0, head + tail)


def judge(
    outputs: Any, ref: Reference, *, dtype_of: Callable[[str], str] | None = None
) -> list[OutputVerdict]:
    """Each output leaf against the reference (see the module docstring).

    Args:
        outputs: what the function returned on one backend: any pytree, tuple, list or dict
            of arrays (JAX arrays, tensors, numpy), or a list of (path, numpy array).
        ref: the function's `Reference`.
        dtype_of: the dtype a float leaf is held to, by path (default: the leaf's own dtype).

    Returns:
        One `OutputVerdict` per leaf of the reference, in its order (``error`` for a leaf the
        outputs lack or whose shape differs).
    """
    if isinstance(outputs, list) and all(
        isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) for o in outputs
    ):
        got = dict(outputs)
    else:
        got = dict(numpy_leaves(outputs))
    out = []
    for k, (path, r) in enumerate(ref.leaves):
        y = got.get(path)
        if y is None:
            out.append(
                OutputVerdict(path, Status.ERROR, math.nan, 0.0, f"{leaf_name(path)} missing")
            )
        elif np.shape(y) != np.shape(r):
            out.append(
                OutputVerdict(
                    path,
                    Status.FAIL,
                    math.nan,
                    0.0,
                    f"{leaf_name(path)}: shape {tuple(np.shape(y))}, reference "
                    f"{tuple(np.shape(r))}",
                )
            )
        elif _is_int(r) or _is_int(np.asarray(y)):
            moved = [m for p in ref.perturbed if (m := p[k]) is not None]
            out.append(_int_verdict(path, np.asarray(y), r, moved, ref.input_dtype))
        else:
            y = np.asarray(y)
            dtype = dtype_of(path) if dtype_of else numerics.dtype_name(y.dtype)
            out.append(_float_verdict(path, y, r, dtype))
    return out


def agreement(a: list[tuple[str, np.ndarray]], b: list[tuple[str, np.ndarray]]) -> tuple:
    """Do two backends' outputs agree? (status, reason, metrics): float leaves within
    `userfn_agreement_allowance` of their dtype, normwise; integer leaves equal. A difference
    is a ``warn``: each backend is judged against the reference on its own."""
    bb = dict(b)
    worst: dict[str, float] = {}
    beyond = []
    for path, x in a:
        y = bb.get(path)
        if y is None or np.shape(x) != np.shape(y):
            beyond.append(f"{leaf_name(path)} (shape)")
            continue
        if _is_int(x):
            n = int(np.count_nonzero(x.astype(np.int64) != y.astype(np.int64)))
            worst[path] = float(n)
            if n:
                beyond.append(f"{leaf_name(path)} ({n} values)")
            continue
        dtype = numerics.dtype_name(x.dtype)
        err, _ = carried_error(
            np.atleast_1d(x.astype(np.float64)), np.atleast_1d(y.astype(np.float64)), dtype
        )
        worst[path] = err
        if err > userfn_agreement_allowance(dtype):
            beyond.append(f"{leaf_name(path)} ({numerics.fmt(err)})")
    metrics = {"difference": worst}
    if not beyond:
        return Status.PASS, f"all {len(a)} outputs agree within twice their allowance", metrics
    return Status.WARN, f"outputs differ between backends: {', '.join(beyond)}", metrics
