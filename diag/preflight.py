"""`diag preflight`: is this machine, with these frameworks and flags, fit to run a job?

Why: an expensive job (a week of training, a fleet of decoders) is started on trust that the
settings are what the author meant, that float32 matmuls are float32, that the kernels it leans
on compute what the math says and that no device is corrupting results. Each of those is a
`diag` command of its own; preflight runs the quick version of each under one time budget and
gives one verdict, each finding with what to do.

Steps, in order of value (what a user loses most by not knowing comes first):

1. ``settings``: XLA_FLAGS / LIBTPU_INIT_ARGS validated (a bad flag raises `BadFlag`, exit 2,
   before anything else runs) and the environment judged by `diag.flags.RULES`. Always runs.
2. ``fingerprints``: each framework's numerics settings (the same rules) and the arithmetic
   each backend's float32 matmul really uses at each precision setting
   (`diag.precision.fingerprint`). When the probes fit in the budget, their workers measure
   both (run.json's ``backends``) and every framework starts once; otherwise
   `diag.environment.env_report` measures them alone, the cheaper half of the check.
3. ``probes``: the shipped `preflight` suite (matmul at each precision setting, softmax,
   exact top-k, greedy argmax on tiny shapes) through `diag.runner.run`, judged against exact
   ground truth.
4. ``nodes``: a short bad-device scan of the local devices (`diag.nodes.scan`).

Budget: a step runs when its expected cost fits in what is left of the budget; otherwise it
is skipped and the result says so. The expected cost is the step's last measured duration on
this machine (stored next to the ground-truth cache, `timings_path`), else a built-in estimate
for a cold start. The budget plans; it does not kill a step that runs long.

Verdict and exit code (DESIGN.md): 3 when the node scan names a suspect device (exclude it);
else 4 when a step crashed or an op raised (the check is incomplete); else 1 when a measured
check failed (a probe, or a fingerprint below what the backend promises); else 0, "fit", with
warnings for settings that change results (they may be what the job wants: each says what to
set instead) and for measured behaviour within what the backend promises.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diag.errors import (
    EXIT_BAD_NODE,
    EXIT_NUMERICAL_FAILURE,
    EXIT_OK,
    EXIT_WORKER_CRASH,
    UsageError,
)
from diag.preflight_costs import load_timings, save_timings, timings_path

__all__ = ["preflight", "Preflight", "Finding", "StepResult", "STEPS", "DEFAULT_BUDGET",
           "timings_path", "write_junit", "progress_line"]

DEFAULT_BUDGET = 60.0
#: Repeats of the node scan: 3 is the fewest with which an input is seen twice on a device
#: (intermittent faults on a single device are then checked, see `diag.nodes.scan`).
NODE_REPEATS = 3
PROBE_REPEATS = 1
FULL_PRECISION = "F32_F32_F32"


@dataclass(frozen=True)
class Step:
    """One preflight step: its name, what it checks, and its cold-start cost on a 2-core CPU.

    The estimates were measured here (jax 0.10.2, torch 2.13 CPU, empty cache) and rounded
    up; a step's own measured duration replaces its estimate after its first run.
    """

    name: str
    what: str
    estimate_s: float
    command: str  # the `diag` command that does this step in full (a crash's traceback)


STEPS: tuple[Step, ...] = (
    Step("settings", "XLA flags validated, environment judged by the settings rules", 2.0,
         "env --no-fingerprints"),
    Step("fingerprints", "framework numerics settings; each backend's float32 matmul "
                         "arithmetic at each precision setting", 6.0, "env"),
    Step("probes", "matmul, softmax, top-k and greedy argmax against exact ground truth "
                   "(suite 'preflight')", 12.0, "run --suite preflight"),
    Step("nodes", "bad-device scan of the local devices", 4.0, "nodes"),
)
_ESTIMATES = {s.name: s.estimate_s for s in STEPS}


@dataclass
class Finding:
    """One thing preflight found: a row of the verdict table and a JUnit testcase.

    Attributes:
      step: the step that found it.
      check: what was checked (a rule, a backend's fingerprint, a probe record, a device).
      status: pass, warn, fail, error or skip.
      what: what was found, one line.
      todo: what to do about it ("" when nothing).
    """

    step: str
    check: str
    status: str
    what: str
    todo: str = ""


@dataclass
class StepResult:
    """How a step went, its cost and why.

    `state` is `ran`, `skipped` (budget), `crashed`, or `with probes` (fingerprints
    measured by the probe step's workers, whose cost includes them).
    """

    name: str
    state: str
    seconds: float = 0.0
    expected_s: float = 0.0
    note: str = ""


@dataclass
class Preflight:
    """The result of `preflight`: findings, what each step did, and the one verdict."""

    budget_s: float
    steps: list[StepResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    fingerprints: dict[str, list[dict]] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def skipped(self) -> list[str]:
        return [s.name for s in self.steps if s.state == "skipped"]

    @property
    def exit_code(self) -> int:
        """3 bad device, else 4 crash, else 1 numerical failure, else 0 (module docstring)."""
        statuses = {(f.step, f.status) for f in self.findings}
        if ("nodes", "fail") in statuses:
            return EXIT_BAD_NODE
        if any(s == "error" for _, s in statuses):
            return EXIT_WORKER_CRASH
        if any(s == "fail" for _, s in statuses):
            return EXIT_NUMERICAL_FAILURE
        return EXIT_OK

    @property
    def verdict(self) -> str:
        fit = f"fit ({len(self.skipped)} step(s) skipped)" if self.skipped else "fit"
        return {EXIT_OK: fit, EXIT_NUMERICAL_FAILURE: "numerical problem",
                EXIT_BAD_NODE: "bad device", EXIT_WORKER_CRASH: "crashed"}[self.exit_code]

    def summary(self) -> str:
        """The last line a person reads: the verdict, the time it took, what was skipped."""
        skipped = f"; skipped: {', '.join(self.skipped)}" if self.skipped else ""
        return (f"diag preflight: {self.verdict} ({self.elapsed_s:.1f} s of "
                f"{self.budget_s:g} s){skipped}")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.status] = out.get(f.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "budget_s": self.budget_s,
                "elapsed_s": round(self.elapsed_s, 3), "skipped": self.skipped,
                "counts": self.counts(), "steps": [asdict(s) for s in self.steps],
                "findings": [asdict(f) for f in self.findings],
                "fingerprints": self.fingerprints}


# ---------------------------------------------------------------------------------------------
# Steps


def _settings(environ: dict[str, str], result: Preflight) -> None:
    from diag.flags import FLAG_VARS, host_findings, parse_flags, validate_xla_flags

    for var in FLAG_VARS:
        parse_flags(environ.get(var), var)  # BadFlag (exit 2) before anything runs
    check = validate_xla_flags(environ)
    result.findings.append(Finding("settings", "XLA_FLAGS", "pass", check))
    result.findings += _rule_findings("settings", host_findings(environ))


def _rule_findings(step: str, found: list[dict]) -> list[Finding]:
    return [Finding(step, f["rule"], "warn",
                    f"{f['setting']} = {f['value']}: {f['why']}", f"set {f['instead']}")
            for f in found]


def _fingerprints(environ: dict[str, str], result: Preflight) -> None:
    """Alone (when the probes do not fit): `diag env`'s workers measure what the probes' would."""
    from diag.environment import env_report

    report = env_report(fingerprints=True, environ=environ)
    backends: dict[str, dict] = {}
    for fw, data in report["frameworks"].items():
        error = data.get("error")
        if error and "not installed" in error:
            result.findings.append(Finding("fingerprints", fw, "skip", error))
        elif error:
            result.findings.append(Finding("fingerprints", fw, "error", error,
                                           f"run `diag --debug env` to see why the {fw} "
                                           "worker failed"))
        backends.update(data.get("backends", {}))
    _judge_backends(environ, result, backends)


def _judge_backends(environ: dict[str, str], result: Preflight,
                    backends: dict[str, dict]) -> None:
    """Framework settings (the rules) and matmul fingerprints of the backends that ran.

    Args:
      backends: {backend: {"settings", "fingerprints", "framework", ...}} as the workers
        report them (`diag env`'s, or a run's run.json ``backends``).
    """
    from diag.backends import BACKENDS, promises_full_precision
    from diag.flags import findings, host_flags

    def settings(fw: str):
        infos = [i for n, i in backends.items() if n.split("-")[0] == fw]
        return infos[0].get("settings", {}) if infos else None

    found = findings({"env": environ, "flags": host_flags(environ), "jax": settings("jax"),
                      "torch": settings("torch"), "backends": set(backends)})
    host_rules = {f.check for f in result.findings}
    # The framework rules only: the environment's were judged in `settings` already.
    result.findings += [f for f in _rule_findings("fingerprints", found)
                        if f.check not in host_rules]
    for name, info in backends.items():
        fps = info.get("fingerprints") or []
        result.fingerprints[name] = fps
        spec = BACKENDS.get(name)
        low = []
        for fp in fps:
            label, precision = fp.get("label"), str(fp.get("precision"))
            if label == FULL_PRECISION:
                continue
            if spec is not None and promises_full_precision(spec, "float32", precision):
                result.findings.append(Finding(
                    "fingerprints", f"{name} {precision}", "fail",
                    f"{name} precision={precision} (via {fp.get('via')}): float32 matmul "
                    f"measured as {label}, below the float32 this backend promises here",
                    f"do not trust float32 results of {name}; run `diag run --suite matmul "
                    f"--backend {name}` and report it against "
                    f"{(info.get('framework') or {}).get('name', name)}"))
            else:
                low.append(f"{precision}: {label}")
        if low:
            result.findings.append(Finding(
                "fingerprints", name, "warn",
                f"{name} float32 matmul is not float32 at " + ", ".join(low),
                "use precision HIGHEST (jax) / set_float32_matmul_precision('highest') "
                "(torch) on the matmuls that need float32"))
        elif fps:
            settings_seen = ", ".join(dict.fromkeys(str(fp.get("precision")) for fp in fps))
            result.findings.append(Finding(
                "fingerprints", name, "pass",
                f"float32 matmul is {FULL_PRECISION} at precision {settings_seen}"))


def _probes(environ: dict[str, str], result: Preflight, cache_dir: str | None,
            with_fingerprints: bool, suite: Any = "preflight") -> None:
    from diag import runner

    # The workers inherit this process's environment; what `environ` changes goes with them.
    extra = {k: v for k, v in environ.items() if os.environ.get(k) != v}
    out = Path(tempfile.mkdtemp(prefix="diag-preflight-"))
    try:
        run = runner.run(suite, out=out, repeats=PROBE_REPEATS, cache_dir=cache_dir,
                         env=extra or None, argv=["diag", "preflight"])
        # The workers measured their settings and the fingerprint of each precision setting
        # the suite's matmul cases use (all of them): no second start of every framework.
        backends = json.loads((run.run_dir / "run.json").read_text()).get("backends") or {}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ran, passed = set(), 0
    for rec in run.records:
        status = rec["status"]
        if status == "skip":
            continue  # hardware that is not here; `fingerprints` lists what is
        if "|" not in rec["backend"]:  # "a|b" is an agreement record between two backends
            ran.add(rec["backend"])
        if status == "pass":
            passed += 1
            continue
        check = f"{rec['backend']} {rec['probe']} {rec['case']}"
        todo = {"fail": f"do not run the job on {rec['backend']} until this passes; `diag run "
                        f"--suite ci --backend {rec['backend'].split('|')[0]}` shows more",
                "error": "the op raised or its worker crashed: see the reason; rerun with "
                         "`diag --debug run --suite preflight`",
                "warn": "within what the backend promises; check the job tolerates it"}
        result.findings.append(Finding("probes", check, status, rec["reason"],
                                       todo.get(status, "")))
    if with_fingerprints:
        _judge_backends(environ, result, backends)
    result.findings.append(Finding("probes", "preflight suite", "pass",
                                   f"{passed} record(s) pass on {', '.join(sorted(ran))}"
                                   if ran else "no backend present to probe"))


def _probe_suite(probes: tuple[str, ...]) -> Any:
    """The probe step's suite: the shipped one, with a case per user's function in `probes`."""
    if not probes:
        return "preflight"
    from diag.suite import load_suite
    from diag.suite_fn import with_functions

    return with_functions(load_suite("preflight"), list(probes))


def _nodes(environ: dict[str, str], result: Preflight, injections: tuple) -> None:
    from diag import nodes
    from diag.backends import framework_installed
    from diag.workers import jax_cache_for_import

    if not framework_installed("jax"):  # the scan's workloads are JAX's
        result.findings.append(Finding("nodes", "devices", "skip",
                                       "jax is not installed: the node scan runs on JAX",
                                       "pip install 'diag[jax]' to scan the devices"))
        return
    # In this process (jax is imported here, with this process's XLA_FLAGS), as `diag nodes`,
    # with the JAX workers' persistent compilation cache (read once, when jax is imported).
    with jax_cache_for_import():
        scan = nodes.scan(repeats=NODE_REPEATS, injections=injections)
    for s in scan.suspects:
        result.findings.append(Finding(
            "nodes", f"device {s.get('device_id')} on {s.get('host')}", "fail",
            str(s.get("reason")), "exclude this device (or its host) from the job; confirm "
                                  "with `diag nodes --repeats 20`"))
    for s in scan.slow:
        result.findings.append(Finding(
            "nodes", f"device {s.get('device_id')} on {s.get('host')}", "warn",
            str(s.get("reason", "slower than the other devices")),
            "a straggler slows every synchronous step: consider excluding it"))
    if not scan.suspects:
        result.findings.append(Finding(
            "nodes", f"{scan.platform} devices", "pass",
            f"{len(scan.devices)} {scan.device_kind} device(s) agree with themselves over "
            f"{scan.repeats} repeats" + (f" ({scan.notes[0]})" if scan.notes else "")))


# ---------------------------------------------------------------------------------------------
# The preflight


def preflight(budget: float = DEFAULT_BUDGET, *, environ: dict[str, str] | None = None,
              cache_dir: str | None = None, injections: tuple = (),
              on_step: Callable[[int, int, StepResult, list[Finding]], None] | None = None,
              probes: tuple[str, ...] = ()) -> Preflight:
    """Run the preflight steps that fit in `budget` seconds; mirrors ``diag preflight``.

    Args:
      budget: seconds the whole preflight may take; steps whose expected cost does not fit
        in what is left are skipped (named in `Preflight.skipped`). `settings` always runs.
      environ: the environment to audit and run with (default: this process's).
      cache_dir: the ground-truth cache folder for the probes (default `DIAG_CACHE_DIR`).
      injections: faults for the node scan to find (`diag.nodes.parse_injection`): proof
        that this preflight's device check can fail, as ``diag nodes --inject``.
      on_step: called after each step with (index, number of steps, its result, its
        findings): progress for the command line.
      probes: users' functions (``FILE.py:FUNCTION``) the probe step also runs (`diag.userfn`).

    Returns:
      A `Preflight`: findings with what to do, steps run and skipped, the verdict and
      `exit_code` (0 fit, 1 numerical problem, 3 bad device, 4 crashed).

    Raises:
      UsageError: a budget that is not a positive number, or a bad function in `probes`.
      BadFlag: XLA_FLAGS or LIBTPU_INIT_ARGS holds a flag XLA refuses (exit 2).
    """
    if not budget > 0:
        raise UsageError(f"budget must be a positive number of seconds, got {budget}")
    environ = dict(os.environ if environ is None else environ)
    result = Preflight(budget_s=float(budget))
    measured = load_timings()
    runs: dict[str, Callable[[], None]] = {
        "settings": lambda: _settings(environ, result),
        "fingerprints": lambda: _fingerprints(environ, result),
        "probes": lambda: _probes(environ, result, cache_dir, "fingerprints" in merged,
                                  _probe_suite(probes)),
        "nodes": lambda: _nodes(environ, result, tuple(injections)),
    }
    new_timings: dict[str, float] = {}
    merged: set[str] = set()
    t0 = time.monotonic()
    for i, step in enumerate(STEPS, 1):
        expected = measured.get(step.name, step.estimate_s)
        left = budget - (time.monotonic() - t0)
        before = len(result.findings)
        if step.name == "fingerprints" and measured.get("probes", _ESTIMATES["probes"]) <= left:
            # The probe workers measure the same settings and fingerprints: one framework
            # start instead of two, when the probes fit (they come next, nothing in between).
            merged.add(step.name)
            sr = StepResult(step.name, "with probes", 0.0, expected,
                            "measured by the probe workers")
        elif step.name != "settings" and expected > left:
            sr = StepResult(step.name, "skipped", 0.0, expected,
                            f"needs ~{expected:.0f} s, {max(left, 0):.0f} s of the budget left")
            result.findings.append(Finding(step.name, step.name, "skip",
                                           f"skipped: {sr.note} ({step.what})",
                                           f"raise --budget to at least "
                                           f"{budget - left + expected:.0f} to include it"))
        else:
            start = time.monotonic()
            try:
                runs[step.name]()
                sr = StepResult(step.name, "ran", 0.0, expected)
            except UsageError:
                raise  # bad flags, bad input: exit 2 before a verdict
            except Exception as e:  # noqa: BLE001 - a crashed step is a finding (exit 4)
                first = " ".join(str(e).split())[:300]
                sr = StepResult(step.name, "crashed", 0.0, expected, type(e).__name__)
                result.findings.append(Finding(step.name, step.name, "error",
                                               f"{type(e).__name__}: {first}",
                                               f"rerun `diag --debug {step.command}` for the "
                                               "traceback"))
            sr.seconds = time.monotonic() - start
            if sr.state == "ran":
                new_timings[step.name] = round(sr.seconds, 3)
        result.steps.append(sr)
        if on_step:
            on_step(i, len(STEPS), sr, result.findings[before:])
    result.elapsed_s = time.monotonic() - t0
    save_timings(new_timings)
    return result


def progress_line(i: int, n: int, step: StepResult, findings: list[Finding]) -> str:
    """One stderr line per step (what `on_step` gets): readable in a CI log as it comes."""
    counts = ", ".join(f"{sum(f.status == s for f in findings)} {s}"
                       for s in ("pass", "warn", "fail", "error")
                       if any(f.status == s for f in findings))
    what = step.note if step.state == "skipped" else counts or step.note or "nothing new"
    return f"diag preflight: [{i}/{n}] {step.name}: {step.state}, {what} ({step.seconds:.1f} s)"


def write_junit(result: Preflight, path: str | os.PathLike) -> Path:
    """One testcase per finding (classname: its step): fail/error as failures, skip skipped.

    Written with junitparser, as `diag.junit` writes `diag check`'s file.
    """
    from junitparser import Error, Failure, Skipped, TestCase, TestSuite

    suite = TestSuite("diag preflight")
    for f in result.findings:
        tc = TestCase(f.check, classname=f"preflight.{f.step}")
        text = f"{f.what}; what to do: {f.todo}" if f.todo else f.what
        if f.status == "fail":
            tc.result = [Failure(text[:500], "fail")]
        elif f.status == "error":
            tc.result = [Error(text[:500], "error")]
        elif f.status == "skip":
            tc.result = [Skipped(text[:500])]
        tc.system_out = text
        suite.add_testcase(tc)
    from diag.junit import save

    return save(suite, path)


class _CallableModule(types.ModuleType):
    """`diag.preflight(...)` calls `preflight`, as `diag.run(...)` calls the runner.

    The module and the function share a name; Python binds `diag.preflight` to the module
    once it is imported, so the module itself is made callable (one name, both uses).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Preflight:
        return preflight(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
