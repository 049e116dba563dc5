"""A user's function prepared on the host, once per process: loaded, its inputs taken, its
float64 reference computed, each within the run's timeout; the first divergent op found on
demand (`diag.diverge.shadow`) for a failing verdict's reason.

A function that hangs cannot be stopped from inside Python: it runs in a daemon thread, and
after `timeout` seconds diag gives up on it with a one-line error (the thread is abandoned;
the CLI exits, and a worker running it is killed by the run's case timeout).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from diag import numerics
from diag.interp import framework_of
from diag.status import Status
from diag.userfn.bind import input_leaves
from diag.userfn.lift import lifted
from diag.userfn.load import UserFunctionError, import_spec
from diag.userfn.reference import Reference, given_reference, reference


def within(seconds: float | None, fn: Callable[[], Any], what: str) -> Any:
    """`fn()`, or `UserFunctionError` when it has not returned after `seconds` (None: wait)."""
    if seconds is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="diag-user-function", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise UserFunctionError(f"{what} did not return within {seconds:g} s (--timeout)")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclasses.dataclass
class Prepared:
    """A user's function on the host.

    Attributes:
        function: the loaded `UserFunction`.
        inputs: (name, array) of every input, as shipped to the workers.
        reference: its float64 `Reference`.
        dtype: the narrowest float dtype among the inputs (float32 without any): the case's.
        pristine: (fn, args, kwargs) as loaded, before anything ran (PyTorch: a deep copy,
            since a step may update its model in place), for the shadow run.
    """

    function: Any
    inputs: list[tuple[str, np.ndarray]]
    reference: Reference
    dtype: str
    pristine: tuple
    _first_op: dict = dataclasses.field(default_factory=dict)
    _causes: dict = dataclasses.field(default_factory=dict)

    def first_divergent_op(self, allowed: float = 0.0) -> str:
        """`diag.diverge.shadow` of the function on its own inputs: the first op (value or
        decision) that leaves the float64 shadow, as ``op at file.py:LINE (function)``; where
        every op keeps the bound of its own dtype, the first whose carried error passed
        `allowed` (the failing output's allowance); else a sentence saying none did or why
        the shadow could not run. Computed once per allowance."""
        if allowed not in self._first_op:
            fn, args, kwargs = self._pristine_copy()
            self._first_op[allowed] = first_op_line(fn, args, kwargs, allowed)
        return self._first_op[allowed]

    def diagnose(self, allowed: float, failing: list) -> tuple[str, Any]:
        """`first_divergent_op`, and the cause of the `failing` outputs (a list of
        `diag.diverge.Failing`; `diag.diverge.explain`): the op whose computation in a wider
        dtype brings them within their allowance, proven by a re-run (None when there is no
        float output to repair). Computed once per allowance and failing outputs."""
        key = (allowed, tuple(f.path for f in failing))
        if key not in self._causes:
            fn, args, kwargs = self._pristine_copy()
            self._causes[key] = first_op_and_cause(
                fn, args, kwargs, allowed, failing, self.function.framework
            )
        return self._causes[key]

    def _pristine_copy(self) -> tuple:
        fn, args, kwargs = self.pristine
        if self.function.framework == "torch":
            fn, args, kwargs = copy.deepcopy((fn, args, kwargs))
        return fn, args, kwargs


def first_op_line(fn: Callable, args: tuple, kwargs: dict, allowed: float = 0.0) -> str:
    """The first op of ``fn(*args, **kwargs)`` that leaves its float64 shadow, as ``first
    divergent op: OP at file.py:LINE (function), PHASE: why``, or a sentence saying none did
    or why the shadow could not run (`diag.diverge.shadow`; shared with `diag.testing`).

    With `allowed` (a failing output's allowance) above 0, every op's threshold is lowered to
    it (`diag.diverge.shadow_within`): where each op kept the bound of its own dtype (a float32
    result computed through bfloat16), the op where the error first passed what the output may
    carry is where it came in.
    """
    from diag.diverge import DivergeError, shadow, shadow_within

    try:
        # on copies of what it reaches: a step may update its global modules, or rebind and
        # donate its global arrays
        with lifted(fn, args, kwargs, framework_of(fn, args, kwargs), widen=False) as lift:
            fn, args, kwargs = lift.fn, lift.args, lift.kwargs
            if allowed > 0:
                report = shadow_within(allowed, fn, *args, **kwargs)
            else:
                report = shadow(fn, *args, **kwargs)
    except DivergeError as e:
        return f"the shadow run could not follow it ({str(e).removeprefix('diag: ')})"
    return first_line(report)


def failing_outputs(verdicts: list, ref: Reference) -> list:
    """The failing outputs as the cause search measures them (`diag.diverge.Failing`): float
    leaves with their allowance; integer leaves (token ids, indices) exactly, forgiving the
    values one rounding of the inputs already moves (`Reference.perturbed`, the judge's warn)."""
    from diag.diverge import Failing

    out = []
    for k, (path, r) in enumerate(ref.leaves):
        v = next((v for v in verdicts if v.path == path), None)
        if v is None or v.status != Status.FAIL:
            continue
        if r.dtype.kind == "f" and v.allowed > 0:
            out.append(Failing(path, r, v.allowed))
        elif r.dtype.kind in "biu" and v.allowed == 0:
            out.append(Failing(path, r, 0.0, _forced(ref, k)))
    return out


def integer_references(ref: Reference) -> list[tuple[np.ndarray, np.ndarray]]:
    """The reference's integer leaves in order, each with where one rounding of the inputs
    already moves it (`diag.diverge.attribution.Exact`: what `diag diverge` holds a flipped
    decision's outputs to)."""
    return [(r, _forced(ref, k)) for k, (_, r) in enumerate(ref.leaves) if r.dtype.kind in "biu"]


def _forced(ref: Reference, k: int) -> np.ndarray:
    """Where leaf `k` (an integer leaf) moves when the inputs move by one rounding."""
    r = ref.leaves[k][1]
    forced = np.zeros(r.shape, bool)
    for moved in ref.perturbed:
        m = moved[k]
        if m is not None:
            forced |= m.astype(np.int64).reshape(r.shape) != r.astype(np.int64)
    return forced


def first_op_and_cause(
    fn: Callable, args: tuple, kwargs: dict, allowed: float, failing: list, framework: str
) -> tuple[str, Any]:
    """(`first_op_line`, the `diag.diverge.Cause` of the `failing` outputs or None), from one
    shadow run and the cause search's re-runs (`diag.diverge.explain`)."""
    from diag.diverge import DivergeError, explain
    from diag.userfn.tree import numpy_leaves

    try:
        report, cause = explain(
            fn, args, kwargs, failing, numpy_leaves, allowance=allowed, framework=framework
        )
    except DivergeError as e:
        return f"the shadow run could not follow it ({str(e).removeprefix('diag: ')})", None
    return first_line(report), cause


def first_line(report: Any) -> str:
    """The sentence naming a shadow report's first divergent op (or saying there is none)."""
    first = report.first
    if first is None:
        return "no single op leaves the float64 shadow (the error builds up over many ops)"
    why = f": {first.reason}" if first.reason else ""
    return f"first divergent op: {first.primitive} at {_where(first)}, {first.phase}{why}"


def _where(op: Any) -> str:
    path = f" [{op.path}]" if op.path else ""
    return f"{op.source or 'an unknown line'}{path}"


def _narrowest(inputs: list[tuple[str, np.ndarray]]) -> str:
    floats = [numerics.dtype_name(a.dtype) for _, a in inputs if numerics.is_supported(a.dtype)]
    if not floats:
        return "float32"
    return max(floats, key=numerics.unit_roundoff)


_PREPARED: dict[tuple[str, str, str], Prepared] = {}


def _reference_of(u: Any, ref_spec: str, timeout: float | None) -> Reference:
    """The function's float64 reference, or the outputs of the reference function `ref_spec`
    names (``file.py:ref``, called with the function's arguments)."""
    if not ref_spec:
        return within(
            timeout,
            lambda: reference(u.fn, u.args, u.kwargs, u.framework),
            f"{u.name} evaluated in float64",
        )
    _, ref, name = import_spec(ref_spec)
    label = f"the reference function {_display(ref_spec)}"
    args, kwargs = u.args, u.kwargs
    if u.framework == "torch":
        args, kwargs = copy.deepcopy((args, kwargs))
    return within(timeout, lambda: given_reference(ref, args, kwargs, label), name)


def _display(spec: str) -> str:
    where, _, name = spec.rpartition(":")
    return f"{where.replace(chr(92), '/').rpartition('/')[2]}:{name}"


def prepare(
    spec: str, timeout: float | None = None, ref_spec: str = "", draw: str = ""
) -> Prepared:
    """Load `spec`, take its inputs and compute its reference: the function in float64, or
    the reference function `ref_spec` names (cached per process).

    Raises:
        UserFunctionError: it could not be loaded, raised, returned no arrays or something
            else than arrays, or did not return within `timeout` seconds.
    """
    from diag.userfn import load

    if (spec, ref_spec, draw) in _PREPARED:
        return _PREPARED[spec, ref_spec, draw]
    # Importing the file (and the framework it imports) is not timed: only what the user's
    # code computes is (FUNCTION, then the function in float64).
    import_spec(spec)
    u = within(timeout, lambda: load(spec, draw=draw), spec.rpartition(":")[2])
    inputs = input_leaves(u.fn, u.args, u.kwargs, u.framework)
    pristine = (u.fn, u.args, u.kwargs)
    if u.framework == "torch":
        pristine = copy.deepcopy(pristine)
    ref = _reference_of(u, ref_spec, timeout)
    prepared = Prepared(u, inputs, ref, _narrowest(inputs), pristine)
    _PREPARED[spec, ref_spec, draw] = prepared
    return prepared
