"""What `diag run --trace` costs: suite wall time with and without it, medians (issue 16).

    PYTHONPATH=$PWD python benchmarks/bench_trace.py [--suite ci] [--backend jax-cpu,torch-cpu]
                                                     [--repeats 3]

Runs the real command (`diag run --json --no-report`) in a subprocess, as a user would, so
interpreter start-up, framework imports and every worker are included. Samples alternate
(plain, traced, plain, traced, ...) so that slow drift in the machine's load hits both
alike; one warm-up run of each fills the ground-truth cache and is not counted. Prints per
mode the median wall time and every sample, the CPU seconds of all processes, the traced /
plain ratio of the medians, and what a traced run adds to the run folder (sessions, bytes).
Also the per-case run time diag records (the median of the timed repeats, which under
--trace run inside the profiler session): the profiler's cost on the op itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _command() -> list[str]:
    script = shutil.which("diag")
    return [script] if script else [sys.executable, "-m", "diag.cli"]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _once(args, out: Path, cache: Path, trace: bool) -> tuple[float, float, dict]:
    cmd = [*_command(), "run", "-s", args.suite, "-b", args.backend, "--json", "--no-report",
           "-o", str(out)] + (["--trace"] if trace else [])
    t0, c0 = time.perf_counter(), _cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "DIAG_CACHE_DIR": str(cache)})
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if proc.returncode not in (0, 1):  # 1: a numerical finding, still a complete run
        sys.exit(f"bench_trace: diag run exited {proc.returncode}: "
                 f"{proc.stderr.strip().splitlines()[-1:]}")
    return wall, cpu, json.loads(proc.stdout)


def _folder_size(run_dir: Path, sub: str) -> tuple[int, int]:
    files = [p for p in (run_dir / sub).rglob("*") if p.is_file()] if (run_dir / sub).exists() \
        else []
    return len(files), sum(p.stat().st_size for p in files)


def _op_medians(data: dict) -> list[float]:
    return [r["timings"]["run_s_median"] for r in data["records"]
            if r.get("kind", "probe") == "probe" and r.get("timings", {}).get("run_s_median")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="ci")
    parser.add_argument("--backend", default="jax-cpu,torch-cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="diag-bench-trace-"))
    cache = root / "cache"
    try:
        for trace in (False, True):  # warm-up: ground truth cached, not counted
            _once(args, root / "warm", cache, trace)
        samples: dict[bool, list[tuple[float, float, dict]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for trace in (False, True):
                samples[trace].append(_once(args, root / "runs", cache, trace))
        medians = {}
        print(f"suite {args.suite}, backends {args.backend}, {args.repeats} sample(s) each")
        for trace, rows in samples.items():
            walls = [w for w, _, _ in rows]
            cpus = [c for _, c, _ in rows]
            medians[trace] = statistics.median(walls)
            spread = (max(walls) - min(walls)) / medians[trace]
            name = "traced" if trace else "plain"
            print(f"{name:<6} median {medians[trace]:6.2f} s wall, "
                  f"{statistics.median(cpus):6.2f} s CPU; samples "
                  f"{', '.join(f'{w:.2f}' for w in walls)}"
                  + (f"  (spread {spread:.0%}: other load?)" if spread > 0.2 else ""))
        print(f"traced / plain: {medians[True] / medians[False]:.2f}x "
              f"(+{medians[True] - medians[False]:.2f} s)")
        plain_ops = _op_medians(samples[False][0][2])
        traced_ops = _op_medians(samples[True][0][2])
        if plain_ops and traced_ops:
            print(f"per-case op time (median of the cases' recorded medians): plain "
                  f"{statistics.median(plain_ops) * 1e3:.3f} ms, traced "
                  f"{statistics.median(traced_ops) * 1e3:.3f} ms")
        run_dir = Path(samples[True][0][2]["run_dir"])
        sessions = [p for p in (run_dir / "plugins" / "profile").iterdir() if p.is_dir()]
        n, size = _folder_size(run_dir, "plugins")
        n_hlo, size_hlo = _folder_size(run_dir, "hlo")
        print(f"a traced run folder adds {len(sessions)} session(s), {n} trace file(s), "
              f"{size / 1e6:.1f} MB; {n_hlo} HLO file(s), {size_hlo / 1e3:.0f} kB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
