"""`scan`: start the framework, run the workloads on every device, gather, vote, compare
configurations, and say whether the self-test held.

The framework (jax or torch) enters only through a runtime (`diag.nodes.local.Runtime`); the
worker protocol (`diag.nodes.local.run_local`), the gathering, the vote and the configuration
comparison are the same for both.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.errors import EXIT_NUMERICAL_FAILURE, UsageError, exit_code
from diag.nodes import config, store
from diag.nodes.distributed import JaxRuntime, StdoutToStderr, import_jax, init_distributed
from diag.nodes.gather import barrier, gather, gather_texts, gather_ulps
from diag.nodes.inject import Injection, check_injections, detection_table, injection_outcomes
from diag.nodes.local import LocalRun, Runtime, hex_digests, local_ulps, run_local
from diag.nodes.result import NodeScan, NodeVote
from diag.nodes.torch_runtime import TorchRuntime, detect_framework
from diag.nodes.vote import Observations, analyze, references
from diag.nodes.workloads import BUILTIN_WORKLOADS, INPUTS_PER_WORKLOAD, Workload

__all__ = ["EXIT_SELFTEST_MISSED", "FRAMEWORKS", "scan"]

#: Exit code when an injected fault was not found and no device is a suspect: the self-test
#: is a check that failed (1), not a bad device (3: none was named), not bad usage (2).
EXIT_SELFTEST_MISSED = EXIT_NUMERICAL_FAILURE

FRAMEWORKS = ("jax", "torch")


def _start(
    framework: str,
    host_devices: int | None,
    platform: str | None,
    distributed: bool,
    cluster: tuple[str | None, int | None, int | None],
    init_timeout: int,
) -> Runtime:
    """The runtime of `framework`, its distributed runtime started when asked (`cluster`:
    the coordinator, number of processes and process id given, or None each)."""
    coordinator, num_processes, process_id = cluster
    if framework == "torch":
        if host_devices is not None:
            raise UsageError(
                "--host-devices forces jax CPU devices; with --framework torch "
                "start one rank per device (torchrun --nproc-per-node N)"
            )
        return TorchRuntime(
            platform, distributed, coordinator, num_processes, process_id, init_timeout
        )
    if "jax" not in sys.modules:
        # XLA aborts the whole process on a flag it does not know; find out in a throwaway one.
        from diag.settings.flags import validate_xla_flags

        validate_xla_flags()
    jax = import_jax(host_devices)
    if distributed:
        init_distributed(jax, coordinator, num_processes, process_id, init_timeout)
    elif any(v is not None for v in (coordinator, num_processes, process_id)):
        raise UsageError("--coordinator/--num-processes/--process-id need --distributed")
    return JaxRuntime(jax, platform or ("cpu" if host_devices is not None else None), distributed)


@dataclass(frozen=True)
class _Plan:
    """What a scan runs (the same on every process) and how it votes: `scan`'s arguments."""

    workloads: list[Workload]
    framework: str
    repeats: int
    seed: int
    injections: Sequence[Injection]
    slow_factor: float
    fail_on_slow: bool


@dataclass
class _Seen:
    """What this process knows after the collectives: every device's observations, every
    process's configuration, the golden store's entry, and its own run."""

    obs: Observations
    fingerprints: list[dict[str, str]]
    golden: dict[str, list[str]]
    gdir: Path
    gpath: Path
    keys: dict[str, str]
    versions: dict[str, str]
    local: LocalRun
    run_s: float
    pid: int
    nproc: int


def _observe(rt: Runtime, plan: _Plan, golden_dir, use_golden: bool) -> _Seen:
    """Run, gather digests and configuration fingerprints, and measure ULPs (collectives:
    every process calls this with the same arguments)."""
    workloads, repeats, seed, injections = plan.workloads, plan.repeats, plan.seed, plan.injections
    check_injections(injections, rt.all_devices())
    devices = rt.local_devices()
    t_run = time.perf_counter()
    local = run_local(rt, devices, workloads, repeats, seed, injections)
    run_s = time.perf_counter() - t_run
    got = gather(rt, local)
    # After the workloads were built and ran: the settings they ran under. One process has
    # nothing to compare its configuration with (and measuring it costs a matmul probe).
    fingerprints: list[dict[str, str]] = [{}]
    if rt.process_count > 1:
        mine = config.encode(config.fingerprint(rt.settings()))
        fingerprints = [config.decode(t) for t in gather_texts(rt, mine)]
    digests = hex_digests(got.digests)
    versions = rt.versions()
    names = [w.name for w in workloads]
    keys = {w.name: w.key(seed) for w in workloads}
    gdir = Path(golden_dir) if golden_dir else store.default_golden_dir()
    gpath = store.golden_path(gdir, got.devices[0]["platform"], got.devices[0]["kind"], versions)
    golden = store.load_golden(gpath, keys) if use_golden else {}
    ref, _ = references(digests, golden, names)
    ulps = gather_ulps(rt, local_ulps(local, ref), got)
    obs = Observations(got.devices, names, digests, got.nan, got.inf, got.times, got.injected, ulps)
    return _Seen(
        obs,
        fingerprints,
        golden,
        gdir,
        gpath,
        keys,
        versions,
        local,
        run_s,
        rt.process_index,
        rt.process_count,
    )


def _selftest(vote: NodeVote, injections, repeats, names, slow_factor):
    if not injections:
        return None
    outcomes = injection_outcomes(
        {**vote.to_dict(), "repeats": repeats, "workloads": names}, injections, slow_factor
    )
    missed = [o for o in outcomes if not o["found"]]
    return {"verdict": "missed" if missed else "found", "injections": outcomes}


def _golden_info(
    seen: _Seen, vote: NodeVote, misconfigured: list, save_golden: bool, notes: list, framework: str
) -> dict[str, Any]:
    info: dict[str, Any] = {"path": str(seen.gpath), "compared": sorted(seen.golden), "saved": 0}
    if not save_golden:
        return info
    if vote.suspects:
        notes.append("golden not saved: the scan found suspects")
    elif misconfigured:
        notes.append("golden not saved: the processes' configurations differ")
    elif seen.pid == 0:
        dev = seen.obs.devices[0]
        store.mark_cache_folder(seen.gdir)
        info["saved"] = store.save_golden(
            seen.gpath,
            seen.keys,
            seen.obs.digests,
            {
                "platform": dev["platform"],
                "device_kind": dev["kind"],
                "framework": framework,
                **seen.versions,
                "host": dev["host"],
                "devices": len(seen.obs.devices),
            },
        )
    return info


def _check(repeats, host_devices, slow_factor, workloads, framework) -> tuple[list, str]:
    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: expected at least 1")
    if host_devices is not None and host_devices < 1:
        raise UsageError(f"--host-devices {host_devices}: expected at least 1")
    if slow_factor <= 1:
        raise UsageError(f"--slow-factor {slow_factor:g}: expected a factor above 1")
    framework = framework or detect_framework()
    if framework not in FRAMEWORKS:
        raise UsageError(f"--framework {framework}: expected jax or torch")
    workloads = list(workloads) if workloads else list(BUILTIN_WORKLOADS.values())
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise UsageError(f"workload given twice: {', '.join(names)}")
    return workloads, framework


def scan(
    *,
    workloads: Sequence[Workload] | None = None,
    repeats: int = 10,
    seed: int = 0,
    host_devices: int | None = None,
    platform: str | None = None,
    injections: Sequence[Injection] = (),
    distributed: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    init_timeout: int = 60,
    golden_dir: os.PathLike | None = None,
    save_golden: bool = False,
    use_golden: bool = True,
    slow_factor: float = 1.5,
    fail_on_slow: bool = False,
    framework: str | None = None,
    epilogue: Callable[[NodeScan], Any] | None = None,
) -> NodeScan:
    """Scan every local device (every device of every process with `distributed`).

    Args:
      workloads: what to run; default every builtin (`BUILTIN_WORKLOADS`).
      repeats: R, calls per device per workload; inputs alternate between two seeded arrays.
      seed: draws the inputs (and is part of the golden key).
      host_devices: force this many jax CPU devices (sets XLA_FLAGS before jax is imported);
        implies platform "cpu". Not with torch.
      platform: "cpu", "gpu" or "tpu"; default the framework's default.
      injections: faults diag applies to chosen devices' outputs (self-test).
      distributed: start the framework's distributed runtime first: `jax.distributed`
        (auto-detected on TPU pods and SLURM) or `torch.distributed` (torchrun's or SLURM's
        environment), or the explicit `coordinator`, `num_processes`, `process_id`.
      init_timeout: seconds to wait for every process to join.
      golden_dir: the golden store (default `diag.nodes.default_golden_dir()`).
      save_golden: store this scan's digests as golden when every device agrees.
      use_golden: compare with a stored golden digest when there is one.
      slow_factor: straggler threshold, see `analyze`.
      fail_on_slow: stragglers count as suspects.
      framework: "jax" or "torch"; default "torch" when torchrun's variables are set
        (`diag.nodes.torch_runtime.detect_framework`), else "jax".
      epilogue: called by process 0 with the result while every process still waits (what
        `diag nodes` writes: the run folder, the report, the JSON); the others leave after it.

    Returns:
      A `NodeScan` (``to_dict()`` is the nodes.json data): the vote of `analyze`, the
      processes whose configuration differs from the majority's (``misconfigured``), and what
      the scan covered. ``exit_code`` is 3 with a suspect or a misconfigured process, else
      `EXIT_SELFTEST_MISSED` (1) when an injected fault was not found, else 0. Every process
      returns the same verdict; only ``process_index`` differs (and ``selftest``, which
      covers the injections that process was given).

    Raises:
      UsageError: bad arguments, jax already started with another device count, an
        injection that matches no scanned device, or (`diag.settings.flags.BadFlag`) a flag in
        XLA_FLAGS that XLA refuses, found in a throwaway process before jax is imported
        here (XLA would abort this one).
      NodeScanError: the framework is missing, distributed start-up failed, or a workload
        raised.
    """
    workloads, framework = _check(repeats, host_devices, slow_factor, workloads, framework)
    plan = _Plan(workloads, framework, repeats, seed, injections, slow_factor, fail_on_slow)
    cluster = (coordinator, num_processes, process_id)
    t_start = time.perf_counter()
    with _quiet(distributed):
        rt = _start(framework, host_devices, platform, distributed, cluster, init_timeout)
    try:
        with _quiet(distributed):
            seen = _observe(rt, plan, golden_dir, use_golden)
        result = _result(seen, plan, save_golden, t_start)
        _epilogue(rt, result, epilogue, distributed)
    finally:
        with _quiet(distributed):
            rt.shutdown()
    return result


def _epilogue(
    rt: Runtime, result: NodeScan, epilogue: Callable[[NodeScan], Any] | None, distributed: bool
) -> None:
    """Process 0 runs `epilogue` while every process waits for it at a barrier."""
    try:
        if epilogue is not None and result.process_index == 0:
            epilogue(result)
    finally:
        # No process leaves before process 0 has written the verdict: torchrun stops
        # every rank as soon as one exits non-zero (as every rank does with a suspect).
        with _quiet(distributed):
            barrier(rt)


def _quiet(distributed: bool):
    """Gloo prints on stdout while the distributed runtime works; --json must stay parseable."""
    return StdoutToStderr() if distributed else contextlib.nullcontext()


def _result(seen: _Seen, plan: _Plan, save_golden: bool, t_start: float) -> NodeScan:
    """The vote, the configuration comparison and the self-test, as one `NodeScan`."""
    workloads, framework, repeats, seed = plan.workloads, plan.framework, plan.repeats, plan.seed
    injections, slow_factor, fail_on_slow = plan.injections, plan.slow_factor, plan.fail_on_slow
    names = [w.name for w in workloads]
    vote = analyze(seen.obs, seen.golden, slow_factor=slow_factor, fail_on_slow=fail_on_slow)
    misconfigured, summary, config_notes = config.judge(vote, seen.fingerprints)
    notes = list(vote.notes) + config_notes
    verdict = vote.verdict
    if misconfigured:
        verdict = "suspect" if vote.suspects else "misconfigured"
    selftest = _selftest(vote, injections, repeats, names, slow_factor)
    # A self-test that did not see its own fault must not read as a clean fleet
    # (`EXIT_SELFTEST_MISSED`); a suspect or a misconfigured process outranks it.
    code = exit_code(
        bad_node=bool(vote.suspects or misconfigured),
        failed=bool(selftest and selftest["verdict"] == "missed"),
    )
    local, obs, run_s = seen.local, seen.obs, seen.run_s
    return NodeScan(
        process_index=seen.pid,
        num_processes=seen.nproc,
        platform=obs.devices[0]["platform"],
        device_kind=obs.devices[0]["kind"],
        versions=seen.versions,
        repeats=repeats,
        seed=seed,
        inputs_per_workload=INPUTS_PER_WORKLOAD,
        workloads=[
            {"name": w.name, "shape": list(w.shape), "dtype": w.dtype, "key": w.key(seed)}
            for w in workloads
        ],
        golden=_golden_info(seen, vote, misconfigured, save_golden, notes, framework),
        injections=[
            {
                "kind": i.kind,
                "rate": i.rate,
                "device": i.device,
                "process": i.process,
                "seed": i.seed,
                "text": i.describe(),
            }
            for i in injections
        ],
        detection=detection_table(repeats, len(workloads), injections),
        selftest=selftest,
        local_devices=len(local.devices),
        compile_seconds=local.compile_s,
        scan_seconds=run_s - local.compile_s,
        seconds_per_device=(run_s - local.compile_s) / max(len(local.devices), 1),
        total_seconds=time.perf_counter() - t_start,
        **{**vote.to_dict(), "exit_code": code, "verdict": verdict, "notes": notes},
        framework=framework,
        misconfigured=misconfigured,
        config=summary,
    )
