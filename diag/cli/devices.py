"""`diag nodes` and `diag env`: which devices and hosts compute wrong, and what is set."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from diag.cli._app import app, split
from diag.errors import DiagError, exit_code

# `diag nodes`'s options, one alias each (the command's signature reads as their list).
_Repeats = Annotated[
    int,
    typer.Option(
        "--repeats",
        "-r",
        min=1,
        help="Calls per device per workload (inputs alternate between two seeded arrays).",
    ),
]
_Workload = Annotated[
    list[str] | None,
    typer.Option(
        "--workload",
        "-w",
        help="Builtin (matmul_bf16, matmul_f32, softmax, train_step) or your own "
        "module:function / file.py:function; repeatable. Default: every builtin.",
    ),
]
_InputShape = Annotated[
    str, typer.Option("--input-shape", help="Input shape for your own workload, e.g. 64,256.")
]
_InputDtype = Annotated[
    str, typer.Option("--input-dtype", help="Input dtype for your own workload.")
]
_HostDevices = Annotated[
    int | None,
    typer.Option(
        "--host-devices",
        min=1,
        help="Scan N CPU devices (sets --xla_force_host_platform_device_count).",
    ),
]
_Platform = Annotated[
    str | None,
    typer.Option(
        "--platform",
        help="cpu, gpu or tpu (torch: cpu or gpu); default the framework's default.",
    ),
]
_Inject = Annotated[
    list[str] | None,
    typer.Option(
        "--inject",
        help="Self-test fault: 'device=3,kind=nan|bitflip|stuck|slow,rate=0.01' "
        "(also process=I, seed=S, delay=SECONDS); repeatable.",
    ),
]
_Distributed = Annotated[
    bool,
    typer.Option(
        "--distributed",
        help="Multi-host: start jax.distributed (auto-detected on "
        "TPU pods and SLURM) or torch.distributed (torchrun's "
        "environment; gloo on CPU, NCCL on GPU).",
    ),
]
_Framework = Annotated[
    str | None,
    typer.Option(
        "--framework",
        help="jax or torch; default torch when started by torchrun (TORCHELASTIC_* or "
        "RANK+LOCAL_RANK+WORLD_SIZE set), else jax.",
    ),
]
_Coordinator = Annotated[
    str | None,
    typer.Option(
        "--coordinator",
        help="HOST:PORT of process 0, when the launcher's environment does not name the cluster.",
    ),
]
_NumProcesses = Annotated[int | None, typer.Option("--num-processes", min=1)]
_ProcessId = Annotated[int | None, typer.Option("--process-id", min=0)]
_InitTimeout = Annotated[
    int, typer.Option("--init-timeout", min=1, help="Seconds to wait for every process to join.")
]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of the inputs (part of the golden key).")]
_GoldenDir = Annotated[
    Path | None,
    typer.Option(
        "--golden-dir",
        help="Golden digest store (default $DIAG_CACHE_DIR/golden or ~/.cache/diag/golden).",
    ),
]
_SaveGolden = Annotated[
    bool,
    typer.Option(
        "--save-golden", help="Store this scan's digests as golden when every device agrees."
    ),
]
_SlowFactor = Annotated[
    float,
    typer.Option(
        "--slow-factor",
        help="Straggler: fastest repeat slower than this times the median device.",
    ),
]
_FailOnSlow = Annotated[
    bool, typer.Option("--fail-on-slow", help="Stragglers are suspects too (exit 3).")
]
_Out = Annotated[
    Path,
    typer.Option("--out", "-o", help="Folder the run folder is created in (process 0 only)."),
]
_Json = Annotated[bool, typer.Option("--json", help="Print the verdict as JSON on stdout.")]
_Report = Annotated[
    bool, typer.Option("--report/--no-report", help="Write report.html into the run folder.")
]


@app.command("nodes")
def nodes_cmd(
    repeats: _Repeats = 10,
    workload: _Workload = None,
    input_shape: _InputShape = "128,128",
    input_dtype: _InputDtype = "float32",
    host_devices: _HostDevices = None,
    platform: _Platform = None,
    inject: _Inject = None,
    distributed: _Distributed = False,
    framework: _Framework = None,
    coordinator: _Coordinator = None,
    num_processes: _NumProcesses = None,
    process_id: _ProcessId = None,
    init_timeout: _InitTimeout = 60,
    seed: _Seed = 0,
    golden_dir: _GoldenDir = None,
    save_golden: _SaveGolden = False,
    slow_factor: _SlowFactor = 1.5,
    fail_on_slow: _FailOnSlow = False,
    out: _Out = Path("reports"),
    as_json: _Json = False,
    report: _Report = True,
) -> None:
    """Scan devices (and hosts) for wrong results: same workloads everywhere, vote on the bits."""
    from diag import nodes, render

    try:
        shape = [int(s) for s in input_shape.replace("x", ",").split(",") if s.strip()]
    except ValueError:
        raise DiagError(f"--input-shape {input_shape!r}: expected sizes like 64,256") from None
    workloads = [nodes.load_workload(w, shape, input_dtype) for w in split(workload) or []]
    injections = [nodes.parse_injection(i) for i in inject or []]

    def write(result) -> None:  # process 0, while the other processes wait for it
        run_dir = nodes.write_run(result, out, ["diag"] + sys.argv[1:])
        report_path = None
        if report:
            from diag.report import write_report

            report_path = write_report(run_dir)
        _show_nodes(result, run_dir, report_path, as_json)
        # Out before the others leave: torchrun may stop this process once they exit non-zero.
        sys.stdout.flush()

    result = nodes.scan(
        workloads=workloads or None,
        repeats=repeats,
        seed=seed,
        host_devices=host_devices,
        platform=platform,
        injections=injections,
        distributed=distributed,
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        init_timeout=init_timeout,
        golden_dir=golden_dir,
        save_golden=save_golden,
        slow_factor=slow_factor,
        fail_on_slow=fail_on_slow,
        framework=framework,
        epilogue=write,
    )
    if result.process_index != 0:
        # A log line, not the result: process 0's stdout carries the verdict.
        render.print_line(
            f"diag: process {result.process_index} of "
            f"{result.num_processes}: {result.verdict}; process 0 "
            "writes the verdict",
            err=True,
        )
    raise typer.Exit(result.exit_code)


def _show_nodes(result, run_dir, report_path, as_json: bool) -> None:
    """`diag nodes`' verdict: JSON on stdout, or tables and lines."""
    from diag import nodes, render
    from diag.render.nodes import nodes_summary, nodes_tables

    if as_json:
        render.out.print_json(
            json.dumps(
                {
                    **result.to_dict(),
                    "run_dir": str(run_dir),
                    "report": str(report_path) if report_path else None,
                },
                default=str,
            )
        )
        return
    for table in nodes_tables(result):
        render.out.print(table)
    for line in nodes_summary(result, run_dir):
        render.print_line(line)
    for line in nodes.misconfigured_lines(result):
        render.print_line(line)
    for outcome in (result.selftest or {}).get("injections", []):
        render.print_line(f"diag: {outcome['text']}")
    if report_path:
        render.print_line(f"diag: report: {report_path}")


@app.command("env")
def env_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON on stdout."),
    fingerprints: bool = typer.Option(
        True,
        "--fingerprints/--no-fingerprints",
        help="Measure which arithmetic each backend's matmul uses at each precision setting.",
    ),
    timeout: float = typer.Option(
        300.0, "--timeout", min=1.0, help="Seconds each framework's worker may take."
    ),
    python: list[str] | None = typer.Option(
        None,
        "--python",
        help="Ask a framework's worker under another Python, FRAMEWORK=PATH (e.g. "
        "torch-xla=/venv/bin/python); same as DIAG_PYTHON_TORCH_XLA=PATH. Repeatable.",
    ),
    deep: bool = typer.Option(
        False,
        "--deep",
        help="Also measure each matmul's arithmetic features (rounding, extra bits, block "
        "FMA width, order, subnormals) with crafted inputs; seconds per backend.",
    ),
) -> None:
    """Devices, versions and every numerics setting in effect, with risky ones flagged.

    Exits 2 when XLA_FLAGS or LIBTPU_INIT_ARGS holds a flag XLA refuses (named in the
    message), 4 when a framework's worker failed, else 0.
    """
    import os

    from diag import render
    from diag.render.env import env_tables
    from diag.settings import environment
    from diag.worker.host import parse_python

    environ = {**os.environ, **parse_python(split(python))}
    report = environment.env_report(
        fingerprints=fingerprints, timeout=timeout, deep=deep, environ=environ
    )
    code = exit_code(
        crashed=any(
            fw.get("error") and "not installed" not in fw["error"]
            for fw in report["frameworks"].values()
        )
    )
    if as_json:
        render.out.print_json(json.dumps({**report, "exit_code": code}, default=str))
    else:
        for table in env_tables(report):
            render.out.print(table)
    raise typer.Exit(code)
