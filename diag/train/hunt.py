"""Where a training run's first NaN/Inf was born: the step, then the op and source line.

A `train` record says at which step and in which tensor a run first went non-finite
(`diag.train.compare`). To say which op made it, `locate_nan` replays that one step from the
parameters the run had just before it (its own trajectory) under `diag.nan.locate`: for JAX
the loss-and-gradient function of `jax_model` (traced equation by equation), for PyTorch the
module's forward and backward (watched op by op). The whole N-step run is not hunted: it is a
Python loop around a jitted step, which `diag.nan` does not trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diag.train.config import TrainConfig, pack, param_layout, unpack

__all__ = ["first_nonfinite_step", "locate_nan"]


def first_nonfinite_step(cfg: TrainConfig, run: dict) -> int | None:
    """The first step whose loss or any gradient holds a NaN/Inf, or None."""
    for t in range(len(run["loss"])):
        arrays = [run["loss"][t]] + [run[f"grad/{n}"][t] for n, _ in param_layout(cfg)]
        if any(not np.all(np.isfinite(np.asarray(a, dtype=np.float64))) for a in arrays):
            return t
    return None


def _params_before(cfg: TrainConfig, run: dict, init: np.ndarray, t: int) -> np.ndarray:
    if t == 0:
        return np.asarray(init, dtype=np.float32)
    return pack(cfg, {n: run[f"param/{n}"][t - 1] for n, _ in param_layout(cfg)}).astype(np.float32)


def locate_nan(
    impl: str,
    cfg: TrainConfig,
    params: np.ndarray,
    batches: np.ndarray,
    compute: str = "float32",
    run: dict | None = None,
) -> dict[str, Any] | None:
    """The first non-finite step of a run and the op that gave birth to it.

    Args:
      impl: `jax` or `torch`.
      cfg, params, batches, compute: the run (as `diag.train.run.run_impl` takes them).
      run: its trajectory when already computed (else it is run here).

    Returns:
      None when the run stays finite; else {"step", "reason" (`diag.nan.reason`: op, file:line,
      phase), and `NanReport.to_dict()`'s fields}.
    """
    from diag import nan
    from diag.train.run import run_impl

    if run is None:
        run = run_impl(impl, cfg, params, batches, compute)
    t = first_nonfinite_step(cfg, run)
    if t is None:
        return None
    flat = _params_before(cfg, run, params, t)
    # The step, its compute dtype and its arguments are the chosen framework's own types.
    step: Callable[..., Any]
    cd: Any
    args: tuple[Any, ...]
    if impl == "jax":
        import jax
        import jax.numpy as jnp

        from diag.train.jax_model import loss_of

        cd = jnp.dtype(compute)

        def step(p, batch):
            return jax.value_and_grad(loss_of)(p, batch, cfg, cd)

        args = (
            {k: jnp.asarray(v) for k, v in unpack(cfg, flat).items()},
            jnp.asarray(np.asarray(batches[t]).astype(np.int32)),
        )
    elif impl == "torch":
        import torch

        from diag.train.torch_model import TinyGPT

        cd = {"float32": torch.float32, "bfloat16": torch.bfloat16}[compute]
        model = TinyGPT(cfg, flat, torch.float32)

        def step(batch):
            loss = model(batch, cd)
            loss.backward()
            return loss

        args = (torch.tensor(np.asarray(batches[t]).astype(np.int64)),)
    else:
        from diag.errors import UsageError

        raise UsageError(f"locate_nan: implementation must be jax or torch, got {impl!r}")
    report = nan.locate(step, *args)
    return {"step": t, "reason": nan.reason(report), **(report.to_dict() if report else {})}
