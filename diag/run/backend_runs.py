"""The state of one run while its backends run one after another (`diag.run.runner.run` drives
it): each backend's worker started with its job, its events taken as they arrive, each result
judged and recorded, agreement and A/B records between backends, a crashed worker restarted
for the cases it had not reached, and where each backend's time went (`PHASES`).
"""

from __future__ import annotations

import json
import queue
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diag.backends import BackendSpec
from diag.compare.outcome import Outcome
from diag.plan.plan import Plan
from diag.plan.registry import PROBES
from diag.plan.suite import Case
from diag.records.results import Record, RunDir
from diag.run.ab import Experiment
from diag.run.judge import Judge
from diag.status import Status
from diag.trace import capture as trace_capture
from diag.worker.host import Worker
from diag.worker.protocol import Arithmetic, CaseError, CaseJob, Done, Event, Job, Ready, Result

__all__ = ["BackendRuns", "PHASES", "MAX_RESTARTS"]

#: Where a backend's time goes, in run.json's `phases`: its worker's start (import, device, the
#: fingerprints it measures after the cases), compile, timed runs, transfers and the NaN hunt
#: of non-finite outputs (in the worker), then on the host the ground truth, judging and
#: writing records; `wall` is the whole, wall minus the rest the protocol's own cost.
PHASES = ("start", "compile", "run", "transfer", "hunt", "truth", "judge", "write", "wall")
MAX_RESTARTS = 3


class BackendRuns:
    """One run's state while its backends run one after another: workers, records as they
    arrive, agreement and A/B records between backends, and where each backend's time went."""

    def __init__(
        self,
        plan: Plan,
        skipped: dict[str, str],
        run_dir: RunDir,
        judge: Judge,
        *,
        repeats: int,
        repeat_budget: float,
        case_timeout: float,
        startup_timeout: float,
        env: dict[str, str],
        ab_env: dict[str, str] | None = None,
        on_record: Callable[[dict], None] | None,
        job_fields: dict[str, Any] | None = None,
    ):
        self.plan, self.suite, self.skipped = plan, plan.suite, skipped
        self.run_dir, self.work = run_dir, judge.store.work
        self.repeats, self.case_timeout = repeats, case_timeout
        self.startup_timeout = startup_timeout
        self.repeat_budget = repeat_budget
        self.env = env
        self.on_record = on_record
        self.job_fields = job_fields or {}  # every job's fields on top of the run's
        self.judge = judge
        self.inputs = self.judge.store.inputs
        self.records: list[dict[str, Any]] = []
        # case id -> backend label -> (its spec, its result event, its output digests): the
        # outputs stay files in the work folder, mapped again when a later backend's output
        # is compared with them, until every backend is done with the case (`finished`)
        self.outcomes: dict[str, dict[str, tuple[BackendSpec, Result, list[str] | None]]] = {}
        self.left: Counter[str] = Counter()  # case id -> backends yet to report it
        self.backend_info: dict[str, Any] = {}
        self.worker: Worker | None = None
        self.exiting: list[Worker] = []  # done with their job, exiting (`Worker.finish`)
        #: framework -> the worker that listed its devices, parked for its first backend
        self.parked: dict[str, Worker] = {}
        self.started: dict[str, Worker] = {}  # label -> its worker, started beside others
        self.ab = Experiment(ab_env, run_dir.path) if ab_env else None
        self.verdicts: dict[str, dict[str, dict]] = {}  # case id -> backend label -> its record
        self.paired: set[tuple[str, str]] = set()  # (case id, `a|b`) of pair records written
        self.trace: Path | None = None  # the run folder when traced (diag.trace)

    def finished(self, case: Case) -> None:
        """A backend is done with `case`. After the last, the case's output files go: their
        page cache is reused by the next outputs instead of growing by every output of the
        suite (matmul: ~1.2 GB per run; on a VM whose host takes back free pages, as on
        diag's 2-core development machines, touching new memory took ~2.6 s per GB)."""
        self.left[case.id] -= 1
        if self.left[case.id] <= 0:
            for _, event, _ in self.outcomes.get(case.id, {}).values():
                for output in event.outputs:
                    self.judge.store.release(output["path"])

    def emit(self, record: Record) -> None:
        record.run_id = self.run_dir.path.name
        self.run_dir.append(record)
        data = record.to_json()
        self.records.append(data)
        if self.on_record:
            self.on_record(data)

    def _record(
        self, case: Case, spec: BackendSpec, status: str, reason: str, **extra: Any
    ) -> Record:
        info = self.backend_info.get(spec.label, {})
        return Record(
            op=case.op,
            probe=f"{self.suite.name}.{case.probe}",
            case=case.label,
            params=case.params,
            backend=spec.label,
            variant=spec.variant,
            device=info.get("device", {}),
            dtype=case.dtype,
            metrics=extra.pop("metrics", {}),
            status=status,
            reason=reason,
            framework=info.get("framework", {}),
            settings=info.get("settings") or {},
            **extra,
        )

    def error(self, case: Case, spec: BackendSpec, reason: str) -> None:
        self.emit(self._record(case, spec, Status.ERROR, reason))

    def judge_result(self, case: Case, spec: BackendSpec, event: Result) -> None:
        judge, label = self.judge, spec.label
        if event.input_digests != self.inputs.digests(case):
            self.error(
                case,
                spec,
                f"{spec.label}: the inputs on the device are not bit-identical "
                f"to the host's (a transfer or conversion changed them)",
            )
            return
        t0 = time.perf_counter()
        oracle_info = judge.store.oracle_info(case)
        t0 = judge.clock(label, "truth", t0)
        shapes = (
            ", ".join(f"{o.get('name')} {o.get('dtype')}{o.get('shape')}" for o in event.outputs)
            or "no outputs"
        )
        try:
            outcome = judge.outcome(case, spec, event)
            ev = judge.evaluate(case, spec, outcome)
        except Exception as e:  # an output diag cannot judge is this case's error, not the run's
            self.emit(
                self._record(
                    case,
                    spec,
                    Status.ERROR,
                    f"{spec.label}: cannot judge the output ({shapes}): {type(e).__name__}: {e}"[
                        :500
                    ],
                    metrics={"traceback": traceback.format_exc()[-2000:]},
                    timings=event.timings,
                    oracle=oracle_info,
                )
            )
            return
        # sha256 of each output's bits: what `diag check --bitwise` compares.
        digests = outcome.digests
        t0 = judge.clock(label, "judge", t0)
        self.emit(
            self._record(
                case,
                spec,
                ev.status,
                ev.reason,
                metrics={**ev.metrics, "output_digests": digests},
                timings=event.timings,
                oracle=oracle_info,
            )
        )
        t0 = judge.clock(label, "write", t0)
        self.verdicts.setdefault(case.id, {})[spec.label] = self.records[-1]
        if event.hlo and self.ab is not None:
            self.ab.hlo[case.id, spec.label] = event.hlo
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
                        case.id, earlier, other, name, outcome, verdicts, probe.agree, context
                    )
                    self.emit(
                        self._pair_record(case, f"{earlier}|{name}", "ab", status, reason, metrics)
                    )
                continue
            (a, x), (b, y) = sorted([(earlier, other), (name, outcome)], key=lambda p: p[0])
            try:
                verdict = probe.agree(x, y, (a, b), context)
                status, reason, metrics = verdict.status, verdict.reason, verdict.metrics
            except Exception as e:  # as in judge_result: one pair's error, not the run's
                status, reason = (
                    Status.ERROR,
                    (f"cannot compare {a} and {b}: {type(e).__name__}: {e}")[:500],
                )
                metrics = {"traceback": traceback.format_exc()[-2000:]}
            self.emit(self._pair_record(case, f"{a}|{b}", "agreement", status, reason, metrics))

    def _pair_record(
        self, case: Case, backends: str, kind: str, status: str, reason: str, metrics: dict
    ) -> Record:
        """A record about two outputs of one case (`agreement`, `ab`): no single device."""
        self.paired.add((case.id, backends))
        return Record(
            op=case.op,
            probe=f"{self.suite.name}.{case.probe}",
            case=case.label,
            params=case.params,
            backend=backends,
            device={},
            dtype=case.dtype,
            metrics=metrics,
            status=status,
            reason=reason,
            kind=kind,
        )

    def unpaired(self) -> None:
        """An `error` record for each planned agreement or A/B record (`Plan.pairs`) that
        was not written because a side has no judged output (it errored, timed out, or could
        not be judged), saying why: results.jsonl accounts for every record the run planned,
        and the count of records matches the count planned."""
        reasons = {(r["probe"], r["case"], r["backend"]): r["reason"] for r in self.records}
        for case in self.suite.cases:
            probe, judged = f"{self.suite.name}.{case.probe}", self.verdicts.get(case.id, {})
            for kind, a, b in self.plan.pairs(case):
                if (case.id, f"{a}|{b}") in self.paired:
                    continue
                why = [
                    f"{x} has no output: {_unlabelled(reasons.get((probe, case.label, x)), x)}"
                    for x in (a, b)
                    if x not in judged
                ]
                self.emit(
                    self._pair_record(
                        case, f"{a}|{b}", kind, Status.ERROR, "not compared: " + "; ".join(why), {}
                    )
                )

    def run_backend(self, spec: BackendSpec) -> None:
        t0 = self.started[spec.label].handed if spec.label in self.started else time.perf_counter()
        try:
            self._run_backend(spec)
        finally:
            self.judge.clock(spec.label, "wall", t0)

    def phases(self) -> dict[str, dict[str, float]]:
        """Seconds per phase (`PHASES`) per backend label, rounded for run.json."""
        return {
            label: {p: round(seconds.get(p, 0.0), 3) for p in PHASES}
            for label, seconds in self.judge.seconds.items()
        }

    def _run_backend(self, spec: BackendSpec) -> None:
        pending = self.plan.cases(spec)
        self.judge.store.write_inputs(pending)  # before the worker starts (written once per run)
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
                why = (
                    f"the worker failed to start ({cause})"
                    if not started
                    else f"the worker crashed {crashes} times (last: {cause})"
                )
                for case in pending:
                    self.error(case, spec, f"{spec.label}: not run: {why}")
                return

    def _job_path(self, spec: BackendSpec, cases: list[Case]) -> Path:
        """Write the worker's job (`diag.worker.protocol.Job`) for `cases` on `spec`."""
        # The arithmetic of each precision setting the fingerprinted cases use, measured in the
        # worker (diag.arith.precision): what a verdict under that setting can be checked against.
        fingerprinted = [c for c in cases if PROBES[c.op].fingerprint]
        settings = {("default", "none")} | {
            (c.params.get("precision", "default"), c.params.get("precision_via", "none"))
            for c in fingerprinted
        }
        job = Job(
            backend=spec.name,
            label=spec.label,
            out_dir=str(self.work),
            repeats=self.repeats,
            repeat_budget_s=self.repeat_budget,
            hlo=self.ab is not None,
            trace=trace_capture.job_field(self.trace, cases),  # --trace (diag.trace)
            fingerprint=sorted(settings, key=lambda p: (p != ("default", "none"), p))
            if fingerprinted
            else [],
            cases=[
                CaseJob(
                    id=c.id,
                    op=c.op,
                    op_args={**PROBES[c.op].fixed_args, **c.op_args},
                    hunt_nans=PROBES[c.op].hunt_nans,
                    inputs=self.inputs.paths(c),
                    input_dtypes=self.inputs.dtypes(c),
                )
                for c in cases
            ],
            **self.job_fields,
        )
        job_path = self.work / f"job-{spec.label}.json"
        job_path.write_text(json.dumps(job.to_json()))
        return job_path

    def start_worker(self, spec: BackendSpec, cases: list[Case]) -> Worker:
        """Write `spec`'s job of running `cases` and start its worker: the framework's parked
        one when it can take it (`diag.worker.host.Worker.adopt`), else a new one. Called for
        each backend in its turn, or up front for the CPU backends that start side by side
        (`diag.worker.host.start_beside`: the run reads their events in its turn)."""
        job_path = self._job_path(spec, cases)
        logs = self.run_dir.path / "logs"
        logs.mkdir(exist_ok=True)
        env = self.ab.worker_env(spec, self.env) if self.ab is not None else self.env
        log = logs / f"{spec.label}.stderr"
        parked = self.parked.pop(spec.framework, None) if env == self.env else None
        if parked is not None:  # its framework is imported already: it starts the job now
            parked.adopt(spec, job_path, log)
            return parked
        return Worker.for_job(spec, job_path, log, env)

    def _run_worker(self, spec: BackendSpec, cases: list[Case]) -> tuple[list[Case], bool, str]:
        """Run cases in one worker.

        Returns:
          (cases not reached when it died, whether it became ready, the cause of death).
          The case it died on gets an `error` record here.
        """
        worker = self.started.pop(spec.label, None) or self.start_worker(spec, cases)
        self.worker = worker
        by_id = {c.id: c for c in cases}
        index = 0
        started = False
        try:
            while True:
                # After its last case a worker measures its arithmetic (part of its start,
                # `_arithmetic` in the worker): the start's timeout, not one case's.
                timeout = (
                    self.case_timeout if started and index < len(cases) else self.startup_timeout
                )
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
                    return cases[index + 1 :], started, cause
                if event is None:
                    if index >= len(cases):
                        return [], started, ""
                    cause = f"worker died: {worker.death()}"
                    self.error(cases[index], spec, f"{spec.label}: {cause}")
                    return cases[index + 1 :], started, cause
                if isinstance(event, Done):
                    if worker.finish():
                        self.exiting.append(worker)
                    return [], started, ""
                if isinstance(event, Ready):
                    started = True
                    # Stamped on arrival, from the job handed over: a worker started beside
                    # another may have been ready long before its turn.
                    self.judge.seconds[spec.label]["start"] += worker.received - worker.handed
                index += self._on_event(spec, event, by_id)
        finally:
            if worker not in self.exiting:
                worker.kill()

    def _on_event(self, spec: BackendSpec, event: Event, by_id: dict[str, Case]) -> int:
        """Take one worker event (not `done`); returns how many cases it finished (0 or 1)."""
        seconds = self.judge.seconds[spec.label]
        if isinstance(event, Ready):
            self.backend_info[spec.label] = {
                "device": event.device,
                "framework": event.framework,
                "settings": event.settings,
            }
        elif isinstance(event, Arithmetic):  # measured after the cases; part of its start
            seconds["start"] += event.seconds
            self.backend_info.setdefault(spec.label, {}).update(
                fingerprints=event.fingerprints, features=event.features
            )
        elif isinstance(event, Result):
            t = event.timings
            seconds["compile"] += t.get("compile_s", 0.0)
            seconds["run"] += sum(t.get("run_s_samples", ()))
            seconds["transfer"] += t.get("transfer_s", 0.0)
            seconds["hunt"] += t.get("hunt_s", 0.0)
            if t.get("compile_shared_with") in by_id:  # the worker names ids
                t["compile_shared_with"] = by_id[t["compile_shared_with"]].label
            self.judge_result(by_id[event.case], spec, event)
            self.finished(by_id[event.case])
            return 1
        elif isinstance(event, CaseError):
            self.error(by_id[event.case], spec, f"{spec.label}: {event.error}")
            self.finished(by_id[event.case])
            return 1
        return 0

    def no_arithmetic(self, spec: BackendSpec, timeout: float) -> None:
        """Hung after its last case, measuring its arithmetic: every record is kept; run.json's
        backend entry says why it holds no fingerprints."""
        self.backend_info.setdefault(spec.label, {})["arithmetic_error"] = (
            f"worker hung measuring its arithmetic after the last case: {timeout:g} s; killed"
        )

    def skip_records(self, requested: bool) -> None:
        """A record per backend that cannot run: `skip` in a default run, `error` when the
        user named it (a run asked to check a backend must not pass without it)."""
        for name, reason in self.skipped.items():
            status, why = (
                (Status.ERROR, f"{name}: not run although asked for: {reason}")
                if requested
                else (Status.SKIP, f"{name}: {reason}")
            )
            self.emit(
                Record(
                    op="*",
                    probe=f"{self.suite.name}",
                    case="*",
                    params={},
                    backend=name,
                    device={},
                    dtype="*",
                    metrics={},
                    status=status,
                    reason=why,
                )
            )


def _unlabelled(reason: str | None, label: str) -> str:
    """A record's reason without its leading `label: ` (the pair's reason names the side)."""
    if reason is None:
        return "no record"
    return reason[len(label) + 2 :] if reason.startswith(f"{label}: ") else reason
