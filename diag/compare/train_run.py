"""The `train` probe's verdicts: N training steps against the float64 reference, per step.

float32 runs are held to `TRAIN_RUN_RTOL['float32']` (derived and measured, see
diag.tolerance): a run that parts from the reference beyond it fails, naming the first step,
the stage (loss, gradients, update) and the tensor. bf16 mixed-precision runs are expected to
drift: they pass with their measured drift in the reason while inside the measured screen
and warn outside it. A NaN/Inf where the reference is finite fails, naming the first step and
tensor. Two backends are held to `AGREEMENT_FACTOR` times the same rows.
"""

from __future__ import annotations

from typing import Any

from diag.compare.outcome import Evaluation, Outcome
from diag.tolerance import AGREEMENT_FACTOR, TRAIN_RUN_RTOL

__all__ = ["evaluate", "agree", "judge"]


def _allowed(params: dict, factor: float = 1.0) -> dict[str, float]:
    rtol = TRAIN_RUN_RTOL.get(params.get("compute", "float32"), TRAIN_RUN_RTOL["float32"])
    return {k: factor * v for k, v in rtol.items()}


def _worst_text(summary: dict) -> str:
    c = summary["curve"]
    w = summary["worst"][0] if summary["worst"] else None
    text = (f"worst loss error {max(c['loss_err']):.2g}, gradient {max(c['grad_err']):.2g}, "
            f"update {max(c['update_err']):.2g}")
    if w:
        text += f" (worst tensor: {w['stage']} of {w['tensor']}, {w['error']:.2g} at step " \
                f"{w['step']})"
    return text


def judge(summary: dict, compute: str, against: str) -> tuple[str, str]:
    """(status, reason) of a run's summary (`diag.train.compare.summarize`) against
    `against` (the float64 reference, or another backend)."""
    n = summary["steps"]
    nf = summary.get("nonfinite")
    if nf:
        return "fail", (f"the run went NaN/Inf at step {nf['step']} in the {nf['tensor']} "
                        f"where {against} is finite")
    div = summary.get("first_divergence")
    if div:
        from diag.train.compare import Divergence

        where = Divergence(**div).text()
        if compute == "float32":
            return "fail", (f"parts from {against} at {where}; {_worst_text(summary)} over "
                            f"{n} steps")
        return "warn", (f"{compute} mixed precision drifts beyond the measured screen from "
                        f"{against} at {where}; {_worst_text(summary)} over {n} steps")
    if compute == "float32":
        return "pass", f"{n} steps within tolerance of {against}; {_worst_text(summary)}"
    return "pass", (f"{compute} mixed precision: measured drift from {against} over {n} "
                    f"steps (inside the measured screen): {_worst_text(summary)}")


def _summary(o: Outcome, ref: dict, factor: float) -> dict[str, Any]:
    from diag.train.compare import summarize, trajectory_errors
    from diag.train.config import from_case

    cfg = from_case(o.params)
    allowed = _allowed(o.params, factor)
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
        summary["reference_error_estimate"] = [e * 2.0**-29 for e in summary["curve"]["grad_err"]]
    status, reason = judge(summary, o.params.get("compute", "float32"), "the float64 reference")
    return Evaluation(status, reason, summary)


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    """Two backends' runs of one case, step by step: (status, reason, metrics)."""
    summary = _summary(a, b.named, AGREEMENT_FACTOR)
    status, reason = judge(summary, a.params.get("compute", "float32"), names[1])
    return status, f"{names[0]} vs {names[1]}: {reason}", summary
