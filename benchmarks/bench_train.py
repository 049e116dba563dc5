"""Time of the `train` suite on this machine, and of its parts.

    PYTHONPATH=$PWD python benchmarks/bench_train.py [--repeats 3] [--steps 8] [--suite]

Prints the median seconds (with the raw samples) of one training run of the shipped suite's
model (2 layers, width 64, vocab 256, seq 64, batch 8) for: the float64 reference, jax-cpu
and torch-cpu in float32 and bf16 mixed precision (each run after a warm-up, so JAX's compile
is not in it), and the first JAX run including its compile. With --suite it also times
`diag run --suite train -b jax-cpu -b torch-cpu` end to end through the real script (workers,
their start-up, the timed repeats and the judging), median of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from diag.train.config import TrainConfig, init_params, make_batches
from diag.train.reference import run_reference


def _median(label: str, fn, repeats: int) -> None:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    note = "  (noisy: spread > 50%)" if spread > 0.5 else ""
    print(f"{label:<34} median {med:7.2f} s  samples {[round(s, 2) for s in samples]}{note}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--suite", action="store_true")
    args = ap.parse_args()
    cfg = TrainConfig(steps=args.steps)
    rng = np.random.default_rng(0)
    p, t = init_params(cfg, rng), make_batches(cfg, rng)
    print(f"model: {cfg.layers} layers, width {cfg.width}, vocab {cfg.vocab}, seq {cfg.seq}, "
          f"batch {cfg.batch}, {cfg.steps} steps")
    _median("float64 reference (numpy)", lambda: run_reference(cfg, p, t), args.repeats)
    from diag.train import jax_model, torch_model

    t0 = time.perf_counter()
    jax_model.run(cfg, p, t, "float32")
    print(f"{'jax-cpu float32, first (compile)':<34} {time.perf_counter() - t0:7.2f} s")
    for name, mod in (("jax-cpu", jax_model), ("torch-cpu", torch_model)):
        for compute in ("float32", "bfloat16"):
            mod.run(cfg, p, t, compute)  # warm-up
            _median(f"{name} {compute}", lambda: mod.run(cfg, p, t, compute), args.repeats)
    if args.suite:
        def suite():
            with tempfile.TemporaryDirectory() as out:
                subprocess.run([sys.executable, "-m", "diag.cli", "run", "--suite", "train",
                                "-b", "jax-cpu", "-b", "torch-cpu", "-o", out],
                               capture_output=True, check=False)
        _median("diag run --suite train (2 backends)", suite, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
