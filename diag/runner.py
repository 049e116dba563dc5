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
import json
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from diag import environment
from diag.ab import Experiment, parse_ab, with_b_sides
from diag.backends import BackendSpec, not_applicable
from diag.compare.outcome import Outcome
from diag.errors import UsageError
from diag.flags import check_flags
from diag.judge import Judge
from diag.outputs import is_no_space, no_space, run_disk_full
from diag.protocol import CaseJob, Job
from diag.registry import PROBES, REPORT_SECTIONS
from diag.results import Interrupted, Record, RunDir, RunResult, new_run_id, worst_status
from diag.suite import Case, Suite, check_applicable, check_memory, load_suite, planned_records
from diag.trace import capture as trace_capture
from diag.trace import passes as trace_passes
from diag.workers import Worker, candidate_backends, resolve_backends, worker_env

__all__ = ["run", "RunResult", "Interrupted", "resolve_backends", "candidate_backends",
           "check_applicable", "check_flags", "parse_ab", "DEFAULT_CASE_TIMEOUT"]

DEFAULT_CASE_TIMEOUT = 600.0

#: Seconds of timed runs after which a case stops repeating (`run(repeat_budget=...)`): about
#: what `timeit.Timer.autorange` aims for; a case slower than this is timed once.
DEFAULT_REPEAT_BUDGET = 0.25

#: Where a backend's time goes, in run.json's `phases`: its worker's start (import, device, the
#: fingerprints it measures after the cases), compile, timed runs, transfers and the NaN hunt
#: of non-finite outputs (in the worker), then on the host the ground truth, judging and
#: writing records; `wall` is the whole, wall minus the rest the protocol's own cost.
PHASES = ("start", "compile", "run", "transfer", "hunt", "truth", "judge", "write", "wall")
DEFAULT_STARTUP_TIMEOUT = 300.0
MAX_RESTARTS = 3


class _Run:
    def __init__(self, suite: Suite, skipped: dict[str, str], run_dir: RunDir, judge: Judge, *,
                 repeats: int, repeat_budget: float, case_timeout: float, startup_timeout: float,
                 env: dict[str, str], ab_env: dict[str, str] | None = None,
                 on_record: Callable[[dict], None] | None):
        self.suite, self.skipped = suite, skipped
        self.run_dir, self.work = run_dir, judge.work
        self.repeats, self.case_timeout = repeats, case_timeout
        self.startup_timeout = startup_timeout
        self.repeat_budget = repeat_budget
        self.env = env
        self.on_record = on_record
        self.judge = judge
        self.inputs = self.judge.inputs
        self.records: list[dict[str, Any]] = []
        # case id -> backend label -> (its spec, its result event, its output digests): the
        # outputs stay files in the work folder, mapped again when a later backend's output
        # is compared with them, until every backend is done with the case (`finished`)
        self.outcomes: dict[str, dict[str, tuple[BackendSpec, dict, list[str] | None]]] = {}
        self.left: Counter[str] = Counter()  # case id -> backends yet to report it
        self.backend_info: dict[str, Any] = {}
        self.worker: Worker | None = None
        self.exiting: list[Worker] = []  # done with their job, exiting (`Worker.finish`)
        #: framework -> the worker that listed its devices, parked for its first backend
        self.parked: dict[str, Worker] = {}
        self.ab = Experiment(ab_env, run_dir.path) if ab_env else None
        self.verdicts: dict[str, dict[str, dict]] = {}  # case id -> backend label -> its record
        self.trace: Path | None = None  # the run folder when traced (diag.trace)

    def plan(self, spec: BackendSpec) -> list[Case]:
        return [c for c in self.suite.cases if not_applicable(spec, c.op, c.params) is None]

    def finished(self, case: Case) -> None:
        """A backend is done with `case`. After the last, the case's output files go: their
        page cache is reused by the next outputs instead of growing by every output of the
        suite (matmul: ~1.2 GB per run; on a VM whose host takes back free pages, as on
        diag's 2-core development machines, touching new memory took ~2.6 s per GB)."""
        self.left[case.id] -= 1
        if self.left[case.id] <= 0:
            for _, event, _ in self.outcomes.get(case.id, {}).values():
                for output in event.get("outputs") or []:
                    self.judge.release(output["path"])

    def emit(self, record: Record) -> None:
        record.run_id = self.run_dir.path.name
        self.run_dir.append(record)
        data = record.to_json()
        self.records.append(data)
        if self.on_record:
            self.on_record(data)

    def _record(self, case: Case, spec: BackendSpec, status: str, reason: str,
                **extra: Any) -> Record:
        info = self.backend_info.get(spec.label, {})
        return Record(op=case.op, probe=f"{self.suite.name}.{case.probe}", case=case.label,
                      params=case.params, backend=spec.label, variant=spec.variant,
                      device=info.get("device", {}),
                      dtype=case.dtype, metrics=extra.pop("metrics", {}), status=status,
                      reason=reason, framework=info.get("framework", {}),
                      settings=info.get("settings") or {}, **extra)

    def error(self, case: Case, spec: BackendSpec, reason: str) -> None:
        self.emit(self._record(case, spec, "error", reason))

    def judge_result(self, case: Case, spec: BackendSpec, event: dict) -> None:
        judge, label = self.judge, spec.label
        if event.get("input_digests") != self.inputs.digests(case):
            self.error(case, spec, f"{spec.label}: the inputs on the device are not bit-identical "
                                   f"to the host's (a transfer or conversion changed them)")
            return
        t0 = time.perf_counter()
        oracle_info = judge.oracle_info(case)
        t0 = judge.clock(label, "truth", t0)
        shapes = ", ".join(f"{o.get('name')} {o.get('dtype')}{o.get('shape')}"
                           for o in event.get("outputs") or []) or "no outputs"
        try:
            outcome = judge.outcome(case, spec, event)
            ev = judge.evaluate(case, spec, outcome)
        except Exception as e:  # an output diag cannot judge is this case's error, not the run's
            self.emit(self._record(
                case, spec, "error", f"{spec.label}: cannot judge the output ({shapes}): "
                                     f"{type(e).__name__}: {e}"[:500],
                metrics={"traceback": traceback.format_exc()[-2000:]},
                timings=event.get("timings", {}), oracle=oracle_info))
            return
        # sha256 of each output's bits: what `diag check --bitwise` compares.
        digests = outcome.digests
        t0 = judge.clock(label, "judge", t0)
        self.emit(self._record(case, spec, ev.status, ev.reason,
                               metrics={**ev.metrics, "output_digests": digests},
                               timings=event.get("timings", {}), oracle=oracle_info))
        t0 = judge.clock(label, "write", t0)
        self.verdicts.setdefault(case.id, {})[spec.label] = self.records[-1]
        if event.get("hlo") and self.ab is not None:
            self.ab.hlo[case.id, spec.label] = event["hlo"]
        self.agree(case, spec, outcome, ev.context)
        self.outcomes.setdefault(case.id, {})[spec.label] = (spec, event, digests)
        judge.clock(label, "judge", t0)

    def agree(self, case: Case, spec: BackendSpec, outcome: Outcome, context: Any) -> None:
        """Agreement records of this output with every earlier backend's for the same case,
        judged with what this output was just judged by (`context`, e.g. its bound)."""
        probe = PROBES[case.op]
        name = spec.label
        for earlier, (espec, event, digests) in self.outcomes.get(case.id, {}).items():
            other = self.judge.outcome(case, espec, event, digests)
            if espec.variant or spec.variant:
                # An A/B side is compared with its own backend's other side only.
                if self.ab is not None and espec.name == spec.name and not espec.variant:
                    verdicts = (self.verdicts[case.id][earlier], self.verdicts[case.id][name])
                    status, reason, metrics = self.ab.attribute(
                        case.id, earlier, other, name, outcome, verdicts, probe.agree, context)
                    self.emit(self._pair_record(case, f"{earlier}|{name}", "ab", status,
                                                reason, metrics))
                continue
            (a, x), (b, y) = sorted([(earlier, other), (name, outcome)], key=lambda p: p[0])
            try:
                status, reason, metrics = probe.agree(x, y, (a, b), context)
            except Exception as e:  # as in judge_result: one pair's error, not the run's
                status, reason = "error", (f"cannot compare {a} and {b}: "
                                           f"{type(e).__name__}: {e}")[:500]
                metrics = {"traceback": traceback.format_exc()[-2000:]}
            self.emit(self._pair_record(case, f"{a}|{b}", "agreement", status, reason, metrics))

    def _pair_record(self, case: Case, backends: str, kind: str, status: str, reason: str,
                     metrics: dict) -> Record:
        """A record about two outputs of one case (`agreement`, `ab`): no single device."""
        return Record(op=case.op, probe=f"{self.suite.name}.{case.probe}", case=case.label,
                      params=case.params, backend=backends, device={}, dtype=case.dtype,
                      metrics=metrics, status=status, reason=reason, kind=kind)

    def run_backend(self, spec: BackendSpec) -> None:
        t0 = time.perf_counter()
        try:
            self._run_backend(spec)
        finally:
            self.judge.clock(spec.label, "wall", t0)

    def phases(self) -> dict[str, dict[str, float]]:
        """Seconds per phase (`PHASES`) per backend label, rounded for run.json."""
        return {label: {p: round(seconds.get(p, 0.0), 3) for p in PHASES}
                for label, seconds in self.judge.seconds.items()}

    def _run_backend(self, spec: BackendSpec) -> None:
        pending = self.plan(spec)
        self.judge.write_inputs(pending)  # before the worker starts (written once per run)
        crashes = 0
        while pending:
            pending, started, cause = self._run_worker(spec, pending)
            if not pending:
                return
            crashes += 1
            # A worker that never became ready will not on a retry (broken install, bad
            # flags, a device another process holds); one that crashed mid-run may have hit
            # one bad case, so it is restarted for the rest, a few times.
            if not started or crashes > MAX_RESTARTS:
                why = (f"the worker failed to start ({cause})" if not started else
                       f"the worker crashed {crashes} times (last: {cause})")
                for case in pending:
                    self.error(case, spec, f"{spec.label}: not run: {why}")
                return

    def _run_worker(self, spec: BackendSpec,
                    cases: list[Case]) -> tuple[list[Case], bool, str]:
        """Run cases in one worker.

        Returns:
          (cases not reached when it died, whether it became ready, the cause of death).
          The case it died on gets an `error` record here.
        """
        # The arithmetic of each precision setting the fingerprinted cases use, measured in the
        # worker (diag.precision): what a verdict under that setting can be checked against.
        fingerprinted = [c for c in cases if PROBES[c.op].fingerprint]
        settings = {("default", "none")} | {
            (c.params.get("precision", "default"), c.params.get("precision_via", "none"))
            for c in fingerprinted}
        job = Job(backend=spec.name, label=spec.label, out_dir=str(self.work),
                  repeats=self.repeats, repeat_budget_s=self.repeat_budget,
                  hlo=self.ab is not None,
                  trace=trace_capture.job_field(self.trace, cases),  # --trace (diag.trace)
                  fingerprint=sorted(settings, key=lambda p: (p != ("default", "none"), p))
                  if fingerprinted else [],
                  cases=[CaseJob(id=c.id, op=c.op,
                                 op_args={**PROBES[c.op].fixed_args, **c.op_args},
                                 hunt_nans=PROBES[c.op].hunt_nans,
                                 inputs=self.inputs.paths(c),
                                 input_dtypes=self.inputs.dtypes(c))
                         for c in cases])
        job_path = self.work / f"job-{spec.label}.json"
        job_path.write_text(json.dumps(job.to_json()))
        logs = self.run_dir.path / "logs"
        logs.mkdir(exist_ok=True)
        env = self.ab.worker_env(spec, self.env) if self.ab is not None else self.env
        spawned = time.perf_counter()
        log = logs / f"{spec.label}.stderr"
        parked = self.parked.pop(spec.framework, None) if env == self.env else None
        if parked is not None:  # its framework is imported already: it starts the job now
            parked.adopt(spec, job_path, log)
            self.worker = worker = parked
        else:
            self.worker = worker = Worker.for_job(spec, job_path, log, env)
        seconds = self.judge.seconds[spec.label]
        by_id = {c.id: c for c in cases}
        index = 0
        started = False
        try:
            while True:
                # After its last case a worker measures its arithmetic (part of its start,
                # `_arithmetic` in the worker): the start's timeout, not one case's.
                timeout = (self.case_timeout if started and index < len(cases)
                           else self.startup_timeout)
                try:
                    event = worker.next_event(timeout)
                except queue.Empty:
                    worker.kill()
                    if index >= len(cases):  # every case reported: it hung measuring after them
                        self.no_arithmetic(spec, timeout)
                        return [], started, ""
                    what = "finish the case" if started else "start (import and open its device)"
                    cause = f"worker hung: did not {what} within {timeout:g} s (timeout); killed"
                    self.error(cases[index], spec, f"{spec.label}: {cause}")
                    return cases[index + 1:], started, cause
                if event is None:
                    if index >= len(cases):
                        return [], started, ""
                    cause = f"worker died: {worker.death()}"
                    self.error(cases[index], spec, f"{spec.label}: {cause}")
                    return cases[index + 1:], started, cause
                kind = event.get("event")
                if kind == "ready":
                    started = True
                    self.judge.clock(spec.label, "start", spawned)
                    self.backend_info[spec.label] = {
                        k: event[k] for k in ("device", "framework", "settings") if k in event}
                elif kind == "arithmetic":  # measured after the cases; part of its start
                    seconds["start"] += event.pop("seconds", 0.0)
                    self.backend_info.setdefault(spec.label, {}).update(
                        (k, event[k]) for k in ("fingerprints", "features") if k in event)
                elif kind == "result":
                    t = event.get("timings") or {}
                    seconds["compile"] += t.get("compile_s", 0.0)
                    seconds["run"] += sum(t.get("run_s_samples", ()))
                    seconds["transfer"] += t.get("transfer_s", 0.0)
                    seconds["hunt"] += t.get("hunt_s", 0.0)
                    if t.get("compile_shared_with") in by_id:  # the worker names ids
                        t["compile_shared_with"] = by_id[t["compile_shared_with"]].label
                    self.judge_result(by_id[event["case"]], spec, event)
                    self.finished(by_id[event["case"]])
                    index += 1
                elif kind == "case_error":
                    self.error(by_id[event["case"]], spec, f"{spec.label}: {event['error']}")
                    self.finished(by_id[event["case"]])
                    index += 1
                elif kind == "done":
                    if worker.finish():
                        self.exiting.append(worker)
                    return [], started, ""
        finally:
            if worker not in self.exiting:
                worker.kill()

    def no_arithmetic(self, spec: BackendSpec, timeout: float) -> None:
        """Hung after its last case, measuring its arithmetic: every record is kept; run.json's
        backend entry says why it holds no fingerprints."""
        self.backend_info.setdefault(spec.label, {})["arithmetic_error"] = (
            f"worker hung measuring its arithmetic after the last case: {timeout:g} s; killed")

    def skip_records(self, requested: bool) -> None:
        """A record per backend that cannot run: `skip` in a default run, `error` when the
        user named it (a run asked to check a backend must not pass without it)."""
        for name, reason in self.skipped.items():
            status, why = ("error", f"{name}: not run although asked for: {reason}") \
                if requested else ("skip", f"{name}: {reason}")
            self.emit(Record(op="*", probe=f"{self.suite.name}", case="*", params={},
                             backend=name, device={}, dtype="*", metrics={},
                             status=status, reason=why))


def run(suite: str | Suite = "matmul", backends: list[str] | None = None, *,
        out: str | os.PathLike = "reports", repeats: int = 3,
        repeat_budget: float = DEFAULT_REPEAT_BUDGET,
        case_timeout: float = DEFAULT_CASE_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT, cache_dir: str | None = None,
        env: dict[str, str] | None = None, ab: list[str] | None = None,
        max_memory: float | None = None, argv: list[str] | None = None, trace: bool = False,
        on_start: Callable[[int, list[str]], None] | None = None,
        on_record: Callable[[dict], None] | None = None) -> RunResult:
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
        memory; `diag.suite.memory_limit`).
      argv: the command line recorded in run.json.
      trace: profile each (case, backend) into the run folder, an XProf logdir, with
        per-op summaries and the optimised HLO (`diag.trace`).
      on_start: called with (number of planned records, backend names) before workers start.
      on_record: called with each record as it is written.

    Returns:
      RunResult with the run folder, the records and the final state.

    Raises:
      SuiteError, UsageError: before anything is written: a bad suite or backend name, a
        suite with no case for these backends, a case needing more host memory than
        `max_memory`, bad XLA_FLAGS/LIBTPU_INIT_ARGS for a JAX backend (`BadFlag`).
      Interrupted: Ctrl-C; the run folder is kept and marked `interrupted`.
    """
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    if not repeat_budget >= 0:
        raise UsageError(f"repeat_budget must be a number of seconds >= 0, got {repeat_budget}")
    if max_memory is not None and not max_memory > 0:
        raise UsageError(f"max_memory must be a positive number of GiB, got {max_memory}")
    if isinstance(suite, Suite):
        loaded = suite
        check_memory(loaded, max_memory)
    else:
        loaded = load_suite(suite, max_memory=max_memory, timeout=case_timeout)
    workers_env = worker_env(env)
    ab_env = parse_ab(ab, base=workers_env)
    candidates = candidate_backends(backends)
    check_applicable(loaded, candidates)
    check_flags(candidates, workers_env, ab_env)
    run_id = new_run_id()
    work = Path(tempfile.mkdtemp(prefix=f"diag-{run_id}-"))
    judge = Judge(work, cache_dir)
    parked: dict[str, Worker] = {}
    try:
        # Every input is drawn and written while the frameworks list their devices, which
        # the host would otherwise wait for idle (~0.4 s of the matmul suite's start).
        with ThreadPoolExecutor(1) as pool:
            written = pool.submit(judge.write_inputs, [
                c for c in loaded.cases
                if any(not_applicable(s, c.op, c.params) is None for s in candidates)])
            specs, skipped, parked = resolve_backends(backends, workers_env)
            written.result()
        try:
            run_dir = RunDir.create(out, run_id, environment.collect(argv))
        except OSError as e:
            why = no_space(out) if is_no_space(e) else f"{e.strerror or e}; pass --out with a " \
                "writable folder"
            raise UsageError(f"cannot create a run folder under '{out}': {why}") from None
    except BaseException:
        for worker in parked.values():
            worker.kill()
        shutil.rmtree(work, ignore_errors=True)
        raise
    if ab_env:
        specs = with_b_sides(specs)
    run_dir.update_meta(suite={"name": loaded.name, "path": loaded.path,
                               "cases": len(loaded.cases)},
                        backends_planned=[s.label for s in specs], backends_skipped=skipped,
                        ab={"B": list(ab or []), "env": ab_env} if ab_env else None,
                        report_sections=REPORT_SECTIONS)
    state = "finished"
    r = _Run(loaded, skipped, run_dir, judge, repeats=repeats, repeat_budget=repeat_budget,
             case_timeout=case_timeout, startup_timeout=startup_timeout, ab_env=ab_env,
             env=workers_env, on_record=on_record)
    r.trace = run_dir.path if trace else None
    r.parked = parked
    r.left.update(c.id for spec in specs for c in r.plan(spec))
    # The host's BLAS (the |A||B| of matmul bounds) on one thread: OpenBLAS's idle threads spin
    # after each call, taking CPU from the backend under test (matmul suite, 2 cores: ~1.5 CPU-s
    # and ~1 s of wall less). Threads split the product's rows and columns, never K: the same bits.
    blas = threadpool_limits(limits=1, user_api="blas")
    planned = planned_records(loaded, specs) + len(skipped)
    try:
        if on_start:
            on_start(planned, [s.label for s in specs])
        r.skip_records(requested=bool(backends))
        for spec in specs:
            r.run_backend(spec)
        if trace and r.ab is not None:  # the first XLA pass where A and B differ
            trace_passes.attribute_run(r)
    except KeyboardInterrupt:
        state = "interrupted"
    except BaseException as e:  # a bug in diag itself, a full disk: keep the records, say why
        state = "aborted"
        with contextlib.suppress(OSError):  # the disk may be full: as much as can be written
            run_dir.update_meta(error=f"{type(e).__name__}: {e}")
        if is_no_space(e):
            raise UsageError(run_disk_full(run_dir.path, run_dir.results_jsonl, len(r.records),
                                           planned)) from None
        raise
    finally:
        for worker in r.exiting:  # a clean exit, unless the run was cut short
            worker.reap(30.0 if state == "finished" else 0.0)
        for worker in filter(None, [r.worker, *r.parked.values()]):
            worker.kill()
        shutil.rmtree(work, ignore_errors=True)  # before run.json: that write may fail
        if state != "finished":
            # A signal can land between a record's write to results.jsonl and its bookkeeping
            # here: what the run folder holds is what the counts and the caller are told.
            r.records = run_dir.records()
        statuses = [rec["status"] for rec in r.records]
        counts = {s: statuses.count(s) for s in ("pass", "warn", "fail", "error", "skip")}
        try:
            run_dir.update_meta(state=state, finished=time.time(), counts=counts,
                                phases=r.phases(), verdict=worst_status(statuses),
                                backends=r.backend_info)
        except OSError as e:
            if state == "aborted":  # an aborted run already says why; this is the same cause
                pass
            elif is_no_space(e):
                raise UsageError(run_disk_full(run_dir.path, run_dir.results_jsonl,
                                               len(r.records), planned)) from None
            else:
                raise
        finally:
            blas.restore_original_limits()  # last: nothing above is skipped if it raises
    result = RunResult(run_dir=run_dir.path, records=r.records, state=state, counts=counts,
                       phases=r.phases())
    if state == "interrupted":
        raise Interrupted(result)
    return result

