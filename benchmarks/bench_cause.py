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
           the CPU, medians of 3 timed runs after the search; included in explain)
and explain/shadow: what naming the cause adds to naming the symptom. The last lines give
the median re-run count and the median wall times over the cases.

Usage: HF_HUB_OFFLINE=1 python benchmarks/bench_cause.py [--repeats N] [--cases a,b]
"""

from __future__ import annotations

import argparse
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

    samples: dict[str, list[float]] = {"plain": [], "shadow": [], "explain": []}
    cause = None
    for k in range(repeats + 1):  # the first round warms up
        for label, run in (("plain", plain), ("shadow", shadowed), ("explain", explained)):
            dt, out = _timed(run)
            if k:
                samples[label].append(dt)
            if label == "explain":
                cause = out[1]
    return {"case": f"{name}:{case}", "cause": cause, **samples}


def _block(out):
    import jax

    return jax.block_until_ready(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default="")
    ns = p.parse_args()
    chosen = [c for c in CASES if not ns.cases or c[1] in ns.cases.split(",")]
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(
        f"{'case':22} {'plain s':>9} {'shadow s':>9} {'explain s':>10} {'explain/shadow':>15}"
        f" {'reruns':>7} {'written s':>10} {'repaired s':>11} {'ratio':>6}  cause"
    )
    rows = []
    for name, case in chosen:
        r = _case(name, case, ns.repeats)
        med = {k: statistics.median(r[k]) for k in ("plain", "shadow", "explain")}
        c = r["cause"]
        reruns = c.reruns if c is not None else 0
        where = (c.cause_ops[0] if c.cause_ops else c.text) if c is not None else "-"
        rows.append((med, reruns))
        t0 = c.time_before_s if c is not None and c.time_before_s else math.nan
        t1 = c.repair_time_s if c is not None and c.repair_time_s else math.nan
        print(
            f"{r['case']:22} {med['plain']:9.3f} {med['shadow']:9.3f} {med['explain']:10.3f}"
            f" {med['explain'] / med['shadow']:15.2f} {reruns:7d} {t0:10.4f} {t1:11.4f}"
            f" {t1 / t0:6.2f}  {where}"
        )
    print(
        f"median re-runs per failing record: {statistics.median(n for _, n in rows):g} "
        f"(max {max(n for _, n in rows)}, budget 10)"
    )
    for k in ("plain", "shadow", "explain"):
        print(f"median {k} wall time: {statistics.median(m[k] for m, _ in rows):.3f} s")


if __name__ == "__main__":
    main()
