"""PyTorch eager backend (cpu/cuda). Imported only inside a worker subprocess.

Defines the same op names as every backend and `diag.oracle`. Eager mode has no separate
compile step: `prepare` runs the op once as warm-up and reports that time as compile time.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from diag.backends.base import Prepared

FRAMEWORK = "torch"
_device = None

# numpy has no bfloat16; ml_dtypes' bfloat16 crosses over as its int16 bit pattern.
_BITS = {"bfloat16": (np.int16, torch.bfloat16)}

# diag's precision levels -> torch.set_float32_matmul_precision. 'default' leaves the
# process setting as it is (torch's own default is 'highest').
_PRECISION = {"default": None, "high": "high", "highest": "highest", "medium": "medium"}


def discover() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    return found


def setup(platform: str) -> dict:
    global _device
    _device = torch.device(platform)
    if platform == "cuda":
        kind = torch.cuda.get_device_name(_device)
    else:
        kind = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    return {
        "device": {"platform": platform, "kind": kind, "id": _device.index or 0,
                   "count": torch.cuda.device_count() if platform == "cuda" else 1},
        "framework": {"name": "torch", "version": torch.__version__},
        "settings": {
            # XLA reads these once, at start-up: what this worker's results were computed under.
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "cuda.matmul.allow_bf16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "cuda.matmul.allow_fp16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        },
    }


def put(x: np.ndarray):
    x = np.array(x)  # a private, writable copy (inputs arrive memory-mapped read-only)
    name = x.dtype.name
    if name in _BITS:
        np_bits, torch_dtype = _BITS[name]
        t = torch.from_numpy(x.view(np_bits)).view(torch_dtype)
    else:
        t = torch.from_numpy(x)
    return t.to(_device)


def get(x) -> np.ndarray:
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def block(x) -> None:
    if _device is not None and _device.type == "cuda":
        torch.cuda.synchronize(_device)


def prepare(fn, args):
    """Eager ops compile nothing: run once as warm-up and report that time."""
    t0 = time.perf_counter()
    out = fn(*args)
    block(out)
    warmup_s = time.perf_counter() - t0
    return Prepared(lambda: fn(*args), warmup_s, first=(out, warmup_s))


def matmul(precision: str = "default", precision_via: str = "none"):
    """`torch.matmul` under `torch.set_float32_matmul_precision(precision)`."""
    setting = _PRECISION[precision]

    def f(a, b):
        if setting is None:
            return torch.matmul(a, b)
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(setting)
        try:
            return torch.matmul(a, b)
        finally:
            torch.set_float32_matmul_precision(previous)

    return f


def softmax():
    """`torch.softmax` over the last axis, in the input dtype."""
    return lambda x: torch.softmax(x, dim=-1)


def gelu():
    """The tanh-approximate GELU written out op by op, as models write it (Hugging Face's
    `NewGELUActivation`, GPT-2's MLP), in the input dtype: eager torch rounds each op's result
    to it; a compiler (torch_xla) may keep the chain in float32. (torch's fused
    `F.gelu(approximate='tanh')` computes in float32 on CPU and, under torch_xla 2.9 on CPU,
    is unchanged by --xla_allow_excess_precision=false: measured.)"""
    k = math.sqrt(2.0 / math.pi)
    return lambda x: 0.5 * x * (1.0 + torch.tanh(k * (x + 0.044715 * torch.pow(x, 3.0))))


def top_k(k: int):
    """`torch.topk`: the k largest along the last axis (sorted), values and indices."""
    def f(x):
        values, indices = torch.topk(x, k, dim=-1)
        return {"values": values, "indices": indices}

    return f


def _sampler(x) -> dict:
    probs = torch.softmax(x, dim=-1)  # materialised, in x's dtype
    return {"argmax": torch.argmax(x, dim=-1),
            "argmax_softmax": torch.argmax(probs, dim=-1),
            "top_k": torch.topk(x, 1, dim=-1).indices[..., 0]}


def greedy_token(batches: tuple[int, ...] = ()):
    """The greedy token per row by every path an eager sampler may take (torch has no
    approx_max_k): `eager/*` on all rows, `eager/batchB/*` on batches of B rows, for each B in
    `batches` (`diag.probes.SAMPLER_BATCHES`)."""
    def paths(x):
        out = {f"eager/{name}": v for name, v in _sampler(x).items()}
        for b in batches:
            chunks = [_sampler(x[i:i + b]) for i in range(0, x.shape[0], b)]
            for name in chunks[0]:
                out[f"eager/batch{b}/{name}"] = torch.cat([c[name] for c in chunks])
        return out

    return paths


def train_step(lr: float = 0.1):
    """One SGD step (autograd), in the inputs' dtype: loss and updated weights. Functional:
    the inputs are not modified, so the step can be run again (timing, a NaN hunt)."""
    def step(x, w1, w2):
        w1g, w2g = (w.detach().clone().requires_grad_(True) for w in (w1, w2))
        labels = torch.argmax(x[:, :w2.shape[1]], dim=1)
        logits = torch.tanh(x @ w1g) @ w2g
        loss = torch.nn.functional.cross_entropy(logits, labels)
        g1, g2 = torch.autograd.grad(loss, (w1g, w2g))
        with torch.no_grad():
            return {"loss": loss.detach(), "w1": w1 - lr * g1, "w2": w2 - lr * g2}

    return step


def train(compute: str = "float32", **case):
    """N AdamW steps of a small transformer (`diag.train`; the math is in
    `diag.train.torch_model`): loss, every gradient and every parameter, per step."""
    from diag.train import torch_model

    return torch_model.op(compute, case, _device)
