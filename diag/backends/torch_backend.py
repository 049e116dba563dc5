"""PyTorch eager backend (cpu/cuda). Imported only inside a worker subprocess.

What is the backend's own: the devices, moving arrays (bf16 by its bits), waiting, the
matmul precision knob (`precision_scope`). The ops are each op module's `on_torch`
(`diag.plan.registry`). Eager mode has no separate compile step: `prepare` runs the op once as
warm-up and reports that time as compile time.
"""

from __future__ import annotations

import contextlib
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
    cuda_matmul = torch.backends.cuda.matmul
    return {
        "device": {
            "platform": platform,
            "kind": kind,
            "id": _device.index or 0,
            "count": torch.cuda.device_count() if platform == "cuda" else 1,
        },
        "framework": {"name": "torch", "version": torch.__version__},
        "settings": {
            # XLA reads these once, at start-up: what this worker's results were computed under.
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "cuda.matmul.allow_bf16_reduced_precision_reduction": (
                cuda_matmul.allow_bf16_reduced_precision_reduction
            ),
            "cuda.matmul.allow_fp16_reduced_precision_reduction": (
                cuda_matmul.allow_fp16_reduced_precision_reduction
            ),
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


def device():
    """The device `setup` opened (an op that places arrays itself, e.g. a training run)."""
    return _device


def use_device(device) -> None:
    """Run on `device` (torch_xla's lazy device: `diag.backends.torch_xla_backend`)."""
    global _device
    _device = device


@contextlib.contextmanager
def precision_scope(precision: str):
    """`torch.set_float32_matmul_precision(precision)` while the block runs, then the
    previous setting; 'default' touches nothing."""
    setting = _PRECISION[precision]
    if setting is None:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
