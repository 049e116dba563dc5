"""`diag preflight`: is this machine, with these frameworks and flags, fit to run a job?

Why: an expensive job (a week of training, a fleet of decoders) is started on trust that the
settings are what the author meant, that float32 matmuls are float32, that the kernels it leans
on compute what the math says and that no device is corrupting results. Each of those is a
`diag` command of its own; preflight runs the quick version of each under one time budget and
gives one verdict, each finding with what to do.

Steps, in order of value (what a user loses most by not knowing comes first):

1. ``settings``: XLA_FLAGS / LIBTPU_INIT_ARGS validated (a bad flag raises `BadFlag`, exit 2,
   before anything else runs) and the environment judged by `diag.settings.flags.RULES`.
   Always runs.
2. ``fingerprints``: each framework's numerics settings (the same rules) and the arithmetic
   each backend's float32 matmul really uses at each precision setting
   (`diag.arith.precision.fingerprint`). When the probes fit in the budget, their workers measure
   both (run.json's ``backends``) and every framework starts once; otherwise
   `diag.settings.environment.env_report` measures them alone, the cheaper half of the check.
3. ``probes``: the shipped `preflight` suite (matmul at each precision setting, softmax,
   exact top-k, greedy argmax on tiny shapes) through `diag.run.runner.run`, judged against exact
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

import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.errors import UsageError
from diag.preflight.costs import load_timings, save_timings, timings_path
from diag.preflight.nodes import scan_hook
from diag.preflight.result import Finding, Preflight, StepResult
from diag.preflight.steps import (
    NODE_REPEATS,
    fingerprints_step,
    nodes_step,
    probes_step,
    settings_step,
)
from diag.status import CHECKED, Status

__all__ = [
    "preflight",
    "Preflight",
    "Finding",
    "StepResult",
    "STEPS",
    "DEFAULT_BUDGET",
    "timings_path",
    "write_junit",
    "progress_line",
]

DEFAULT_BUDGET = 60.0


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
    Step(
        "settings",
        "XLA flags validated, environment judged by the settings rules",
        2.0,
        "env --no-fingerprints",
    ),
    Step(
        "fingerprints",
        "framework numerics settings; each backend's float32 matmul "
        "arithmetic at each precision setting",
        6.0,
        "env",
    ),
    Step(
        "probes",
        "matmul, softmax, top-k and greedy argmax against exact ground truth (suite 'preflight')",
        12.0,
        "run --suite preflight",
    ),
    Step("nodes", "bad-device scan of the local devices", 4.0, "nodes"),
)
_ESTIMATES = {s.name: s.estimate_s for s in STEPS}


def _probe_suite(probes: tuple[str | tuple[str, str], ...]) -> Any:
    """The probe step's suite: the shipped one, with a case per user's function in `probes`
    (a spec, or a pair of it and its reference function's)."""
    if not probes:
        return "preflight"
    from diag.plan.suite import load_suite
    from diag.plan.suite_fn import with_functions

    pairs = [(p, "") if isinstance(p, str) else p for p in probes]
    return with_functions(
        load_suite("preflight"), [p for p, _ in pairs], references=[r for _, r in pairs]
    )


# ---------------------------------------------------------------------------------------------
# The preflight


def preflight(
    budget: float = DEFAULT_BUDGET,
    *,
    environ: dict[str, str] | None = None,
    cache_dir: str | None = None,
    injections: tuple = (),
    on_step: Callable[[int, int, StepResult, list[Finding]], None] | None = None,
    probes: tuple[str | tuple[str, str], ...] = (),
) -> Preflight:
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
      probes: users' functions to probe too: ``FILE.py:FUNCTION``, or (it, ``FILE.py:REF``).

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
    merged: set[str] = set()
    scan_dir = Path(tempfile.mkdtemp(prefix="diag-preflight-nodes-"))
    scanned = scan_dir / "nodes.json"  # the probes' JAX worker's node scan, when merged
    runs: dict[str, Callable[[], float | None]] = {
        "settings": lambda: settings_step(environ, result),
        "fingerprints": lambda: fingerprints_step(environ, result),
        "probes": lambda: probes_step(
            environ,
            result,
            cache_dir,
            with_fingerprints="fingerprints" in merged,
            suite=_probe_suite(probes),
            node_scan=scan_hook(scanned, NODE_REPEATS, tuple(injections))
            if "nodes" in merged
            else None,
        ),
        "nodes": lambda: nodes_step(
            environ, result, tuple(injections), scanned if "nodes" in merged else None
        ),
    }
    new_timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        for i, step in enumerate(STEPS, 1):
            expected = measured.get(step.name, step.estimate_s)
            left = budget - (time.monotonic() - t0)
            before = len(result.findings)
            if (
                step.name == "probes"
                and expected + measured.get("nodes", _ESTIMATES["nodes"]) <= left
            ):
                # Both fit: the probes' JAX worker scans the devices after its cases (jax is
                # imported there already; diag.preflight.nodes), the host does not import it.
                merged.add("nodes")
            sr = _step(step, expected, left, budget, measured, merged, runs[step.name], result)
            if sr.state == "ran":
                new_timings[step.name] = round(sr.seconds, 3)
            result.steps.append(sr)
            if on_step:
                on_step(i, len(STEPS), sr, result.findings[before:])
    finally:
        shutil.rmtree(scan_dir, ignore_errors=True)
    result.elapsed_s = time.monotonic() - t0
    save_timings(new_timings)
    return result


def _step(
    step: Step,
    expected: float,
    left: float,
    budget: float,
    measured: dict[str, float],
    merged: set[str],
    run: Callable[[], float | None],
    result: Preflight,
) -> StepResult:
    """Run one step, or say why not (the budget, or another step measures it)."""
    if step.name == "fingerprints" and measured.get("probes", _ESTIMATES["probes"]) <= left:
        # The probe workers measure the same settings and fingerprints: one framework
        # start instead of two, when the probes fit (they come next, nothing in between).
        merged.add(step.name)
        return StepResult(step.name, "with probes", 0.0, expected, "measured by the probe workers")
    if step.name != "settings" and expected > left and step.name not in merged:
        sr = StepResult(
            step.name,
            "skipped",
            0.0,
            expected,
            f"needs ~{expected:.0f} s, {max(left, 0):.0f} s of the budget left",
        )
        result.findings.append(
            Finding(
                step.name,
                step.name,
                Status.SKIP,
                f"skipped: {sr.note} ({step.what})",
                f"raise --budget to at least {budget - left + expected:.0f} to include it",
            )
        )
        return sr
    start = time.monotonic()
    try:
        seconds = run()
        sr = StepResult(step.name, "ran", 0.0, expected)
    except UsageError:
        raise  # bad flags, bad input: exit 2 before a verdict
    except Exception as e:  # noqa: BLE001 - a crashed step is a finding (exit 4)
        seconds = None
        first = " ".join(str(e).split())[:300]
        sr = StepResult(step.name, "crashed", 0.0, expected, type(e).__name__)
        result.findings.append(
            Finding(
                step.name,
                step.name,
                Status.ERROR,
                f"{type(e).__name__}: {first}",
                f"rerun `diag --debug {step.command}` for the traceback",
            )
        )
    sr.seconds = time.monotonic() - start
    if seconds is not None:  # measured where it ran: the probes' JAX worker
        sr.seconds, sr.note = seconds, "scanned by the probes' JAX worker"
    return sr


def progress_line(i: int, n: int, step: StepResult, findings: list[Finding]) -> str:
    """One stderr line per step (what `on_step` gets): readable in a CI log as it comes."""
    counts = ", ".join(
        f"{sum(f.status == s for f in findings)} {s}"
        for s in CHECKED
        if any(f.status == s for f in findings)
    )
    what = step.note if step.state == "skipped" else counts or step.note or "nothing new"
    return f"diag preflight: [{i}/{n}] {step.name}: {step.state}, {what} ({step.seconds:.1f} s)"


def write_junit(result: Preflight, path: str | os.PathLike) -> Path:
    """One testcase per finding (classname: its step): fail/error as failures, skip skipped.

    Written with junitparser, as `diag.gate.junit` writes `diag check`'s file.
    """
    from junitparser import Error, Failure, Skipped, TestCase, TestSuite

    suite = TestSuite("diag preflight")
    for f in result.findings:
        tc = TestCase(f.check, classname=f"preflight.{f.step}")
        text = f"{f.what}; what to do: {f.todo}" if f.todo else f.what
        if f.status == Status.FAIL:
            tc.result = [Failure(text[:500], Status.FAIL)]
        elif f.status == Status.ERROR:
            tc.result = [Error(text[:500], Status.ERROR)]
        elif f.status == Status.SKIP:
            tc.result = [Skipped(text[:500])]
        tc.system_out = text
        suite.add_testcase(tc)
    from diag.gate.junit import save

    return save(suite, path)


class _CallableModule(types.ModuleType):
    """`diag.preflight(...)` calls `preflight`, as `diag.run(...)` calls the runner.

    The module and the function share a name; Python binds `diag.preflight` to the module
    once it is imported, so the module itself is made callable (one name, both uses).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Preflight:
        return preflight(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
