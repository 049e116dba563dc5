"""Which XLA pass makes an A/B pair differ: per-pass dumps of both sides, compared in order.

An `--ab` setting such as `--xla_allow_excess_precision=false` changes the compiled program
somewhere in XLA's pipeline; the final HLO diff (`diag.run.ab`) shows *what* changed, this module
says *where*. For each case whose A and B outputs differ on a JAX backend, the case is
compiled again in two throwaway processes, each with its side's environment plus XLA's own
dump flags (`--xla_dump_to=DIR --xla_dump_hlo_pass_re=.*`), which write the module after
every pass that changed it:
`module_NNNN.<module>.NNNN.<pipeline>.after_<pass>.before_<next>.txt`. The dumps of each
module are walked in order on both sides; the first position where the pass differs or the
program it left differs (metadata ignored) names the pass, with the instructions that
differ there (on jax-cpu, a bf16 softmax under `--xla_allow_excess_precision=false`:
`float-normalization-bf16` and the `convert` it inserts).

Compilation depends only on the inputs' shapes and dtypes, but the real inputs are used
anyway (they are at hand), so the process compiles exactly what the worker compiled.
XLA reads its flags once per process: hence a process per side.

    python -m diag.trace.passes JOB.json      # inside: compile one case, let XLA dump
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from diag.trace import hlo
from diag.trace.layout import PASSES_DIR

__all__ = ["attribute_run", "first_difference", "dumps", "TIMEOUT_S"]

TIMEOUT_S = 300.0
DUMP_FLAGS = "--xla_dump_to={dir} --xla_dump_hlo_pass_re=.*"
_DUMP = re.compile(r"^module_(?P<n>\d+)\.(?P<module>.+?)\.(?P<seq>\d{4})\.(?P<step>.+)\.txt$")


def dumps(folder: Path) -> dict[str, list[tuple[str, Path]]]:
    """A dump folder's per-pass files: module -> [(step, path)] in pipeline order.

    A module compiled twice in one process keeps its number; modules are keyed
    `<name>#<k>` by the k-th occurrence of the name, so A's and B's line up.
    """
    found: dict[tuple[int, str], list[tuple[int, str, Path]]] = {}
    for path in Path(folder).iterdir():
        m = _DUMP.match(path.name)
        if m:
            found.setdefault((int(m["n"]), m["module"]), []).append(
                (int(m["seq"]), m["step"], path)
            )
    out: dict[str, list[tuple[str, Path]]] = {}
    seen: dict[str, int] = {}
    for (_, module), steps in sorted(found.items()):
        k = seen[module] = seen.get(module, -1) + 1
        out[f"{module}#{k}"] = [(step, path) for _, step, path in sorted(steps)]
    return out


def _pass_name(step: str) -> str:
    """`simplification.after_algsimp.before_simplify-sorts` -> `algsimp` (in `simplification`)."""
    pipeline, _, rest = step.partition(".after_")
    if not rest:
        return step
    name = rest.split(".before_")[0]
    return f"{name} (pipeline {pipeline})" if name != "pipeline-start" else f"start of {pipeline}"


def _program(path: Path) -> list[str]:
    return hlo.program_lines(path.read_text(errors="replace"))


def first_difference(a_dir: Path, b_dir: Path) -> dict[str, Any] | None:
    """The first pass after which the A and B dumps differ, or None when all match.

    Returns:
      {"module", "index", "pass", "pass_b" (when the two sides ran different passes there),
      "dump_a", "dump_b" (file names), "added"/"removed" (instruction lines B has and A
      lacks, and the reverse), "opcodes" ({opcode: [A count, B count]} that differ),
      "dumps": [A count, B count]}.
    """
    a_mods, b_mods = dumps(a_dir), dumps(b_dir)
    for module in [m for m in a_mods if m in b_mods]:
        a, b = a_mods[module], b_mods[module]
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                return _difference(module, i, a, b)
            (sa, pa), (sb, pb) = a[i], b[i]
            if sa != sb or _program(pa) != _program(pb):
                return _difference(module, i, a, b)
    return None


def _difference(module: str, i: int, a: list, b: list) -> dict[str, Any]:
    sa, pa = a[i] if i < len(a) else (None, None)
    sb, pb = b[i] if i < len(b) else (None, None)
    text_a = pa.read_text(errors="replace") if pa else ""
    text_b = pb.read_text(errors="replace") if pb else ""
    ca, cb = hlo.opcode_counts(text_a), hlo.opcode_counts(text_b)
    out = {
        "module": module.split("#")[0],
        "index": i,
        "pass": _pass_name(sb or sa or ""),
        "dump_a": pa.name if pa else None,
        "dump_b": pb.name if pb else None,
        "dumps": [len(a), len(b)],
        "opcodes": {
            op: [ca.get(op, 0), cb.get(op, 0)]
            for op in sorted(set(ca) | set(cb))
            if ca.get(op, 0) != cb.get(op, 0)
        },
        **hlo.changed_instructions(text_a, text_b),
    }
    if sa != sb and sa and sb:
        out["pass_a"] = _pass_name(sa)
    return out


def _compile_side(job: dict, env: dict[str, str], folder: Path) -> str | None:
    """Compile one case in a fresh process whose XLA dumps every pass into `folder`;
    an error sentence, or None."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DUMP_FLAGS.format(dir=folder)}".strip()
    # A program found in JAX's persistent compilation cache is not compiled, so not dumped.
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    job_path = folder.parent / f"{folder.name}.job.json"
    job_path.write_text(json.dumps(job))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "diag.trace.passes", str(job_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"compiling with per-pass dumps took over {TIMEOUT_S:g} s"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return f"compiling with per-pass dumps failed (exit {proc.returncode}): {tail}"
    return None


def attribute_pair(
    job: dict,
    env_a: dict[str, str],
    env_b: dict[str, str],
) -> dict[str, Any]:
    """Compile one case on both sides with per-pass dumps and name the first differing pass.

    Returns:
      {"first_difference": {...} or None} or {"error": "..."}.
    """
    with tempfile.TemporaryDirectory(prefix="diag-passes-") as tmp:
        for side, env in (("A", env_a), ("B", env_b)):
            error = _compile_side(job, env, Path(tmp) / side)
            if error:
                return {"error": f"{side} side: {error}"}
        return {"first_difference": first_difference(Path(tmp) / "A", Path(tmp) / "B")}


def attribute_run(run) -> list[dict[str, Any]]:
    """For a traced A/B run (`diag.run.backend_runs.BackendRuns`): attribute each JAX case whose
    outputs differ to an XLA pass, written to `trace/passes/<case>.<backend>.json`.

    Called after every backend ran, before the work folder (the inputs) is removed.
    """
    from diag.backends import get_spec
    from diag.plan.registry import PROBES

    by_label = {c.label: c for c in run.suite.cases}
    out = []
    for rec in list(run.records):
        if rec.get("kind") != "ab" or not (rec.get("metrics") or {}).get("changed_outputs"):
            continue
        a_label, _, b_label = str(rec["backend"]).partition("|")
        case = by_label.get(rec["case"])
        spec = get_spec(a_label)
        if case is None or spec.framework != "jax":
            continue  # per-pass dumps are XLA's; an eager backend has no passes
        job = {
            "backend": spec.name,
            "op": case.op,
            "op_args": {**PROBES[case.op].fixed_args, **case.op_args},
            "inputs": run.inputs.paths(case),
            "input_dtypes": [case.dtype] * len(run.inputs.paths(case)),
        }
        b_env = run.ab.b_env(run.env)
        result = {
            "case_id": case.id,
            "case": case.label,
            "backend": a_label,
            "pair": rec["backend"],
            "setting": run.ab.setting,
        }
        try:
            result.update(attribute_pair(job, run.env, b_env))
        except Exception as e:  # evidence, not a verdict: never the end of the run
            result["error"] = f"pass attribution failed: {type(e).__name__}: {e}"[:300]
        path = run.run_dir.path / PASSES_DIR / f"{case.id}.{a_label}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        out.append(result)
    return out


def _compile(job_path: str) -> int:
    """Inside the throwaway process: compile the case (XLA writes the dumps)."""
    import importlib

    import numpy as np

    from diag import numerics
    from diag.backends import get_spec
    from diag.plan.registry import build

    job = json.loads(Path(job_path).read_text())
    spec = get_spec(job["backend"])
    backend = importlib.import_module(spec.module)
    backend.setup(spec.platform)
    args = [
        backend.put(numerics.from_bits(np.load(p), d))
        for p, d in zip(job["inputs"], job["input_dtypes"])
    ]
    fn = build(backend, job["op"], **job["op_args"])
    backend.hlo_text(fn, args)
    return 0


if __name__ == "__main__":
    sys.exit(_compile(sys.argv[1]))
