"""How fast is the correctly rounded softmax oracle, and is it still exact?

Prints, per batch: oracle time (median of repeats, no cache), plain float64 numpy softmax time,
mpmath reference time (timed on a sample of rows, extrapolated to the batch), the ratios
oracle/f64 and mp/oracle, the fallback count, and the mismatches of the oracle against mpmath on
the sampled rows (must be 0). Target: a [8, 262144] float32 batch in well under 2 s.

Usage: python benchmarks/bench_oracle_softmax.py [--quick] [--repeats N] [--sample-rows N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import diag.oracle as oracle
from diag.numerics import bits_view
from diag.oracle import mp


def describe(samples):
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    warn = "  (spread > 50%: machine busy?)" if spread > 0.5 else ""
    return med, f"median {med:.3f}s  min {min(samples):.3f}s  max {max(samples):.3f}s{warn}"


def f64_softmax(x):
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def bench(rows, n, dt, sd, repeats, sample_rows, seed=0):
    x = (np.random.default_rng(seed).standard_normal((rows, n)) * sd).astype(dt)
    t_f64, t_or = [], []
    res = None
    for _ in range(repeats):  # interleaved: both see the same machine load
        t0 = time.perf_counter()
        f64_softmax(x)
        t_f64.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = oracle.softmax_result(x)
        t_or.append(time.perf_counter() - t0)
    # mpmath needs the whole row for its sum, so whole rows are sampled and extrapolated.
    picks = np.random.default_rng(seed + 1).choice(rows, size=min(sample_rows, rows),
                                                   replace=False)
    t0 = time.perf_counter()
    want = np.stack([mp.softmax(x[r:r + 1])[0] for r in picks])
    t_mp = (time.perf_counter() - t0) / len(picks) * rows
    bad = int((bits_view(res.value[picks]) != bits_view(want)).sum())
    m_f64, s_f64 = describe(t_f64)
    m_or, s_or = describe(t_or)
    name = np.dtype(dt).name
    print(f"[{rows}, {n}] {name} N(0,{sd:g}^2)")
    print(f"  float64 softmax  {s_f64}")
    print(f"  oracle           {s_or}  fallbacks {res.fallbacks}")
    print(f"  mpmath           {t_mp:.1f}s (extrapolated from {len(picks)} rows)")
    print(f"  oracle / f64 = {m_or / m_f64:.1f}x   mpmath / oracle = {t_mp / m_or:.0f}x   "
          f"mismatches vs mpmath on sampled rows: {bad}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batches only")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample-rows", type=int, default=1)
    args = ap.parse_args()
    cases = [(8, 32768, np.float32, 1.0), (8, 32768, np.float32, 5.0),
             (8, 32768, ml_dtypes.bfloat16, 5.0)]
    if not args.quick:
        cases += [(8, 262144, np.float32, 1.0), (8, 262144, np.float32, 5.0)]
    for rows, n, dt, sd in cases:
        bench(rows, n, dt, sd, args.repeats, args.sample_rows)


if __name__ == "__main__":
    main()
