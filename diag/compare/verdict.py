"""The verdict type and the one formatter of a mismatch, for every op family.

A verdict a person acts on says how many elements (or rows) are off, out of how many, where the
worst one is, what it was, what it should have been and what was allowed, in the same words
whichever op produced it and wherever it is shown (terminal, report, exception). That is
torch.testing's `_make_mismatch_msg` habit ("Mismatched elements: k / n (x%) ... at index
(i, j) (up to atol allowed)"). Each op family describes what went wrong as a `Mismatch`;
`format_mismatch` writes it; the family adds only the words that name its op and its rule
("error exceeds the float32 accumulation bound in ..."). So a reason cannot drift from its
metrics, and a new op family gets the same sentence for free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diag import numerics

__all__ = ["Mismatch", "Verdict", "format_mismatch", "format_index", "fmt"]

#: Significant digits of the values in a reason (got / correctly rounded / allowed): bf16
#: and fp16 carry about 2.4 and 3.3 decimal digits, so four show a one-ulp difference.
REASON_DIGITS = 4


def format_index(flat: int, shape: tuple[int, ...]) -> str:
    """A flat index as the tuple a person types to find the element: ``(3, 17)``."""
    return "(" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + ")"


def fmt(x: Any) -> str:
    """A value in a reason: `numerics.fmt` at `REASON_DIGITS`, Python's exponent form."""
    return numerics.fmt(x, REASON_DIGITS, compact=False)


@dataclass(frozen=True)
class Mismatch:
    """How many of an output's elements (or rows) break the rule, and the worst of them.

    Attributes:
      count: how many break it.
      total: out of how many.
      unit: what is counted (`elements`, `rows`, `elements of defined rows`).
      share: whether the percentage follows the count.
      where: where the worst (or first) one is: an index `(i, j)` or `row r`.
      ratio: the worst error over its allowance (the bound ratio), when a bound applies.
      got: the backend's value there.
      expected: the correctly rounded value there.
      allowed: the allowance there (± around `expected`).
      ulp: the worst distance in ULPs, when no bound applies (agreement of two backends).
    """

    count: int
    total: int
    unit: str = "elements"
    share: bool = True
    where: str | None = None
    ratio: float | None = None
    got: Any = None
    expected: Any = None
    allowed: Any = None
    ulp: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, for a record's metrics."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


def format_mismatch(m: Mismatch) -> str:
    """The one sentence every op family uses for a mismatch.

    ``k / n unit (x%)``, then the worst: against a bound, ``; worst R x the bound at W: got G,
    correctly rounded E, allowed ±A``; between two outputs, ``, up to U ULP at W``.

    Args:
      m: the mismatch.

    Returns:
      The text, without the op's own words around it.
    """
    text = f"{m.count} / {m.total} {m.unit}"
    if m.share:
        text += f" ({m.count / max(m.total, 1):.2%})"
    if m.ratio is not None and m.where is not None:
        text += f"; worst {m.ratio:.3g}x the bound at {m.where}"
        if m.got is not None:
            text += (
                f": got {fmt(m.got)}, correctly rounded {fmt(m.expected)}, allowed "
                f"±{fmt(m.allowed)}"
            )
    elif m.ulp is not None and m.where is not None:
        text += f", up to {m.ulp} ULP at {m.where}"
    return text


@dataclass
class Verdict:
    """One output's (or one pair of outputs') verdict: what a record carries.

    Attributes:
      status: `pass`, `warn` or `fail`.
      reason: one line a person can act on; its mismatch part is `format_mismatch(mismatch)`.
      metrics: the measurements behind it (the record's `metrics`, keys in docs/records.md).
      context: handed from a backend's evaluation to the probe's agreement check (matmul:
        a function returning the per-element bound, computed only if a check needs it).
      mismatch: what broke the rule, when something did.
    """

    status: str
    reason: str
    metrics: dict
    context: Any = None
    mismatch: Mismatch | None = None
