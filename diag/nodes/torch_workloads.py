"""diag's builtin node-scan workloads written in torch (imported in the scan, torch loaded).

The same computations as the JAX builtins (`diag.nodes.workloads`), from the same seeded
weights: a chain of four 128x128 matmuls with tanh (bf16 or fp32), a softmax of ``4 x`` over the
last axis, one SGD step of a tanh MLP with softmax cross-entropy and labels drawn from the input
(the new weights and the loss, flattened into one array). They run at the framework's default
settings, as users run them: a rank whose torch numerics settings differ computes what those
settings say (and its configuration fingerprint says which setting differs).

Bits are compared between devices of one framework only: a torch scan's golden digests are
stored under torch's version, never compared with jax's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from diag.nodes.seeded import weights

__all__ = ["from_numpy", "matmul_chain", "softmax", "to_numpy", "train_step"]


def from_numpy(x: np.ndarray) -> torch.Tensor:
    """A host tensor with `x`'s bits (bfloat16 through a 16-bit view: numpy has no bf16)."""
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_numpy(y) -> np.ndarray:
    """A host numpy copy of a tensor's bits (bfloat16 as ml_dtypes' bfloat16)."""
    if not isinstance(y, torch.Tensor):
        return np.asarray(y)
    y = y.detach().cpu().contiguous()
    if y.dtype == torch.bfloat16:
        from diag.numerics import as_dtype

        return y.view(torch.int16).numpy().view(as_dtype("bfloat16"))
    return y.numpy()


def _on(device: torch.device, arrays: list[np.ndarray], cache: dict) -> list[torch.Tensor]:
    """The weights on `device`, copied there once."""
    if device not in cache:
        cache[device] = [from_numpy(a).to(device) for a in arrays]
    return cache[device]


def matmul_chain(dtype: str) -> Callable:
    ws = weights(1, [(128, 128)] * 4, dtype)
    cache: dict[torch.device, list[torch.Tensor]] = {}

    @torch.no_grad()
    def chain(x):
        for w in _on(x.device, ws, cache):  # tanh keeps values in [-1, 1]: no bf16 overflow
            x = torch.tanh(x @ w)
        return x

    return chain


def softmax() -> Callable:
    @torch.no_grad()
    def fn(x):
        return torch.softmax(4.0 * x, dim=-1)

    return fn


def train_step(lr: float = 0.1) -> Callable:
    """One SGD step (autograd), float32: the new w1, w2 and the loss in one array."""
    ws = weights(2, [(32, 64), (64, 10)], "float32")
    cache: dict[torch.device, list[torch.Tensor]] = {}

    def step(x):
        w1, w2 = (w.clone().requires_grad_(True) for w in _on(x.device, ws, cache))
        with torch.enable_grad():
            labels = torch.argmax(x[:, : w2.shape[1]], dim=1)
            logits = torch.tanh(x @ w1) @ w2
            logp = torch.log_softmax(logits, dim=-1)
            loss = -logp.gather(1, labels[:, None]).mean()
            g1, g2 = torch.autograd.grad(loss, (w1, w2))
        with torch.no_grad():
            return torch.cat([(w1 - lr * g1).ravel(), (w2 - lr * g2).ravel(), loss[None]])

    return step
