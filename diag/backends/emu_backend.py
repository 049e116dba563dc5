"""Emulated backends (`emu-bf16x1`, `emu-tf32`, ...): numpy models of dot algorithms.

Why: most users have no TPU at hand, yet the TPU's default float32 matmul is one bf16 pass.
Running a probe on `emu-bf16x1` next to `jax-cpu` shows what that default does to it
(the `[d,4] x [4,d]` drift between JAX on TPU and PyTorch, for one). The arithmetic is
`diag.arith.dot_algorithms.emulate`, defined there with its sources.

An emulation is never a hardware result: the device reads `platform: emulated` with a kind
that says "not hardware", the backend names start with `emu-`, and their specs promise
nothing: every verdict on them is `warn` at worst, never `fail` (a bound breach, or an
overflow to Inf where the truth is finite, is what the emulated algorithm does there, not a
broken device). Only `matmul` is implemented.

Same interface as the other backend modules (see `diag.worker.main`); the "platform" is
the algorithm's `DotAlgorithmPreset` name, which matmul's `on_numpy` runs (`algorithm`).
Framework: numpy (always installed).
"""

from __future__ import annotations

import time

import numpy as np

from diag.arith.dot_algorithms import ALGORITHMS
from diag.backends.base import Prepared

FRAMEWORK = "numpy"
_algorithm: str | None = None


def discover() -> list[str]:
    """Every algorithm can be emulated on any machine."""
    return list(ALGORITHMS)


def setup(platform: str) -> dict:
    global _algorithm
    if platform not in ALGORITHMS:
        raise ValueError(f"diag: no emulation of '{platform}'; known: {', '.join(ALGORITHMS)}")
    _algorithm = platform
    return {
        "device": {
            "platform": "emulated",
            "kind": f"numpy emulation of {platform} (not hardware)",
            "id": 0,
            "count": 1,
        },
        "framework": {
            "name": "numpy",
            "version": np.__version__,
            "emulates": platform,
            "what": ALGORITHMS[platform].what,
        },
        "settings": {"algorithm": platform},
    }


def put(x: np.ndarray):
    return np.array(x)  # a private copy: inputs arrive memory-mapped read-only


def get(x) -> np.ndarray:
    return np.asarray(x)


def block(x) -> None:
    return None


def prepare(fn, args):
    """Nothing to compile: run once as warm-up and report that time."""
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    return Prepared(lambda: fn(*args), seconds, first=(out, seconds))


def algorithm(precision: str = "default") -> str:
    """The emulated algorithm (matmul's `on_numpy` runs it); it has one precision, its own,
    so `precision` must be default."""
    if precision != "default":
        raise ValueError(
            f"diag: an emulated backend has one precision ({_algorithm}); "
            f"got precision={precision!r}"
        )
    assert _algorithm is not None, "setup() first"
    return _algorithm
