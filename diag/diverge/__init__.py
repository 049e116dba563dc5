"""Find the first op where a low-precision or ported computation leaves the true result.

Most numerical bugs never make a NaN: a bf16 accumulation, a cancellation, a softmax without
max-subtraction, a mis-ported layer move the result quietly. Three questions, one module:

* `shadow(fn, *args)`: run a JAX function (its jaxpr, equation by equation, through jit, scan,
  cond, custom_jvp/vjp and grad) or a PyTorch function (every aten op, forward and backward, under
  a dispatch mode) in its own dtypes, with a float64 *shadow* of every value beside it. Per op:
  the error the op adds itself (its output against the float64 evaluation of the same op on its
  actual inputs, in ULPs and as a ratio to the op's own bound), the error carried in and out
  against the shadow, and the amplification. `first` is the earliest op that broke its bound or
  where the carried error crossed the threshold (rules in `diag.diverge.rules` and
  docs/diverge.md).
* `explain(fn, args, kwargs, failing, leaves)` and `diagnose(fn, *args)`: the cause of a
  failure, not only where it shows: the smallest set of ops whose computation in a wider dtype
  brings every failing output within its allowance, found by re-running the function with
  candidates (ranked from the shadow's figures) promoted, and claimed only when a re-run
  confirms it (`diag.diverge.cause`).
* `tap(name, x)` and `compare(run_a, run_b)`: two implementations (JAX and PyTorch, or two
  versions of one model) tap the same names; `compare` says which tap first differs by more
  than two correct implementations may. Module outputs (torch `nn.Module`, flax linen) are
  tapped automatically with `modules=True`, paired through a name map.

Neither framework is imported here; the one the function uses is imported on first call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from diag.diverge.cause import Cause, Failing
from diag.diverge.records import (
    CompareReport,
    DivergeError,
    NothingCompared,
    OpRecord,
    ShadowReport,
    TapRecord,
)
from diag.interp import framework_of

__all__ = [
    "Cause",
    "CompareReport",
    "DivergeError",
    "Failing",
    "NothingCompared",
    "OpRecord",
    "ShadowReport",
    "TapRecord",
    "compare",
    "diagnose",
    "explain",
    "shadow",
    "shadow_outputs",
    "shadow_within",
    "tap",
]


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
    framework = framework_of(fn, args, kwargs)
    if framework == "torch":
        from diag.diverge import torch_shadow

        return torch_shadow.shadow(fn, args, kwargs)
    from diag.diverge import jax_shadow

    return jax_shadow.shadow(fn, args, kwargs)


def shadow_outputs(
    fn: Callable, args: tuple, kwargs: dict, framework: str | None = None
) -> tuple[ShadowReport, list]:
    """`shadow`, and the float64 shadow of each leaf of the function's result (a numpy array,
    None for a leaf that is not a float), in the result's leaf order: the reference of a
    function that hard-codes a low-precision dtype (`diag.userfn`).

    Raises:
        DivergeError: `fn` raised or could not be traced.
    """
    framework = framework or framework_of(fn, args, kwargs)
    outputs: list = []
    if framework == "torch":
        from diag.diverge import torch_shadow

        return torch_shadow.shadow(fn, args, kwargs, outputs), outputs
    from diag.diverge import jax_shadow

    return jax_shadow.shadow(fn, args, kwargs, outputs), outputs


def tap(name: str, x: Any) -> Any:
    """Identity that records `x` under `name` while `compare` runs (JAX: inside jit too).

    Outside `compare` it returns `x` and records nothing (JAX: the tap is compiled in, but the
    host callback returns at once). Works on JAX arrays and torch tensors.
    """
    from diag.diverge import taps

    return taps.tap(name, x)


def compare(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    *,
    modules: bool = False,
    name_map: dict[str, str] | Callable[[str], str | None] | None = None,
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
        NothingCompared: the runs share no tap name (or one tapped nothing): the message
            names what each tapped.
    """
    from diag.diverge import compare_runs

    return compare_runs.compare(run_a, run_b, modules=modules, name_map=name_map)


def shadow_within(allowance: float, fn: Callable, *args: Any, **kwargs: Any) -> ShadowReport:
    """`shadow`, with every op's carried-error threshold lowered to `allowance`.

    For a caller that already knows an output is wrong by more than `allowance` (diag.testing):
    `first` is then also the op where the error first grew past what that output may carry,
    such as a cast of a float32 value to bfloat16, which its own dtype's sqrt(u) forgives.
    """
    from diag.diverge.ledger import limit

    with limit(allowance):
        return shadow(fn, *args, **kwargs)


def explain(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    failing: Sequence[Failing],
    leaves: Callable[[Any], list[tuple[str, Any]]],
    *,
    allowance: float = 0.0,
    framework: str | None = None,
) -> tuple[ShadowReport, Cause | None]:
    """The shadow report and the cause of the `failing` outputs (`diag.diverge.cause`): the
    smallest set of ops whose computation in a wider dtype brings every failing output within
    its allowance, proven by re-running the function with them promoted.

    Raises:
        DivergeError: the function could not be run op by op.
    """
    from diag.diverge import attribution as ex

    return ex.explain(fn, args, kwargs, failing, leaves, allowance=allowance, framework=framework)


def diagnose(fn: Callable, *args: Any, **kwargs: Any) -> tuple[ShadowReport, Cause | None]:
    """`shadow`, and when it fails, the cause of the outputs past sqrt(u) of their dtype
    against their float64 shadow (`diag diverge`).

    Raises:
        DivergeError: the function could not be run op by op.
    """
    from diag.diverge import attribution as ex

    return ex.diagnose(fn, args, kwargs)
