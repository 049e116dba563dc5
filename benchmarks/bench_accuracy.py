"""How long `diag accuracy` takes, beside the backend's own time for the same calls.

    python benchmarks/bench_accuracy.py [--backend torch-cpu] [--float32-backends jax-cpu,...]

Targets (issue: accuracy tables): the whole bfloat16 + float16 sweep of every function on one
backend within 30 s with a warm truth cache and within 3 min cold; float32 at 10^6 samples
per function within 60 s warm per backend. Each figure is printed beside the backend's own
time for the same calls (the median warm call plus the first call's, summed over the calls),
so what diag adds (worker start, truth, measuring) is plain. The cache is a fresh temporary
folder, so "cold" is cold.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import machine  # noqa: E402


def _run(functions, dtypes, backend, cache_dir, samples=1_000_000):
    from diag.accuracy.tables import tables
    from diag.oracle.cache import GroundTruthCache

    start = time.perf_counter()
    result = tables(functions, dtypes, [backend], samples=samples,
                    cache=GroundTruthCache(cache_dir), settings=False, repeats=1)
    wall = time.perf_counter() - start
    own = sum((r.seconds or 0) + (r.compile_seconds or 0) for r in result.rows)
    return wall, own, result


def _line(label, wall, own, result, target):
    met = "met" if wall <= target else "NOT met"
    print(f"{label}: {wall:7.1f} s (truth {result.truth_seconds:6.1f} s; backend's own time "
          f"for the same {len(result.rows)} calls {own:6.2f} s; diag / backend "
          f"{wall / own if own else float('inf'):7.1f}x); target <= {target:g} s: {met}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="torch-cpu")
    parser.add_argument("--float32-backends", default="jax-cpu,torch-cpu")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="diag-bench-accuracy-") as tmp:
        cache = Path(tmp)
        narrow = ["bfloat16", "float16"]
        cold = _run(None, narrow, args.backend, cache)
        _line(f"bf16+fp16 sweep, 16 functions, {args.backend}, cold", *cold, 180)
        warm = _run(None, narrow, args.backend, cache)
        _line(f"bf16+fp16 sweep, 16 functions, {args.backend}, warm", *warm, 30)
        first = None
        for backend in args.float32_backends.split(","):
            if first is None:  # fills the float32 truth cache, then every backend is warm
                first = _run(None, ["float32"], backend, cache)
                _line(f"float32 10^6 samples x 16, {backend}, cold", *first, float("inf"))
            f32 = _run(None, ["float32"], backend, cache)
            _line(f"float32 10^6 samples x 16, {backend}, warm", *f32, 60)
    if os.environ.get("DIAG_PYTHON_TORCH_XLA") is None:
        print("(torch-xla-cpu: set DIAG_PYTHON_TORCH_XLA and add it to --float32-backends)")


if __name__ == "__main__":
    main()
