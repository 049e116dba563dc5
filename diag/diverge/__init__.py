"""Find the first op where a low-precision or ported computation leaves the true result.

Most numerical bugs never make a NaN: a bf16 accumulation, a cancellation, a softmax without
max-subtraction, a mis-ported layer move the result quietly. Two questions, one module:

* `shadow(fn, *args)`: run a JAX function (its jaxpr, equation by equation, through jit, scan,
  cond, custom_jvp/vjp and grad) or a PyTorch function (every aten op, forward and backward, under
  a dispatch mode) in its own dtypes, with a float64 *shadow* of every value beside it. Per op:
  the error the op adds itself (its output against the float64 evaluation of the same op on its
  actual inputs, in ULPs and as a ratio to the op's own bound), the error carried in and out
  against the shadow, and the amplification. `first` is the earliest op that broke its bound or
  where the carried error crossed the threshold (rules in `diag.diverge._rules` and
  docs/diverge.md).
* `tap(name, x)` and `compare(run_a, run_b)`: two implementations (JAX and PyTorch, or two
  versions of one model) tap the same names; `compare` says which tap first differs by more
  than two correct implementations may. Module outputs (torch `nn.Module`, flax linen) are
  tapped automatically with `modules=True`, paired through a name map.

Neither framework is imported here; the one the function uses is imported on first call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from diag.errors import DiagError, EXIT_WORKER_CRASH

__all__ = ["CompareReport", "DivergeError", "OpRecord", "ShadowReport", "TapRecord", "compare",
           "shadow", "tap"]


class DivergeError(DiagError):
    """The function could not be run op by op: it raised, or could not be traced."""

    exit_code = EXIT_WORKER_CRASH


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op's figures, as `shadow` measured them.

    Attributes:
        index: position of the op in execution order (among ops with float outputs).
        primitive: the jaxpr primitive (``add``, ``reduce_sum``) or aten op (``aten.exp``).
        op_class: ``rounded``, ``library``, ``reduction``, ``structural`` or ``composite``:
            which own-error bound applies (docs/diverge.md).
        source: ``file.py:LINE (function)`` of the user's line; for a backward op the forward
            line it differentiates. ``library`` names the library line where it helps.
        path: where the op sits (``jit[f]/scan[273]``; torch: the module path).
        phase: ``forward`` or ``backward``.
        dtype, shape: of the op's (first float) output.
        own_ulps: the op's own error: max |y - f64(op)(inputs)| in ULPs of `dtype`.
        own_ratio: the same against the op's own bound (above 1: less precision than claimed).
        carried_in: largest normwise relative error (vs the float64 shadow) among its inputs.
        carried: normwise relative error of its output against the shadow.
        carried_ulps: the same in ULPs of `dtype` at the output's largest magnitude.
        amplification: carried / max(carried_in, u of `dtype`): how much the op grew the error.
        threshold: the carried-error threshold for `dtype` (sqrt(u)), or of the narrower dtype
            the value was computed from.
        reason: why this op is `first` (empty for the others).
        library: the library frame that wrote the op, when the user line is a caller of it.
    """

    index: int
    primitive: str
    op_class: str
    source: str
    path: str
    phase: str
    dtype: str
    shape: tuple[int, ...]
    own_ulps: float
    own_ratio: float
    carried_in: float
    carried: float
    carried_ulps: float
    amplification: float
    threshold: float
    reason: str = ""
    library: str = ""


@dataclasses.dataclass(frozen=True)
class ShadowReport:
    """What `shadow` found.

    Attributes:
        framework: ``jax`` or ``torch``.
        function: the function's name.
        first: the first divergent op, or None when the function stays within its bounds.
        ops: the top contributors, largest amplification (then own-error ratio) first.
        curve: carried error after each op, in execution order (the error along the program).
        n_ops: how many ops with float outputs were evaluated.
        result_error: carried error of the function's (first float) result.
        note: what the reader should know (ops the shadow could not follow, ...).
    """

    framework: str
    function: str
    first: OpRecord | None
    ops: tuple[OpRecord, ...]
    curve: tuple[float, ...]
    n_ops: int
    result_error: float
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: an infinite figure is the string ``inf``, a missing one None."""
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class TapRecord:
    """One tapped name, compared between two runs.

    Attributes:
        name: the tap's name (``#k`` added for its k-th repetition); a module path for
            automatic taps.
        index: position in run A's execution order.
        dtype, shape: of run A's value.
        max_rel: max |a - b| / max |b| (normwise relative difference).
        mean_rel: mean |a - b| / mean |b|.
        allowed: what two correct implementations in `dtype` may differ by (u^(2/3)).
        ratio: max_rel / allowed; above 1 the tap is beyond it.
        note: e.g. shapes that differ.
    """

    name: str
    index: int
    dtype: str
    shape: tuple[int, ...]
    max_rel: float
    mean_rel: float
    allowed: float
    ratio: float
    note: str = ""

    @property
    def beyond(self) -> bool:
        return self.ratio > 1.0


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """What `compare` found: per tap in run A's order, and the first beyond what is allowed.

    Attributes:
        first: the first tap beyond its allowance, or None.
        taps: every tap both runs recorded, in run A's order.
        only_a, only_b: names one run tapped and the other did not.
    """

    first: TapRecord | None
    taps: tuple[TapRecord, ...]
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: an infinite figure is the string ``inf``, a missing one None."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x: Any) -> Any:
    """Tuples to lists; inf/-inf to ``"inf"``/``"-inf"`` and NaN to None (JSON has neither)."""
    if isinstance(x, float):
        if x != x:
            return None
        return x if abs(x) != float("inf") else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def shadow(fn: Callable, *args: Any, **kwargs: Any) -> ShadowReport:
    """Run ``fn(*args, **kwargs)`` op by op beside a float64 shadow; name the first divergent op.

    Args:
        fn: a JAX function (jitted or not; it must be traceable by `jax.make_jaxpr`) or a
            PyTorch function or module (it may call ``.backward()``).
        *args, **kwargs: passed to `fn` unchanged.

    Returns:
        A `ShadowReport`; its `first` is None when no op diverged.

    Raises:
        DivergeError: `fn` raised or could not be traced.
    """
    from diag.nan import _framework_of

    framework = _framework_of(fn, args, kwargs)
    if framework == "torch":
        from diag.diverge import _torch as impl
    else:
        from diag.diverge import _jax as impl
    return impl.shadow(fn, args, kwargs)


def tap(name: str, x: Any) -> Any:
    """Identity that records `x` under `name` while `compare` runs (JAX: inside jit too).

    Outside `compare` it returns `x` and records nothing (JAX: the tap is compiled in, but the
    host callback returns at once). Works on JAX arrays and torch tensors.
    """
    from diag.diverge._tap import tap as _tap

    return _tap(name, x)


def compare(run_a: Callable[[], Any], run_b: Callable[[], Any], *, modules: bool = False,
            name_map: dict[str, str] | Callable[[str], str | None] | None = None
            ) -> CompareReport:
    """Run two implementations, each tapping the same names; find the first tap that differs.

    Args:
        run_a, run_b: zero-argument callables, each running one implementation (its own weights
            and inputs) that calls `diag.tap` on the values to compare.
        modules: also tap every torch `nn.Module` output and every flax linen module output
            under its path (``encoder.layers.0.mlp``; flax ``encoder/layers_0/mlp``).
        name_map: run B's tap names -> run A's (a dict, or a function returning None to drop a
            name), so a torch path and a flax path can be paired.

    Returns:
        A `CompareReport`; `first` is None when every shared tap is within its allowance.

    Raises:
        DivergeError: a run raised.
    """
    from diag.diverge._compare import compare as _compare

    return _compare(run_a, run_b, modules=modules, name_map=name_map)
