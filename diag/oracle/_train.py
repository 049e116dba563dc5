"""Reference for the training-step probe: one SGD step of a small MLP, evaluated in float64.

A whole training step has no cheap correctly rounded answer (tanh, exp and log of sums of
sums), so this reference is the same math evaluated in float64 on the given inputs and
rounded once to the output dtype. float64 carries 29 more bits than float32: for the sizes
the probes use its own error is far below one float32 ulp, except where a result nearly
cancels (small gradients of a weight whose update rounds away), so ULP figures against it
are meaningful and a NaN or Inf where it is finite is certainly the backend's.

The step (the same in every backend module):
    labels = argmax(x[:, :c])                       (first index among equal values)
    h      = tanh(x @ w1);  logits = h @ w2
    loss   = mean(logsumexp(logits) - logits[label])
    w1', w2' = w1 - lr * dloss/dw1, w2 - lr * dloss/dw2
"""

from __future__ import annotations

import numpy as np

__all__ = ["train_step_core"]


def train_step_core(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, lr: float):
    """(loss, new w1, new w2) in float64 for float64 inputs (see the module docstring)."""
    c = w2.shape[1]
    labels = np.argmax(x[:, :c], axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.tanh(x @ w1)
        logits = h @ w2
        m = logits.max(axis=1, keepdims=True)
        e = np.exp(logits - m)
        s = e.sum(axis=1, keepdims=True)
        rows = np.arange(x.shape[0])
        loss = np.mean(m[:, 0] + np.log(s[:, 0]) - logits[rows, labels])
        dlogits = e / s
        dlogits[rows, labels] -= 1.0
        dlogits /= x.shape[0]
        g2 = h.T @ dlogits
        dpre = (dlogits @ w2.T) * (1.0 - h * h)
        g1 = x.T @ dpre
    return np.float64(loss), w1 - lr * g1, w2 - lr * g2
