"""train: N AdamW steps of a small transformer (`diag.train`) against the float64 reference.

Inputs are the initial weights and batches (float32 whatever `compute` is: fp32 master
weights), the truth the float64 reference of the same steps (`diag.train.reference`), judged
per step and tensor; the models are `diag.train.jax_model` and `diag.train.torch_model`.

float32 runs are held to `TRAIN_RUN_RTOL['float32']` (derived and measured, see
diag.tolerance): a run that parts from the reference beyond it fails, naming the first step,
the stage (loss, gradients, update) and the tensor. bf16 mixed-precision runs are expected to
drift: they pass with their measured drift in the reason while inside the measured screen
and warn outside it. A NaN/Inf where the reference is finite fails, naming the first step and
tensor. Two backends are held to `AGREEMENT_FACTOR` times the same rows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from diag.compare.outcome import Evaluation, Outcome
from diag.compare.verdict import Verdict
from diag.plan.probe import Probe
from diag.status import Status
from diag.tolerance import AGREEMENT_FACTOR, TRAIN_REFERENCE_ERROR_FACTOR, train_run_allowed
from diag.train.config import from_case, init_params, make_batches, n_params

__all__ = [
    "PROBE",
    "evaluate",
    "agree",
    "judge",
    "make_inputs",
    "input_shapes",
    "truth",
    "label",
    "host_bytes",
    "validate",
]


def _worst_text(summary: dict) -> str:
    c = summary["curve"]
    w = summary["worst"][0] if summary["worst"] else None
    text = (
        f"worst loss error {max(c['loss_err']):.2g}, gradient {max(c['grad_err']):.2g}, "
        f"update {max(c['update_err']):.2g}"
    )
    if w:
        text += (
            f" (worst tensor: {w['stage']} of {w['tensor']}, {w['error']:.2g} at step {w['step']})"
        )
    return text


def judge(summary: dict, compute: str, against: str) -> tuple[str, str]:
    """(status, reason) of a run's summary (`diag.train.compare.summarize`) against
    `against` (the float64 reference, or another backend)."""
    n = summary["steps"]
    nf = summary.get("nonfinite")
    if nf:
        return Status.FAIL, (
            f"the run went NaN/Inf at step {nf['step']} in the {nf['tensor']} "
            f"where {against} is finite"
        )
    div = summary.get("first_divergence")
    if div:
        from diag.train.compare import Divergence

        where = Divergence(**div).text()
        if compute == "float32":
            return Status.FAIL, (
                f"parts from {against} at {where}; {_worst_text(summary)} over {n} steps"
            )
        return Status.WARN, (
            f"{compute} mixed precision drifts beyond the measured screen from "
            f"{against} at {where}; {_worst_text(summary)} over {n} steps"
        )
    if compute == "float32":
        return Status.PASS, f"{n} steps within tolerance of {against}; {_worst_text(summary)}"
    return Status.PASS, (
        f"{compute} mixed precision: measured drift from {against} over {n} "
        f"steps (inside the measured screen): {_worst_text(summary)}"
    )


def _summary(o: Outcome, ref: dict, factor: float) -> dict[str, Any]:
    from diag.train.compare import summarize, trajectory_errors
    from diag.train.config import from_case

    cfg = from_case(o.params)
    allowed = train_run_allowed(o.params.get("compute", "float32"), factor)
    return summarize(trajectory_errors(cfg, o.named, ref, o.inputs[0]), allowed)


def evaluate(o: Outcome) -> Evaluation:
    """One backend's run against the float64 reference (`o.truth.extra['trajectory']`)."""
    ref = o.truth.extra["trajectory"]
    summary = _summary(o, ref, 1.0)
    summary["loss"] = [float(x) for x in o.named["loss"]]
    summary["loss_ref"] = [float(x) for x in ref["loss"]]
    # The reference's own error, estimated per step from this run's (docs/train.md): the
    # same dynamics amplify float64's rounding, 2^-29 times float32's.
    if o.params.get("compute", "float32") == "float32":
        summary["reference_error_estimate"] = [
            e * TRAIN_REFERENCE_ERROR_FACTOR for e in summary["curve"]["grad_err"]
        ]
    status, reason = judge(summary, o.params.get("compute", "float32"), "the float64 reference")
    return Evaluation(status, reason, summary)


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' runs of one case, step by step."""
    summary = _summary(a, b.named, AGREEMENT_FACTOR)
    status, reason = judge(summary, a.params.get("compute", "float32"), names[1])
    return Verdict(status, f"{names[0]} vs {names[1]}: {reason}", summary)


# ---------------------------------------------------------------------------------------------
# The row: inputs, truth, label, memory


def make_inputs(rng: np.random.Generator, params: dict, dtype) -> list[np.ndarray]:
    """The initial parameters (flat float32) and the token batches [steps, batch, seq+1]."""
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
    return OracleResult(
        value=traj["loss"],
        method="float64-reference",
        fallbacks=0,
        elements=int(sum(v.size for v in traj.values())),
        cache_hit=False,
        seconds=time.perf_counter() - t0,
        extra={"trajectory": traj},
    )


def label(params: dict) -> str:
    return (
        f"{params['layers']}L d={params['width']} h={params['heads']} "
        f"V={params['vocab']} seq={params['seq']} batch={params['batch']} "
        f"steps={params['steps']} lr={params['lr']} compute={params['compute']}"
    )


# Host copies of the whole trajectory at its peak: the float64 reference (grads + params),
# its per-step lists, and two backends' float32 outputs loaded for agreement.
_TRAJECTORY_COPIES = 8


def host_bytes(params: dict) -> int:
    cfg = from_case(params)
    return 8 * _TRAJECTORY_COPIES * 2 * cfg.steps * n_params(cfg)


def validate(params: dict) -> str | None:
    return from_case(params).problem()


def on_jax(backend, compute: str = "float32", **case):
    """N AdamW steps (the math is in `diag.train.jax_model`): loss, every gradient and every
    parameter, per step."""
    from diag.train import jax_model

    return jax_model.op(compute, case, backend.device())


def on_torch(backend, compute: str = "float32", **case):
    """N AdamW steps (the math is in `diag.train.torch_model`): loss, every gradient and every
    parameter, per step."""
    from diag.train import torch_model

    return torch_model.op(compute, case, backend.device())


PROBE = Probe(
    op="train",
    dims=("layers", "width", "vocab", "seq", "batch", "steps"),
    params={
        "heads": (int, None, 4),
        "lr": (float, None, 3e-3),
        "compute": (str, ("float32", "bfloat16"), ["float32", "bfloat16"]),
    },
    op_args=("layers", "width", "vocab", "seq", "batch", "steps", "heads", "lr", "compute"),
    dtypes=("float32",),
    inputs=("transformer",),
    input_shapes=input_shapes,
    truth=truth,
    truth_args=("heads", "lr"),
    evaluate=evaluate,
    agree=agree,
    label=label,
    validate=validate,
    host_bytes=host_bytes,
    make_inputs=make_inputs,
    report_section="training",
    implementations={"jax": on_jax, "torch": on_torch},
)
