"""The accuracy tables: every backend x function x dtype, each a `Row` against the truth.

The library call behind `diag accuracy`: pick the functions, dtypes and backends (each name
checked before any work), build each table's inputs and its truth once (cached on disk), run
every backend's calls in its own worker, and measure each output against the truth.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from diag.accuracy.functions import FUNCTIONS, ElementwiseFunction, get_function
from diag.accuracy.host import Call, calls_for, run_backend
from diag.accuracy.inputs import SAMPLES, inputs
from diag.accuracy.measure import Row, measure, row_key
from diag.accuracy.truth import FORMATS, Truth, truth
from diag.backends import BACKENDS, BackendSpec, framework_installed, get_spec
from diag.errors import UsageError
from diag.oracle.cache import GroundTruthCache

__all__ = ["DTYPES", "Tables", "default_backends", "parse_dtypes", "tables"]

#: The dtypes of the tables, in the order they are shown.
DTYPES = ("bfloat16", "float16", "float32")
_ALIASES = {
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f32": "float32",
    "fp32": "float32",
}


@dataclass
class Tables:
    """What `tables` measured.

    Attributes:
      rows: one per (backend, function, setting, dtype) that ran.
      errors: `row_key` -> why that call gave no row (the op raised on that backend).
      versions: backend -> its framework versions.
      truth_seconds: time spent building inputs and truths (cache reads included).
      fallbacks: (function, dtype) -> elements the truth's fast path left to mpmath.
    """

    rows: list[Row] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    versions: dict[str, dict] = field(default_factory=dict)
    truth_seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)


def parse_dtypes(names: Sequence[str] | None) -> list[str]:
    """Dtype names (aliases such as bf16 accepted) -> the tables' names; UsageError else."""
    out = []
    for name in names or DTYPES:
        canonical = _ALIASES.get(name, name)
        if canonical not in FORMATS:
            raise UsageError(
                f"unknown dtype '{name}' for accuracy tables; known: {', '.join(DTYPES)}"
            )
        out.append(canonical)
    return list(dict.fromkeys(out))


def default_backends(env: Mapping[str, str] | None = None) -> list[str]:
    """The CPU backends this machine can run: JAX and PyTorch where installed, torch_xla
    where its Python is named (DIAG_PYTHON_TORCH_XLA, `--python torch-xla=PATH`)."""
    from diag.worker.interpreter import python_var

    env = os.environ if env is None else env
    names = [n for n in ("jax-cpu", "torch-cpu") if framework_installed(BACKENDS[n].framework)]
    if env.get(python_var("torch_xla")):
        names.append("torch-xla-cpu")
    return names


def _resolve(
    functions: Sequence[str] | None,
    dtypes: Sequence[str] | None,
    backends: Sequence[str] | None,
    env: Mapping[str, str],
) -> tuple[list[ElementwiseFunction], list[str], list[BackendSpec]]:
    fns = [get_function(f) for f in functions] if functions else list(FUNCTIONS.values())
    specs = [get_spec(b) for b in (backends or default_backends({**os.environ, **env}))]
    for spec in specs:
        if spec.emulated:
            raise UsageError(
                f"{spec.name} emulates a matmul algorithm; accuracy tables "
                "measure devices: pick a jax, torch or torch-xla backend"
            )
    if not specs:
        raise UsageError("no backend to measure: install jax or torch, or pass --backend")
    return fns, parse_dtypes(dtypes), specs


def tables(
    functions: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    backends: Sequence[str] | None = None,
    *,
    samples: int = SAMPLES,
    env: Mapping[str, str] | None = None,
    cache: GroundTruthCache | None = None,
    settings: bool = True,
    repeats: int = 3,
    on_progress: Callable[[str], None] | None = None,
) -> Tables:
    """Measure every backend x function x dtype against the correctly rounded truth.

    Args:
      functions: names from `diag.accuracy.functions.FUNCTIONS` (default: all).
      dtypes: bfloat16, float16, float32 (default: all three).
      backends: backend names (default: `default_backends`).
      samples: float32 samples per function, beside the hard cases.
      env: variables for the workers (DIAG_PYTHON_* from `--python`).
      cache: the ground-truth cache (default: diag's folder).
      settings: also a row per JAX `accuracy=` setting where lax offers one.
      repeats: warm calls timed per call.
      on_progress: called with a line as each stage starts.

    Raises:
      UsageError: an unknown function, dtype or backend (before any work).
      WorkerFailed: a backend's worker crashed.
    """
    env = dict(env or {})
    fns, dts, specs = _resolve(functions, dtypes, backends, env)
    say = on_progress or (lambda line: None)
    result = Tables()
    start = time.perf_counter()
    xs: dict[tuple[str, str], np.ndarray] = {}
    truths: dict[tuple[str, str], Truth] = {}
    for fn in fns:
        for dtype in dts:
            xs[fn.name, dtype] = x = inputs(fn, dtype, samples)
            truths[fn.name, dtype] = t = truth(fn, x, dtype, cache)
            result.fallbacks[f"{fn.name} {dtype}"] = t.fallbacks
    result.truth_seconds = time.perf_counter() - start
    say(f"truth of {len(truths)} table(s) in {result.truth_seconds:.1f} s")
    for spec in specs:
        calls = calls_for(spec, fns, dts, settings)
        say(f"{spec.name}: {len(calls)} call(s)")
        outcomes, result.versions[spec.name] = run_backend(
            spec, calls, lambda c: xs[c.fn.name, c.dtype], env, repeats
        )
        for o in outcomes:
            _add(result, spec, o.call, o, xs, truths)
    return result


def _add(result: Tables, spec: BackendSpec, call: Call, outcome, xs, truths) -> None:
    key = (call.fn.name, call.dtype)
    if outcome.outputs is None:
        name = row_key(
            {
                "backend": spec.name,
                "function": call.fn.name,
                "setting": call.setting,
                "dtype": call.dtype,
            }
        )
        result.errors[name] = outcome.error
        return
    row = measure(
        call.fn,
        xs[key],
        outcome.outputs,
        truths[key],
        backend=spec.name,
        dtype=call.dtype,
        setting=call.setting,
    )
    row.seconds, row.compile_seconds = outcome.seconds, outcome.compile_seconds
    result.rows.append(row)
