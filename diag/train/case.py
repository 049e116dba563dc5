"""How the `train` probe's cases are made: inputs, ground truth, label, memory, checks.

The probe table (`diag.probes`) holds one row for `train`; the functions that row needs live
here so that the table stays data. Inputs are two arrays, drawn once on the host with numpy:
the packed float32 initial parameters and the float32 token batches (`diag.train.config`).
The ground truth is the float64 reference of the same steps (`diag.train.reference`), shared
by the float32 and the bf16 mixed-precision cases of the same model (the `compute` parameter
is not part of it).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from diag.train.config import from_case, init_params, make_batches, n_params

__all__ = ["make_inputs", "input_shapes", "truth", "label", "host_bytes", "validate"]


def make_inputs(rng: np.random.Generator, params: dict, dtype) -> list[np.ndarray]:
    """[packed initial parameters, token batches], float32, from the case's seed."""
    cfg = from_case(params)
    return [init_params(cfg, rng), make_batches(cfg, rng)]


def input_shapes(params: dict) -> list[tuple[int, ...]]:
    cfg = from_case(params)
    return [(n_params(cfg),), (cfg.steps, cfg.batch, cfg.seq + 1)]


def truth(inputs: list, params: dict, cache: Any):
    """The float64 reference run as an `OracleResult`: value = the per-step loss, extra =
    {"trajectory": every tensor at every step} (not disk-cached: ~0.1 s a step here)."""
    from diag.oracle import OracleResult
    from diag.train.reference import run_reference

    t0 = time.perf_counter()
    traj = run_reference(from_case(params), inputs[0], inputs[1])
    return OracleResult(value=traj["loss"], method="float64-reference", fallbacks=0,
                        elements=int(sum(v.size for v in traj.values())), cache_hit=False,
                        seconds=time.perf_counter() - t0, extra={"trajectory": traj})


def label(params: dict) -> str:
    return (f"{params['layers']}L d={params['width']} h={params['heads']} "
            f"V={params['vocab']} seq={params['seq']} batch={params['batch']} "
            f"steps={params['steps']} lr={params['lr']} compute={params['compute']}")


# Host copies of the whole trajectory at its peak: the float64 reference (grads + params),
# its per-step lists, and two backends' float32 outputs loaded for agreement.
_TRAJECTORY_COPIES = 8


def host_bytes(params: dict) -> int:
    cfg = from_case(params)
    return 8 * _TRAJECTORY_COPIES * 2 * cfg.steps * n_params(cfg)


def validate(params: dict) -> Optional[str]:
    return from_case(params).problem()
