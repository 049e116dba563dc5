"""Inside a worker: profile each case into the run folder.

After a case's timed repeats the worker calls `trace_case(...)`; with tracing off (the job
has no `trace` field) that returns at once. With it on, the case's compiled call runs again,
as many times as the timed repeats, inside one profiler session of the framework the worker
already imported. The timed repeats themselves stay outside the profiler, so a record's
timings mean the same traced or not: the profiler's own cost (a callback on every op, shapes
recorded) never enters them.

  - JAX: `jax.profiler.trace` + `jax.profiler.TraceAnnotation("diag:<case>")`; the session
    lands in `plugins/profile/<case>.<backend>/` (XProf's own layout), and the optimised HLO
    of the case is saved to `hlo/`.
  - PyTorch eager: `torch.profiler.profile(record_shapes=True)` + `record_function`; the
    Kineto trace is saved as `<host>.pt.trace.json.gz` in the same kind of folder.

Then the summary (`diag.trace.summarise`) is written to `trace/<case>.<backend>.json`. A case
whose op takes a `precision` and runs at the default one is also profiled at `highest`, so
the report can say what the precise setting costs on this backend, measured the same way.

A profiler that cannot start or a converter that fails never fails the case: the summary
then says why (`summary_error`), and the case's numbers stand.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diag.trace import summarise
from diag.trace.layout import HLO_DIR, SESSIONS_DIR, SUMMARY_DIR, session_name

__all__ = ["job_field", "trace_case"]


def job_field(run_dir: str | os.PathLike | None, cases) -> dict | None:
    """The `trace` field of a worker job: where to write and each case's label, or None.

    Args:
      run_dir: the run folder when the run is traced, else None.
      cases: the job's `diag.plan.suite.Case`s (their labels name the captures in summaries).
    """
    if run_dir is None:
        return None
    return {"dir": str(run_dir), "labels": {c.id: c.label for c in cases}}


def trace_case(
    job: dict, backend, label: str, case: dict, fn, args, thunk, calls: int | None = None
) -> None:
    """Profile one case's compiled call (`thunk`), `calls` times (default: the job's repeats),
    when the job asks for traces (`job["trace"]`); nothing otherwise. Never raises for a
    profiler or converter failure."""
    field = job.get("trace")
    framework = getattr(backend, "FRAMEWORK", None)
    if not field or framework not in _SESSIONS:
        return
    calls = max(1, calls or int(job.get("repeats", 3)))
    try:
        _trace(field, framework, backend, job, label, case, fn, args, thunk, calls)
    except Exception as e:  # the trace is evidence; its failure must not lose the result
        print(f"diag: tracing {case['id']} failed: {type(e).__name__}: {e}", file=sys.stderr)


@contextlib.contextmanager
def _jax_session(folder: Path, name: str) -> Iterator[None]:
    import jax

    tmp = Path(tempfile.mkdtemp(prefix="diag-trace-"))
    try:
        with jax.profiler.trace(str(tmp)):
            with jax.profiler.TraceAnnotation(f"diag:{name}"):
                yield
        # jax writes tmp/plugins/profile/<timestamp>/: one session per capture, renamed
        # after the case (timestamps collide within a second).
        (written,) = [p for p in (tmp / SESSIONS_DIR).iterdir() if p.is_dir()]
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(written), folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _torch_session(folder: Path, name: str) -> Iterator[None]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(f"diag:{name}"):
            yield
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"{socket.gethostname()}.pt.trace.json.gz"))


_SESSIONS = {"jax": _jax_session, "torch": _torch_session}


def _highest_variant(job: dict, case: dict) -> dict | None:
    """The op arguments of the same case at `highest` precision, when the case runs an op
    that takes a precision at its default; None otherwise."""
    from diag.backends import get_spec

    op_args = case.get("op_args", {})
    if op_args.get("precision") != "default":
        return None
    spec = get_spec(job["backend"])
    if "highest" not in spec.precisions or not spec.precision_via:
        return None
    return {**op_args, "precision": "highest", "precision_via": spec.precision_via[0]}


def _trace(
    field: dict,
    framework: str,
    backend,
    job: dict,
    label: str,
    case: dict,
    fn,
    args,
    thunk,
    calls: int,
) -> None:
    run_dir = Path(field["dir"])
    name = session_name(case["id"], label)
    folder = run_dir / SESSIONS_DIR / name
    summary: dict[str, Any] = {
        "case_id": case["id"],
        "case": field.get("labels", {}).get(case["id"], case["id"]),
        "backend": label,
        "framework": framework,
        "op": case.get("op"),
        "session": str(SESSIONS_DIR / name),
    }
    t0 = time.perf_counter()
    try:
        with _SESSIONS[framework](folder, name):
            for _ in range(calls):
                backend.block(thunk())
    except Exception as e:  # no profiler: the case's numbers stand, the summary says why
        summary["summary_error"] = f"no trace: the profiler failed: {type(e).__name__}: {e}"[:300]
        _write_json(run_dir / SUMMARY_DIR / f"{name}.json", summary)
        return
    summary["traced_wall_s"] = time.perf_counter() - t0
    try:
        summary.update(_summarise(framework, backend, folder, fn, args, run_dir, name))
    except Exception as e:
        summary["summary_error"] = (
            f"trace captured, summary unavailable: {type(e).__name__}: {e}"
        )[:300]
        summary["traceback"] = traceback.format_exc()[-1500:]
    variant = _highest_variant(job, case)
    if variant is not None:
        summary["highest"] = _compare_highest(
            framework, backend, case, variant, args, run_dir, label, calls
        )
    _write_json(run_dir / SUMMARY_DIR / f"{name}.json", summary)


def _summarise(
    framework: str, backend, folder: Path, fn, args, run_dir: Path, name: str
) -> dict[str, Any]:
    """The summary fields of one captured session (plus the saved HLO for JAX)."""
    hlo_text = None
    out: dict[str, Any] = {}
    if hasattr(backend, "hlo_text"):
        try:
            hlo_text = backend.hlo_text(fn, args)
        except Exception as e:  # the timeline is still worth having
            out["hlo_error"] = f"{type(e).__name__}: {e}"[:300]
        if hlo_text is not None:
            path = run_dir / HLO_DIR / f"{name}.hlo.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(hlo_text)
            out["hlo"] = str(path.relative_to(run_dir))
    out.update(summarise.summarise_session(framework, folder, hlo_text))
    return out


def _compare_highest(
    framework: str, backend, case: dict, op_args: dict, args, run_dir: Path, label: str, calls: int
) -> dict[str, Any]:
    """Profile the same case at `highest` precision: its per-call op time, for the cost of
    the precise setting next to the default one."""
    from diag.plan.registry import build

    name = session_name(case["id"], label, "highest")
    folder = run_dir / SESSIONS_DIR / name
    try:
        fn = build(backend, case["op"], **op_args)
        thunk = backend.prepare(fn, args).run
        with _SESSIONS[framework](folder, name):
            for _ in range(calls):
                backend.block(thunk())
        text = backend.hlo_text(fn, args) if hasattr(backend, "hlo_text") else None
        out = summarise.summarise_session(framework, folder, text)
        return {
            "session": str(SESSIONS_DIR / name),
            "op_args": op_args,
            "per_call_us": out.get("per_call_us"),
            "ops": (out.get("ops") or [])[:3],
            "call_us_samples": out.get("call_us_samples") or [],
            "summary_error": out.get("summary_error"),
        }
    except Exception as e:
        return {
            "summary_error": f"the highest-precision comparison failed: {type(e).__name__}: {e}"[
                :300
            ]
        }


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str, indent=1))
    os.replace(tmp, path)
