"""Is it drift, or a bug? Compare a port of the training run with its original.

"The port scores differently" has two explanations: two correct implementations round
differently (drift), or the port computes another function (a bug). The two runs alone cannot
tell them apart; the float64 reference of the intended run can. `compare_ports` runs the
original, the port and the reference from the same weights and batches, and:

* drift: both stay within the float32 tolerance of the reference at every step
  (`diag.tolerance.TRAIN_RUN_RTOL`); whatever separates them is rounding;
* a bug: one of them leaves the reference beyond tolerance; diag names the step, the stage
  (loss, gradients, update) and the tensor where it first does, and then the known porting
  bug that explains it: the port is rerun against the float64 reference with each bug of
  `diag.train.PORT_BUGS` planted, and a bug whose reference the port follows within tolerance
  at every step is named.

    from diag.train import compare_ports
    report = compare_ports(bug="gelu_tanh")     # plant a bug in the PyTorch port
    print(report.reason)                        # names the bug, step, stage and tensor

JAX and torch are imported on the call, not on `import diag.train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag.train.compare import Divergence, first_divergence, summarize, trajectory_errors
from diag.train.config import PORT_BUGS, TrainConfig, init_params, make_batches, with_bug
from diag.train.run import IMPLEMENTATIONS, run_impl

__all__ = ["PortReport", "compare_ports", "run_impl", "IMPLEMENTATIONS"]


#: A quick default: 2 layers, width 64, vocab 256, seq 32, batch 4, 4 steps (~3 s a run here).
DEFAULT_CONFIG = TrainConfig(seq=32, batch=4, steps=4)


@dataclass
class PortReport:
    """What `compare_ports` found.

    Attributes:
      verdict: `drift` (both follow the reference; rounding separates them) or `bug` (one
        leaves it).
      culprit: `port`, `original` or `both` for a bug; None for drift.
      first_divergence: where the culprit first leaves the reference (the port's when both
        do), or None.
      suspects: the known porting bugs (`PORT_BUGS` names) whose float64 run the culprit
        follows within tolerance; empty when none explains it.
      reason: one sentence a person can act on.
      summaries: `diag.train.compare.summarize` of original vs reference, port vs
        reference, and port vs original.
    """

    verdict: str
    culprit: str | None
    first_divergence: Divergence | None
    suspects: list[str]
    reason: str
    summaries: dict[str, Any] = field(default_factory=dict)


def _suspects(cfg: TrainConfig, run: dict, params, batches, allowed) -> list[str]:
    from diag.train.reference import run_reference

    found = []
    for bug in PORT_BUGS:
        ref = run_reference(with_bug(cfg, bug), params, batches)
        errors = trajectory_errors(cfg, run, ref, params)
        if errors["nonfinite"] is None and first_divergence(errors, allowed) is None:
            found.append(bug)
    return found


def _drift_text(original: str, port: str, steps: int, curve: dict) -> str:
    """The verdict when both runs stay within tolerance (`curve`: port vs original)."""
    return (
        f"drift, not a bug: {original} and {port} both stay within the float32 "
        f"tolerance of the float64 reference for {steps} steps (they differ by up to "
        f"{max(curve['loss_err']):.2g} in the loss, {max(curve['grad_err']):.2g} in a gradient, "
        f"{max(curve['update_err']):.2g} in an update): rounding, not a different function"
    )


def _blame(off: list[str], div, errors: dict, names: dict[str, str]) -> str:
    """Which run leaves the reference, where (`div`: its first divergence, or None for a
    NaN/Inf first), and whether the other stays within tolerance."""
    who = off[0]
    where = (
        div.text()
        if div
        else f"step {errors[who]['nonfinite'][0]}: NaN/Inf in the {errors[who]['nonfinite'][1]}"
    )
    return (
        f"the {who} ({names[who]}) leaves the float64 reference at {where}"
        + (f" (so does the {off[1]})" if len(off) > 1 else "")
        + (
            f", while the {'original' if who == 'port' else 'port'} "
            f"({names['original' if who == 'port' else 'port']}) stays within tolerance"
            if len(off) == 1
            else ""
        )
    )


def compare_ports(
    original: str = "jax",
    port: str = "torch",
    *,
    bug: str | None = None,
    original_bug: str | None = None,
    cfg: TrainConfig = DEFAULT_CONFIG,
    compute: str = "float32",
    seed: int = 0,
) -> PortReport:
    """Run `original` and `port` from the same weights and batches and say: drift or bug.

    Args:
      original: the implementation ported from (`jax`, `torch` or `reference`).
      port: the implementation ported to.
      bug: a porting bug to plant in the port (`PORT_BUGS`), None for a correct port.
      original_bug: a bug to plant in the original instead (to check diag blames it).
      cfg: the model and run (the intended conventions; bugs are planted on top).
      compute: `float32` (the tolerances are derived for it) or `bfloat16` (measured drift
        screen: only gross bugs stand out of bf16 drift).
      seed: the seed of the initial weights and batches.

    Returns:
      A `PortReport`.

    Raises:
      UsageError: an unknown implementation or bug.
    """
    from diag.tolerance import AGREEMENT_FACTOR, TRAIN_RUN_RTOL
    from diag.train.reference import run_reference

    problem = cfg.problem()
    if problem:
        from diag.errors import UsageError

        raise UsageError(f"compare_ports: {problem}")
    rng = np.random.default_rng(seed)
    params, batches = init_params(cfg, rng), make_batches(cfg, rng)
    allowed = dict(TRAIN_RUN_RTOL[compute])
    ref = run_reference(cfg, params, batches)
    runs = {
        "original": run_impl(original, with_bug(cfg, original_bug), params, batches, compute),
        "port": run_impl(port, with_bug(cfg, bug), params, batches, compute),
    }
    errors = {k: trajectory_errors(cfg, r, ref, params) for k, r in runs.items()}
    summaries = {f"{k} vs reference": summarize(e, allowed) for k, e in errors.items()}
    summaries["port vs original"] = summarize(
        trajectory_errors(cfg, runs["port"], runs["original"], params),
        {k: AGREEMENT_FACTOR * v for k, v in allowed.items()},
    )
    divs = {k: first_divergence(e, allowed) for k, e in errors.items()}
    names = {"original": original, "port": port}
    off = [k for k in ("port", "original") if divs[k] is not None or errors[k]["nonfinite"]]
    if not off:
        text = _drift_text(original, port, cfg.steps, summaries["port vs original"]["curve"])
        return PortReport("drift", None, None, [], text, summaries)
    culprit = off[0] if len(off) == 1 else "both"
    who = off[0]
    div = divs[who]
    suspects = _suspects(cfg, runs[who], params, batches, allowed)
    blame = _blame(off, div, errors, names)
    if errors[who]["nonfinite"] and names[who] in ("jax", "torch"):
        from diag.train.hunt import locate_nan

        bad = with_bug(cfg, bug if who == "port" else original_bug)
        hunt = locate_nan(names[who], bad, params, batches, compute, run=runs[who])
        if hunt:
            blame += f"; its first NaN/Inf, at step {hunt['step']}: {hunt['reason']}"
    if suspects:
        named = "; or ".join(f"{s}: {PORT_BUGS[s][2]}" for s in suspects)
        cause = f"it follows the float64 run with this bug planted: {named}"
    else:
        cause = "no known porting bug explains it (diag.train.PORT_BUGS)"
    return PortReport(
        "bug", culprit, div, suspects, f"a bug, not drift: {blame}; {cause}", summaries
    )
