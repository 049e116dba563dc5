"""Assertions for a team's own test suite: a function's outputs against its float64 evaluation.

A test of numerical code usually ends in ``torch.testing.assert_close(out, expected, rtol=1e-4,
atol=1e-5)``: an expected value someone computed once, and tolerances someone picked until the
test passed. `assert_numerics` needs neither. It evaluates the function in float64 on the host
(`diag.userfn.reference`; diag.diverge's float64 shadow where the function hard-codes a
narrower dtype inside), holds each output to what its dtype allows (`diag.userfn.judge`:
sqrt(u) normwise for floats, `diag.tolerance.userfn`; exact agreement for token ids and
indices, forced-by-rounding differences a warning), and when an output fails, runs the
function once more op by op (`diag.userfn.host.first_op_line`: `diag.diverge.shadow_within`)
to name the op and the line where the error grew past what that output may carry, and the
cause: the op whose computation in a wider dtype brings the failing outputs within their
allowance, proven by re-running the function with it promoted (`diag.diverge.explain`)::

    from diag.testing import assert_numerics

    def test_logits():
        assert_numerics(model, ids)                 # raises AssertionError, or returns verdicts

No fixture or pytest plugin is registered: the assertion is a plain function, and an entry
point (``pytest11``) would load diag into every pytest session of every environment it is
installed in, for nothing a fixture could add.

`import diag.testing` imports no framework; the function's framework is imported on first call.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from diag.errors import UsageError
from diag.interp import framework_of
from diag.status import Status
from diag.tolerance.userfn import userfn_output_allowance
from diag.userfn import OutputVerdict, Reference, judge, reference
from diag.userfn.host import failing_outputs, first_op_and_cause, first_op_line
from diag.userfn.reference import given_reference

__all__ = ["NumericsWarning", "assert_numerics"]


class NumericsWarning(UserWarning):
    """An output differs from the reference only where rounding forces it (a `warn` verdict)."""


def assert_numerics(
    fn: Callable | str,
    *args: Any,
    backends: Sequence[str] | None = None,
    reference: Callable | str | None = None,
    **kwargs: Any,
) -> list[OutputVerdict]:
    """Assert that ``fn(*args, **kwargs)`` computes what its float64 evaluation does, to within
    what each output's dtype allows.

    Args:
        fn: a JAX function (jitted or not) or a PyTorch function or module; it may return any
            pytree, tuple or dict of arrays (float outputs and integer ones: token ids, indices).
            Or a ``FILE.py:FUNCTION`` / ``pkg.module:function`` spec (FUNCTION returns ``(fn,
            args)``): then it runs as `diag run` runs it, each backend in its own worker.
        *args, **kwargs: what `fn` is called with (arrays, tensors, parameter trees).
        backends: where to run it. A function: ``jax-cpu`` or ``torch-cpu``, in this process
            (default: its framework's). A spec: any backend names (``torch-xla-cpu``,
            ``jax-gpu``; default: every backend present), each in its worker; a named backend
            that cannot run here fails, as ``diag run --backend`` does.
        reference: a function called with the same arguments whose outputs are the truth
            (e.g. your float64 or mpmath implementation), instead of `fn` in float64. With a
            spec, a ``FILE.py:REF`` spec or a function defined at the top level of a file
            (the workers' host loads it by name), as ``diag run --reference``.

    Returns:
        One `diag.userfn.OutputVerdict` per output leaf (``pass`` or ``warn``), when none fails.

    Raises:
        AssertionError: an output fails: one line per failing output (its error, what its
            dtype allows, where the largest difference is), then the first divergent op and
            its source line, then what the reference was.
        UsageError: a backend this process cannot run `fn` on.
    """
    __tracebackhide__ = True  # pytest shows the assertion, not diag's frames
    if isinstance(fn, str):
        if args or kwargs:
            raise UsageError(
                f"diag.testing: {fn!r} brings its own arguments: pass no arguments with a "
                "FILE.py:FUNCTION spec"
            )
        return _through_workers(fn, backends, _reference_spec(reference))
    framework = framework_of(fn, args, kwargs)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    verdicts: list[OutputVerdict] = []
    ref = _reference(fn, args, kwargs, framework, reference)
    for backend in _backends(backends, framework):
        got = judge(_run(fn, args, kwargs, framework), ref)
        failing = [v for v in got if v.status in (Status.FAIL, Status.ERROR)]
        if failing:
            raise AssertionError(_message(name, backend, got, failing, ref, fn, args, kwargs))
        for v in got:
            if v.status == Status.WARN:
                warnings.warn(f"diag: {name} on {backend}: {v.reason}", NumericsWarning, 2)
        verdicts.extend(got)
    return verdicts


def _reference_spec(reference: Callable | str | None) -> str:
    """The ``FILE.py:REF`` spec the workers' host loads a reference by: given as one, or
    read from a function defined at the top level of a file (its file and name).

    Raises:
        UsageError: a reference that is not such a function (a lambda, a nested function).
    """
    if reference is None or isinstance(reference, str):
        return reference or ""
    import inspect
    import sys

    name = getattr(reference, "__name__", "")
    module = sys.modules.get(getattr(reference, "__module__", "") or "")
    try:
        file = inspect.getsourcefile(reference)
    except TypeError:
        file = None
    if file is None or module is None or getattr(module, name, None) is not reference:
        raise UsageError(
            f"diag.testing: the reference {name or reference!r} is not a function at the top "
            "level of a file, which the workers' host loads by name: define it at a module's "
            "top level, or pass reference='FILE.py:REF'"
        )
    return f"{file}:{name}"


def _through_workers(
    spec: str, backends: Sequence[str] | str | None, reference: str = ""
) -> list[OutputVerdict]:
    """`diag run SPEC`: each backend in its own worker, inputs bit-identical; a failing or
    erroring record is a line of the AssertionError (a named backend that cannot run here is
    one, as with ``diag run --backend``), a `warn` record a `NumericsWarning`."""
    __tracebackhide__ = True
    import tempfile

    from diag.plan.suite_fn import function_suite
    from diag.run import runner

    named = [backends] if isinstance(backends, str) else list(backends or [])
    with tempfile.TemporaryDirectory(prefix="diag-testing-") as out:
        suite = function_suite(spec, reference=reference)
        result = runner.run(suite, named or None, out=out, repeats=1)
    verdicts: list[OutputVerdict] = []
    failing: list[str] = []
    for r in result.records:
        reason = r["reason"]
        where = reason if reason.startswith(f"{r['backend']}:") else f"{r['backend']}: {reason}"
        if r["status"] in (Status.FAIL, Status.ERROR):
            failing.append(where)
        elif r["status"] == Status.WARN:
            warnings.warn(f"diag: {spec} on {where}", NumericsWarning, 3)
        verdicts.extend(OutputVerdict(**v) for v in r.get("metrics", {}).get("outputs", ()))
    if failing:
        head = f"diag: {spec}: {len(failing)} of {len(result.records)} records failed"
        raise AssertionError("\n".join([head, *(f"  {line}" for line in failing)]))
    return verdicts


def _backends(backends: Sequence[str] | None, framework: str) -> list[str]:
    local = f"{framework}-cpu"
    if backends is None:
        return [local]
    if isinstance(backends, str):
        backends = [backends]
    for b in backends:
        if b != local:
            raise UsageError(
                f"diag.testing: {b!r}: a {framework} function runs here on {local} only; "
                f"give assert_numerics a 'FILE.py:FUNCTION' spec to run it on {b} in a worker"
            )
    return list(backends)


def _reference(
    fn: Callable, args: tuple, kwargs: dict, framework: str, user: Callable | str | None
) -> Reference:
    if user is None:
        return reference(fn, args, kwargs, framework)
    if isinstance(user, str):
        from diag.userfn import import_spec

        user = import_spec(user)[1]
    label = getattr(user, "__qualname__", None) or type(user).__name__
    return given_reference(user, args, kwargs, label)


def _run(fn: Callable, args: tuple, kwargs: dict, framework: str) -> Any:
    if framework == "jax":
        import jax

        with jax.default_device(jax.devices("cpu")[0]):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def _limit(failing: list[OutputVerdict], ref: Reference) -> float:
    """What the failing outputs may carry: the smallest float allowance among them; for an
    integer output, the allowance of the inputs' dtype (an error past it can move a decision
    that dtype resolves)."""
    floats = [v.allowed for v in failing if v.allowed > 0]
    if floats:
        return min(floats)
    return userfn_output_allowance(ref.input_dtype or "float32")


def _first_op(
    fn: Callable, args: tuple, kwargs: dict, limit: float, failing: list, ref: Reference
) -> list[str]:
    """The lines naming the first divergent op and the cause of the failing outputs
    (`diag.userfn.host.first_op_and_cause`)."""
    if "torch" in type(fn).__module__ or any("torch" in type(a).__module__ for a in args):
        fn, args, kwargs = copy.deepcopy((fn, args, kwargs))  # a step may update in place
    outputs = failing_outputs(failing, ref)
    if not outputs:
        return [first_op_line(fn, args, kwargs, limit)]
    line, cause = first_op_and_cause(
        fn, args, kwargs, limit, outputs, framework_of(fn, args, kwargs)
    )
    return [line] if cause is None else [line, cause.text]


def _message(
    name: str,
    backend: str,
    verdicts: list[OutputVerdict],
    failing: list[OutputVerdict],
    ref: Reference,
    fn: Callable,
    args: tuple,
    kwargs: dict,
) -> str:
    lines = [
        f"diag: {name} on {backend}: {len(failing)} of {len(verdicts)} outputs beyond what "
        "their dtype allows",
        *(f"  {v.reason}" for v in failing),
        *(f"  {line}" for line in _first_op(fn, args, kwargs, _limit(failing, ref), failing, ref)),
        f"  reference: {ref.description}",
    ]
    return "\n".join(lines)
