"""How fast is the correctly rounded matmul oracle, and is it still exact?

Prints, per shape: oracle time (median of repeats, no cache), plain float64 matmul time, mpmath
exact time (timed on a random sample of elements, extrapolated to the whole output), the ratios
oracle/f64 and mp/oracle, the fallback counts, and the number of mismatches of the oracle against
mpmath on the sampled elements (must be 0). Targets: oracle <= 10x float64, >= 1000x mpmath.

Usage: python benchmarks/bench_oracle.py [--quick] [--repeats N] [--sample N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import diag.oracle as oracle
from diag.numerics import bits_view
from diag.oracle import mp


def timed(fn, repeats):
    samples = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return samples, out


def describe(samples):
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    warn = "  (spread > 50%: machine busy?)" if spread > 0.5 else ""
    return med, f"median {med:.3f}s  min {min(samples):.3f}s  max {max(samples):.3f}s{warn}"


def bench(m, k, n, repeats, n_sample, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # Interleave so both see the same machine load.
    t_f64, t_or = [], []
    res = None
    for _ in range(repeats):
        s, _ = timed(lambda: a64 @ b64, 1)
        t_f64 += s
        s, res = timed(lambda: oracle.matmul_result(a, b), 1)
        t_or += s
    flat = rng.choice(m * n, size=min(n_sample, m * n), replace=False)
    sample = [divmod(int(e), n) for e in flat]
    t0 = time.perf_counter()
    want = mp.matmul(a, b, elements=sample)
    t_mp_sample = time.perf_counter() - t0
    t_mp = t_mp_sample / len(sample) * m * n
    got = np.array([res.value[i, j] for i, j in sample], np.float32)
    mismatches = int((bits_view(got) != bits_view(want)).sum())
    med_f64, d_f64 = describe(t_f64)
    med_or, d_or = describe(t_or)
    print(f"fp32 [{m},{k}] x [{k},{n}]  ({m * n} outputs, method {res.method})")
    print(f"  float64 matmul : {d_f64}")
    print(f"  oracle         : {d_or}")
    print(f"  mpmath exact   : {t_mp_sample:.2f}s for {len(sample)} elements -> "
          f"{t_mp:.1f}s extrapolated to {m * n}")
    print(f"  oracle / f64   : {med_or / med_f64:.1f}x medians, {min(t_or) / min(t_f64):.1f}x minimums"
          "   (target <= 10x)")
    print(f"  mp / oracle    : {t_mp / med_or:.0f}x   (target >= 1000x)")
    print(f"  fallbacks      : {res.fallbacks} of {res.elements} not proven by the BLAS stage, "
          f"{res.exact} needed the exact sum")
    print(f"  mismatches     : {mismatches} of {len(sample)} sampled vs mpmath")
    return mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sample", type=int, default=None, help="elements checked with mpmath")
    args = ap.parse_args()
    if args.quick:
        shapes = [(1024, 4, 1024), (64, 16384, 64)]
        repeats, n_sample = args.repeats or 3, args.sample or 50
    else:
        shapes = [(4096, 4, 4096), (256, 65536, 256)]
        repeats, n_sample = args.repeats or 5, args.sample or 200
    bad = 0
    for m, k, n in shapes:
        # The long-K case costs ~0.4 s per mpmath element: sample fewer.
        bad += bench(m, k, n, repeats, n_sample if k < 1024 else max(5, n_sample // 20))
    if bad:
        raise SystemExit(f"{bad} mismatches against mpmath")


if __name__ == "__main__":
    main()
