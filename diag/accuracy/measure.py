"""One row of a table: a backend's outputs of one function and dtype, against the truth.

The error of an output y at input x is |y - f(x)| / ulp(f(x)), measured at the exact value
f(x) (not at its rounding: an output one step off a correctly rounded value near a binade
edge is then 1 ulp or 0.5 ulp as the exact value says), over outputs and truths that are both
finite. Equality is IEEE's (-0 == +0; a zero's sign is not counted) with NaN equal to NaN.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from diag.accuracy.functions import ElementwiseFunction
from diag.accuracy.truth import Truth, exact_ulp

__all__ = ["HISTOGRAM_EDGES", "Row", "measure", "row_key"]

#: Upper edges of the ULP-error histogram's bins: (0, 0.5], (0.5, 1], (1, 2], ... ; an
#: output equal to the correctly rounded value counts in the first bin whatever its error.
HISTOGRAM_EDGES = (0.5, 1, 2, 4, 16, 64, 256, 1024, 4096, 65536, float("inf"))
_WORST = 10
_ULP_MEMO: dict[tuple[str, float, str], float] = {}


@dataclass
class Row:
    """One (backend, function, setting, dtype) of the tables; its fields are `--json`'s.

    Attributes:
      backend, function, dtype: what was measured; setting: JAX's `accuracy=` value for the
        op ('' for the default call).
      inputs: how many inputs (every finite one in the domain for 16-bit dtypes).
      not_correctly_rounded: outputs other than the correctly rounded value.
      max_ulp: the largest error in ulps at the exact value, over finite outputs and truths.
      worst_input: {input, output, correct, ulp} where max_ulp is reached (None if nowhere).
      nonfinite_wrong: NaN/Inf where the truth is finite, or finite where it is not.
      flushed: zero where the truth is a nonzero number.
      histogram: [[upper edge, count], ...] of the errors (`HISTOGRAM_EDGES`); the last edge
        is written "inf".
      worst_inputs: the ten largest errors, largest first, as worst_input.
      seconds: the backend's own time for the call, warm (compiled and cached where the
        framework compiles); compile_seconds: the first call's.
    """

    backend: str
    function: str
    setting: str
    dtype: str
    inputs: int
    not_correctly_rounded: int
    max_ulp: float
    worst_input: dict[str, Any] | None
    nonfinite_wrong: int
    flushed: int
    histogram: list[list[Any]]
    worst_inputs: list[dict[str, Any]] = field(default_factory=list)
    seconds: float | None = None
    compile_seconds: float | None = None

    @property
    def percent_wrong(self) -> float:
        """not_correctly_rounded as a percentage of inputs."""
        return 100.0 * self.not_correctly_rounded / self.inputs if self.inputs else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


def row_key(row: Row | dict[str, Any]) -> str:
    """What names a row in a baseline and in messages: `torch-cpu exp bfloat16`, plus the
    setting when there is one."""
    d = row.to_json() if isinstance(row, Row) else row
    setting = f" [{d['setting']}]" if d.get("setting") else ""
    return f"{d['backend']} {d['function']}{setting} {d['dtype']}"


def _errors(
    fn: ElementwiseFunction, x: np.ndarray, y: np.ndarray, t: Truth, dtype: str, wrong: np.ndarray
) -> np.ndarray:
    """ULP errors at the exact value where both are finite (NaN elsewhere)."""
    both = np.isfinite(y) & np.isfinite(t.rounded)
    ulp = t.ulp.copy()
    for i in np.flatnonzero(wrong & both & t.ambiguous):
        key = (fn.name, float(x[i]), dtype)
        if key not in _ULP_MEMO:  # backends often share a wrong output: decide it once
            _ULP_MEMO[key] = exact_ulp(fn, float(x[i]), dtype, float(t.rounded[i]))
        ulp[i] = _ULP_MEMO[key]
    with np.errstate(all="ignore"):
        err = np.abs(y - t.exact) / ulp
    err[~both] = np.nan
    err[both & ~wrong] = np.minimum(err[both & ~wrong], 0.5)
    return err


def _at(x: np.ndarray, y: np.ndarray, t: Truth, err: np.ndarray, i: int) -> dict[str, Any]:
    return {
        "input": float(x[i]),
        "output": float(y[i]),
        "correct": float(t.rounded[i]),
        "ulp": float(err[i]),
    }


def measure(
    fn: ElementwiseFunction,
    x: np.ndarray,
    y: np.ndarray,
    t: Truth,
    *,
    backend: str,
    dtype: str,
    setting: str = "",
) -> Row:
    """The row of outputs `y` at inputs `x` against truth `t`.

    Args:
      fn: the function's row (to settle an ulp near a power of two with mpmath).
      x, y: inputs and the backend's outputs (any float arrays holding the dtype's values).
      t: the truth at `x` (`diag.accuracy.truth.truth`).
      backend, dtype, setting: what the row names.
    """
    x = np.asarray(x).astype(np.float64)
    y = np.asarray(y).astype(np.float64)
    same = (y == t.rounded) | (np.isnan(y) & np.isnan(t.rounded))
    wrong = ~same
    err = _errors(fn, x, y, t, dtype, wrong)
    finite_err = np.where(np.isnan(err), -1.0, err)
    order = np.argsort(-finite_err, kind="stable")[:_WORST]
    worst = [_at(x, y, t, err, int(i)) for i in order if finite_err[i] > 0 and wrong[i]]
    bins = np.searchsorted(np.array(HISTOGRAM_EDGES), err[~np.isnan(err)], side="left")
    counts = np.bincount(bins, minlength=len(HISTOGRAM_EDGES))
    return Row(
        backend=backend,
        function=fn.name,
        setting=setting,
        dtype=dtype,
        inputs=int(x.size),
        not_correctly_rounded=int(wrong.sum()),
        max_ulp=float(finite_err.max(initial=0.0)),
        worst_input=_at(x, y, t, err, int(order[0])) if x.size and finite_err.max() > 0 else None,
        nonfinite_wrong=int((np.isfinite(y) != np.isfinite(t.rounded)).sum()),
        flushed=int(((y == 0) & (t.rounded != 0) & np.isfinite(t.rounded)).sum()),
        histogram=[
            ["inf" if e == float("inf") else e, int(c)] for e, c in zip(HISTOGRAM_EDGES, counts)
        ],
        worst_inputs=worst,
    )
