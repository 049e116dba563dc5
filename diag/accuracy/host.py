"""The host side of the accuracy worker: one job per backend, its outputs read back.

The inputs travel as .npy files of raw bits (bit-identical on every backend, as diag's run
ships them) and the outputs come back the same way; the worker's Python is the one diag's
runs use for the framework (`diag.worker.interpreter`: DIAG_PYTHON_TORCH_XLA, set by
`--python torch-xla=PATH`).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.accuracy.functions import JAX_SETTINGS, ElementwiseFunction
from diag.backends import BackendSpec
from diag.errors import EXIT_WORKER_CRASH, DiagError
from diag.numerics import bits_view, from_bits

__all__ = ["Call", "Outcome", "WorkerFailed", "calls_for", "run_backend"]

#: Seconds a backend's worker may take for a whole job before it is stopped.
TIMEOUT_S = 1800.0


class WorkerFailed(DiagError):
    """A backend's accuracy worker crashed or hung; the message names it and its last words."""

    exit_code = EXIT_WORKER_CRASH


@dataclass(frozen=True)
class Call:
    """One call a backend makes: a function in a dtype, under a setting ('' by default)."""

    fn: ElementwiseFunction
    dtype: str
    setting: str = ""


@dataclass(frozen=True)
class Outcome:
    """What a call gave: its outputs (or the error it raised) and its times."""

    call: Call
    outputs: np.ndarray | None
    error: str | None
    seconds: float | None
    compile_seconds: float | None


def calls_for(
    spec: BackendSpec,
    fns: Sequence[ElementwiseFunction],
    dtypes: Sequence[str],
    settings: bool = True,
) -> list[Call]:
    """Every call of a backend: each function in each dtype, plus a call per JAX accuracy
    setting where the backend runs JAX and the function has a lax op taking one."""
    calls = []
    for fn in fns:
        for dtype in dtypes:
            calls.append(Call(fn, dtype))
            if settings and spec.runs == "jax" and fn.lax:
                calls += [Call(fn, dtype, s) for s in JAX_SETTINGS]
    return calls


def _item(call: Call, spec: BackendSpec, i: int, folder: Path, input_path: str) -> dict:
    kwargs: dict[str, Any]
    accuracy: list[Any] | None = None
    if call.setting:
        kind, args = JAX_SETTINGS[call.setting]
        path, kwargs, accuracy = f"jax.lax.{call.fn.lax}", {}, [kind, args]
    else:
        path, kwargs = call.fn.call(spec.runs)
    return {
        "id": i,
        "call": path,
        "kwargs": kwargs,
        "accuracy": accuracy,
        "dtype": call.dtype,
        "input": input_path,
        "output": str(folder / f"out{i}.npy"),
    }


def run_backend(
    spec: BackendSpec,
    calls: Sequence[Call],
    inputs: Callable[[Call], np.ndarray],
    env: Mapping[str, str] | None = None,
    repeats: int = 3,
) -> tuple[list[Outcome], dict[str, Any]]:
    """Run `calls` on `spec`'s backend in one worker.

    Args:
      spec: the backend.
      calls: what to run.
      inputs: the inputs of a call (an array of its dtype).
      env: variables on top of the workers' environment (DIAG_PYTHON_* from `--python`).
      repeats: warm calls timed per call (the median is reported).

    Returns:
      Each call's outcome, in order, and the framework's versions.

    Raises:
      WorkerFailed: the worker died, hung or answered nothing readable.
    """
    from diag.worker.host import worker_env
    from diag.worker.interpreter import worker_cmd

    full_env = worker_env(env)
    python = worker_cmd(spec.framework, full_env)[0]
    with tempfile.TemporaryDirectory(prefix="diag-accuracy-") as tmp:
        folder = Path(tmp)
        items: list[dict] = []
        written: dict[tuple[str, str], str] = {}
        for i, call in enumerate(calls):
            key = (call.fn.name, call.dtype)
            if key not in written:
                written[key] = str(folder / f"in{len(written)}.npy")
                np.save(written[key], bits_view(inputs(call)), allow_pickle=False)
            items.append(_item(call, spec, i, folder, written[key]))
        job = folder / "job.json"
        job.write_text(
            json.dumps(
                {
                    "backend": spec.name,
                    "framework": spec.framework,
                    "platform": spec.platform,
                    "repeats": repeats,
                    "items": items,
                }
            )
        )
        answers = _start(spec, [python, "-m", "diag.accuracy.worker", str(job)], full_env)
        done = answers.pop("done")
        return [_outcome(c, answers.get(i), items[i]["output"]) for i, c in enumerate(calls)], (
            done.get("versions", {})
        )


def _start(spec: BackendSpec, cmd: list[str], env: Mapping[str, str]) -> dict:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(env), timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise WorkerFailed(
            f"{spec.name}: the accuracy worker ran past {TIMEOUT_S:.0f} s and was stopped"
        ) from None
    answers: dict[Any, Any] = {}
    for line in proc.stdout.splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        answers["done" if data.get("done") else data.get("id")] = data
    if "done" not in answers:
        last = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise WorkerFailed(
            f"{spec.name}: the accuracy worker exited {proc.returncode} before finishing: "
            f"{last}; is {spec.framework} installed for it? ({spec.install_hint})"
        )
    return answers


def _outcome(call: Call, answer: dict | None, output: str) -> Outcome:
    if answer is None or "error" in answer:
        error = answer["error"] if answer else "no answer from the worker"
        return Outcome(call, None, error, None, None)
    y = from_bits(np.load(output), call.dtype)
    return Outcome(call, y, None, answer["seconds"], answer["compile_s"])
