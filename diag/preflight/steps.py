"""The steps of `diag preflight` (`diag.preflight`): each adds its findings to the result.

``settings`` (the environment and XLA flags), ``fingerprints`` (`diag env`'s workers, or the
probe workers' measurements via `judge_backends`), ``probes`` (the `preflight` suite through
`diag.run.runner.run`) and ``nodes`` (a short bad-device scan, in the probes' JAX worker when it
ran there: `diag.preflight.nodes`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from diag.preflight.result import Finding, Preflight
from diag.records.results import Record
from diag.status import Status
from diag.worker.protocol import Hook

__all__ = [
    "settings_step",
    "fingerprints_step",
    "judge_backends",
    "probes_step",
    "nodes_step",
    "rule_findings",
    "NODE_REPEATS",
    "PROBE_REPEATS",
    "FULL_PRECISION",
]

#: Repeats of the node scan: 3 is the fewest with which an input is seen twice on a device
#: (intermittent faults on a single device are then checked, see `diag.nodes.scan`).
NODE_REPEATS = 3
PROBE_REPEATS = 1
FULL_PRECISION = "F32_F32_F32"


def settings_step(environ: dict[str, str], result: Preflight) -> None:
    from diag.settings.flags import FLAG_VARS, host_findings, parse_flags, validate_xla_flags

    for var in FLAG_VARS:
        parse_flags(environ.get(var), var)  # BadFlag (exit 2) before anything runs
    check = validate_xla_flags(environ)
    result.findings.append(Finding("settings", "XLA_FLAGS", Status.PASS, check))
    result.findings += rule_findings("settings", host_findings(environ))


def rule_findings(step: str, found: list[dict]) -> list[Finding]:
    return [
        Finding(
            step,
            f["rule"],
            Status.WARN,
            f"{f['setting']} = {f['value']}: {f['why']}",
            f"set {f['instead']}",
        )
        for f in found
    ]


def fingerprints_step(environ: dict[str, str], result: Preflight) -> None:
    """Alone (when the probes do not fit): `diag env`'s workers measure what the probes' would."""
    from diag.settings.environment import env_report

    report = env_report(fingerprints=True, environ=environ)
    backends: dict[str, dict] = {}
    for fw, data in report["frameworks"].items():
        error = data.get("error")
        if error and "not installed" in error:
            result.findings.append(Finding("fingerprints", fw, Status.SKIP, error))
        elif error:
            result.findings.append(
                Finding(
                    "fingerprints",
                    fw,
                    Status.ERROR,
                    error,
                    f"run `diag --debug env` to see why the {fw} worker failed",
                )
            )
        backends.update(data.get("backends", {}))
    judge_backends(environ, result, backends)


def judge_backends(environ: dict[str, str], result: Preflight, backends: dict[str, dict]) -> None:
    """Framework settings (the rules) and matmul fingerprints of the backends that ran.

    Args:
      backends: {backend: {"settings", "fingerprints", "framework", ...}} as the workers
        report them (`diag env`'s, or a run's run.json ``backends``).
    """
    from diag.backends import BACKENDS, promises_full_precision
    from diag.settings.flags import findings, host_flags

    def settings(fw: str):
        infos = [i for n, i in backends.items() if n.split("-")[0] == fw]
        return infos[0].get("settings", {}) if infos else None

    found = findings(
        {
            "env": environ,
            "flags": host_flags(environ),
            "jax": settings("jax"),
            "torch": settings("torch"),
            "backends": set(backends),
        }
    )
    host_rules = {f.check for f in result.findings}
    # The framework rules only: the environment's were judged in `settings` already.
    result.findings += [
        f for f in rule_findings("fingerprints", found) if f.check not in host_rules
    ]
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
                result.findings.append(
                    Finding(
                        "fingerprints",
                        f"{name} {precision}",
                        Status.FAIL,
                        f"{name} precision={precision} (via {fp.get('via')}): float32 matmul "
                        f"measured as {label}, below the float32 this backend promises here",
                        f"do not trust float32 results of {name}; run `diag run --suite matmul "
                        f"--backend {name}` and report it against "
                        f"{(info.get('framework') or {}).get('name', name)}",
                    )
                )
            else:
                low.append(f"{precision}: {label}")
        if low:
            result.findings.append(
                Finding(
                    "fingerprints",
                    name,
                    Status.WARN,
                    f"{name} float32 matmul is not float32 at " + ", ".join(low),
                    "use precision HIGHEST (jax) / set_float32_matmul_precision('highest') "
                    "(torch) on the matmuls that need float32",
                )
            )
        elif fps:
            settings_seen = ", ".join(dict.fromkeys(str(fp.get("precision")) for fp in fps))
            result.findings.append(
                Finding(
                    "fingerprints",
                    name,
                    Status.PASS,
                    f"float32 matmul is {FULL_PRECISION} at precision {settings_seen}",
                )
            )


def probes_step(
    environ: dict[str, str],
    result: Preflight,
    cache_dir: str | None,
    with_fingerprints: bool,
    node_scan: Hook | None,
    suite: Any = "preflight",
) -> None:
    from diag.run import runner

    # The workers inherit this process's environment; what `environ` changes goes with them.
    # Their jobs carry the node scan's request (`node_scan`, diag.preflight.nodes) and skip the
    # arithmetic features (nothing in preflight reads them).
    extra = {k: v for k, v in environ.items() if os.environ.get(k) != v}
    out = Path(tempfile.mkdtemp(prefix="diag-preflight-"))
    try:
        run = runner.run(
            suite,
            out=out,
            repeats=PROBE_REPEATS,
            cache_dir=cache_dir,
            env=extra,
            argv=["diag", "preflight"],
            job_fields={"features": False, "hooks": [node_scan] if node_scan else []},
        )
        # The workers measured their settings and the fingerprint of each precision setting
        # the suite's matmul cases use (all of them): no second start of every framework.
        backends = json.loads((run.run_dir / "run.json").read_text()).get("backends") or {}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ran, passed = set(), 0
    for rec in map(Record.from_json, run.records):
        status = rec.status
        if status == Status.SKIP:
            continue  # hardware that is not here; `fingerprints` lists what is
        if "|" not in rec.backend:  # "a|b" is an agreement record between two backends
            ran.add(rec.backend)
        if status == Status.PASS:
            passed += 1
            continue
        check = f"{rec.backend} {rec.probe} {rec.case}"
        todo: dict[str, str] = {
            Status.FAIL: f"do not run the job on {rec.backend} until this passes; `diag run "
            f"--suite ci --backend {rec.backend.split('|')[0]}` shows more",
            Status.ERROR: "the op raised or its worker crashed: see the reason; rerun with "
            "`diag --debug run --suite preflight`",
            Status.WARN: "within what the backend promises; check the job tolerates it",
        }
        result.findings.append(Finding("probes", check, status, rec.reason, todo.get(status, "")))
    if with_fingerprints:
        judge_backends(environ, result, backends)
    result.findings.append(
        Finding(
            "probes",
            "preflight suite",
            Status.PASS,
            f"{passed} record(s) pass on {', '.join(sorted(ran))}"
            if ran
            else "no backend present to probe",
        )
    )


def nodes_step(
    environ: dict[str, str], result: Preflight, injections: tuple, scanned: Path | None
) -> float | None:
    """The node scan's findings; returns its seconds when the probes' JAX worker scanned
    (`scanned` holds its answer, diag.preflight.nodes), None when it ran here."""
    from diag.backends import framework_installed
    from diag.preflight.nodes import collect
    from diag.worker.host import jax_cache_for_import

    if not framework_installed("jax"):  # the scan's workloads are JAX's
        result.findings.append(
            Finding(
                "nodes",
                "devices",
                Status.SKIP,
                "jax is not installed: the node scan runs on JAX",
                "pip install 'diag[jax]' to scan the devices",
            )
        )
        return None
    found = collect(scanned) if scanned is not None else None
    if found is not None:
        scan, seconds = found
    else:
        # In this process (jax is imported here, with this process's XLA_FLAGS), as `diag
        # nodes`, with the JAX workers' persistent compilation cache (read at jax's import).
        from diag import nodes

        seconds = None
        with jax_cache_for_import():
            scan = nodes.scan(repeats=NODE_REPEATS, injections=injections)
    for s in scan.suspects:
        result.findings.append(
            Finding(
                "nodes",
                f"device {s.get('device_id')} on {s.get('host')}",
                Status.FAIL,
                str(s.get("reason")),
                "exclude this device (or its host) from the job; confirm "
                "with `diag nodes --repeats 20`",
            )
        )
    for s in scan.slow:
        result.findings.append(
            Finding(
                "nodes",
                f"device {s.get('device_id')} on {s.get('host')}",
                Status.WARN,
                str(s.get("reason", "slower than the other devices")),
                "a straggler slows every synchronous step: consider excluding it",
            )
        )
    if not scan.suspects:
        result.findings.append(
            Finding(
                "nodes",
                f"{scan.platform} devices",
                Status.PASS,
                f"{len(scan.devices)} {scan.device_kind} device(s) agree with themselves over "
                f"{scan.repeats} repeats" + (f" ({scan.notes[0]})" if scan.notes else ""),
            )
        )
    return seconds
