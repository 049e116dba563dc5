"""Cost of `diag.arith.precision.features` per backend and input dtype (what `diag env --deep` adds).

    PYTHONPATH=$PWD python benchmarks/bench_features.py [--repeats 3]

Prints the median seconds of one `features(matmul, dtype)` call (5 matmuls of up to
about [430, 64] x [64, 430] plus the numpy model's predictions) for jax-cpu and torch-cpu (when
installed) and for a numpy model of a unit, with the raw samples. The cost is on the host
side mostly (hypotheses evaluated with the model), so it is about the same on any device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from diag.arith.features import UNITS
from diag.arith.precision import features


def _backends():
    yield "model v100", UNITS["v100"]
    try:
        import jax.numpy as jnp

        yield "jax-cpu", lambda a, b: np.asarray(jnp.matmul(a, b))
    except ImportError:
        pass
    try:
        import torch

        from diag.backends import torch_backend

        yield "torch-cpu", lambda a, b: torch_backend.get(
            torch.matmul(torch_backend.put(a), torch_backend.put(b)))
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'backend':<12} {'dtype':<9} {'median s':>9}  samples")
    for name, fn in _backends():
        for dtype in ("float32", "bfloat16", "float16"):
            samples = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                features(fn, dtype)
                samples.append(time.perf_counter() - t0)
            print(f"{name:<12} {dtype:<9} {statistics.median(samples):>9.3f}  "
                  + ", ".join(f"{s:.3f}" for s in samples))


if __name__ == "__main__":
    main()
