"""A user's function as an op: loaded from ``FILE.py:FUNCTION`` or ``pkg.module:function``,
evaluated in float64 on the host as its reference, and judged output by output.

The question users bring is about their own code: "my model's logits differ between TPU and
GPU (or after a jax upgrade): is that the hardware's precision, a compiler flag, or a bug in my
code?". `load` reads the function and its arguments the way `diag nan` does; `reference`
evaluates it in float64 (`diag.userfn.reference`); `judge` holds each output to an allowance
derived from its dtype (`diag.tolerance.userfn`). `diag run FILE.py:FUNCTION` runs it on every
backend of its framework through the same pipeline as diag's own probes.

Neither framework is imported here; the one the function uses is imported by its file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diag.interp import framework_of
from diag.userfn.drawn import drawn_call
from diag.userfn.judge import OutputVerdict, agreement, judge
from diag.userfn.load import (
    UserFunctionError,
    call_maker,
    import_spec,
    load_target,
    seed_globals,
    source_hash,
)
from diag.userfn.reference import Reference, reference
from diag.userfn.tree import flatten, leaf_name, numpy_leaves

__all__ = [
    "OutputVerdict",
    "Reference",
    "UserFunction",
    "UserFunctionError",
    "agreement",
    "call_maker",
    "flatten",
    "import_spec",
    "judge",
    "leaf_name",
    "load",
    "load_target",
    "numpy_leaves",
    "reference",
    "seed_globals",
    "source_hash",
]


@dataclasses.dataclass(frozen=True)
class UserFunction:
    """A user's function, ready to run.

    Attributes:
        name: how it is shown (``model.py:forward``, ``pkg.mod:forward``).
        spec: what the user gave (``path/to/model.py:forward``).
        fn, args, kwargs: the function under test and what it is called with.
        framework: ``jax`` or ``torch``.
        source_hash: sha256 (16 hex digits) of the source of the module that defines it.
    """

    name: str
    spec: str
    fn: Callable
    args: tuple
    kwargs: dict
    framework: str
    source_hash: str

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)


def _display(spec: str) -> str:
    where, _, name = spec.rpartition(":")
    return f"{Path(where).name if where.endswith('.py') else where}:{name}"


def load(spec: str, absent: frozenset[str] = frozenset(), draw: str = "") -> UserFunction:
    """``FILE.py:FUNCTION`` or ``pkg.module:function`` -> a `UserFunction`.

    FUNCTION is called with no arguments (after the global generators are seeded); it returns
    ``(fn, args)`` or ``(fn, args, kwargs)``, else FUNCTION itself is the function under test.
    A worker passes the other framework's modules as `absent`: the file's imports of them get
    stand-ins where they are not installed (`diag.userfn.standin`). With `draw` (a suite
    entry's ``inputs``, ``shape``, ``dtype``, ``seed``; `diag.userfn.drawn`), FUNCTION is the
    function under test, called on arrays drawn by diag's input makers.

    Raises:
        UserFunctionError: a malformed spec, no such file, module or function, or importing
            the file or calling FUNCTION raised (one line, naming which).
    """
    module, maker, name = import_spec(spec, absent)
    if draw:
        fn, args, kwargs = drawn_call(maker, draw)
    else:
        fn, args, kwargs = call_maker(maker, name)
    return UserFunction(
        name=_display(spec),
        spec=spec,
        fn=fn,
        args=args,
        kwargs=kwargs,
        framework=framework_of(fn, args, kwargs),
        source_hash=source_hash(module),
    )
