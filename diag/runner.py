"""Plan cases x backends, run each backend in its own worker, judge and record every result.

    suite -> cases -> inputs (numpy, seeded, written once) -> worker per backend -> compare
          -> results.jsonl (appended as each record arrives), with agreement across backends

The host never imports a framework. A worker that is missing its framework, crashes, or hangs
past its timeout becomes `skip`/`error` records and the run goes on with the next backend; a
crashed worker is restarted for the cases it had not reached.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diag import environment, numerics
from diag.backends import BACKENDS, BackendSpec, framework_installed, get_spec, not_applicable
from diag.backends import promises_full_precision
from diag.compare import agreement, compare, judge, judge_agreement
from diag.errors import EXIT_NUMERICAL_FAILURE, EXIT_OK, EXIT_WORKER_CRASH, UsageError
from diag.probes import INPUT_MAKERS, PROBES
from diag.results import Record, RunDir, new_run_id, worst_status
from diag.suite import Case, Suite, load_suite

__all__ = ["run", "RunResult", "resolve_backends", "DEFAULT_CASE_TIMEOUT"]

DEFAULT_CASE_TIMEOUT = 600.0
DEFAULT_STARTUP_TIMEOUT = 300.0
DISCOVERY_TIMEOUT = 180.0
MAX_RESTARTS = 3


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict[str, Any]]
    state: str  # finished | interrupted
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """4 when a worker crashed or an op raised, else 1 when a check failed, else 0."""
        if any(r["status"] == "error" for r in self.records):
            return EXIT_WORKER_CRASH
        if any(r["status"] == "fail" for r in self.records):
            return EXIT_NUMERICAL_FAILURE
        return EXIT_OK


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the run folder is marked `interrupted` and keeps its records."""

    def __init__(self, result: RunResult):
        super().__init__("interrupted")
        self.result = result


# ---------------------------------------------------------------------------------------------
# Backend discovery


def _worker_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "diag.backends.worker", *args]


def _worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The worker must import this same diag, installed or not.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _discover(framework: str) -> tuple[list[str], str | None]:
    """Platforms a framework sees, from a throwaway worker; (platforms, error)."""
    try:
        proc = subprocess.run(_worker_cmd("--discover", framework), capture_output=True,
                              text=True, timeout=DISCOVERY_TIMEOUT, env=_worker_env())
    except subprocess.TimeoutExpired:
        return [], f"{framework} did not list its devices within {DISCOVERY_TIMEOUT:.0f} s"
    for line in proc.stdout.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "platforms":
            return event["platforms"], None
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return [], f"importing {framework} failed (exit {proc.returncode}): {tail}"


def resolve_backends(names: list[str] | None) -> tuple[list[BackendSpec], dict[str, str]]:
    """Which backends to run and which to skip (with the reason).

    Args:
      names: backend names the user asked for, or None for every backend present.

    Raises:
      UsageError: an unknown backend name.
    """
    specs = [get_spec(n) for n in dict.fromkeys(names)] if names else [
        s for s in BACKENDS.values() if s.default]
    run: list[BackendSpec] = []
    skipped: dict[str, str] = {}
    seen: dict[str, tuple[list[str], str | None]] = {}
    for spec in specs:
        if not framework_installed(spec.framework):
            skipped[spec.name] = f"{spec.framework} is not installed ({spec.install_hint})"
            continue
        if spec.framework not in seen:
            seen[spec.framework] = _discover(spec.framework)
        platforms, error = seen[spec.framework]
        if error:
            skipped[spec.name] = error
        elif spec.platform not in platforms:
            skipped[spec.name] = (f"no {spec.platform} device visible to {spec.framework} "
                                  f"(it sees: {', '.join(platforms) or 'none'})")
        else:
            run.append(spec)
    return run, skipped


# ---------------------------------------------------------------------------------------------
# Inputs and ground truth


class _Inputs:
    """Input arrays per input key: drawn once on the host, written once as raw bits."""

    def __init__(self, work: Path):
        self.work = work
        self._arrays: dict[str, list[np.ndarray]] = {}
        self._paths: dict[str, list[str]] = {}
        self._digests: dict[str, list[str]] = {}

    def digests(self, case: Case) -> list[str]:
        """sha256 of each input's bits, to check what a backend received."""
        if case.input_key not in self._digests:
            self._digests[case.input_key] = [numerics.bits_digest(a) for a in self.get(case)]
        return self._digests[case.input_key]

    def get(self, case: Case) -> list[np.ndarray]:
        if case.input_key not in self._arrays:
            probe = PROBES[case.op]
            rng = np.random.default_rng(case.seed)
            dtype = numerics.as_dtype(case.dtype)
            arrays = [INPUT_MAKERS[case.inputs](rng, shape, dtype)
                      for shape in probe.input_shapes(case.params)]
            paths = []
            for i, a in enumerate(arrays):
                path = self.work / f"in-{case.input_key}-{i}.npy"
                np.save(path, numerics.bits_view(a))
                paths.append(str(path))
            self._arrays[case.input_key] = arrays
            self._paths[case.input_key] = paths
        return self._arrays[case.input_key]

    def paths(self, case: Case) -> list[str]:
        self.get(case)
        return self._paths[case.input_key]


class _Truth:
    """Correctly rounded results per input key, from diag.oracle (disk-cached by input hash)."""

    def __init__(self, inputs: _Inputs, cache_dir: str | None):
        from diag import oracle
        from diag.oracle.cache import GroundTruthCache, default_cache_dir

        self._oracle = oracle
        self._cache = GroundTruthCache(cache_dir or default_cache_dir())
        self._inputs = inputs
        self._memo: dict[str, Any] = {}

    def get(self, case: Case):
        if case.input_key not in self._memo:
            evaluate = getattr(self._oracle, f"{case.op}_result")
            self._memo[case.input_key] = evaluate(*self._inputs.get(case), cache=self._cache)
        return self._memo[case.input_key]


# ---------------------------------------------------------------------------------------------
# One worker


class _Worker:
    """A backend worker process and its event stream, read with a timeout."""

    def __init__(self, spec: BackendSpec, job_path: Path, log_path: Path,
                 env: dict[str, str]):
        self.spec = spec
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(_worker_cmd(str(job_path)), stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, start_new_session=True)
        self._events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._events.put(None)  # EOF: the worker exited or closed its stream

    def next_event(self, timeout: float) -> dict | None:
        """The next event; None at EOF. Raises queue.Empty on timeout."""
        return self._events.get(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()

    def death(self) -> str:
        """Why the worker stopped, for an error record."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code < 0:
            name = signal.Signals(-code).name
            cause = f"killed by {name}"
            if name == "SIGKILL":
                cause += " (out of memory, or killed from outside)"
            elif name in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL"):
                cause += " (a native crash in the framework)"
        else:
            cause = f"exited with code {code}"
        tail = self.stderr_tail()
        return f"{cause}; last stderr: {tail}" if tail else cause

    def stderr_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------------------------------------
# The run


class _Run:
    def __init__(self, suite: Suite, skipped: dict[str, str], run_dir: RunDir, work: Path, *,
                 repeats: int, case_timeout: float, startup_timeout: float, cache_dir: str | None, env: dict[str, str],
                 on_record: Callable[[dict], None] | None):
        self.suite, self.skipped = suite, skipped
        self.run_dir, self.work = run_dir, work
        self.repeats, self.case_timeout, self.startup_timeout = repeats, case_timeout, startup_timeout
        self.env = env
        self.on_record = on_record
        self.inputs = _Inputs(work)
        self.truth = _Truth(self.inputs, cache_dir)
        self.records: list[dict[str, Any]] = []
        self.outputs: dict[str, dict[str, str]] = {}  # case id -> backend -> output path
        self.backend_info: dict[str, Any] = {}
        self.worker: _Worker | None = None

    def plan(self, spec: BackendSpec) -> list[Case]:
        return [c for c in self.suite.cases if not_applicable(spec, c.op, c.params) is None]

    def emit(self, record: Record) -> None:
        record.run_id = self.run_dir.path.name
        self.run_dir.append(record)
        data = record.to_json()
        self.records.append(data)
        if self.on_record:
            self.on_record(data)

    def _record(self, case: Case, spec: BackendSpec, status: str, reason: str,
                **extra: Any) -> Record:
        info = self.backend_info.get(spec.name, {})
        return Record(op=case.op, probe=f"{self.suite.name}.{case.probe}", case=case.label,
                      params=case.params, backend=spec.name, device=info.get("device", {}),
                      dtype=case.dtype, metrics=extra.pop("metrics", {}), status=status,
                      reason=reason, framework=info.get("framework", {}), **extra)

    def error(self, case: Case, spec: BackendSpec, reason: str) -> None:
        self.emit(self._record(case, spec, "error", reason))

    def judge_result(self, case: Case, spec: BackendSpec, event: dict) -> None:
        probe = PROBES[case.op]
        truth = self.truth.get(case)
        output = numerics.from_bits(np.load(event["output"]), event["dtype"])
        oracle_info = {"method": truth.method, "fallbacks": truth.fallbacks,
                       "cache_hit": truth.cache_hit, "seconds": round(truth.seconds, 4)}
        expected = truth.value
        if event.get("input_digests") != self.inputs.digests(case):
            self.error(case, spec, f"{spec.name}: the inputs on the device are not bit-identical "
                                   f"to the host's (a transfer or conversion changed them)")
            return
        if output.shape != expected.shape or output.dtype != expected.dtype:
            self.emit(self._record(
                case, spec, "fail",
                f"returned {numerics.dtype_name(output.dtype)}{list(output.shape)}, expected "
                f"{numerics.dtype_name(expected.dtype)}{list(expected.shape)}",
                timings=event.get("timings", {}), oracle=oracle_info))
            return
        bound = probe.bound(self.inputs.get(case), expected, case.params)
        metrics = compare(output, expected, bound)
        precision = case.params.get("precision", "default")
        status, reason = judge(
            metrics, claim=probe.claim, setting=f"precision={precision}",
            promised=promises_full_precision(spec, case.dtype, precision))
        self.emit(self._record(case, spec, status, reason, metrics=metrics,
                               timings=event.get("timings", {}), oracle=oracle_info))
        self.agree(case, spec.name, output, bound)
        self.outputs.setdefault(case.id, {})[spec.name] = event["output"]

    def agree(self, case: Case, name: str, output: np.ndarray, bound: np.ndarray) -> None:
        """Agreement records of this output with every earlier backend's for the same case,
        judged with the bound this output was just judged by."""
        claim = PROBES[case.op].claim
        for earlier, path in self.outputs.get(case.id, {}).items():
            other = numerics.from_bits(np.load(path), case.dtype)
            (a, x), (b, y) = sorted([(earlier, other), (name, output)], key=lambda p: p[0])
            m = agreement(x, y, bound)
            status, reason = judge_agreement(m, a, b, claim)
            self.emit(Record(op=case.op, probe=f"{self.suite.name}.{case.probe}",
                             case=case.label, params=case.params, backend=f"{a}|{b}",
                             device={}, dtype=case.dtype, metrics=m, status=status,
                             reason=reason, kind="agreement"))

    def run_backend(self, spec: BackendSpec) -> None:
        pending = self.plan(spec)
        for case in pending:  # write inputs before the worker starts
            self.inputs.paths(case)
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
                    self.error(case, spec, f"{spec.name}: not run: {why}")
                return

    def _run_worker(self, spec: BackendSpec,
                    cases: list[Case]) -> tuple[list[Case], bool, str]:
        """Run cases in one worker.

        Returns:
          (cases not reached when it died, whether it became ready, the cause of death).
          The case it died on gets an `error` record here.
        """
        job = {"backend": spec.name, "out_dir": str(self.work), "repeats": self.repeats,
               "cases": [{"id": c.id, "op": c.op, "op_args": c.op_args,
                          "inputs": self.inputs.paths(c),
                          "input_dtypes": [c.dtype] * len(self.inputs.paths(c))}
                         for c in cases]}
        job_path = self.work / f"job-{spec.name}.json"
        job_path.write_text(json.dumps(job))
        logs = self.run_dir.path / "logs"
        logs.mkdir(exist_ok=True)
        self.worker = worker = _Worker(spec, job_path, logs / f"{spec.name}.stderr", self.env)
        by_id = {c.id: c for c in cases}
        index = 0
        started = False
        try:
            while True:
                timeout = self.case_timeout if started else self.startup_timeout
                try:
                    event = worker.next_event(timeout)
                except queue.Empty:
                    worker.kill()
                    what = "finish the case" if started else "start (import and open its device)"
                    cause = f"worker hung: did not {what} within {timeout:g} s (timeout); killed"
                    self.error(cases[index], spec, f"{spec.name}: {cause}")
                    return cases[index + 1:], started, cause
                if event is None:
                    if index >= len(cases):
                        return [], started, ""
                    cause = f"worker died: {worker.death()}"
                    self.error(cases[index], spec, f"{spec.name}: {cause}")
                    return cases[index + 1:], started, cause
                kind = event.get("event")
                if kind == "ready":
                    started = True
                    self.backend_info[spec.name] = {k: event.get(k) for k in
                                                    ("device", "framework", "settings")}
                elif kind == "result":
                    self.judge_result(by_id[event["case"]], spec, event)
                    index += 1
                elif kind == "case_error":
                    self.error(by_id[event["case"]], spec, f"{spec.name}: {event['error']}")
                    index += 1
                elif kind == "done":
                    worker.proc.wait(timeout=30)
                    return [], started, ""
        finally:
            worker.kill()

    def skip_records(self) -> None:
        for name, reason in self.skipped.items():
            self.emit(Record(op="*", probe=f"{self.suite.name}", case="*", params={},
                             backend=name, device={}, dtype="*", metrics={},
                             status="skip", reason=f"{name}: {reason}"))


def total_planned(suite: Suite, specs: list[BackendSpec]) -> int:
    return sum(1 for s in specs for c in suite.cases if not_applicable(s, c.op, c.params) is None)


def run(suite: str | Suite = "matmul", backends: list[str] | None = None, *,
        out: str | os.PathLike = "reports", repeats: int = 3,
        case_timeout: float = DEFAULT_CASE_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT, cache_dir: str | None = None,
        env: dict[str, str] | None = None, argv: list[str] | None = None,
        on_start: Callable[[int, list[str]], None] | None = None,
        on_record: Callable[[dict], None] | None = None) -> RunResult:
    """Run a suite on backends and write a run folder.

    Args:
      suite: a shipped suite name, a path to a suite file, or a loaded `Suite`.
      backends: backend names, or None for every backend present.
      out: the folder run folders are created in.
      repeats: timed repeats per case (the median is reported, samples kept).
      case_timeout: seconds a worker may take for one case before it is killed.
      startup_timeout: seconds a worker may take to import its framework and open its device.
      cache_dir: ground-truth cache folder (default: `DIAG_CACHE_DIR` or ~/.cache/diag).
      env: extra environment variables for the workers.
      argv: the command line recorded in run.json.
      on_start: called with (number of planned records, backend names) before workers start.
      on_record: called with each record as it is written.

    Returns:
      RunResult with the run folder, the records and the final state.

    Raises:
      SuiteError, UsageError: bad suite or backend name, before anything is written.
      Interrupted: Ctrl-C; the run folder is kept and marked `interrupted`.
    """
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    loaded = suite if isinstance(suite, Suite) else load_suite(suite)
    specs, skipped = resolve_backends(backends)
    run_id = new_run_id()
    try:
        run_dir = RunDir.create(out, run_id, environment.collect(argv))
    except OSError as e:
        raise UsageError(f"cannot create a run folder under '{out}': {e.strerror or e}; "
                         f"pass --out with a writable folder") from None
    run_dir.update_meta(suite={"name": loaded.name, "path": loaded.path,
                               "cases": len(loaded.cases)},
                        backends_planned=[s.name for s in specs], backends_skipped=skipped)
    work = Path(tempfile.mkdtemp(prefix=f"diag-{run_id}-"))
    state = "finished"
    r = _Run(loaded, skipped, run_dir, work, repeats=repeats, case_timeout=case_timeout,
             startup_timeout=startup_timeout, cache_dir=cache_dir,
             env=_worker_env(env), on_record=on_record)
    try:
        if on_start:
            on_start(total_planned(loaded, specs) + len(skipped), [s.name for s in specs])
        r.skip_records()
        for spec in specs:
            r.run_backend(spec)
    except KeyboardInterrupt:
        state = "interrupted"
    except BaseException as e:  # a bug in diag itself: keep the records, say what happened
        state = "aborted"
        run_dir.update_meta(error=f"{type(e).__name__}: {e}")
        raise
    finally:
        if r.worker is not None:
            r.worker.kill()
        statuses = [rec["status"] for rec in r.records]
        counts = {s: statuses.count(s) for s in ("pass", "warn", "fail", "error", "skip")}
        run_dir.update_meta(state=state, finished=time.time(), counts=counts,
                            verdict=worst_status(statuses), backends=r.backend_info)
        shutil.rmtree(work, ignore_errors=True)
    result = RunResult(run_dir=run_dir.path, records=r.records, state=state, counts=counts)
    if state == "interrupted":
        raise Interrupted(result)
    return result
