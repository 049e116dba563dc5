"""One training run by one implementation: JAX, torch or the float64 reference.

Its own module so that comparing ports (`diag.train.ports`) and hunting a NaN in a run
(`diag.train.hunt`) both use it without importing each other. JAX and torch are imported on
the call.
"""

from __future__ import annotations

import numpy as np

from diag.train.config import TrainConfig

__all__ = ["IMPLEMENTATIONS", "run_impl"]

#: Where a run can come from: the two frameworks and the float64 reference itself.
IMPLEMENTATIONS = ("jax", "torch", "reference")


def run_impl(
    impl: str, cfg: TrainConfig, params: np.ndarray, batches: np.ndarray, compute: str = "float32"
) -> dict[str, np.ndarray]:
    """One run by `impl` (`IMPLEMENTATIONS`); `reference` ignores `compute` (float64)."""
    if impl == "jax":
        from diag.train import jax_model

        return jax_model.run(cfg, params, batches, compute)
    if impl == "torch":
        from diag.train import torch_model

        return torch_model.run(cfg, params, batches, compute)
    if impl == "reference":
        from diag.train.reference import run_reference

        return run_reference(cfg, params, batches)
    from diag.errors import UsageError

    raise UsageError(
        f"unknown implementation {impl!r}; expected one of {', '.join(IMPLEMENTATIONS)}"
    )
