"""What a suite expands into: `Case`s (one op on one input set under one setting) in a
`Suite`. Plain data, shared by the suite loader (`diag.plan.suite`), the entries naming a user's
function (`diag.plan.suite_fn`) and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "Suite"]


@dataclass(frozen=True)
class Case:
    """One op on one input set under one setting; run on every backend it applies to.

    Attributes:
      id: short unique id within the suite, safe as a file name (`c0007`).
      probe: the suite entry's name.
      op: the op name.
      label: human-readable case id, stable across runs (records' `case`).
      params: the case parameters as data (shape, dtype, precision, sweep).
      op_args: the parameters forwarded to the backend op.
      inputs: name of the input maker.
      input_key: identifies the input arrays (cases that differ only in op_args share them).
      seed: the seed the inputs are drawn from.
      expect: the outcome the suite entry plants (`diag.plan.probe.EXPECTATIONS`), or None.
      host_bytes: the estimated peak host memory of the case (`Probe.host_bytes`).
      where: the suite entry it came from (`probe[2]`), for errors.
    """

    id: str
    probe: str
    op: str
    label: str
    params: dict[str, Any]
    op_args: dict[str, Any]
    inputs: str
    input_key: str
    seed: int = 0
    dtype: str = field(default="")
    expect: str | None = None
    host_bytes: int = 0
    where: str = ""


@dataclass(frozen=True)
class Suite:
    name: str
    path: str
    description: str
    seed: int
    cases: tuple[Case, ...]
