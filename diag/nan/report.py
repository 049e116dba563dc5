"""What `diag.nan` reports: the op that gave birth to a NaN/Inf, and summaries of its operands."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from diag.errors import DiagError

PHASES = ("forward", "backward", "input")


class NanHuntError(DiagError):
    """The function could not be hunted: it raised, could not be traced, or mixes frameworks."""


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """What one input or output of the offending op held; enough to see why it went non-finite.

    `min`/`max` ignore NaNs (None when there is no non-NaN element); `zeros`, `negatives`,
    `nans`, `infs` are element counts. Non-float tensors leave the float fields None.
    """

    shape: tuple[int, ...]
    dtype: str
    min: float | None = None
    max: float | None = None
    zeros: int | None = None
    negatives: int | None = None
    nans: int = 0
    infs: int = 0

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def short(self) -> str:
        """One compact phrase, e.g. ``f32[4] min -1 max 3, 1 zero``."""
        parts = [f"{self.dtype}{list(self.shape)}"]
        if self.min is not None:
            parts.append(f"min {self.min:.4g} max {self.max:.4g}")
        for name, n in (
            ("zero", self.zeros),
            ("negative", self.negatives),
            ("NaN", self.nans),
            ("Inf", self.infs),
        ):
            if n:
                parts.append(f"{n} {name}{'s' if n > 1 and name[-1] != 'N' else ''}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class NanReport:
    """Where the first NaN/Inf that reaches a function's results was born.

    Attributes:
        framework: ``jax`` or ``torch``.
        primitive: the op that produced it: a jaxpr primitive (``log``, ``div``) or an aten op
            (``aten.sqrt``). ``input`` when the non-finite value was passed in, not computed.
        kind: ``NaN`` or ``Inf``: what the op produced.
        source: ``file.py:LINE (function)`` of the user's code that wrote the op (for a backward
            op, the forward line it differentiates); empty when unknown.
        file, line, function: the same source, unabbreviated.
        library: the innermost line of an installed library (transformers' modeling_gpt2.py,
            optax, jax.nn) that made the op, below the user's line; empty when the user's
            own line made it or it is not known.
        path: where the op sits, e.g. ``jit[step]/scan[3]/custom_jvp``; the index in brackets is
            the loop iteration. Empty at the top level.
        phase: ``forward``, ``backward`` (the op exists to compute a gradient) or ``input``.
        inputs: a summary per input of the op (non-tensor operands are left out).
        output: summary of the op's (first non-finite) output.
        bad_index: index of the first non-finite element of that output, when it has one.
        inputs_at_index: each input's value at `bad_index`, for elementwise ops (same shape or
            scalar inputs); None otherwise.
        births: how many births were seen in total (a masked one counts too).
        note: anything the reader should know (e.g. only the compiled run went non-finite).
        raised: when the NaN/Inf made the function raise (``torch.multinomial`` on a NaN
            row): the op, its line and the exception; empty otherwise.
        arrived: what the function was given that was already non-finite (an attention mask
            holding -inf): facts to show, not findings.
    """

    framework: str
    primitive: str
    kind: str
    source: str
    path: str
    phase: str
    inputs: tuple[TensorSummary, ...] = ()
    output: TensorSummary | None = None
    file: str = ""
    line: int = 0
    function: str = ""
    bad_index: tuple[int, ...] | None = None
    inputs_at_index: tuple[float, ...] | None = None
    births: int = 1
    note: str = ""
    raised: str = ""
    arrived: tuple[str, ...] = ()
    library: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))
