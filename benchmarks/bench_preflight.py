"""Wall time of `diag preflight`, cold and warm, beside the frameworks' import floor (issue 35).

    python benchmarks/bench_preflight.py [--repeats 3]

Runs the real command (`diag preflight --json`, the default budget) in a subprocess, as a user
would, so interpreter start-up, framework imports and every worker are included. Interleaved,
each repeat runs, in this order:

* floor: ``import jax; jax.devices()`` plus ``import torch`` in one fresh Python: what starting
  the frameworks preflight checks costs at the least;
* cold: an empty `DIAG_CACHE_DIR` (no ground truth, no measured step costs, no compiled JAX
  programs): target <= 2.5x the floor;
* warm: one cache folder, filled by a first run that is not counted: target <= 1.5x the floor,
  and faster than cold;
* warm, no JAX cache: the same with JAX's persistent compilation cache turned off
  (JAX_ENABLE_COMPILATION_CACHE=false): what that cache (diag.worker.host.jax_cache_env) saves.

Prints the machine, the median and every sample of each, the ratios, the per-step seconds of
the median warm sample, and the CPU seconds of every process a sample started. Other load on
the machine inflates the wall time, not the CPU time: read both, and the ratios.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import describe, machine  # noqa: E402

TARGETS = {"warm": 1.5, "cold": 2.5}  # times the import floor
FLOOR_CODE = "import jax; jax.devices(); import torch"


def _command() -> list[str]:
    script = shutil.which("diag")
    return [script] if script else [sys.executable, "-m", "diag.cli"]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every finished descendant waited for
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], env: dict) -> tuple[float, float, str]:
    t0, c0 = time.perf_counter(), _cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir())
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if proc.returncode != 0:
        sys.exit(f"bench_preflight: {' '.join(cmd[:3])} exited {proc.returncode}: "
                 f"{proc.stderr.strip().splitlines()[-1:]}")
    return wall, cpu, proc.stdout


def _environ() -> dict[str, str]:
    """The environment the samples run with: with PYTHONDONTWRITEBYTECODE dropped unless
    --keep-no-bytecode (an installed diag has its .pyc files; without them every one of
    preflight's processes compiles diag's sources again, ~0.12 CPU-s each here)."""
    env = dict(os.environ)
    if not KEEP_NO_BYTECODE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


KEEP_NO_BYTECODE = False


def floor() -> tuple[float, float, str]:
    return _run([sys.executable, "-c", FLOOR_CODE], _environ())


def preflight(cache: Path, jax_cache: bool = True) -> tuple[float, float, str]:
    env = {**_environ(), "DIAG_CACHE_DIR": str(cache)}
    if not jax_cache:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return _run([*_command(), "preflight", "--json"], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-jax-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="also time warm runs with JAX's compilation cache off")
    parser.add_argument("--keep-no-bytecode", action="store_true",
                        help="keep PYTHONDONTWRITEBYTECODE from the environment")
    args = parser.parse_args()
    global KEEP_NO_BYTECODE
    KEEP_NO_BYTECODE = args.keep_no_bytecode
    print(f"machine: {machine()}")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("PYTHONDONTWRITEBYTECODE is set here: " + (
            "kept, so every diag process compiles diag's sources afresh" if KEEP_NO_BYTECODE
            else "dropped for the samples, as an installed diag has its .pyc files"))
    kinds = ("floor", "cold", "warm") + (("warm, no JAX cache",) if args.no_jax_cache else ())
    res: dict[str, list[tuple[float, float, str]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="diag-bench-preflight-") as tmp:
        root = Path(tmp)
        preflight(root / "warm")  # fills the caches and the measured step costs; not counted
        for i in range(args.repeats):
            res["floor"].append(floor())
            res["cold"].append(preflight(root / f"cold{i}"))
            res["warm"].append(preflight(root / "warm"))
            if args.no_jax_cache:
                res["warm, no JAX cache"].append(preflight(root / "warm", jax_cache=False))
    med = {k: statistics.median(w for w, _, _ in v) for k, v in res.items()}
    cpu = {k: statistics.median(c for _, c, _ in v) for k, v in res.items()}
    for k in kinds:
        walls = [w for w, _, _ in res[k]]
        cpus = ", ".join(f"{c:.2f}" for _, c, _ in res[k])
        ratio = "" if k == "floor" else f"  = {med[k] / med['floor']:.2f}x the floor"
        print(f"{k:<19} {describe(walls)}{ratio}")
        # Under other load the wall time of a 3 s import swings 2-5x; CPU seconds do not.
        cratio = "" if k == "floor" else f" = {cpu[k] / cpu['floor']:.2f}x the floor's"
        print(f"{'':<19} CPU seconds (user+sys, all processes): median {cpu[k]:.2f}{cratio}; "
              f"samples {cpus}")
    warm = sorted(res["warm"], key=lambda s: s[0])[(args.repeats - 1) // 2]
    steps = ", ".join(f"{s['name']} {s['seconds']:.1f}" for s in json.loads(warm[2])["steps"])
    print(f"steps of the median warm sample (s): {steps}")
    if args.no_jax_cache:
        print(f"JAX's persistent cache: warm {med['warm']:.2f} s vs "
              f"{med['warm, no JAX cache']:.2f} s without it "
              f"({med['warm'] / med['warm, no JAX cache']:.2f}x)")
    ok = True
    for k, t in TARGETS.items():
        r = med[k] / med["floor"]
        # Interleaved: each sample over the floor sample taken just before it.
        per = [s[0] / f[0] for s, f in zip(res[k], res["floor"])]
        ok &= r <= t
        print(f"target {k} <= {t:g}x the import floor: {r:.2f}x, {'met' if r <= t else 'NOT met'}"
              f" (per interleaved sample {', '.join(f'{x:.2f}' for x in per)}; by CPU seconds "
              f"{cpu[k] / cpu['floor']:.2f}x)")
    faster = med["warm"] < med["cold"]
    print(f"target warm faster than cold: {med['warm'] / med['cold']:.2f}x, "
          f"{'met' if faster else 'NOT met'}")
    sys.exit(0 if ok and faster else 1)


if __name__ == "__main__":
    main()
