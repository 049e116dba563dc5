"""How fast is the correctly rounded matmul oracle next to a float64 matmul, and is it still exact?

    python benchmarks/bench_oracle.py [--quick] [--repeats N] [--threads T] [--sample N]
                                      [--profile]

Per case, interleaved in one process (both see the same machine load): a float64 matmul of the
same shape on inputs already in float64 (the floor), and `diag.oracle.matmul_result` on the
float32 inputs (no cache). Prints the raw samples, medians, the ratio against the target
(issue 35), the oracle's fallback counts, and its mismatches against mpmath on a sample of
elements (must be 0). With --profile, cProfile's top entries for each case over its target.

Cases: N(0,1) [4096,4]x[4,4096], 1024^3, [64,65536]x[65536,64] (target 2x);
1000x16384x1000 N(0,1) (3x); the same with 20% ill-conditioned rows (10x): rows of A
projected onto the orthogonal complement of B's columns plus 1e-5 of noise, so that their dot
products with B's columns cancel to ~1e-7 of sum|a_k b_k| (the median condition is printed).

BLAS threads default to 1, as in `diag run` (diag/run/runner.py limits the host's BLAS to one
thread while workers run); on a shared 2-core machine two threads also made small GEMMs 10-60x
slower (idle OpenBLAS threads spin against other processes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import describe, machine, profile_top, timed, verdict  # noqa: E402

import diag.oracle as oracle  # noqa: E402
from diag.numerics import bits_view  # noqa: E402
from diag.oracle import mp  # noqa: E402


def ill_rows(a: np.ndarray, b: np.ndarray, frac: float, noise: float, rng) -> np.ndarray:
    """A copy of a whose first `frac` of rows are ~orthogonal to every column of b."""
    a = a.copy()
    r = int(a.shape[0] * frac)
    q, _ = np.linalg.qr(b.astype(np.float64))
    x = rng.standard_normal((r, a.shape[1]))
    x -= (x @ q) @ q.T
    x /= np.abs(x).max(axis=1, keepdims=True)
    a[:r] = (x + noise * rng.standard_normal(x.shape)).astype(a.dtype)
    return a


def cases(quick: bool):
    """(label, m, k, n, target, ill) per case."""
    if quick:
        return [("[1024,4]x[4,1024]", 1024, 4, 1024, 2.0, False),
                ("256^3", 256, 256, 256, 2.0, False),
                ("[16,16384]x[16384,16]", 16, 16384, 16, 2.0, False),
                ("200x4096x200 ill rows", 200, 4096, 200, 10.0, True)]
    return [("[4096,4]x[4,4096]", 4096, 4, 4096, 2.0, False),
            ("1024^3", 1024, 1024, 1024, 2.0, False),
            ("[64,65536]x[65536,64]", 64, 65536, 64, 2.0, False),
            ("1000x16384x1000 N(0,1)", 1000, 16384, 1000, 3.0, False),
            ("1000x16384x1000 ill rows", 1000, 16384, 1000, 10.0, True)]


def bench(label, m, k, n, target, ill, repeats, n_sample, do_profile, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    if ill:
        a = ill_rows(a, b, 0.2, 1e-5, rng)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    t_f64, t_or = [], []
    res = oracle.matmul_result(a, b)  # warm-up: page faults, imports
    for _ in range(repeats):
        t_f64.append(timed(lambda: a64 @ b64))
        t_or.append(timed(lambda: oracle.matmul_result(a, b)))
    ratio = statistics.median(t_or) / statistics.median(t_f64)
    print(f"{label}: fp32 [{m},{k}]x[{k},{n}], {m * n} outputs, method {res.method}")
    if ill:
        r = int(m * 0.2)
        cond = (np.abs(a64[:r]) @ np.abs(b64)) / np.abs(a64[:r] @ b64)
        print(f"  ill-conditioned rows: {r} of {m}, median condition sum|ab|/|sum ab| "
              f"{np.median(cond):.2g}")
    print(f"  float64 matmul : {describe(t_f64)}")
    print(f"  oracle         : {describe(t_or)}")
    print(f"  fallbacks      : {res.fallbacks} of {res.elements} not proven by the GEMM stage, "
          f"{res.exact} needed math.fsum")
    picks = rng.choice(m * n, size=min(n_sample, m * n), replace=False)
    if ill:  # half the sample from the ill-conditioned rows
        picks[: len(picks) // 2] = rng.choice(int(m * 0.2) * n, size=len(picks) // 2)
    sample = [divmod(int(e), n) for e in picks]
    want = mp.matmul(a, b, elements=sample)
    got = np.array([res.value[i, j] for i, j in sample], np.float32)
    bad = int((bits_view(got) != bits_view(want)).sum())
    print(f"  mismatches     : {bad} of {len(sample)} sampled elements vs mpmath")
    print(f"  {verdict('oracle / float64 matmul (medians)', ratio, target)}")
    if do_profile and ratio > target:
        print("  profile of one oracle call (cProfile, by internal time):")
        print("    " + profile_top(lambda: oracle.matmul_result(a, b)).replace("\n", "\n    "))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    ap.add_argument("--sample", type=int, default=6, help="elements checked with mpmath")
    ap.add_argument("--profile", action="store_true", help="profile cases over their target")
    args = ap.parse_args()
    print(f"machine: {machine()}; BLAS threads {args.threads}")
    bad = 0
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for c in cases(args.quick):
            bad += bench(*c, repeats=args.repeats, n_sample=args.sample,
                         do_profile=args.profile)
    if bad:
        raise SystemExit(f"{bad} mismatches against mpmath")


if __name__ == "__main__":
    main()
