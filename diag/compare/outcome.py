"""What one backend returned for one case (`Outcome`), and the checks that its outputs are
the shape and dtype of the truth before any number is judged (`MalformedOutput`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.compare.verdict import Verdict


@dataclass
class Outcome:
    """What one backend returned for one case, with everything needed to judge it.

    Attributes:
      inputs: the host's input arrays (what the backend received, bit for bit).
      outputs: the backend's outputs, in the op's order.
      names: a name per output (`values`, `indices`, or sampler paths like `jit/argmax`).
      truth: the oracle's result for this case (None for probes that need none).
      params: the case parameters.
      promised: whether the backend promises the claimed arithmetic under this setting.
      setting: the setting in words, for reasons (`precision=default`).
      nan_report: where a non-finite output was born (`diag.nan`), when the op asked the
        worker to hunt it.
      shared: `memo(name, compute)`, the run's store of arrays that depend on the case alone
        (`diag.run.store.CaseStore.shared`): what one backend's verdict computed from the inputs
        and the truth, every other backend's reuses. None: compute every time.
      digests: sha256 of each output's bits (`numerics.bits_digest`), when known.
      recall: `memo(key, compute)`, the run's store of what was computed from the case and
        some outputs' bits (`diag.run.store.CaseStore.recall`): the key names the computation and
        the digests of the outputs it read, so an output bit-identical to one judged before
        against the same truth (a precision setting a backend ignores) gets the same metrics
        without comparing its elements again. None: compute every time.
    """

    inputs: list
    outputs: list
    names: list
    truth: Any
    params: dict
    promised: bool = True
    setting: str = ""
    nan_report: dict | None = None
    shared: Callable[[str, Callable[[], np.ndarray]], np.ndarray] | None = None
    digests: list | None = None
    recall: Callable[[tuple, Callable[[], Any]], Any] | None = None

    def remembered(self, name: str, compute: Callable[[], Any], *others: Outcome) -> Any:
        """`compute()`, or what it gave earlier in this run for the same case, the same `name`
        (which must say everything else the value depends on) and the same bits of this
        outcome's outputs and `others`' (`recall`, keyed by their digests)."""
        outcomes = (self, *others)
        if self.recall is None or any(o.digests is None for o in outcomes):
            return compute()
        return self.recall((name, *(tuple(o.digests or ()) for o in outcomes)), compute)

    @property
    def named(self) -> dict:
        """The outputs by name (`values`, `indices`, a sampler path, `loss`, ...)."""
        return dict(zip(self.names, self.outputs))


#: The probe table's name for the verdict on one output (`diag.compare.verdict.Verdict`).
Evaluation = Verdict


class MalformedOutput(ValueError):
    """A backend returned outputs of the wrong shape, dtype or number: not a numerical result.

    The runner turns it (and any other exception while judging one output) into an `error`
    record with the reason, and the run goes on.
    """


def only_output(o: Outcome, expected: np.ndarray) -> np.ndarray:
    """The one output of a single-output op, checked against the truth's shape and dtype."""
    if len(o.outputs) != 1:
        raise MalformedOutput(f"returned {len(o.outputs)} outputs, expected 1")
    _shape_mismatch(o.outputs[0], expected)
    return o.outputs[0]


def _shape_mismatch(output: np.ndarray, expected: np.ndarray) -> None:
    """Raise `MalformedOutput` unless `output` has the truth's shape and dtype."""
    from diag import numerics

    if output.shape == expected.shape and output.dtype == expected.dtype:
        return
    raise MalformedOutput(
        f"returned {numerics.dtype_name(output.dtype)}{list(output.shape)}, "
        f"expected {numerics.dtype_name(expected.dtype)}"
        f"{list(expected.shape)}"
    )
