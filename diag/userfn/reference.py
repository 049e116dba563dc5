"""The reference a user's function is judged against: the same function, evaluated in float64.

Not an exact result: the float64 evaluation of the function's own code, whose error is about
2^-29 times the float32 one's. It runs on the host, once, never on a device under test:
JAX with x64 enabled and every float input widened to float64; PyTorch on a copy of the
module turned to `.double()`, float tensors widened, and float64 the default dtype. A
function that hard-codes a low-precision dtype (an ``.astype(jnp.bfloat16)``, a ``dtype=``)
still computes in it there; then the reference is the float64 shadow `diag.diverge` keeps
beside every op (`shadow_outputs`), and the record says so.

Integer outputs (token ids, indices) carry no error to measure, only decisions. Inputs rounded
to their dtype are known to within one rounding, so the reference is evaluated again on inputs
moved by one unit roundoff of their dtype: an element whose reference decision moves under
such a change is one the dtype cannot resolve (forced by rounding). The moves are sign
patterns, not random draws: in pattern (k, s) the element at flat index n of each input moves
by s * (-1)^(bit k of n) * u * |x|, for every bit k of the largest input's size and s = +-1.
Any two elements of an input differ in some bit, so for every pair some pattern moves one up
and the other down, and another the reverse: a choice between two inputs closer than one
rounding (a sampler's near-tied logits) is always found, in 2 * ceil(log2 n) evaluations.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from diag import numerics
from diag.userfn.lift import lifted
from diag.userfn.load import UserFunctionError
from diag.userfn.narrow import jax_narrow, torch_narrow
from diag.userfn.tree import numpy_leaves

#: At most this many bits of the flat index are patterned (2x as many evaluations): inputs
#: of more than 2^20 elements have their pairs beyond it covered only in part.
MAX_PATTERN_BITS = 20

FLOAT64_EVALUATION = "float64 evaluation of the same function (not an exact result)"
SHADOW_EVALUATION = (
    "float64 shadow of every op (diag.diverge): the function hard-codes a narrower dtype, "
    "so its own float64 evaluation is not float64"
)


@dataclasses.dataclass(frozen=True)
class Reference:
    """What a user's function's outputs are judged against.

    Attributes:
        kind: ``float64`` (the function evaluated in float64) or ``shadow`` (diag.diverge's
            float64 shadow, where the function hard-codes a narrower dtype).
        description: one line saying what the reference is, for the record.
        leaves: (path, array) per output leaf: float64 for float leaves, integers as they are.
        perturbed: per rounding-moved evaluation, the leaves' arrays (integer leaves only;
            None for float leaves); empty when no output is an integer.
        input_dtype: the narrowest float dtype among the inputs (whose rounding `perturbed`
            models), or ``""`` without float inputs.
        note: what else the reader should know (ops the shadow could not follow).
        lifted: the globals and closure cells the function reaches whose floats the
            reference widened with its arguments (``global fc1 (Linear)``;
            `diag.userfn.lift`).
        left_out: the paths of outputs that are None (a model output's absent field): not
            judged, and said so.
    """

    kind: str
    description: str
    leaves: tuple[tuple[str, np.ndarray], ...]
    perturbed: tuple[tuple[np.ndarray | None, ...], ...] = ()
    input_dtype: str = ""
    note: str = ""
    lifted: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    def leaf(self, path: str) -> np.ndarray | None:
        return next((a for p, a in self.leaves if p == path), None)


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return numerics.dtype_name(dtype) in ("float64", "float32", "float16", "bfloat16")
    except Exception:  # noqa: BLE001 - not a dtype numerics knows
        return False


def _map(x: Any, fn: Callable) -> Any:
    if isinstance(x, dict):
        return type(x)((k, _map(v, fn)) for k, v in x.items())
    if isinstance(x, list):
        return [_map(v, fn) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map(v, fn) for v in x)
    return fn(x)


class _Widen:
    """Widen a float leaf to float64, optionally moved by one unit roundoff of its dtype in
    sign pattern `pattern` = (bit k, sign s) (see the module docstring)."""

    def __init__(self, pattern: tuple[int, float] | None):
        self.pattern = pattern
        self.narrowest: str = ""
        self.largest = 0
        self.lifted: tuple[str, ...] = ()  # the globals and closure cells widened with it
        self.left_out: list[str] = []  # outputs that are None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        name = numerics.dtype_name(x.dtype)
        if not self.narrowest or numerics.unit_roundoff(name) > numerics.unit_roundoff(
            self.narrowest
        ):
            self.narrowest = name
        x64 = x.astype(np.float64)
        self.largest = max(self.largest, x64.size)
        if self.pattern is None:
            return x64
        bit, s = self.pattern
        index = np.arange(x64.size, dtype=np.int64).reshape(x64.shape)
        sign = np.where((index >> bit) & 1, -s, s)
        return x64 * (1.0 + sign * numerics.unit_roundoff(name))


def _jax_eval(
    fn: Callable, args: tuple, kwargs: dict, widen: _Widen, narrow: set[str] | None
) -> Any:
    import jax
    import jax.numpy as jnp

    def leaf(x: Any) -> Any:
        if isinstance(x, (jax.Array, np.ndarray)) and _is_float_dtype(x.dtype):
            return jnp.asarray(widen(np.asarray(x)))
        return x

    with jax.enable_x64(True), lifted(fn, args, kwargs, "jax") as lift:
        widen.lifted = lift.labels
        a, k = jax.tree_util.tree_map(leaf, (args, kwargs))
        leaves = numpy_leaves(fn(*a, **k), left_out=widen.left_out)
        if narrow is not None:
            narrow |= jax_narrow(fn, a, k)
        return leaves


def _torch_eval(
    fn: Callable, args: tuple, kwargs: dict, widen: _Widen, narrow: set[str] | None
) -> Any:
    import torch

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            host = x.detach().cpu().to(torch.float64).numpy()
            w = torch.from_numpy(widen(host.astype(_np_dtype(x))))
            return w.requires_grad_(x.requires_grad)
        return x

    before = torch.get_default_dtype()
    with lifted(fn, args, kwargs, "torch") as lift:
        widen.lifted = lift.labels
        a, k = _map((lift.args, lift.kwargs), leaf)
        torch.set_default_dtype(torch.float64)
        try:
            with torch_narrow(narrow) if narrow is not None else contextlib.nullcontext():
                out = lift.fn(*a, **k)
        finally:
            torch.set_default_dtype(before)
        return numpy_leaves(out, left_out=widen.left_out)


def _np_dtype(t: Any) -> np.dtype:
    import torch

    if t.dtype == torch.bfloat16:
        return numerics.as_dtype("bfloat16")
    return np.dtype(str(t.dtype).removeprefix("torch."))


def evaluate64(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    framework: str,
    pattern: tuple[int, float] | None = None,
    narrow: set[str] | None = None,
) -> tuple[list[tuple[str, np.ndarray]], _Widen]:
    """The function's output leaves evaluated in float64 (its inputs moved by `pattern`), and
    what the widening saw (the narrowest input float dtype, the largest input's size).
    `narrow`, when given, receives the dtypes narrower than float64 the function hard-codes
    inside (`diag.userfn.narrow`).

    Raises:
        UserFunctionError: the function raised or returned no arrays.
    """
    widen = _Widen(pattern)
    run = _torch_eval if framework == "torch" else _jax_eval
    name = getattr(fn, "__name__", None) or type(fn).__name__
    try:
        leaves = run(fn, args, kwargs, widen, narrow)
    except UserFunctionError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise UserFunctionError(
            f"{name} raised {type(e).__name__} when evaluated in float64: {e}"
        ) from e
    return leaves, widen


def _shadow_reference(
    fn: Callable, args: tuple, kwargs: dict, framework: str, wide: list
) -> Reference:
    """diag.diverge's float64 shadow of each float leaf; integer leaves from the float64
    evaluation `wide` (the same leaves, in the same order). It runs on copies of what the
    function reaches: a step may update its modules, or rebind and donate its globals."""
    from diag.diverge import DivergeError, shadow_outputs

    try:
        with lifted(fn, args, kwargs, framework, widen=False) as lift:
            report, shadows = shadow_outputs(lift.fn, lift.args, lift.kwargs, framework)
    except DivergeError as e:
        raise UserFunctionError(str(e)) from e
    leaves = tuple(
        (p, s if s is not None and a.dtype.kind not in "biu" else a)
        for (p, a), s in zip(wide, shadows)
    )
    return Reference("shadow", SHADOW_EVALUATION, leaves, note=report.note)


def reference(fn: Callable, args: tuple, kwargs: dict, framework: str) -> Reference:
    """The float64 reference of ``fn(*args, **kwargs)`` (see the module docstring).

    Args:
        fn, args, kwargs: the user's function and what it is called with (arrays or tensors).
        framework: ``jax`` or ``torch``.

    Returns:
        A `Reference`; its `kind` and `description` say which reference it is.

    Raises:
        UserFunctionError: the function raised, or returned no arrays.
    """
    inside: set[str] = set()
    leaves, seen = evaluate64(fn, args, kwargs, framework, narrow=inside)
    narrowest = seen.narrowest
    if (
        inside
        or any(a.dtype.kind == "f" and a.dtype != np.float64 for _, a in leaves)
        or any(a.dtype.name == "bfloat16" for _, a in leaves)
    ):
        shadow = _shadow_reference(fn, args, kwargs, framework, leaves)
        return dataclasses.replace(shadow, lifted=seen.lifted, left_out=tuple(seen.left_out))
    perturbed: list[tuple[np.ndarray | None, ...]] = []
    if narrowest and any(a.dtype.kind in "biu" for _, a in leaves):
        bits = min(max(1, (seen.largest - 1).bit_length()), MAX_PATTERN_BITS)
        for bit in range(bits):
            for s in (1.0, -1.0):
                moved, _ = evaluate64(fn, args, kwargs, framework, (bit, s))
                perturbed.append(tuple(a if a.dtype.kind in "biu" else None for _, a in moved))
    return Reference(
        "float64",
        FLOAT64_EVALUATION,
        tuple(leaves),
        tuple(perturbed),
        narrowest,
        lifted=seen.lifted,
        left_out=tuple(seen.left_out),
    )


def given_reference(ref: Callable, args: tuple, kwargs: dict, label: str) -> Reference:
    """The outputs of the reference function the user names (`diag.testing`'s ``reference=``,
    a suite entry's ``reference = "file.py:ref"``), called with the function's own arguments and
    taken as evaluated (its arithmetic is the user's choice: diag does not widen it).

    Raises:
        UserFunctionError: the reference raised, or returned no arrays.
    """
    try:
        got = ref(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's reference may raise anything
        raise UserFunctionError(f"the reference {label} raised {type(e).__name__}: {e}") from e
    return Reference(
        "user",
        f"outputs of {label} (the user's reference, as evaluated)",
        tuple(numpy_leaves(got)),
    )
