"""The `diag` command line: parse, call the library, render, set the exit code.

Exit codes (stable, documented in the README): 0 all good; 1 a numerical check failed;
2 bad usage or bad input file; 3 a bad device or host was found; 4 a worker crashed or an op
raised; 70 diag itself failed (a bug: one line, the traceback with --debug); 130 interrupted
(Ctrl-C) and 143 terminated (SIGTERM), the run folder keeps every finished record.

What the user sees on an error is always one line starting ``diag:`` on stderr: usage
errors are caught through typer's own exception (`typer.TyperException`, the root of the
click that typer vendors; the `click` package itself may not be installed).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer

from diag.errors import DiagError, EXIT_USAGE

# no_args_is_help is off: a bare `diag` is a usage error (one line, exit 2), not a help page
# printed by the parser before diag can say anything.
app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="diag: do these devices, frameworks and compiler flags compute what "
                       "the math says?")
cache_app = typer.Typer(no_args_is_help=False, help="Inspect or clear the ground-truth cache.")
app.add_typer(cache_app, name="cache")

EXIT_INTERRUPTED = 130
# SIGTERM (a CI job cancelled, a scheduler's preemption): 128 + 15, as a shell reports it.
EXIT_TERMINATED = 128 + signal.SIGTERM
# diag itself failed (a bug, not the user's input nor the device): sysexits' EX_SOFTWARE,
# apart from 1 (a numerical failure, which a CI gate must be able to trust) and from 2-4.
EXIT_INTERNAL = 70
_debug = False


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so every Ctrl-C clean-up path runs for it.

    `diag.runner.run` already turns a KeyboardInterrupt into a run folder marked
    `interrupted`, its worker killed and its temp folder removed; SIGTERM deserves the same.
    """


_terminated = False


def _on_sigterm(signum, frame) -> None:
    global _terminated
    if _terminated:  # a second SIGTERM must not cut the clean-up of the first short
        return
    _terminated = True
    raise Terminated("terminated by SIGTERM")


def _split(values: Optional[List[str]]) -> Optional[List[str]]:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@app.command()
def run(
    suite: str = typer.Option("matmul", "--suite", "-s",
                              help="A shipped suite name (e.g. matmul) or a path to a .toml file."),
    backend: Optional[List[str]] = typer.Option(
        None, "--backend", "-b",
        help="Backend(s) to run, repeatable or comma-separated (jax-cpu, jax-gpu, jax-tpu, "
             "torch-cpu, torch-cuda; numpy emulations of accelerator matmul arithmetic, never "
             "run by default: emu-bf16x1, emu-bf16x3, emu-bf16x6, emu-tf32, emu-tf32x3, "
             "emu-f16). Default: every hardware backend present."),
    out: Path = typer.Option(Path("reports"), "--out", "-o",
                             help="Folder the run folder is created in."),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print the run summary and records as JSON on stdout."),
    report: bool = typer.Option(True, "--report/--no-report",
                                help="Write report.html into the run folder."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed repeats per case."),
    timeout: float = typer.Option(600.0, "--timeout", min=0.1,
                                  help="Seconds one case may take before its worker is killed."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir",
                                             help="Ground-truth cache folder."),
    ab: Optional[List[str]] = typer.Option(
        None, "--ab",
        help="A/B experiment: run every backend again with this setting (NAME=VALUE: an "
             "environment variable, an XLA_FLAGS addition such as "
             "'XLA_FLAGS=--xla_allow_excess_precision=false', or a JAX config option) and "
             "report what it changes. Repeatable."),
    max_memory: Optional[float] = typer.Option(
        None, "--max-memory", min=0.001,
        help="Host memory one case may need, in GiB; a suite with a larger case is refused "
             "before anything runs. Default: half of this machine's physical memory."),
) -> None:
    """Run a probe suite on every backend present and judge each result against exact math."""
    from diag import render, runner

    progress = render.RunProgress(enabled=not as_json)
    try:
        result = runner.run(suite, _split(backend), out=out, repeats=repeats,
                            case_timeout=timeout, cache_dir=str(cache_dir) if cache_dir else None,
                            ab=ab, max_memory=max_memory, argv=["diag"] + sys.argv[1:],
                            on_start=progress.start,
                            on_record=progress.record)
    except runner.Interrupted as e:
        progress.stop()
        n = len(e.result.records)
        why = "terminated (SIGTERM)" if _terminated else "interrupted"
        render.print_error(f"diag: {why}; {n} finished record(s) kept in {e.result.run_dir}")
        raise typer.Exit(EXIT_TERMINATED if _terminated else EXIT_INTERRUPTED)
    finally:
        progress.stop()
    report_path = None
    if report:
        from diag.report import write_report

        report_path = write_report(result.run_dir)
    if as_json:
        render.out.print_json(json.dumps({
            "run_dir": str(result.run_dir), "state": result.state, "counts": result.counts,
            "exit_code": result.exit_code, "report": str(report_path) if report_path else None,
            "records": result.records}, default=str))
    else:
        render.out.print(render.summary_table(result.records))
        problems = render.problems_table(result.records)
        if problems is not None:
            render.out.print(problems)
        counts = ", ".join(f"{v} {k}" for k, v in result.counts.items() if v)
        render.print_line(f"diag: {counts or 'no records'}; run folder: {result.run_dir}")
        if report_path:
            render.print_line(f"diag: report: {report_path}")
    raise typer.Exit(result.exit_code)


@app.command("report")
def report_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder (holding run.json and results.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the HTML file."),
) -> None:
    """Write a self-contained HTML report for a run folder.

    Exits 2 when results.jsonl has lines that cannot be read (other than a torn last line):
    the report is still written, and says how many records it could not show.
    """
    from diag import render
    from diag.report import write_report
    from diag.results import read_results

    if not (run_dir / "run.json").is_file():
        raise DiagError(f"{run_dir}: not a diag run folder (no run.json); pass the folder "
                        f"that `diag run` printed")
    path = write_report(run_dir, out)
    read = read_results(run_dir)
    render.print_line(f"diag: report: {path}")
    for problem in read.problems(run_dir / "results.jsonl"):
        render.print_error(f"diag: {problem}")
    if read.unreadable:
        raise typer.Exit(EXIT_USAGE)


@cache_app.command("info")
def cache_info(cache_dir: Optional[Path] = typer.Option(None, "--cache-dir")) -> None:
    """Show where the ground-truth cache is and how big it is."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    info = GroundTruthCache(cache_dir or default_cache_dir()).info()
    render.out.print_json(json.dumps(info, default=str))


@cache_app.command("clear")
def cache_clear(cache_dir: Optional[Path] = typer.Option(None, "--cache-dir")) -> None:
    """Delete diag's cached ground-truth results (only in a folder diag marked as its cache)."""
    from diag import render
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    cache = GroundTruthCache(cache_dir or default_cache_dir())
    removed = cache.clear()
    render.print_line(f"diag: removed {removed} cached file(s) from {cache.root}")


@app.command("nodes")
def nodes_cmd(
    repeats: int = typer.Option(10, "--repeats", "-r", min=1,
                                help="Calls per device per workload (inputs alternate between "
                                     "two seeded arrays)."),
    workload: Optional[List[str]] = typer.Option(
        None, "--workload", "-w",
        help="Builtin (matmul_bf16, matmul_f32, softmax, train_step) or your own "
             "module:function / file.py:function; repeatable. Default: every builtin."),
    input_shape: str = typer.Option("128,128", "--input-shape",
                                    help="Input shape for your own workload, e.g. 64,256."),
    input_dtype: str = typer.Option("float32", "--input-dtype",
                                    help="Input dtype for your own workload."),
    host_devices: Optional[int] = typer.Option(
        None, "--host-devices", min=1,
        help="Scan N CPU devices (sets --xla_force_host_platform_device_count)."),
    platform: Optional[str] = typer.Option(None, "--platform",
                                           help="cpu, gpu or tpu; default jax's default."),
    inject: Optional[List[str]] = typer.Option(
        None, "--inject",
        help="Self-test fault: 'device=3,kind=nan|bitflip|stuck|slow,rate=0.01' "
             "(also process=I, seed=S, delay=SECONDS); repeatable."),
    distributed: bool = typer.Option(False, "--distributed",
                                     help="Multi-host: start jax.distributed (auto-detected on "
                                          "TPU pods and SLURM)."),
    coordinator: Optional[str] = typer.Option(None, "--coordinator", help="HOST:PORT of "
                                              "process 0, when jax cannot detect the cluster."),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", min=1),
    process_id: Optional[int] = typer.Option(None, "--process-id", min=0),
    init_timeout: int = typer.Option(60, "--init-timeout", min=1,
                                     help="Seconds to wait for every process to join."),
    seed: int = typer.Option(0, "--seed", help="Seed of the inputs (part of the golden key)."),
    golden_dir: Optional[Path] = typer.Option(None, "--golden-dir",
                                              help="Golden digest store (default "
                                                   "$DIAG_CACHE_DIR/golden or "
                                                   "~/.cache/diag/golden)."),
    save_golden: bool = typer.Option(False, "--save-golden",
                                     help="Store this scan's digests as golden when every "
                                          "device agrees."),
    slow_factor: float = typer.Option(1.5, "--slow-factor",
                                      help="Straggler: fastest repeat slower than this times "
                                           "the median device."),
    fail_on_slow: bool = typer.Option(False, "--fail-on-slow",
                                      help="Stragglers are suspects too (exit 3)."),
    out: Path = typer.Option(Path("reports"), "--out", "-o",
                             help="Folder the run folder is created in (process 0 only)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON on stdout."),
    report: bool = typer.Option(True, "--report/--no-report",
                                help="Write report.html into the run folder."),
) -> None:
    """Scan devices (and hosts) for wrong results: same workloads everywhere, vote on the bits."""
    from diag import nodes, render

    try:
        shape = [int(s) for s in input_shape.replace("x", ",").split(",") if s.strip()]
    except ValueError:
        raise DiagError(f"--input-shape {input_shape!r}: expected sizes like 64,256") from None
    workloads = [nodes.load_workload(w, shape, input_dtype) for w in _split(workload) or []]
    injections = [nodes.parse_injection(i) for i in inject or []]
    result = nodes.scan(workloads=workloads or None, repeats=repeats, seed=seed,
                        host_devices=host_devices, platform=platform, injections=injections,
                        distributed=distributed, coordinator=coordinator,
                        num_processes=num_processes, process_id=process_id,
                        init_timeout=init_timeout, golden_dir=golden_dir,
                        save_golden=save_golden, slow_factor=slow_factor,
                        fail_on_slow=fail_on_slow)
    if result.process_index != 0:
        # A log line, not the result: process 0's stdout carries the verdict.
        render.print_line(f"diag: process {result.process_index} of "
                          f"{result.num_processes}: {result.verdict}; process 0 "
                          "writes the verdict", err=True)
        raise typer.Exit(result.exit_code)
    run_dir = nodes.write_run(result, out, ["diag"] + sys.argv[1:])
    report_path = None
    if report:
        from diag.report import write_report

        report_path = write_report(run_dir)
    if as_json:
        render.out.print_json(json.dumps({**result.to_dict(), "run_dir": str(run_dir),
                                          "report": str(report_path) if report_path else None},
                                         default=str))
    else:
        for table in render.nodes_tables(result):
            render.out.print(table)
        for line in render.nodes_summary(result, run_dir):
            render.print_line(line)
        for outcome in (result.selftest or {}).get("injections", []):
            render.print_line(f"diag: {outcome['text']}")
        if report_path:
            render.print_line(f"diag: report: {report_path}")
    raise typer.Exit(result.exit_code)


@app.command("env")
def env_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON on stdout."),
    fingerprints: bool = typer.Option(
        True, "--fingerprints/--no-fingerprints",
        help="Measure which arithmetic each backend's matmul uses at each precision setting."),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0,
                                  help="Seconds each framework's worker may take."),
    deep: bool = typer.Option(
        False, "--deep",
        help="Also measure each matmul's arithmetic features (rounding, extra bits, block "
             "FMA width, order, subnormals) with crafted inputs; seconds per backend."),
) -> None:
    """Devices, versions and every numerics setting in effect, with risky ones flagged.

    Exits 2 when XLA_FLAGS or LIBTPU_INIT_ARGS holds a flag XLA refuses (named in the
    message), 4 when a framework's worker failed, else 0.
    """
    from diag import environment, render

    report = environment.env_report(fingerprints=fingerprints, timeout=timeout, deep=deep)
    code = 4 if any(fw.get("error") and "not installed" not in fw["error"]
                    for fw in report["frameworks"].values()) else 0
    if as_json:
        render.out.print_json(json.dumps({**report, "exit_code": code}, default=str))
    else:
        for table in render.env_tables(report):
            render.out.print(table)
    raise typer.Exit(code)


@app.command("nan")
def nan_cmd(
    target: str = typer.Argument(..., help="FILE.py:FUNCTION; FUNCTION returns (fn, args) to "
                                           "hunt, or is hunted itself with no arguments."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Find the op that first produced a NaN/Inf reaching FUNCTION's results (exit 1 if any)."""
    from diag import nan, render
    from diag.flags import validate_xla_flags

    validate_xla_flags()  # before the target imports jax: a bad flag would abort it (exit 2)
    fn, args, kwargs = nan.load_target(target)
    report = nan.hunt(fn, args, kwargs)
    if as_json:
        render.out.print_json(json.dumps({
            "target": target, "found": report is not None, "reason": nan.reason(report),
            "report": report.to_dict() if report is not None else None}))
    elif report is None:
        render.out.print(f"diag nan: {target}: no NaN/Inf produced", soft_wrap=True,
                         markup=False)
    else:
        render.out.print(render.nan_report_table(report))
        render.out.print(f"diag nan: {nan.reason(report)}", soft_wrap=True, markup=False)
    raise typer.Exit(1 if report is not None else 0)


@app.command("preflight")
def preflight_cmd(
    budget: float = typer.Option(60.0, "--budget", min=0.001, help="Seconds it may take: "
                                 "steps that do not fit (by measured cost) are skipped, named."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON on stdout."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write JUnit XML: one "
                                         "testcase per finding."),
    inject: Optional[List[str]] = typer.Option(None, "--inject", help="A fault for the node "
                                               "scan to find, as `diag nodes --inject`."),
) -> None:
    """Fit to run a job? Settings, fingerprints, quick probes, a node scan: one verdict.

    Exits 0 fit, 1 numerical problem, 3 bad device, 4 a step crashed, 2 bad usage/flag."""
    from diag import nodes, preflight, render

    result = preflight.preflight(
        budget, injections=tuple(nodes.parse_injection(i) for i in inject or []),
        on_step=lambda *a: render.print_line(preflight.progress_line(*a), err=True))
    if junit is not None:
        render.print_line(f"diag: junit: {preflight.write_junit(result, junit)}", err=as_json)
    if as_json:
        render.out.print_json(json.dumps(result.to_dict(), default=str))
    else:
        render.out.print(render.preflight_table(result))
        render.print_line(result.summary())
    raise typer.Exit(result.exit_code)


@app.command("baseline")
def baseline_cmd(
    run_dir: Path = typer.Argument(..., help="A finished run folder (e.g. of `diag run "
                                             "--suite ci`)."),
    out: Path = typer.Option(Path("baseline.json"), "--out", "-o",
                             help="The baseline file to write (commit it)."),
) -> None:
    """Save a run's verdict-relevant metrics, fingerprints and key as a CI baseline."""
    from diag import baseline, render

    data = baseline.build(run_dir)
    path = baseline.save(data, out)
    failing = sum(r["status"] in ("fail", "error") for r in data["records"])
    render.print_line(f"diag: baseline of {len(data['records'])} record(s) of suite "
                      f"{data['suite']!r} written to {path}")
    if failing:
        render.print_error(f"diag: {failing} record(s) of this run failed or errored: `diag "
                           "check` lists them as known failures (JUnit failures) and exits 1 "
                           "when any of them changes")


@app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="The run folder to check."),
    baseline_file: Path = typer.Option(..., "--baseline", help="A file `diag baseline` wrote."),
    bitwise: bool = typer.Option(False, "--bitwise",
                                 help="Any changed bit is drift (same hardware and versions)."),
    junit: Optional[Path] = typer.Option(None, "--junit",
                                         help="Also write a JUnit XML file: one testcase per "
                                              "(probe, case, backend)."),
) -> None:
    """Compare a run with a baseline: exit 1 naming every drifted record, 0 when none drifted.

    Exits 2 when the baseline or the run folder cannot be used (one line says why).
    """
    from diag import baseline, render

    data = baseline.load(baseline_file)
    result = baseline.check(run_dir, data, bitwise=bitwise)
    for line in result.key_mismatch:
        render.print_error(f"diag: key mismatch: {line}")
    for note in result.notes:
        render.print_line(f"diag: {note}")
    for drift in result.drifts:
        render.print_error(f"diag: drift: {drift.text()}")
    for failure in result.failures:
        render.print_line(f"diag: failed: {failure}")
    if junit is not None:
        render.print_line(f"diag: junit: {baseline.write_junit(result, junit)}")
    verdict = "drifted" if result.drifts else "no drift"
    render.print_line(f"diag: {verdict}: {result.compared} record(s) compared, "
                      f"{len(result.drifts)} drift(s), {len(result.missing)} missing, "
                      f"{len(result.extra)} new, {len(result.failures)} failed")
    raise typer.Exit(result.exit_code)


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    global _debug
    _debug = debug


def _usage_line(e: Exception) -> str:
    """A typer/click usage error as one `diag:` line that says where help is."""
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.command_path:
        where = ctx.command_path
    else:  # the parser raised before it made a context: the command is the first known word
        names = [c.name or c.callback.__name__ for c in app.registered_commands]
        names += [g.name for g in app.registered_groups]
        word = next((a for a in sys.argv[1:] if a in names), None)
        where = f"diag {word}" if word else "diag"
    text = (e.format_message() if hasattr(e, "format_message") else str(e)).strip()
    text = " ".join(text.split()).rstrip(".")
    if not text:
        text = "missing command"
    text = text[0].lower() + text[1:]
    return f"diag: {text}; see '{where} --help'"


def _exit_code(code: int) -> int:
    return EXIT_TERMINATED if _terminated else code


def main() -> None:
    """Console-script entry point: every outcome is an exit code, every error one line.

    DiagError -> its message and exit code; a usage error -> one line naming it and where
    help is, exit 2; Ctrl-C -> 130, SIGTERM -> 143; anything else is a bug in diag -> one line
    and exit 70. `--debug` adds the traceback (the exit code stays the same).
    """
    import traceback

    debug = "--debug" in sys.argv[1:sys.argv.index("--") if "--" in sys.argv else None]
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        # With standalone_mode=False typer returns the code a command exits with and lets
        # usage errors through to us; a KeyboardInterrupt comes back as 130.
        code = app(standalone_mode=False, prog_name="diag")
    except DiagError as e:
        if _debug or debug:
            traceback.print_exc()
        _fail(str(e))
        sys.exit(_exit_code(e.exit_code))
    except typer.Exit as e:
        sys.exit(_exit_code(e.exit_code))
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(_exit_code(EXIT_INTERRUPTED))
    except typer.TyperException as e:  # bad usage: unknown option/command, bad value
        if _debug or debug:
            traceback.print_exc()
        _fail(_usage_line(e))
        sys.exit(_exit_code(EXIT_USAGE))
    except Exception as e:  # a bug in diag: say so in one line, keep the traceback for --debug
        if _debug or debug:
            traceback.print_exc()
        first = " ".join(str(e).split())[:300]
        _fail(f"diag: internal error: {type(e).__name__}{': ' + first if first else ''}; "
              "rerun with --debug for the traceback and report it")
        sys.exit(_exit_code(EXIT_INTERNAL))
    sys.exit(_exit_code(code if isinstance(code, int) else 0))


def _fail(line: str) -> None:
    """Print one error line on stderr; plain text if rich itself is what failed."""
    try:
        from diag import render

        render.print_error(line)
    except Exception:  # noqa: BLE001 - the last resort must not raise
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
