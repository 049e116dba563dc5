"""Whether an elementwise op fed some non-finite elements still gave birth elsewhere.

A masked attention adds a -inf mask: the sum holds -inf where the mask does, which is no
birth; an x / 0 on the finite elements of the same op would be one. The PyTorch hunt then
compares the op's output element by element with the union of its inputs' non-finite
elements (broadcast to the output's shape).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from diag.interp.torch_ops import is_float

__all__ = ["pointwise_birth"]

_HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)


def _host_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's buffer (no copy), None where numpy cannot hold it."""
    if t.dtype not in _HOST_DTYPES or not t.is_cpu:
        return None
    t = t.detach()
    try:
        return t.numpy()
    except RuntimeError:  # a lazy conj/neg view
        return t.resolve_conj().resolve_neg().numpy()


def pointwise_birth(flat_in: list, outs: list) -> str | None:
    """``NaN`` when an elementwise op's output holds a NaN where no input does, ``Inf`` when it
    holds an Inf where every input is finite, else None (each non-finite element came in).

    On CPU the masks are numpy arrays (single-threaded, no parallel region per call: ~10x
    cheaper than torch's for the small tensors of a masked attention)."""
    ins = [
        x if isinstance(x, float) else _host_view(x)
        for x in flat_in
        if isinstance(x, float) or is_float(x)
    ]
    host_outs = [_host_view(t) for t in outs]
    if all(x is not None for x in ins) and all(a is not None for a in host_outs):
        return _pointwise_birth_host(ins, host_outs)  # type: ignore[arg-type]
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            shape = outs[0].shape
            in_nan = torch.zeros(shape, dtype=torch.bool, device=outs[0].device)
            in_bad = in_nan.clone()
            for x in flat_in:
                if isinstance(x, float):
                    in_nan |= x != x
                    in_bad |= not math.isfinite(x)
                elif is_float(x):
                    in_nan |= torch.isnan(x).broadcast_to(shape)
                    in_bad |= ~torch.isfinite(x).broadcast_to(shape)
            for t in outs:
                if t.shape != shape:
                    return None
                if bool((torch.isnan(t) & ~in_nan).any()):
                    return "NaN"
            for t in outs:
                if bool((torch.isinf(t) & ~in_bad).any()):
                    return "Inf"
    except RuntimeError:  # inputs that do not broadcast to the output: not elementwise here
        return None
    return None


def _pointwise_birth_host(ins: list, outs: list[np.ndarray]) -> str | None:
    """`pointwise_birth` on numpy views (floats and arrays in `ins`)."""
    shape = outs[0].shape
    in_nan = np.zeros(shape, bool)
    in_bad = np.zeros(shape, bool)
    try:
        for x in ins:
            if isinstance(x, float):
                in_nan |= x != x
                in_bad |= not math.isfinite(x)
            else:
                in_nan |= np.isnan(x)
                in_bad |= ~np.isfinite(x)
    except ValueError:  # inputs that do not broadcast to the output: not elementwise here
        return None
    for a in outs:
        if a.shape != shape:
            return None
        if (np.isnan(a) & ~in_nan).any():
            return "NaN"
    for a in outs:
        if (np.isinf(a) & ~in_bad).any():
            return "Inf"
    return None
