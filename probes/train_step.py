"""train_step: one SGD step of a small tanh MLP with softmax cross-entropy; finiteness
against the float64 reference decides, the loss's ULPs screen (`diag.tolerance`'s train_step
row, `TRAIN_LOSS_ULP_SCREEN`). Truth: `diag.oracle.train_step_result` (a float64 evaluation,
not an exact result). A non-finite output is hunted to the op that produced it (`diag.nan`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diag import numerics, oracle
from diag.compare.outcome import Evaluation, Outcome
from diag.compare.verdict import Mismatch, Verdict, fmt, format_mismatch
from diag.plan.probe import F64, FLOATS, ROWS_COPIES, Probe
from diag.status import Status
from diag.tolerance import TRAIN_LOSS_ULP_SCREEN


def compare_train_step(
    out: dict[str, np.ndarray], truth: dict[str, np.ndarray], inputs: list[np.ndarray]
) -> dict[str, Any]:
    """A training step's outputs (`loss`, `w1`, `w2`) against the float64 reference.

    Args:
      out: the backend's outputs by name.
      truth: the reference by name, rounded to the same dtype (`diag.oracle.train_step_result`).
      inputs: x, w1, w2 as given; the weights' update is `new - old`.

    Returns:
      elements (how many output values: loss and both weights), unexpected_nonfinite (NaN/Inf where
      the reference is finite, or the reverse, or a
      different non-finite value), reference_nonfinite (elements where the float64 step
      itself overflows the dtype), nan_count, loss / loss_ref / loss_ulp / loss_rel_err, and per
      weight its max and p99
      ULP and `update_err`: max |w'_backend - w'_ref| over the largest reference update (ULPs
      of the new weights alone mislead where an update nearly cancels a weight).
    """
    metrics: dict[str, Any] = {
        "elements": 0,
        "unexpected_nonfinite": 0,
        "nan_count": 0,
        "reference_nonfinite": 0,
    }
    old = {"w1": inputs[1], "w2": inputs[2]}
    for name in ("loss", "w1", "w2"):
        got, ref = np.asarray(out[name]), np.asarray(truth[name])
        if got.shape != ref.shape:
            raise ValueError(f"train_step output {name}: shape {got.shape}, expected {ref.shape}")
        got = got.astype(ref.dtype)
        g64, r64 = got.astype(np.float64), ref.astype(np.float64)
        metrics["elements"] += int(got.size)
        fin_g, fin_r = np.isfinite(g64), np.isfinite(r64)
        same_nonfinite = (np.isnan(g64) & np.isnan(r64)) | (~fin_g & ~fin_r & (g64 == r64))
        metrics["unexpected_nonfinite"] += int(
            np.count_nonzero((~fin_g | ~fin_r) & ~same_nonfinite)
        )
        metrics["nan_count"] += int(np.count_nonzero(np.isnan(g64)))
        # The float64 step overflows this dtype here: no backend can return it finite.
        metrics["reference_nonfinite"] += int(np.count_nonzero(~fin_r))
        ulp = numerics.ulp_distance(got, ref).ravel()
        comparable = ulp[ulp < numerics.NAN_ULP]
        if name == "loss":
            metrics.update(
                loss=float(g64),
                loss_ref=float(r64),
                loss_ulp=int(ulp[0]) if ulp[0] < numerics.NAN_ULP else None,
                loss_rel_err=(
                    float(abs(g64 - r64) / abs(r64))
                    if np.isfinite(g64) and np.isfinite(r64) and r64 != 0
                    else None
                ),
            )
            continue
        both = fin_g & fin_r
        err = np.abs(np.where(both, g64 - r64, 0.0))
        step = np.abs(np.where(fin_r, r64 - old[name].astype(np.float64), 0.0))
        scale = float(step.max()) if step.size else 0.0
        metrics[name] = {
            "max_ulp": int(comparable.max()) if comparable.size else None,
            "p99_ulp": float(np.percentile(comparable, 99)) if comparable.size else None,
            "update_err": float(err.max() / scale) if scale > 0 else 0.0,
            "max_update": scale,
        }
    return metrics


def train_mismatch(metrics: dict[str, Any]) -> Mismatch | None:
    """The output elements that went non-finite where the float64 reference did not, or None
    (the loss screen is a warn about one number, not a count)."""
    k = metrics["unexpected_nonfinite"]
    if not k:
        return None
    # Records written before `elements` existed count the loss and the weights' sizes apart.
    return Mismatch(
        k,
        metrics.get("elements", k),
        "output elements",
        share=False,
        got=metrics["loss"],
        expected=metrics["loss_ref"],
    )


def judge_train_step(metrics: dict[str, Any], *, nan_reason: str | None = None) -> tuple[str, str]:
    """fail: NaN/Inf where the float64 reference is finite (with where it was born, from the
    NaN hunt); warn: the loss is more than `TRAIN_LOSS_ULP_SCREEN` ULP from the reference;
    pass: otherwise."""
    k = metrics["unexpected_nonfinite"]
    if k:
        where = f"; {nan_reason}" if nan_reason else ""
        fits = ""
        if metrics.get("reference_nonfinite"):
            fits = (
                f"; the step does not fit this dtype: even the float64 reference overflows "
                f"it in {metrics['reference_nonfinite']} elements (use a wider dtype or "
                f"loss scaling)"
            )
        m = train_mismatch(metrics)
        assert m is not None  # train_mismatch counts these non-finite elements
        return Status.FAIL, (
            f"the step went non-finite: {format_mismatch(m)} "
            f"are NaN/Inf where the "
            f"float64 reference is finite or a different value (loss "
            f"{fmt(metrics['loss'])}, reference {fmt(metrics['loss_ref'])})"
            f"{fits}{where}"
        )
    updates = ", ".join(f"{n} {metrics[n]['update_err']:.2%}" for n in ("w1", "w2"))
    summary = (
        f"loss {fmt(metrics['loss'])} is {metrics['loss_ulp']} ULP from the float64 "
        f"reference; weight update error (of the largest update): {updates}"
    )
    if metrics["loss_ulp"] is not None and metrics["loss_ulp"] > TRAIN_LOSS_ULP_SCREEN:
        return Status.WARN, f"{summary}: more than the {TRAIN_LOSS_ULP_SCREEN} ULP screen"
    return Status.PASS, f"finite step; {summary}"


def agree_train_step(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: tuple[str, str]
) -> Verdict:
    """Two backends' training steps: `warn` when one goes non-finite where the other does not
    (the "which hosts give NaN losses" question), else `pass` with how far apart they are."""
    x, y = names
    metrics: dict[str, Any] = {}
    split = []
    for name in ("loss", "w1", "w2"):
        u, v = np.asarray(a[name]), np.asarray(b[name]).astype(np.asarray(a[name]).dtype)
        fu, fv = np.isfinite(u.astype(np.float64)), np.isfinite(v.astype(np.float64))
        ulp = numerics.ulp_distance(u, v).ravel()
        metrics[name] = {
            "mismatched": int(np.count_nonzero(ulp)),
            "nonfinite_split": int(np.count_nonzero(fu != fv)),
        }
        if metrics[name]["nonfinite_split"]:
            split.append(name)
    if split:
        return Verdict(
            Status.WARN,
            (
                f"{x} and {y} disagree on finiteness: {', '.join(split)} is NaN/Inf on "
                f"one and finite on the other"
            ),
            metrics,
        )
    diff = ", ".join(f"{n} {metrics[n]['mismatched']}" for n in ("loss", "w1", "w2"))
    if not any(metrics[n]["mismatched"] for n in metrics):
        return Verdict(Status.PASS, f"{x} and {y} agree bit for bit", metrics)
    return Verdict(Status.PASS, f"{x} and {y} both finite; elements that differ: {diff}", metrics)


def evaluate(o: Outcome) -> Evaluation:
    """One backend's training step against the float64 reference, with where a NaN was born
    when the worker hunted it."""
    out = o.named
    truth = {"loss": o.truth.value, **o.truth.extra}
    metrics = compare_train_step(out, truth, o.inputs)
    status, reason = judge_train_step(metrics, nan_reason=(o.nan_report or {}).get("reason"))
    mismatch = train_mismatch(metrics)
    if o.nan_report:
        metrics["nan_report"] = o.nan_report
    return Evaluation(status, reason, metrics, mismatch=mismatch)


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' steps of one case: finiteness first."""
    return agree_train_step(a.named, b.named, names)


def input_shapes(params: dict) -> list[tuple[int, ...]]:
    b, d, c = params["batch"], params["d"], params["c"]
    return [(b, d), (d, d), (d, c)]


def host_bytes(params: dict) -> int:
    b, d, c = params["batch"], params["d"], params["c"]
    return F64 * ROWS_COPIES * (b * d + d * d + d * c + b * c)


def label(params: dict) -> str:
    return (
        f"batch={params['batch']} d={params['d']} c={params['c']} {params['dtype']} "
        f"{params['inputs']} lr={params['lr']}"
    )


def truth(inputs: list, params: dict, cache):
    x, w1, w2 = inputs
    return oracle.train_step_result(x, w1, w2, params["lr"], cache=cache)


def _jax_loss(w1, w2, x):
    """Softmax cross-entropy of a tanh MLP; labels from the inputs (see diag.oracle._train)."""
    import jax
    import jax.numpy as jnp

    labels = jnp.argmax(x[:, : w2.shape[1]], axis=1)
    logits = jnp.tanh(x @ w1) @ w2
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def on_jax(backend, lr: float = 0.1):
    """One SGD step (`jax.value_and_grad`), in the inputs' dtype: loss and updated weights."""
    import jax

    def step(x, w1, w2):
        loss, (g1, g2) = jax.value_and_grad(_jax_loss, argnums=(0, 1))(w1, w2, x)
        return {"loss": loss, "w1": w1 - lr * g1, "w2": w2 - lr * g2}

    return step


def on_torch(backend, lr: float = 0.1):
    """One SGD step (autograd), in the inputs' dtype: loss and updated weights. Functional:
    the inputs are not modified, so the step can be run again (timing, a NaN hunt)."""
    import torch

    def step(x, w1, w2):
        w1g, w2g = (w.detach().clone().requires_grad_(True) for w in (w1, w2))
        labels = torch.argmax(x[:, : w2.shape[1]], dim=1)
        logits = torch.tanh(x @ w1g) @ w2g
        loss = torch.nn.functional.cross_entropy(logits, labels)
        g1, g2 = torch.autograd.grad(loss, (w1g, w2g))
        with torch.no_grad():
            return {"loss": loss.detach(), "w1": w1 - lr * g1, "w2": w2 - lr * g2}

    return step


PROBE = Probe(
    op="train_step",
    dims=("batch", "d", "c"),
    params={"lr": (float, None, 0.1)},
    op_args=("lr",),
    dtypes=FLOATS,
    inputs=("mlp", "mlp_huge"),
    input_shapes=input_shapes,
    truth=truth,
    truth_args=("lr",),
    evaluate=evaluate,
    agree=agree,
    label=label,
    host_bytes=host_bytes,
    hunt_nans=True,
    implementations={"jax": on_jax, "torch": on_torch},
)
