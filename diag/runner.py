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

import dataclasses
import difflib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diag import environment, numerics
from diag.backends import BACKENDS, BackendSpec, framework_installed, get_spec, not_applicable
from diag.backends import promises_full_precision
from diag.errors import EXIT_NUMERICAL_FAILURE, EXIT_OK, EXIT_WORKER_CRASH, UsageError
from diag.probes import INPUT_MAKERS, PROBES, Evaluation, Outcome, expected_outcome
from diag.results import Record, RunDir, new_run_id, worst_status
from diag.suite import Case, Suite, check_memory, load_suite

__all__ = ["run", "RunResult", "resolve_backends", "candidate_backends", "check_applicable",
           "check_flags", "parse_ab", "DEFAULT_CASE_TIMEOUT"]

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


def _discover(framework: str, env: dict[str, str]) -> tuple[list[str], str | None]:
    """Platforms a framework sees, from a throwaway worker started with the workers'
    environment; (platforms, error).

    Raises:
      BadFlag: the framework aborted on a flag in XLA_FLAGS/LIBTPU_INIT_ARGS (JAX reads them
        when it lists its devices, so this check costs no extra process).
    """
    from diag.flags import flag_error

    try:
        proc = subprocess.run(_worker_cmd("--discover", framework), capture_output=True,
                              text=True, timeout=DISCOVERY_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return [], f"{framework} did not list its devices within {DISCOVERY_TIMEOUT:.0f} s"
    for line in proc.stdout.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "platforms":
            return event["platforms"], None
    bad = flag_error(proc.stderr)
    if bad is not None:
        raise bad
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return [], f"importing {framework} failed (exit {proc.returncode}): {tail}"


def candidate_backends(names: list[str] | None) -> list[BackendSpec]:
    """The backends named (in order, once each), or every default backend.

    Raises:
      UsageError: an unknown backend name.
    """
    if names:
        return [get_spec(n) for n in dict.fromkeys(names)]
    return [s for s in BACKENDS.values() if s.default]


def resolve_backends(names: list[str] | None, env: dict[str, str] | None = None,
                     ) -> tuple[list[BackendSpec], dict[str, str]]:
    """Which backends can run and which cannot (with the reason).

    Args:
      names: backend names the user asked for, or None for every backend present.
      env: the workers' environment (default: this process's, as workers get it).

    Raises:
      UsageError: an unknown backend name.
      BadFlag: JAX refused a flag in XLA_FLAGS/LIBTPU_INIT_ARGS while listing its devices.
    """
    env = _worker_env() if env is None else env
    specs = candidate_backends(names)
    run: list[BackendSpec] = []
    skipped: dict[str, str] = {}
    seen: dict[str, tuple[list[str], str | None]] = {}
    for spec in specs:
        if not framework_installed(spec.framework):
            skipped[spec.name] = f"{spec.framework} is not installed ({spec.install_hint})"
            continue
        if spec.framework not in seen:
            seen[spec.framework] = _discover(spec.framework, env)
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
    """Ground truth per case from the probe's oracle (disk-cached by input hash), computed
    once per input set and truth parameters (top_k and approx_max_k with the same k share)."""

    def __init__(self, inputs: _Inputs, cache_dir: str | None):
        from diag.oracle.cache import GroundTruthCache, default_cache_dir

        self._cache = GroundTruthCache(cache_dir or default_cache_dir())
        self._inputs = inputs
        self._memo: dict[str, Any] = {}

    def get(self, case: Case):
        probe = PROBES[case.op]
        key = json.dumps([probe.truth.__name__, case.input_key,
                          [case.params[a] for a in probe.truth_args]])
        if key not in self._memo:
            self._memo[key] = probe.truth(self._inputs.get(case), case.params, self._cache)
        return self._memo[key]


# ---------------------------------------------------------------------------------------------
# One worker


# The A/B variant of a backend runs as `<backend>+B`: same device, the setting applied.
AB_SUFFIX = "+B"
HLO_EXCERPT_LINES = 40
# An HLO instruction: `[ROOT] [%]name = type opcode(operands), ...`.
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def _hlo_ops(lines: list[str]) -> dict[str, int]:
    """Instruction counts by opcode in HLO text."""
    counts: dict[str, int] = {}
    for line in lines:
        m = _HLO_OP.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def parse_ab(assignments: list[str] | None,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an A/B experiment's B side from `NAME=VALUE` assignments.

    `XLA_FLAGS` and `LIBTPU_INIT_ARGS` values are appended to the flags in effect on the A
    side (`base`: the environment the A worker gets, a library caller's `env=` included);
    a JAX config name (`jax_default_matmul_precision=highest`) becomes the environment
    variable JAX reads it from at start-up (`JAX_DEFAULT_MATMUL_PRECISION`).

    Args:
      assignments: `NAME=VALUE` strings.
      base: the A side's environment (default: this process's).

    Raises:
      UsageError: an assignment that is not NAME=VALUE.
    """
    base = os.environ if base is None else base
    env: dict[str, str] = {}
    for item in assignments or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--ab expects NAME=VALUE (an environment variable or a JAX "
                             f"config option), got {item!r}")
        if name.lower().startswith("jax_"):
            name = name.upper()
        if name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
            current = env.get(name, base.get(name, ""))
            value = f"{current} {value}".strip()
        env[name] = value
    return env


def _as_emulation(ev: Evaluation) -> Evaluation:
    """An emulated backend's verdict: `warn` at worst.

    An emulation is a model of an algorithm, not a device under test, and it promises
    nothing: a bound breach, or an overflow to Inf where the truth is finite, shows what that
    algorithm does to the case (worth a warning), never a broken machine or library.
    """
    if ev.status != "fail":
        return ev
    return dataclasses.replace(ev, status="warn", reason=(
        f"{ev.reason}; an emulation promises nothing, so this is what the emulated algorithm "
        f"does here, not a failure"))


def _load_output(meta: dict) -> np.ndarray:
    """An output the worker wrote: floats as raw bits (see `numerics.bits_view`), ints as is.

    Memory-mapped: outputs are kept for agreement with later backends, and the OS pages them
    from the work folder instead of holding every backend's outputs in memory.
    """
    data = np.load(meta["path"], mmap_mode="r")
    if meta["dtype"].startswith(("int", "uint", "bool")):
        return data
    return numerics.from_bits(data, meta["dtype"])


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
                 repeats: int, case_timeout: float, startup_timeout: float,
                 cache_dir: str | None, env: dict[str, str],
                 ab_env: dict[str, str] | None = None,
                 on_record: Callable[[dict], None] | None):
        self.suite, self.skipped = suite, skipped
        self.run_dir, self.work = run_dir, work
        self.repeats, self.case_timeout, self.startup_timeout = repeats, case_timeout, startup_timeout
        self.env = env
        self.on_record = on_record
        self.inputs = _Inputs(work)
        self.truth = _Truth(self.inputs, cache_dir)
        self.records: list[dict[str, Any]] = []
        # case id -> backend -> what it returned; outputs are small next to the inputs
        self.outcomes: dict[str, dict[str, Outcome]] = {}
        self.backend_info: dict[str, Any] = {}
        self.worker: _Worker | None = None
        self.ab_env = ab_env or {}
        self.hlo: dict[str, dict[str, str]] = {}  # case id -> backend -> compiled HLO text path
        self.verdicts: dict[str, dict[str, dict]] = {}  # case id -> backend -> its record

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
                      reason=reason, framework=info.get("framework", {}),
                      settings=info.get("settings") or {}, **extra)

    def error(self, case: Case, spec: BackendSpec, reason: str) -> None:
        self.emit(self._record(case, spec, "error", reason))

    def judge_result(self, case: Case, spec: BackendSpec, event: dict) -> None:
        probe = PROBES[case.op]
        if event.get("input_digests") != self.inputs.digests(case):
            self.error(case, spec, f"{spec.name}: the inputs on the device are not bit-identical "
                                   f"to the host's (a transfer or conversion changed them)")
            return
        truth = self.truth.get(case)
        oracle_info = {}
        if truth is not None:
            oracle_info = {"method": truth.method, "fallbacks": truth.fallbacks,
                           "cache_hit": truth.cache_hit, "seconds": round(truth.seconds, 4)}
        precision = case.params.get("precision", "default")
        shapes = ", ".join(f"{o.get('name')} {o.get('dtype')}{o.get('shape')}"
                           for o in event.get("outputs") or []) or "no outputs"
        try:
            outcome = Outcome(
                inputs=self.inputs.get(case),
                outputs=[_load_output(o) for o in event["outputs"]],
                names=[o["name"] for o in event["outputs"]], truth=truth, params=case.params,
                promised=promises_full_precision(spec, case.dtype, precision),
                setting=f"precision={precision}", nan_report=event.get("nan_report"))
            ev = expected_outcome(case.expect, probe.evaluate(outcome), outcome)
        except Exception as e:  # an output diag cannot judge is this case's error, not the run's
            self.emit(self._record(
                case, spec, "error", f"{spec.name}: cannot judge the output ({shapes}): "
                                     f"{type(e).__name__}: {e}"[:500],
                metrics={"traceback": traceback.format_exc()[-2000:]},
                timings=event.get("timings", {}), oracle=oracle_info))
            return
        if spec.emulated:
            ev = _as_emulation(ev)
        # sha256 of each output's bits: what `diag check --bitwise` compares.
        digests = [numerics.bits_digest(o) for o in outcome.outputs]
        self.emit(self._record(case, spec, ev.status, ev.reason,
                               metrics={**ev.metrics, "output_digests": digests},
                               timings=event.get("timings", {}), oracle=oracle_info))
        self.verdicts.setdefault(case.id, {})[spec.name] = self.records[-1]
        if event.get("hlo"):
            self.hlo.setdefault(case.id, {})[spec.name] = event["hlo"]
        self.agree(case, spec.name, outcome, ev.context)
        self.outcomes.setdefault(case.id, {})[spec.name] = outcome

    def agree(self, case: Case, name: str, outcome: Outcome, context: Any) -> None:
        """Agreement records of this output with every earlier backend's for the same case,
        judged with what this output was just judged by (`context`, e.g. its bound)."""
        probe = PROBES[case.op]
        for earlier, other in self.outcomes.get(case.id, {}).items():
            if earlier.endswith(AB_SUFFIX) or name.endswith(AB_SUFFIX):
                # A setting's variant is compared with its own backend only.
                if name == earlier + AB_SUFFIX:
                    self.attribute(case, earlier, other, name, outcome, context)
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

    def attribute(self, case: Case, a: str, x: Outcome, b: str, y: Outcome,
                  context: Any) -> None:
        """An `ab` record: what the A/B setting changed in this case on one backend."""
        changed = [n for n, u, v in zip(x.names, x.outputs, y.outputs)
                   if numerics.bits_digest(u) != numerics.bits_digest(v)]
        _, _, difference = PROBES[case.op].agree(x, y, (a, b), context)
        va, vb = self.verdicts[case.id][a], self.verdicts[case.id][b]
        metrics: dict[str, Any] = {
            "changed_outputs": changed, "difference": difference,
            "status": [va["status"], vb["status"]],
            "max_ulp": [va["metrics"].get("max_ulp"), vb["metrics"].get("max_ulp")]}
        setting = " ".join(f"{k}={v}" for k, v in self.ab_env.items())
        if not changed:
            status, reason = "pass", f"{setting} changes nothing in {a}'s results (bit for bit)"
        else:
            status = "warn"
            what = ", ".join(changed)
            n, k = difference.get("elements"), difference.get("mismatched")
            amount = f"{k} / {n} elements, " if n and k is not None else ""
            reason = (f"{setting} changes {a}'s {what} ({amount}verdict {va['status']} -> "
                      f"{vb['status']}): drift attributed to this setting")
            hlo = self.hlo_diff(case, a, b)
            if hlo:
                metrics["hlo_diff"] = hlo
                ops = ", ".join(f"{op} {n1}->{n2}" for op, (n1, n2) in hlo["ops"].items())
                reason += f"; compiled HLO differs ({ops or 'no op count changes'})"
        self.emit(self._pair_record(case, f"{a}|{b}", "ab", status, reason, metrics))

    def hlo_diff(self, case: Case, a: str, b: str) -> dict | None:
        """The compiled-HLO difference between two variants of a case, written to the run
        folder (`ab/<case>.<backend>.hlo.diff`), with the op counts that changed."""
        paths = self.hlo.get(case.id, {})
        if a not in paths or b not in paths:
            return None
        text_a, text_b = (Path(paths[n]).read_text().splitlines() for n in (a, b))
        diff = list(difflib.unified_diff(text_a, text_b, f"{a}.hlo", f"{b}.hlo", lineterm=""))
        folder = self.run_dir.path / "ab"
        folder.mkdir(exist_ok=True)
        path = folder / f"{case.id}.{a}.hlo.diff"
        path.write_text("\n".join(diff) + "\n")
        count_a, count_b = _hlo_ops(text_a), _hlo_ops(text_b)
        ops = {op: (count_a.get(op, 0), count_b.get(op, 0))
               for op in sorted(set(count_a) | set(count_b))
               if count_a.get(op, 0) != count_b.get(op, 0)}
        changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        # The changed lines without their context, for the record and the report.
        excerpt = [line for line in diff[2:] if line[:1] in "+-@"][:HLO_EXCERPT_LINES]
        return {"path": str(path.relative_to(self.run_dir.path)), "changed_lines": changed,
                "ops": ops, "excerpt": excerpt}

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
        base = spec.name.removesuffix(AB_SUFFIX)
        # The arithmetic of each matmul precision setting the cases use, measured in the worker
        # (diag.precision): what a verdict under that setting can be checked against.
        settings = {("default", "none")} | {
            (c.params.get("precision", "default"), c.params.get("precision_via", "none"))
            for c in cases if c.op == "matmul"}
        job = {"backend": base, "label": spec.name, "out_dir": str(self.work),
               "repeats": self.repeats, "hlo": bool(self.ab_env),
               "fingerprint": sorted(settings, key=lambda p: (p != ("default", "none"), p))
               if any(c.op == "matmul" for c in cases) else [],
               "cases": [{"id": c.id, "op": c.op, "op_args": c.op_args,
                          "inputs": self.inputs.paths(c),
                          "input_dtypes": [c.dtype] * len(self.inputs.paths(c))}
                         for c in cases]}
        job_path = self.work / f"job-{spec.name}.json"
        job_path.write_text(json.dumps(job))
        logs = self.run_dir.path / "logs"
        logs.mkdir(exist_ok=True)
        env = {**self.env, **self.ab_env} if spec.name.endswith(AB_SUFFIX) else self.env
        self.worker = worker = _Worker(spec, job_path, logs / f"{spec.name}.stderr", env)
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
                    self.backend_info[spec.name] = {
                        k: event[k] for k in ("device", "framework", "settings",
                                              "fingerprints") if k in event}
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

    def skip_records(self, requested: bool) -> None:
        """A record per backend that cannot run: `skip` in a default run, `error` when the
        user named it (a run asked to check a backend must not pass without it)."""
        for name, reason in self.skipped.items():
            status, why = ("error", f"{name}: not run although asked for: {reason}") \
                if requested else ("skip", f"{name}: {reason}")
            self.emit(Record(op="*", probe=f"{self.suite.name}", case="*", params={},
                             backend=name, device={}, dtype="*", metrics={},
                             status=status, reason=why))


def total_planned(suite: Suite, specs: list[BackendSpec]) -> int:
    return sum(1 for s in specs for c in suite.cases if not_applicable(s, c.op, c.params) is None)


def check_applicable(suite: Suite, specs: list[BackendSpec]) -> None:
    """Refuse a suite none of whose cases applies to any of these backends.

    Such a run would check nothing and say so only as "no records"; a CI gate would go green.

    Raises:
      UsageError: naming the suite's ops and, per backend, why its cases do not apply.
    """
    if not specs or total_planned(suite, specs):
        return
    ops = ", ".join(dict.fromkeys(c.op for c in suite.cases))
    why = "; ".join(
        f"{s.name}: " + ", ".join(dict.fromkeys(
            r for c in suite.cases if (r := not_applicable(s, c.op, c.params))))
        for s in specs)
    raise UsageError(f"suite '{suite.name}' has no case that runs on "
                     f"{', '.join(s.name for s in specs)} (the suite's ops: {ops}; {why}); "
                     f"choose other backends with --backend or another suite")


def check_flags(specs: list[BackendSpec], env: dict[str, str],
                ab_env: dict[str, str]) -> None:
    """Refuse XLA_FLAGS/LIBTPU_INIT_ARGS that a JAX worker would abort on (as `diag env`).

    Only when a JAX backend is among `specs`. Syntax is checked here, on the host; whether
    XLA knows each flag is checked by JAX itself when it lists its devices (`_discover`,
    started with the same environment, no extra process), and for an A/B run whose B side
    changes the flags, in one throwaway JAX process (`diag.flags.validate_xla_flags`).

    Raises:
      BadFlag: naming the variable and the flag (exit 2).
    """
    from diag.flags import FLAG_VARS, parse_flags, validate_xla_flags

    if not any(s.framework == "jax" for s in specs):
        return
    b_env = {**env, **ab_env}
    for var in FLAG_VARS:
        parse_flags(env.get(var), var)
        parse_flags(b_env.get(var), var)
    if any(b_env.get(v) != env.get(v) for v in FLAG_VARS) and framework_installed("jax"):
        validate_xla_flags(b_env)


def run(suite: str | Suite = "matmul", backends: list[str] | None = None, *,
        out: str | os.PathLike = "reports", repeats: int = 3,
        case_timeout: float = DEFAULT_CASE_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT, cache_dir: str | None = None,
        env: dict[str, str] | None = None, ab: list[str] | None = None,
        max_memory: float | None = None, argv: list[str] | None = None,
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
      env: extra environment variables for the workers (both sides of an A/B run).
      ab: an A/B experiment: `NAME=VALUE` settings (environment variables, XLA_FLAGS
        additions, JAX config options) for a second worker per backend, `<backend>+B`; each
        case gets an `ab` record saying what the setting changed (and, for JAX, the compiled
        HLO difference). XLA_FLAGS additions extend the A side's flags, `env=` included.
      max_memory: host memory one case may need, in GiB (default: half of the physical
        memory; `diag.suite.memory_limit`).
      argv: the command line recorded in run.json.
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
    if max_memory is not None and not max_memory > 0:
        raise UsageError(f"max_memory must be a positive number of GiB, got {max_memory}")
    if isinstance(suite, Suite):
        loaded = suite
        check_memory(loaded, max_memory)
    else:
        loaded = load_suite(suite, max_memory=max_memory)
    worker_env = _worker_env(env)
    ab_env = parse_ab(ab, base=worker_env)
    candidates = candidate_backends(backends)
    check_applicable(loaded, candidates)
    check_flags(candidates, worker_env, ab_env)
    specs, skipped = resolve_backends(backends, worker_env)
    if ab_env:  # each backend, then the same backend under the setting
        specs = [v for s in specs for v in (s, dataclasses.replace(s, name=s.name + AB_SUFFIX))]
    run_id = new_run_id()
    try:
        run_dir = RunDir.create(out, run_id, environment.collect(argv))
    except OSError as e:
        raise UsageError(f"cannot create a run folder under '{out}': {e.strerror or e}; "
                         f"pass --out with a writable folder") from None
    run_dir.update_meta(suite={"name": loaded.name, "path": loaded.path,
                               "cases": len(loaded.cases)},
                        backends_planned=[s.name for s in specs], backends_skipped=skipped,
                        ab={"B": list(ab or []), "env": ab_env} if ab_env else None)
    work = Path(tempfile.mkdtemp(prefix=f"diag-{run_id}-"))
    state = "finished"
    r = _Run(loaded, skipped, run_dir, work, repeats=repeats, case_timeout=case_timeout,
             startup_timeout=startup_timeout, cache_dir=cache_dir, ab_env=ab_env,
             env=worker_env, on_record=on_record)
    try:
        if on_start:
            on_start(total_planned(loaded, specs) + len(skipped), [s.name for s in specs])
        r.skip_records(requested=bool(backends))
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
