"""Plan cases x backends, run each backend in its own worker, judge and record every result.

    suite -> cases -> inputs (numpy, seeded, written once) -> worker per backend -> compare
          -> results.jsonl (appended as each record arrives), with agreement across backends

The host never imports a framework. A worker that crashes or hangs past its timeout becomes
`error` records and the run goes on with the next backend; a crashed worker is restarted for
the cases it had not reached. A backend that cannot run (framework or device absent) is a
`skip` record in a default run and an `error` record when the user named it: a gate that
asked for jax-tpu must not go green without it. An output that cannot be judged (wrong
shape, missing outputs) is an `error` record for that case, never the end of the run.

Checked before any run folder is written (exit 2): bad XLA_FLAGS/LIBTPU_INIT_ARGS when a JAX
backend is planned, a suite with no case for the chosen backends, a case needing more host
memory than the limit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from diag.errors import UsageError, ended_by, exit_code
from diag.plan.plan import Plan
from diag.plan.registry import REPORT_SECTIONS
from diag.plan.suite import Suite, check_memory, load_suite
from diag.records.outputs import is_no_space, no_space, run_disk_full
from diag.records.results import COUNTED, Interrupted, RunDir, RunResult, new_run_id, worst_status
from diag.records.run_meta import run_verdict
from diag.run.ab import parse_ab, with_b_sides
from diag.run.backend_runs import PHASES, BackendRuns
from diag.run.judge import Judge
from diag.settings import environment
from diag.settings.flags import check_flags
from diag.trace import passes as trace_passes
from diag.worker.host import Worker, candidate_backends, resolve_backends, start_beside, worker_env

__all__ = [
    "run",
    "RunResult",
    "Interrupted",
    "resolve_backends",
    "candidate_backends",
    "PHASES",
    "check_flags",
    "parse_ab",
    "DEFAULT_CASE_TIMEOUT",
]

DEFAULT_CASE_TIMEOUT = 600.0

#: Seconds of timed runs after which a case stops repeating (`run(repeat_budget=...)`): about
#: what `timeit.Timer.autorange` aims for; a case slower than this is timed once.
DEFAULT_REPEAT_BUDGET = 0.25

DEFAULT_STARTUP_TIMEOUT = 300.0


def run(
    suite: str | Suite = "matmul",
    backends: list[str] | None = None,
    *,
    out: str | os.PathLike = "reports",
    repeats: int = 3,
    repeat_budget: float = DEFAULT_REPEAT_BUDGET,
    case_timeout: float = DEFAULT_CASE_TIMEOUT,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    cache_dir: str | None = None,
    env: dict[str, str] | None = None,
    ab: list[str] | None = None,
    max_memory: float | None = None,
    argv: list[str] | None = None,
    trace: bool = False,
    on_start: Callable[[int, list[str]], None] | None = None,
    on_record: Callable[[dict], None] | None = None,
    job_fields: dict[str, Any] | None = None,
) -> RunResult:
    """Run a suite on backends and write a run folder.

    Args:
      suite: a shipped suite name, a path to a suite file, or a loaded `Suite`.
      backends: backend names, or None for every backend present.
      out: the folder run folders are created in.
      repeats: timed runs per case, at most (the median is reported, samples kept).
      repeat_budget: seconds of timed runs after which a case stops repeating (at least one
        run always): a slow case is timed once, a fast one `repeats` times. `math.inf`
        times every case `repeats` times.
      case_timeout: seconds a worker may take for one case before it is killed.
      startup_timeout: seconds a worker may take to import its framework and open its device.
      cache_dir: ground-truth cache folder (default: `DIAG_CACHE_DIR` or ~/.cache/diag).
      env: extra environment variables for the workers (both sides of an A/B run).
      ab: an A/B experiment: `NAME=VALUE` settings (environment variables, XLA_FLAGS
        additions, JAX config options) for a second worker per backend, `<backend>+B`; each
        case gets an `ab` record saying what the setting changed (and, for JAX, the compiled
        HLO difference). XLA_FLAGS additions extend the A side's flags, `env=` included.
      max_memory: host memory one case may need, in GiB (default: half of the physical
        memory; `diag.plan.suite.memory_limit`).
      argv: the command line recorded in run.json.
      trace: profile each (case, backend) into the run folder, an XProf logdir, with
        per-op summaries and the optimised HLO (`diag.trace`).
      on_start: called with (number of planned records, backend names) before workers start.
      on_record: called with each record as it is written.
      job_fields: more fields of every worker's `diag.worker.protocol.Job` (preflight's hooks).

    Returns:
      RunResult with the run folder, the records and the final state.

    Raises:
      SuiteError, UsageError: before anything is written: a bad suite or backend name, a
        suite with no case for these backends, a case needing more host memory than
        `max_memory`, bad XLA_FLAGS/LIBTPU_INIT_ARGS for a JAX backend (`BadFlag`).
      Interrupted: Ctrl-C; the run folder is kept and marked `interrupted`.
    """
    _check_numbers(repeats, repeat_budget, max_memory)
    loaded = _loaded(suite, max_memory, case_timeout)
    workers_env, ab_env, plan = _check_plan(loaded, backends, env, ab)
    run_id = new_run_id()
    work = Path(tempfile.mkdtemp(prefix=f"diag-{run_id}-"))
    judge = Judge(work, cache_dir)
    specs, skipped, parked, run_dir = _start(
        plan, backends, workers_env, judge, work, out, run_id, argv
    )
    plan = _planned(run_dir, plan, specs, skipped, ab, ab_env)
    r = BackendRuns(
        plan,
        skipped,
        run_dir,
        judge,
        repeats=repeats,
        repeat_budget=repeat_budget,
        case_timeout=case_timeout,
        startup_timeout=startup_timeout,
        ab_env=ab_env,
        env=workers_env,
        on_record=on_record,
        job_fields=job_fields,
    )
    return _drive(r, skipped, parked, backends, work, trace, on_start)


def _loaded(suite: str | Suite, max_memory: float | None, timeout: float) -> Suite:
    """The suite, loaded (its users' functions prepared within `timeout`) and checked against
    the host memory limit."""
    if isinstance(suite, Suite):
        check_memory(suite, max_memory)
        return suite
    return load_suite(suite, max_memory=max_memory, timeout=timeout)


def _planned(run_dir: RunDir, plan: Plan, specs: list, skipped: dict, ab, ab_env) -> Plan:
    """The plan over the backends to run (each with its B side in an A/B run), written into
    run.json: those with a case to run (a JAX user's function plans no torch backend, whose
    worker would start, run nothing and show in the time line)."""
    specs = plan.with_specs(specs).backends_run()
    if ab_env:
        specs = with_b_sides(specs)
    loaded = plan.suite
    run_dir.update_meta(
        suite={"name": loaded.name, "path": loaded.path, "cases": len(loaded.cases)},
        backends_planned=[s.label for s in specs],
        backends_skipped=skipped,
        ab={"B": list(ab or []), "env": ab_env} if ab_env else None,
        report_sections=REPORT_SECTIONS,
    )
    return plan.with_specs(specs)


def _check_plan(loaded: Suite, backends, env, ab) -> tuple:
    """(workers' environment, the A/B side's, the plan over the candidate backends), refusing
    a plan with no case for these backends or bad XLA flags before anything is written."""
    workers_env = worker_env(env)
    ab_env = parse_ab(ab, base=workers_env)
    plan = Plan.of(loaded, candidate_backends(backends))
    plan.check()
    check_flags(list(plan.specs), workers_env, ab_env)
    return workers_env, ab_env, plan


def _check_numbers(repeats: int, repeat_budget: float, max_memory: float | None) -> None:
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    if not repeat_budget >= 0:
        raise UsageError(f"repeat_budget must be a number of seconds >= 0, got {repeat_budget}")
    if max_memory is not None and not max_memory > 0:
        raise UsageError(f"max_memory must be a positive number of GiB, got {max_memory}")


def _start(
    plan: Plan,
    backends,
    workers_env,
    judge: Judge,
    work: Path,
    out,
    run_id: str,
    argv,
) -> tuple:
    """Inputs written while the frameworks list their devices; the run folder created.
    Returns (specs, skipped, parked workers, run folder)."""
    parked: dict[str, Worker] = {}
    try:
        # Every input is drawn and written while the frameworks list their devices, which
        # the host would otherwise wait for idle (~0.4 s of the matmul suite's start).
        with ThreadPoolExecutor(1) as pool:
            written = pool.submit(judge.store.write_inputs, plan.cases_run())
            specs, skipped, parked = resolve_backends(backends, workers_env)
            written.result()
        if not backends:  # a default run lists absent backends that had something to run
            skipped = {n: why for n, why in skipped.items() if plan.runs_anything(n)}
        try:
            run_dir = RunDir.create(out, run_id, environment.collect(argv))
        except OSError as e:
            why = (
                no_space(out)
                if is_no_space(e)
                else f"{e.strerror or e}; pass --out with a writable folder"
            )
            raise UsageError(f"cannot create a run folder under '{out}': {why}") from None
    except BaseException:
        for worker in parked.values():
            worker.kill()
        shutil.rmtree(work, ignore_errors=True)
        raise
    return specs, skipped, parked, run_dir


def _drive(
    r: BackendRuns,
    skipped: dict,
    parked: dict,
    backends,
    work: Path,
    trace: bool,
    on_start,
) -> RunResult:
    """Run every backend in turn; whatever happens, finish the run folder (state, counts).
    Raises `Interrupted` (holding the result) after Ctrl-C."""
    run_dir, specs = r.run_dir, list(r.plan.specs)
    r.trace = run_dir.path if trace else None
    r.parked = parked
    r.left.update(c.id for spec in specs for c in r.plan.cases(spec))
    state = "finished"
    # The host's BLAS (the |A||B| of matmul bounds) on one thread: OpenBLAS's idle threads spin
    # after each call, taking CPU from the backend under test (matmul suite, 2 cores: ~1.5 CPU-s
    # and ~1 s of wall less). Threads split the product's rows and columns, never K: the same bits.
    blas = threadpool_limits(limits=1, user_api="blas")
    planned = r.plan.records() + len(skipped)
    ended: int | None = None  # the exit code of a run that did not finish
    try:
        if on_start:
            on_start(planned, [s.label for s in specs])
        r.skip_records(requested=bool(backends))
        for s in [] if r.ab is not None or trace else start_beside(specs, parked):
            r.started[s.label] = r.start_worker(s, r.plan.cases(s))  # CPU: side by side
        for spec in specs:
            r.run_backend(spec)
        r.unpaired()  # a pair a timeout or an error left uncompared: an error record
        if trace and r.ab is not None:  # the first XLA pass where A and B differ
            trace_passes.attribute_run(r)
    except KeyboardInterrupt as e:
        # Ctrl-C ends the process with 130; the CLI's SIGTERM (a KeyboardInterrupt carrying
        # `exit_code`) with 143.
        state, ended = "interrupted", ended_by(e)
    except BaseException as e:  # a bug in diag itself, a full disk: keep the records, say why
        state = "aborted"
        ended = exit_code(bad_file=True) if is_no_space(e) else ended_by(e)
        with contextlib.suppress(OSError):  # the disk may be full: as much as can be written
            run_dir.update_meta(error=f"{type(e).__name__}: {e}")
        if is_no_space(e):
            raise UsageError(
                run_disk_full(run_dir.path, run_dir.results_jsonl, len(r.records), planned)
            ) from None
        raise
    finally:
        counts = _finish(r, state, work, planned, blas, ended)
    result = RunResult(
        run_dir=run_dir.path, records=r.records, state=state, counts=counts, phases=r.phases()
    )
    if state == "interrupted":
        raise Interrupted(result)
    return result


def _finish(
    r: BackendRuns, state: str, work: Path, planned: int, blas, ended: int | None
) -> dict[str, int]:
    """Reap the workers, remove the work folder, write run.json's final state and counts
    (a run that did not finish: verdict `incomplete` and the exit code it ends with)."""
    run_dir = r.run_dir
    for worker in r.exiting:  # a clean exit, unless the run was cut short
        worker.reap(30.0 if state == "finished" else 0.0)
    for worker in filter(None, [r.worker, *r.parked.values(), *r.started.values()]):
        worker.kill()
    shutil.rmtree(work, ignore_errors=True)  # before run.json: that write may fail
    if state != "finished":
        # A signal can land between a record's write to results.jsonl and its bookkeeping
        # here: what the run folder holds is what the counts and the caller are told.
        r.records = run_dir.records()
    statuses = [rec["status"] for rec in r.records]
    counts: dict[str, int] = {s: statuses.count(s) for s in COUNTED}
    try:
        run_dir.update_meta(
            state=state,
            finished=time.time(),
            counts=counts,
            phases=r.phases(),
            verdict=run_verdict(state, worst_status(statuses)),
            exit_code=ended,
            backends=r.backend_info,
        )
    except OSError as e:
        if state == "aborted":  # an aborted run already says why; this is the same cause
            pass
        elif is_no_space(e):
            raise UsageError(
                run_disk_full(run_dir.path, run_dir.results_jsonl, len(r.records), planned)
            ) from None
        else:
            raise
    finally:
        blas.restore_original_limits()  # last: nothing above is skipped if it raises
    return counts
