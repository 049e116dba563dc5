"""How fast is the correctly rounded softmax oracle next to a float64 softmax, and is it exact?

    python benchmarks/bench_oracle_softmax.py [--quick] [--repeats N] [--sample-rows N]
                                              [--profile]

Per batch, interleaved in one process (both see the same machine load): a plain float64 numpy
softmax (convert, max, exp, sum, divide, round back: the floor) and `diag.oracle.softmax_result`
(no cache). Prints the machine, raw samples, medians, the ratio against the target (issue 35:
<= 3x), the fallback count, and the mismatches against mpmath on sampled rows (must be 0).
With --profile, cProfile's top entries for each batch over its target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def bench(rows, n, dt, sd, repeats, sample_rows, do_profile, seed=0):
    x = (np.random.default_rng(seed).standard_normal((rows, n)) * sd).astype(dt)
    res = oracle.softmax_result(x)  # warm-up
    t_f64, t_or = [], []
    for _ in range(repeats):
        t_f64.append(timed(lambda: f64_softmax(x)))
        t_or.append(timed(lambda: oracle.softmax_result(x)))
    # mpmath needs the whole row for its sum, so whole rows are sampled.
    picks = np.random.default_rng(seed + 1).choice(rows, size=min(sample_rows, rows),
                                                   replace=False)
    want = np.stack([mp.softmax(x[r:r + 1])[0] for r in picks])
    bad = int((bits_view(res.value[picks]) != bits_view(want)).sum())
    ratio = statistics.median(t_or) / statistics.median(t_f64)
    print(f"[{rows}, {n}] {np.dtype(dt).name} N(0,{sd:g}^2)")
    print(f"  float64 softmax : {describe(t_f64)}")
    print(f"  oracle          : {describe(t_or)}")
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
