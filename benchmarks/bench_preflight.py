"""Wall time of `diag preflight`, cold and warm, against its targets (issue 15).

    PYTHONPATH=$PWD python benchmarks/bench_preflight.py [--repeats 3]

Runs the real command (`diag preflight --json`, the default budget) in a subprocess, as a user
would, so interpreter start-up, framework imports and every worker are included:

* cold: an empty `DIAG_CACHE_DIR` for every sample (no ground truth cached, no measured step
  costs): target at most 30 s on a 2-core CPU with JAX and torch;
* warm: one cache folder, filled by a first run that is not counted: target at most 10 s.

Prints the median and every sample, the per-step seconds of the median sample, the CPU
seconds of every process a sample started, and whether each target is met. Other load on the
machine inflates the wall time, not the CPU time: read both.
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

TARGETS = {"cold": 30.0, "warm": 10.0}
_CPU: list[float] = []  # CPU seconds of each sample's processes, in the order they ran


def _command() -> list[str]:
    script = shutil.which("diag")
    return [script] if script else [sys.executable, "-m", "diag.cli"]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every finished descendant waited for
    return usage.ru_utime + usage.ru_stime


def _once(cache: Path) -> tuple[float, dict]:
    env = {**os.environ, "DIAG_CACHE_DIR": str(cache)}
    t0, c0 = time.perf_counter(), _cpu()
    proc = subprocess.run([*_command(), "preflight", "--json"], capture_output=True, text=True,
                          env=env)
    wall = time.perf_counter() - t0
    _CPU.append(_cpu() - c0)
    if proc.returncode != 0:
        sys.exit(f"bench_preflight: diag preflight exited {proc.returncode}: "
                 f"{proc.stderr.strip().splitlines()[-1:]}")
    return wall, json.loads(proc.stdout)


def _report(kind: str, samples: list[tuple[float, dict]], cpu: list[float]) -> bool:
    walls = [w for w, _ in samples]
    median = statistics.median(walls)
    _, data = min(samples, key=lambda s: abs(s[0] - median))
    steps = ", ".join(f"{s['name']} {s['seconds']:.1f}" for s in data["steps"])
    ok = median <= TARGETS[kind]
    spread = (max(walls) - min(walls)) / median if median else 0.0
    print(f"{kind:<5} median {median:6.2f} s (target <= {TARGETS[kind]:g} s: "
          f"{'met' if ok else 'MISSED'})  samples: {', '.join(f'{w:.2f}' for w in walls)}")
    print(f"      steps of the median sample (s): {steps}")
    # The steps run one after another, so on an idle machine the wall time is about the CPU
    # time: the figure to read when other load inflates the wall time.
    print(f"      CPU seconds (user+sys, all processes): median {statistics.median(cpu):.2f}; "
          f"samples: {', '.join(f'{c:.2f}' for c in cpu)}")
    if spread > 0.2:
        print(f"      warning: samples spread {spread:.0%} of the median (other load?)")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"cpu cores: {os.cpu_count()}; load average: "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="diag-bench-preflight-") as tmp:
        root = Path(tmp)
        cold = [_once(root / f"cold{i}") for i in range(args.repeats)]
        _once(root / "warm")  # fills the cache and the measured step costs; not counted
        warm = [_once(root / "warm") for _ in range(args.repeats)]
    n = args.repeats
    ok = (_report("cold", cold, _CPU[:n]) & _report("warm", warm, _CPU[n + 1:]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
