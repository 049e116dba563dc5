"""How fast does diag judge one 16.7M-element float32 matmul record, element by element?

    PYTHONPATH=$PWD python benchmarks/bench_judge.py [--repeats 5] [--no-legacy]

The record: the matmul suite's float32 [4096,4]x[4,4096] case (its seeded inputs), the
correctly rounded truth from diag's oracle, the real bound (`diag.tolerance`), a float32
product as a CPU backend returns it and a second one summed in the opposite order (another
backend). Judging it = `compare` (output against truth and bound) + `agreement` (the two
outputs against each other), diag's code now beside the whole-array numpy code it replaced
(tests/legacy_judge.py), and a float64 matmul of the same shape, all interleaved in one
process so that they see the same machine load; medians of `--repeats` samples, each printed.

Tried and measured here: fused numba loops (commits 417bef8..e729124) judged this record 2.4x
faster than the numpy passes (quiet machine), but `diag run --suite matmul` no faster (the
bound, not the comparison, dominates its judge phase), at ~0.8-1.6 s of numba import and cache
loading per process and 14-35 s of compiling per fresh install: not adopted.

Target (issue 14): judging <= 2.5x the float64 matmul. Other load on the machine inflates
every figure (the load average is printed); the ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TARGET = 2.5

def record():
    """(a, b, output, other output, truth, bound) of the suite's 16.7M-element f32 case."""
    from diag import oracle
    from diag.plan.inputs import INPUT_MAKERS
    from diag.numerics import as_dtype
    from diag.plan.registry import PROBES
    from diag.plan.suite import load_suite
    from diag.tolerance import tolerance

    case = next(c for c in load_suite("matmul").cases
                if c.params.get("d") == 4096 and c.dtype == "float32")
    rng = np.random.default_rng(case.seed)
    a, b = (INPUT_MAKERS[case.inputs](rng, shape, as_dtype(case.dtype))
            for shape in PROBES[case.op].input_shapes(case.params))
    truth = oracle.matmul_result(a, b).value
    bound = tolerance("matmul", truth.dtype).bound([a, b], truth, case.params)
    return a, b, a @ b, a[:, ::-1] @ b[::-1, :], truth, bound


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def describe(samples: list[float]) -> str:
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    warn = "  (spread > 50%: machine busy?)" if spread > 0.5 else ""
    return f"median {med:.4f} s  [{', '.join(f'{s:.4f}' for s in samples)}]{warn}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-legacy", action="store_true",
                    help="skip the whole-array code (several seconds a sample)")
    args = ap.parse_args()
    sys.path.append(str(ROOT))  # tests/legacy_judge.py; PYTHONPATH picks the diag measured
    from diag.compare.elementwise import agreement, compare

    a, b, out, other, truth, bound = record()
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    judges = {"diag": (compare, agreement)}
    if not args.no_legacy:
        from tests import legacy_judge

        judges["whole-array numpy (before)"] = (legacy_judge.compare, legacy_judge.agreement)
    for cmp, agr in judges.values():  # fault every page in before timing
        cmp(out[:2], truth[:2], bound[:2])
        agr(out[:2], other[:2], bound[:2])
    samples: dict[str, list[float]] = {"float64 matmul": []}
    for _ in range(args.repeats):
        samples["float64 matmul"].append(timed(lambda: a64 @ b64))
        for name, (cmp, agr) in judges.items():
            for part, fn in (("compare", lambda: cmp(out, truth, bound)),
                             ("agreement", lambda: agr(out, other, bound))):
                samples.setdefault(f"{name}: {part}", []).append(timed(fn))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"one float32 [4096,4]x[4,4096] record ({out.size} elements), load average {load}")
    for name, s in samples.items():
        print(f"  {name:<42} {describe(s)}")
    f64 = statistics.median(samples["float64 matmul"])
    judged = {name: statistics.median(samples[f"{name}: compare"])
              + statistics.median(samples[f"{name}: agreement"]) for name in judges}
    for name, sec in judged.items():
        print(f"  {name + ': compare + agreement':<42} {sec:.4f} s = {sec / f64:.2f}x the "
              "float64 matmul")
    if len(judged) == 2:
        print(f"  speed-up over the whole-array code: "
              f"{judged['whole-array numpy (before)'] / judged['diag']:.1f}x")
    ratio = judged["diag"] / f64
    print(f"target: compare + agreement <= {TARGET}x the float64 matmul: {ratio:.2f}x, "
          f"{'met' if ratio <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
