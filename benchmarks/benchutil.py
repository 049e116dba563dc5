"""What every diag benchmark prints beside its figures: the machine, raw samples, medians, ratios.

Imported by the benchmarks in this folder (run them from the repository root or with
``python benchmarks/NAME.py``; this file sits next to them).
"""

from __future__ import annotations

import cProfile
import io
import os
import platform
import pstats
import statistics
import time


def machine() -> str:
    """CPU model, cores, load average, Python and numpy versions and the BLAS numpy uses."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    import numpy as np

    blas = ""
    try:
        from threadpoolctl import threadpool_info

        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            blas = f", BLAS {info[0]['internal_api']} {info[0]['version']} ({info[0]['architecture']})"
    except Exception:  # threadpoolctl missing or unable to read the library: say nothing
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model}, {os.cpu_count()} cores, load average {load}; Python "
            f"{platform.python_version()}, numpy {np.__version__}{blas}")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def describe(samples: list[float]) -> str:
    """Median and every raw sample; a warning when the spread exceeds half the median."""
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    warn = "  (spread > 50%: machine busy?)" if spread > 0.5 else ""
    return f"median {med:.4f} s  [{', '.join(f'{s:.4f}' for s in samples)}]{warn}"


def verdict(name: str, ratio: float, target: float) -> str:
    return f"target {name} <= {target:g}x: {ratio:.2f}x, {'met' if ratio <= target else 'NOT met'}"


def profile_top(fn, n: int = 12) -> str:
    """cProfile's top `n` entries by internal time for one call of fn."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    lines = out.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return "\n".join(lines[start:start + n + 1])
