"""Host side of the worker protocol: start a backend's worker, list what a framework sees.

The worker itself (`diag.worker.main`) documents the protocol; this module is the other
end of it: the command and environment every worker starts with, device discovery through a
throwaway worker, and a running worker whose JSON event stream is read with a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diag import numerics
from diag.backends import BACKENDS, BackendSpec, framework_installed, get_spec
from diag.worker.interpreter import parse_python, python_var, worker_cmd

__all__ = [
    "load_output",
    "worker_env",
    "jax_cache_env",
    "jax_cache_for_import",
    "candidate_backends",
    "resolve_backends",
    "run_env_worker",
    "parse_python",
    "python_var",
    "DISCOVERY_TIMEOUT",
    "start_beside",
]

DISCOVERY_TIMEOUT = 180.0


def framework_available(framework: str, env: Mapping[str, str]) -> bool:
    """Whether a worker could import `framework`: it has its own Python, or diag's has it."""
    return bool(env.get(python_var(framework))) or framework_installed(framework)


# ---------------------------------------------------------------------------------------------
# Backend discovery


def worker_env(
    extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment every worker starts with (runs, discovery, `diag env`).

    Args:
      extra: variables to set on top (a library caller's `env=`, an A/B side).
      base: the environment to start from (default: this process's).
    """
    env = dict(os.environ if base is None else base)
    env.update(jax_cache_env(env))
    # The worker must import this same diag, installed or not.
    root = str(Path(__file__).resolve().parents[2])  # the folder holding diag/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


#: JAX's persistent compilation cache, set through the environment (JAX reads these at import):
#: every program kept, however small or quick to compile. Measured (FIELD-NOTES, 2-core AMD
#: EPYC): warm `diag preflight` 4.32 -> 3.32 s, `diag run --suite ci` 7.55 -> 4.15 s (the NaN
#: hunt compiles one small program per op).
JAX_CACHE_VARS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}


def jax_cache_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that give JAX workers a persistent compilation cache in diag's cache folder.

    Nothing when the user set JAX_COMPILATION_CACHE_DIR (their cache, their thresholds; an empty
    value turns it off), when XLA_FLAGS asks for dumps (`--xla_dump_to`: a program found in the
    cache is not compiled, so not dumped), or when the folder could not be created (JAX would
    warn on every compile). Nothing is written here: JAX creates the folder on its first entry.
    """
    if "JAX_COMPILATION_CACHE_DIR" in env or "--xla_dump_to" in env.get("XLA_FLAGS", ""):
        return {}
    from diag.oracle.cache import jax_cache_dir

    path = jax_cache_dir(env)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not (probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)):
        return {}
    out = {"JAX_COMPILATION_CACHE_DIR": str(path)}
    out.update({k: v for k, v in JAX_CACHE_VARS.items() if k not in env})
    return out


@contextlib.contextmanager
def jax_cache_for_import():
    """For a framework scan in this process (`diag preflight`'s node scan): os.environ holds
    `jax_cache_env` while jax is first imported, and is as it was afterwards (JAX has read its
    settings by then). Nothing changes when jax is already imported."""
    added = (
        {}
        if "jax" in sys.modules
        else {k: v for k, v in jax_cache_env(os.environ).items() if k not in os.environ}
    )
    os.environ.update(added)
    try:
        if added:
            import jax  # noqa: F401  (reads JAX_COMPILATION_CACHE_DIR now)
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _events(stdout: str):
    """The protocol events in a finished worker's stdout (one JSON object per line; anything
    else a framework printed there is skipped)."""
    for line in stdout.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def _discover(framework: str, env: dict[str, str]) -> tuple[list[str], str | None, Worker | None]:
    """Platforms a framework sees, from a worker started with the workers' environment;
    (platforms, error, the worker parked for a job).

    The worker that listed the devices stays up with its framework imported, parked, and
    runs the first of that framework's backends the runner hands it (`Worker.adopt`):
    a run pays for one import per framework, not two, and the second framework's worker is
    ready while the first backend runs.

    Raises:
      BadFlag: the framework aborted on a flag in XLA_FLAGS/LIBTPU_INIT_ARGS (JAX reads them
        when it lists its devices, so this check costs no extra process).
    """
    from diag.settings.flags import flag_error

    worker = Worker(framework, ["--discover", framework, "--then-job"], env, park=True)
    try:
        event = worker.next_event(DISCOVERY_TIMEOUT)
    except queue.Empty:
        worker.kill()
        return [], f"{framework} did not list its devices within {DISCOVERY_TIMEOUT:.0f} s", None
    if event is not None and event.get("event") == "platforms":
        worker.platforms = event["platforms"]
        return event["platforms"], None, worker
    worker.kill()
    stderr = worker.stderr_text()
    bad = flag_error(stderr)
    if bad is not None:
        raise bad
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return [], f"importing {framework} failed (exit {worker.proc.returncode}): {tail}", None


def candidate_backends(names: list[str] | None) -> list[BackendSpec]:
    """The backends named (in order, once each), or every default backend.

    Raises:
      UsageError: an unknown backend name.
    """
    if names:
        return [get_spec(n) for n in dict.fromkeys(names)]
    return [s for s in BACKENDS.values() if s.default]


def _result_or_error(job):
    try:
        return job.result()
    except BaseException as e:
        return e


def resolve_backends(
    names: list[str] | None,
    env: dict[str, str] | None = None,
) -> tuple[list[BackendSpec], dict[str, str], dict[str, Worker]]:
    """Which backends can run and which cannot (with the reason).

    Args:
      names: backend names the user asked for, or None for every backend present.
      env: the workers' environment (default: this process's, as workers get it).

    Returns:
      (backends that can run, {backend: why not} for the rest, {framework: its discovery
      worker, parked for the first of its backends to run}); the caller owns the parked
      workers (`Worker.adopt` one, `kill` the rest).

    Raises:
      UsageError: an unknown backend name.
      BadFlag: JAX refused a flag in XLA_FLAGS/LIBTPU_INIT_ARGS while listing its devices.
    """
    from concurrent.futures import ThreadPoolExecutor

    env = worker_env() if env is None else env
    specs = candidate_backends(names)
    run: list[BackendSpec] = []
    skipped: dict[str, str] = {}
    # Each framework lists its devices in its own process; they start side by side (mostly
    # import time: ~2 s for jax, ~3 s for torch here), not one after the other.
    frameworks = list(
        dict.fromkeys(s.framework for s in specs if framework_available(s.framework, env))
    )
    with ThreadPoolExecutor(max_workers=max(1, len(frameworks))) as pool:
        pending = {fw: pool.submit(_discover, fw, env) for fw in frameworks}
        results = {fw: _result_or_error(job) for fw, job in pending.items()}
    parked = {fw: r[2] for fw, r in results.items() if not isinstance(r, BaseException) and r[2]}
    for r in results.values():
        if isinstance(r, BaseException):  # BadFlag: no parked worker outlives it
            for worker in parked.values():
                worker.kill()
            raise r
    seen = {fw: r[:2] for fw, r in results.items()}
    for spec in specs:
        if spec.framework not in seen:
            skipped[spec.name] = f"{spec.framework} is not installed ({spec.install_hint})"
            continue
        platforms, error = seen[spec.framework]
        if error:
            skipped[spec.name] = error
        elif spec.platform not in platforms:
            skipped[spec.name] = (
                f"no {spec.platform} device visible to {spec.framework} "
                f"(it sees: {', '.join(platforms) or 'none'})"
            )
        else:
            run.append(spec)
    for fw in [fw for fw in parked if not any(s.framework == fw for s in run)]:
        parked.pop(fw).kill()
    return run, skipped, parked


#: At most this many backends' workers run at once (`start_beside`), the one the host reads
#: included: each holds its framework and its outputs in memory.
MAX_BESIDE = max(2, min(4, (os.cpu_count() or 2) // 4))


def start_beside(specs: Sequence[BackendSpec], parked: Mapping[str, Worker]) -> list[BackendSpec]:
    """The backends after the first (`specs[0]`, the host's) whose workers start with it.

    A backend may run beside others when it computes on the host's CPU and holds no device
    another backend needs: diag's numpy emulation, or a CPU backend of a framework that listed
    only the CPU (a JAX that also sees a GPU takes GPU memory when it starts). Its worker runs
    its cases while the host judges the earlier backends' results; the host reads each
    backend's events in the planned order, so records come in the order they would one by
    one. At most `MAX_BESIDE` workers run at once; the rest start in their turn.
    """
    cpu_only = {fw for fw, w in parked.items() if w.platforms == ["cpu"]}
    ok = [
        s
        for s in specs[1:]
        if s.framework == "numpy" or (s.platform == "cpu" and s.framework in cpu_only)
    ]
    return ok[: MAX_BESIDE - 1]


def run_env_worker(
    framework: str,
    environ: Mapping[str, str],
    fingerprints: bool,
    timeout: float,
    deep: bool = False,
) -> dict[str, Any]:
    """One `--env FRAMEWORK` worker (`diag env`): what it reports per backend.

    Returns:
      {"backends": {name: info}, "platforms": [...], "error": "..." when it failed}.

    Raises:
      BadFlag: the framework aborted on a flag in XLA_FLAGS/LIBTPU_INIT_ARGS.
    """
    from diag.settings.flags import flag_error

    env = worker_env(base=environ)
    cmd = worker_cmd(framework, env, "--env", framework)
    if not fingerprints:
        cmd.append("--no-fingerprints")
    if deep:  # the matmul's arithmetic features (diag.arith.features)
        cmd.append("--deep")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"backends": {}, "error": f"{framework} did not report within {timeout:g} s"}
    result: dict[str, Any] = {"backends": {}}
    for event in _events(proc.stdout):
        if event.get("event") == "backend":
            result["backends"][event.pop("backend")] = {
                k: v for k, v in event.items() if k != "event"
            }
        elif event.get("event") == "done":
            result["platforms"] = event.get("platforms", [])
    if proc.returncode != 0 or "platforms" not in result:
        bad = flag_error(proc.stderr)
        if bad is not None:
            raise bad
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        result["error"] = f"the {framework} worker failed (exit {proc.returncode}): {tail}"
    return result


# ---------------------------------------------------------------------------------------------
# One worker


def load_output(meta: dict) -> np.ndarray:
    """An output the worker wrote: floats as raw bits (see `numerics.bits_view`), ints as is.

    Memory-mapped: outputs are kept for agreement with later backends, and the OS pages them
    from the work folder instead of holding every backend's outputs in memory.
    """
    data = np.load(meta["path"], mmap_mode="r")
    if meta["dtype"].startswith(("int", "uint", "bool")):
        return data
    return numerics.from_bits(data, meta["dtype"])


class Worker:
    """A backend worker process and its event stream, read with a timeout.

    Started either for a job (`for_job`), or parked (`park=True`, by `_discover`): it lists
    its framework's platforms, then waits on stdin for the job `adopt` gives it. Its stderr
    goes to the backend's log file; until it has one (a parked worker), it is kept here.
    """

    def __init__(
        self,
        framework: str,
        args: list[str],
        env: dict[str, str],
        *,
        log_path: Path | None = None,
        park: bool = False,
    ):
        self.framework = framework
        self.spec: BackendSpec | None = None
        #: what its framework listed, when it was started to list them (`_discover`)
        self.platforms: list[str] | None = None
        self.log_path = log_path
        #: when it was handed its job (`perf_counter`), and when its last event arrived
        self.handed = time.perf_counter()
        self.received = self.handed
        self._log = open(log_path, "ab") if log_path else None
        self._early: list[bytes] = []  # stderr before there is a log file
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            worker_cmd(framework, env, *args),
            stdin=subprocess.PIPE if park else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._stderr = threading.Thread(target=self._pump_stderr, daemon=True)
        self._stderr.start()

    @classmethod
    def for_job(
        cls, spec: BackendSpec, job_path: Path, log_path: Path, env: dict[str, str]
    ) -> Worker:
        worker = cls(spec.framework, [str(job_path)], env, log_path=log_path)
        worker.spec = spec
        return worker

    def adopt(self, spec: BackendSpec, job_path: Path, log_path: Path) -> None:
        """Hand a parked worker its job; what it wrote to stderr so far goes first in the
        backend's log."""
        self.handed = time.perf_counter()
        with self._lock:
            self.spec, self.log_path = spec, log_path
            self._log = open(log_path, "ab")
            self._log.write(b"".join(self._early))
            self._log.flush()
            self._early.clear()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{job_path}\n".encode())
            self.proc.stdin.close()
        except OSError:  # it died while parked: its death is read from the event stream
            pass

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                if self._log is None or self._log.closed:
                    self._early.append(line)
                else:
                    self._log.write(line)
                    self._log.flush()

    def stderr_text(self) -> str:
        """Everything the worker wrote to stderr (once it has exited)."""
        self._stderr.join(timeout=10)
        with self._lock:
            early = b"".join(self._early).decode(errors="replace")
        if self.log_path is None:
            return early
        try:
            return self.log_path.read_text(errors="replace") + early
        except OSError:
            return early

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put((time.perf_counter(), json.loads(line)))
            except json.JSONDecodeError:
                continue
        self._events.put((time.perf_counter(), None))  # EOF: it exited or closed its stream

    def next_event(self, timeout: float) -> dict | None:
        """The next event; None at EOF. Raises queue.Empty on timeout. `received` is when it
        arrived (a worker started beside others may have sent it long before it is read)."""
        self.received, event = self._events.get(timeout=timeout)
        return event

    def finish(self) -> bool:
        """After its `done`: wait for it to exit (the framework's teardown, ~0.3 s), unless
        it holds no device the next worker could need (its framework listed only the CPU,
        or it is diag's numpy emulation): then it exits while the next backend runs.
        Returns whether it may still be running (the caller `reap`s it later)."""
        if self.platforms == ["cpu"] or self.framework == "numpy":
            return True
        self.reap()
        return False

    def reap(self, timeout: float = 30.0) -> None:
        """Let it exit on its own for up to `timeout` seconds, then `kill`."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._stderr.join(timeout=10)
        with self._lock:
            if self._log is not None:
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
        lines = self.stderr_text().strip().splitlines()
        return lines[-1][:300] if lines else ""
