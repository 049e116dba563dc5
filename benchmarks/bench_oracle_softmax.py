"""How fast is the correctly rounded softmax oracle next to a float64 softmax, and is it exact?

    python benchmarks/bench_oracle_softmax.py [--quick] [--repeats N] [--sample-rows N]
                                              [--profile]

Per batch, interleaved in one process (all see the same machine load): a plain float64 numpy
softmax (convert, max, exp, sum, divide, round back: the floor), the same softmax writing into
arrays kept between calls (fresh 2 MiB temporaries cost more in first-touch page faults than the
arithmetic; the oracle keeps its scratch arrays, so this is the floor without that cost) and
`diag.oracle.softmax_result` (no cache). Prints the machine, raw wall and CPU samples, medians,
the ratio against the target (issue 35: <= 3x the plain float64 softmax), the ratio to the
kept-array floor (no target), the fallback count, and the mismatches against mpmath on sampled
rows (must be 0). With --profile, cProfile's top entries for each batch over its target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import describe, machine, profile_top, timed, verdict  # noqa: E402

import diag.oracle as oracle  # noqa: E402
from diag.numerics import bits_view  # noqa: E402
from diag.oracle import mp  # noqa: E402

TARGET = 3.0


def f64_softmax(x):
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def f64_softmax_kept(x, k):
    """The same float64 softmax into arrays `k` kept between calls (no fresh temporaries)."""
    x64, out = k["x64"], k["out"]
    np.copyto(x64, x, casting="unsafe")
    x64 -= x64.max(axis=-1, keepdims=True)
    np.exp(x64, out=x64)
    x64 /= x64.sum(axis=-1, keepdims=True)
    np.copyto(out, x64, casting="unsafe")
    return out


def cpu_timed(fn, cpu):
    c0 = time.process_time()
    wall = timed(fn)
    cpu.append(time.process_time() - c0)
    return wall


def bench(rows, n, dt, sd, repeats, sample_rows, do_profile, seed=0):
    x = (np.random.default_rng(seed).standard_normal((rows, n)) * sd).astype(dt)
    res = oracle.softmax_result(x)  # warm-up
    kept = {"x64": np.empty(x.shape), "out": np.empty(x.shape, x.dtype)}
    f64_softmax_kept(x, kept)
    t_f64, t_kept, t_or, c_f64, c_kept, c_or = [], [], [], [], [], []
    for _ in range(repeats):
        t_f64.append(cpu_timed(lambda: f64_softmax(x), c_f64))
        t_kept.append(cpu_timed(lambda: f64_softmax_kept(x, kept), c_kept))
        t_or.append(cpu_timed(lambda: oracle.softmax_result(x), c_or))
    # mpmath needs the whole row for its sum, so whole rows are sampled.
    picks = np.random.default_rng(seed + 1).choice(rows, size=min(sample_rows, rows),
                                                   replace=False)
    want = np.stack([mp.softmax(x[r:r + 1])[0] for r in picks])
    bad = int((bits_view(res.value[picks]) != bits_view(want)).sum())
    med = statistics.median
    ratio = med(t_or) / med(t_f64)
    print(f"[{rows}, {n}] {np.dtype(dt).name} N(0,{sd:g}^2)")
    print(f"  float64 softmax       wall {describe(t_f64)}")
    print(f"                        cpu  {describe(c_f64)}")
    print(f"  same, kept arrays     wall {describe(t_kept)}")
    print(f"                        cpu  {describe(c_kept)}")
    print(f"  oracle                wall {describe(t_or)}")
    print(f"                        cpu  {describe(c_or)}")
    print(f"  by CPU time: oracle / float64 softmax {med(c_or) / med(c_f64):.2f}x; "
          f"oracle / kept-array float64 softmax {med(c_or) / med(c_kept):.2f}x "
          f"(wall {med(t_or) / med(t_kept):.2f}x; no target)")
    print(f"  fallbacks {res.fallbacks} (mpmath); mismatches vs mpmath on {len(picks)} "
          f"sampled rows: {bad}")
    print(f"  {verdict('oracle / float64 softmax (medians)', ratio, TARGET)}")
    if do_profile and ratio > TARGET:
        print("  profile of one oracle call (cProfile, by internal time):")
        print("    " + profile_top(lambda: oracle.softmax_result(x)).replace("\n", "\n    "))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batches only")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sample-rows", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="profile batches over the target")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    cases = [(8, 32768, np.float32, 1.0), (8, 32768, np.float32, 5.0),
             (8, 32768, ml_dtypes.bfloat16, 5.0), (512, 1024, np.float32, 5.0)]
    if not args.quick:
        cases += [(8, 262144, np.float32, 1.0), (8, 262144, np.float32, 5.0),
                  (4096, 512, np.float32, 5.0)]
    bad = sum(bench(*c, args.repeats, args.sample_rows, args.profile) for c in cases)
    if bad:
        raise SystemExit(f"{bad} mismatches against mpmath")


if __name__ == "__main__":
    main()
