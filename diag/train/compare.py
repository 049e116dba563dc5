"""Per-step errors of one training run against another (the float64 reference or a second
backend), and the first step, stage and tensor where they part beyond tolerance.

Why these measures: a training run's tensors are judged as wholes (normwise relative error
per tensor), because an element of a gradient that is nearly zero has no meaningful relative
error, and Adam turns such noise into full-size updates. Parameters are judged on the
distance they travelled from the shared initial weights (||p - p_ref|| / ||p_ref - p_0||):
the weights themselves barely move in a few steps, so a relative error of the weights would
hide any update bug. Stages are ordered as a step computes them: the loss (forward), then
the gradients (backward), then the updated parameters (optimizer), so the first divergence
says which part of a step first went wrong.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from diag.train.config import TrainConfig, param_layout, unpack

__all__ = ["STAGES", "Divergence", "trajectory_errors", "summarize"]

STAGES = ("loss", "grad", "update")
_TINY = 1e-300


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part beyond tolerance.

    Attributes:
      step: the step (0-based) at which it happens.
      stage: `loss`, `grad` or `update` (forward, backward, optimizer).
      tensor: the parameter whose gradient or update is off the most (relative to what it is
        allowed) at that step and stage; `loss` for the loss.
      error: its relative error.
      allowed: what it was allowed.
    """

    step: int
    stage: str
    tensor: str
    error: float
    allowed: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        what = "the loss" if self.stage == "loss" else f"the {self.stage} of {self.tensor}"
        return (
            f"step {self.step}: {what} is {self.error:.3g} off (relative), allowed "
            f"{self.allowed:.3g}"
        )


def _norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(x, dtype=np.float64).ravel()))


def trajectory_errors(cfg: TrainConfig, got: dict, ref: dict, init: np.ndarray) -> dict:
    """Relative errors of `got` against `ref`, per step and tensor.

    Args:
      cfg: the run's configuration (tensor names and shapes).
      got, ref: trajectories (`loss`, `grad/<name>`, `param/<name>`, stacked over steps).
      init: the packed initial parameters both runs started from.

    Returns:
      {"loss": [steps], "grad": {name: [steps]}, "update": {name: [steps]}, "nonfinite":
      (step, tensor) of the first NaN/Inf in `got` where `ref` is finite, or None}.
    """
    p0 = unpack(cfg, np.asarray(init, dtype=np.float64))
    steps = len(ref["loss"])
    gl, rl = np.asarray(got["loss"], np.float64), np.asarray(ref["loss"], np.float64)
    out: dict[str, Any] = {
        "loss": list(np.abs(gl - rl) / np.maximum(np.abs(rl), _TINY)),
        "grad": {},
        "update": {},
        "nonfinite": None,
    }
    for name, _ in param_layout(cfg):
        g, rg = got[f"grad/{name}"], ref[f"grad/{name}"]
        p, rp = got[f"param/{name}"], ref[f"param/{name}"]
        out["grad"][name] = [_norm(g[t] - rg[t]) / max(_norm(rg[t]), _TINY) for t in range(steps)]
        out["update"][name] = [
            _norm(p[t] - rp[t]) / max(_norm(rp[t] - p0[name]), _TINY) for t in range(steps)
        ]
    for t in range(steps):
        bad = [("loss", gl[t], rl[t])] + [
            (f"{kind} of {name}", got[f"{kind}/{name}"][t], ref[f"{kind}/{name}"][t])
            for kind in ("grad", "param")
            for name, _ in param_layout(cfg)
        ]
        for label, a, b in bad:
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if np.any(~np.isfinite(a64) & np.isfinite(b64)):
                out["nonfinite"] = (t, label)
                return out
    return out


def first_divergence(errors: dict, allowed: dict[str, float]) -> Divergence | None:
    """The first (step, stage) where some error exceeds what it is allowed, naming the worst
    tensor there (by error over allowance); None when the runs never part. NaN counts as
    beyond any tolerance."""
    steps = len(errors["loss"])
    for t in range(steps):
        for stage in STAGES:
            tol = allowed[stage]
            if stage == "loss":
                cands = [("loss", errors["loss"][t])]
            else:
                cands = [(name, errs[t]) for name, errs in errors[stage].items()]
            over = [(e, n) for n, e in cands if not e <= tol]
            if over:
                e, n = max(over, key=lambda p: np.inf if np.isnan(p[0]) else p[0])
                return Divergence(t, stage, n, float(e), tol)
    return None


def summarize(errors: dict, allowed: dict[str, float], top: int = 5) -> dict[str, Any]:
    """What a record keeps: the per-step curves, the worst tensors, the first divergence.

    Returns:
      {"steps", "allowed", "curve": {"loss_err", "grad_err", "update_err"} (per step, the
      worst tensor's), "worst": the `top` tensors by worst error over allowance, with the
      step, "first_divergence": `Divergence.to_dict()` or None, "nonfinite": {"step",
      "tensor"} or None}.
    """
    steps = len(errors["loss"])

    def worst(stage, t):
        return max(errs[t] for errs in errors[stage].values())

    rows = []
    for stage in ("grad", "update"):
        for name, errs in errors[stage].items():
            t = int(np.nanargmax(errs)) if not np.all(np.isnan(errs)) else 0
            rows.append(
                {
                    "tensor": name,
                    "stage": stage,
                    "error": float(errs[t]),
                    "step": t,
                    "ratio": float(errs[t]) / allowed[stage],
                }
            )
    rows.sort(key=lambda r: -r["ratio"] if np.isfinite(r["ratio"]) else -np.inf)
    div = first_divergence(errors, allowed)
    nf = errors.get("nonfinite")
    return {
        "steps": steps,
        "allowed": dict(allowed),
        "curve": {
            "loss_err": [float(e) for e in errors["loss"]],
            "grad_err": [float(worst("grad", t)) for t in range(steps)],
            "update_err": [float(worst("update", t)) for t in range(steps)],
        },
        "worst": rows[:top],
        "first_divergence": div.to_dict() if div else None,
        "nonfinite": {"step": nf[0], "tensor": nf[1]} if nf else None,
    }
