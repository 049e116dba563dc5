"""What the PyTorch shadow looks up once per aten op and once per dtype, not on every call.

The shadow mode (`diag.diverge.torch_shadow`) runs in Python for every aten op, forward and
backward: a 3-layer MLP training step is 36 ops, a GPT-2 forward 170. On the width-256 MLP step
the dispatch's Python, outside the ops and the figures, took 2.77 ms of a 9-12 ms shadow (one
thread; 2.48 ms with this module), so what depends only on the op or the dtype (the schema
name split, what the op writes, its kind and class, a dtype's threshold) is computed here
once and kept (`OpInfo`, `threshold`), and the per-tensor tests are written flat (`real`,
`low`, `wide`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from diag.diverge.rules import op_class
from diag.diverge.torch_decide import CONSUMERS, DECISIONS
from diag.interp.torch_ops import is_float, op_kind, written_args
from diag.tolerance.diverge import diverge_carried_threshold

NP = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}
REAL = frozenset(NP)
_SEEDED = torch.Tag.nondeterministic_seeded


def real(t: Any) -> bool:
    """A float tensor the shadow follows: float64, float32, float16 or bfloat16, strided, with
    memory and elements (`diag.interp.torch_ops.is_float` narrowed to those dtypes; the dtype
    is tested first, which turns away masks, indices and Python floats at once)."""
    return isinstance(t, torch.Tensor) and t.dtype in REAL and is_float(t)


_THRESHOLDS = {d: diverge_carried_threshold(np_dtype) for d, np_dtype in NP.items()}


def threshold(dtype: torch.dtype) -> float:
    """`diverge_carried_threshold` of a torch float dtype (one of `REAL`)."""
    return _THRESHOLDS[dtype]


def low(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy, without a float64 copy: the rules widen float32 and
    float16 exactly as they subtract (bfloat16, which numpy lacks, becomes float32, exactly)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def wide(x: Any) -> Any:
    """A float dtype or float tensor in float64 (a tensor copied: the op may write it)."""
    if isinstance(x, torch.dtype):
        return torch.float64 if x in REAL else x
    if real(x):
        return x.detach().to(torch.float64, copy=True)
    return x


class OpInfo:
    """What the shadow needs to know of one aten overload, from its schema.

    Attributes:
        name: the schema name without namespace (``addmm``); primitive: ``aten.addmm``.
        writes: `diag.interp.torch_ops.written_args` (`VIEW` for a view).
        kind: `diag.interp.torch_ops.op_kind` (``judge``, ``fill``, ``copy``, ``garbage``).
        seeded: whether torch tags it as drawing random numbers.
        decision, consumer: whether it takes a decision (`DECISIONS`) or picks values by a
            mask or indices (`CONSUMERS`).
        reduction: whether its class is ``reduction`` (`diag.diverge.rules.op_class`).
    """

    __slots__ = (
        "name",
        "primitive",
        "writes",
        "kind",
        "seeded",
        "decision",
        "consumer",
        "reduction",
    )

    def __init__(self, func) -> None:
        self.name = func._schema.name.split("::", 1)[-1]
        self.primitive = f"aten.{self.name}"
        self.writes = written_args(func)
        self.kind = op_kind(func)
        self.seeded = _SEEDED in func.tags
        self.decision = self.name in DECISIONS
        self.consumer = self.name in CONSUMERS
        self.reduction = op_class(self.name) == "reduction"


_INFO: dict[Any, OpInfo] = {}


def op_info(func) -> OpInfo:
    """The `OpInfo` of an aten overload, made on its first call."""
    got = _INFO.get(func)
    if got is None:
        got = _INFO[func] = OpInfo(func)
    return got
