"""What does the cause search cost beside a plain run and the shadow?

On the planted bugs of tests/data/cause/ (transformers BERT/GPT-2/Llama, Flax linen/NNX,
optax and torch.optim; each fails, and the search finds its cause), per case, warm (each step
runs once first so compilation and imports are not counted), medians of --repeats:
  plain    the function run once as the user runs it (PyTorch eager; JAX jitted as written)
  shadow   `diag.diverge.shadow` of it (the figures every failing record already pays for)
  explain  `diag.diverge.explain`: the shadow, then the ranked re-runs until one repairs it
  reruns   how many re-runs of the function the search took (at most 10; the baseline run
           as written is not counted)
  written, repaired  what the repair costs in time: the cause's `time_before_s` and
           `repair_time_s` (the function as written and with the cause promoted, op by op on
           the CPU, the fastest of the search's own run and one more; included in explain)
  before   `explain` as the search ran before its re-runs were cut (same code, patched
           here): every JAX re-run evaluates the whole jaxpr (none starts downstream from
           the baseline's kept values) and the repair is timed by 3 more runs of each, the
           search's own runs not counted
and explain/shadow, before/shadow: what naming the cause adds to naming the symptom, now and
before. The last lines give the median re-run count and the median wall times over the cases.

Usage: HF_HUB_OFFLINE=1 python benchmarks/bench_cause.py [--repeats N] [--cases a,b]
       [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "cause"
CASES = [
    ("hf_torch", "pool"),
    ("hf_torch", "logsig"),
    ("hf_torch", "attnpool"),
    ("hf_torch", "rmsnorm"),
    ("hf_torch", "rope"),
    ("hf_torch", "step"),
    ("flax_jax", "eps"),
    ("flax_jax", "softmax"),
    ("flax_jax", "rope"),
    ("flax_jax", "scan"),
]


def _module(name: str):
    key = f"bench_cause_{name}"
    spec = importlib.util.spec_from_file_location(key, DATA / f"{name}.py")
    sys.modules[key] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _case(name: str, case: str, repeats: int) -> dict:
    from diag.diverge import Failing, explain, shadow
    from diag.userfn import judge
    from diag.userfn.host import prepare
    from diag.userfn.tree import numpy_leaves

    mod = _module(name)
    fn, args = getattr(mod, f"{case}_planted")()
    prepared = prepare(f"{DATA / name}.py:{case}_planted")
    ref = prepared.reference
    got = judge(numpy_leaves(fn(*copy.deepcopy(args))), ref)
    failing = [
        Failing(v.path, ref.leaf(v.path), v.allowed)
        for v in got
        if v.status == "fail" and v.allowed > 0
    ]
    allowed = min(f.allowance for f in failing)

    def plain():
        return fn(*copy.deepcopy(args)) if name == "hf_torch" else _block(fn(*args))

    def shadowed():
        return shadow(fn, *copy.deepcopy(args))

    def explained():
        a = copy.deepcopy(args)
        return explain(fn, a, {}, failing, numpy_leaves, allowance=allowed)

    def before():
        with _as_before():
            return explained()

    runs = (("plain", plain), ("shadow", shadowed), ("explain", explained), ("before", before))
    samples: dict[str, list[float]] = {label: [] for label, _ in runs}
    cause = None
    for k in range(repeats + 1):  # the first round warms up
        for label, run in runs:
            dt, out = _timed(run)
            if k:
                samples[label].append(dt)
            if label == "explain":
                cause = out[1]
            elif label == "before" and out[1].cause_ops != cause.cause_ops:
                raise SystemExit(f"{name}:{case}: before found {out[1].text}")
    return {"case": f"{name}:{case}", "cause": cause, **samples}


@contextlib.contextmanager
def _as_before():
    """The search as it ran before: whole JAX re-runs and 3 more timed runs of each of the
    function as written and repaired. The same runs as then; only the figures it reports
    differ (here the fastest of 4, then the median of the 3), which costs no time."""
    from diag.diverge import attribution, jax_cause

    call, timings = jax_cause.Rerun.__call__, attribution.TIMINGS
    jax_cause.Rerun.__call__ = jax_cause.Rerun.whole  # type: ignore[method-assign]
    attribution.TIMINGS = 3
    try:
        yield
    finally:
        jax_cause.Rerun.__call__, attribution.TIMINGS = call, timings  # type: ignore[method-assign]


def _block(out):
    import jax

    return jax.block_until_ready(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default="")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads (default 1: on a shared machine two threads that wait on "
        "each other make one run's time vary tenfold)",
    )
    ns = p.parse_args()
    import torch

    torch.set_num_threads(ns.threads)
    chosen = [c for c in CASES if not ns.cases or c[1] in ns.cases.split(",")]
    print(
        f"# {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"torch threads {ns.threads}"
    )
    print(
        f"{'case':22} {'plain s':>9} {'shadow s':>9} {'explain s':>10} {'explain/shadow':>15}"
        f" {'before s':>9} {'before/shadow':>14} {'reruns':>7} {'written s':>10}"
        f" {'repaired s':>11} {'ratio':>6}  cause"
    )
    rows = []
    for name, case in chosen:
        r = _case(name, case, ns.repeats)
        med = {k: statistics.median(r[k]) for k in ("plain", "shadow", "explain", "before")}
        c = r["cause"]
        reruns = c.reruns if c is not None else 0
        where = (c.cause_ops[0] if c.cause_ops else c.text) if c is not None else "-"
        rows.append((med, reruns))
        t0 = c.time_before_s if c is not None and c.time_before_s else math.nan
        t1 = c.repair_time_s if c is not None and c.repair_time_s else math.nan
        print(
            f"{r['case']:22} {med['plain']:9.3f} {med['shadow']:9.3f} {med['explain']:10.3f}"
            f" {med['explain'] / med['shadow']:15.2f} {med['before']:9.3f}"
            f" {med['before'] / med['shadow']:14.2f} {reruns:7d} {t0:10.4f} {t1:11.4f}"
            f" {t1 / t0:6.2f}  {where}"
        )
    print(
        f"median re-runs per failing record: {statistics.median(n for _, n in rows):g} "
        f"(max {max(n for _, n in rows)}, budget 10)"
    )
    for k in ("plain", "shadow", "explain", "before"):
        print(f"median {k} wall time: {statistics.median(m[k] for m, _ in rows):.3f} s")
    ratios = [m["explain"] / m["shadow"] for m, _ in rows]
    was = [m["before"] / m["shadow"] for m, _ in rows]
    print(
        f"explain/shadow: median {statistics.median(ratios):.2f}, max {max(ratios):.2f} "
        f"(before: median {statistics.median(was):.2f}, max {max(was):.2f}; target <= 3)"
    )


if __name__ == "__main__":
    main()
