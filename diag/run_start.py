"""Starting a backend's worker for a run: its job file (`diag.protocol.Job`) and the worker.

Apart from the runner's event loop so that a run can start several CPU backends' workers at
once (`diag.workers.start_beside`) and read their events in their turn.
"""

from __future__ import annotations

import json
from typing import Any

from diag.backends import BackendSpec
from diag.protocol import CaseJob, Job
from diag.registry import PROBES
from diag.suite import Case
from diag.trace import capture as trace_capture
from diag.workers import Worker

__all__ = ["start_job"]


def start_job(run: Any, spec: BackendSpec, cases: list[Case]) -> Worker:
    """Write `spec`'s job of running `cases` and start its worker: the framework's parked
    one (`diag.workers.Worker.adopt`) when the run has it, else a new one.

    Args:
      run: the runner's run in progress (its work folder, inputs, repeats, A/B experiment,
        trace folder, environment and parked workers).
    """
    # The arithmetic of each precision setting the fingerprinted cases use, measured in the
    # worker (diag.precision): what a verdict under that setting can be checked against.
    fingerprinted = [c for c in cases if PROBES[c.op].fingerprint]
    settings = {("default", "none")} | {
        (c.params.get("precision", "default"), c.params.get("precision_via", "none"))
        for c in fingerprinted
    }
    job = Job(
        backend=spec.name,
        label=spec.label,
        out_dir=str(run.work),
        repeats=run.repeats,
        repeat_budget_s=run.repeat_budget,
        hlo=run.ab is not None,
        trace=trace_capture.job_field(run.trace, cases),  # --trace (diag.trace)
        fingerprint=sorted(settings, key=lambda p: (p != ("default", "none"), p))
        if fingerprinted
        else [],
        cases=[
            CaseJob(
                id=c.id,
                op=c.op,
                op_args={**PROBES[c.op].fixed_args, **c.op_args},
                hunt_nans=PROBES[c.op].hunt_nans,
                inputs=run.inputs.paths(c),
                input_dtypes=[c.dtype] * len(run.inputs.paths(c)),
            )
            for c in cases
        ],
    )
    job_path = run.work / f"job-{spec.label}.json"
    job_path.write_text(json.dumps(job.to_json()))
    logs = run.run_dir.path / "logs"
    logs.mkdir(exist_ok=True)
    env = run.ab.worker_env(spec, run.env) if run.ab is not None else run.env
    log = logs / f"{spec.label}.stderr"
    parked = run.parked.pop(spec.framework, None) if env == run.env else None
    if parked is not None:  # its framework is imported already: it starts the job now
        parked.adopt(spec, job_path, log)
        return parked
    return Worker.for_job(spec, job_path, log, env)
