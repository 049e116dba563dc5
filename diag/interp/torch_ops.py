"""The aten-level helpers of the PyTorch hunt: tensor checks, and what an op is and writes.

Which tensors an op's arguments hold and whether they are finite (cheaply: it runs per op), and
per op schema what it writes, whether it is a view, a fill or a copy, and whether it is
elementwise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def flat_args(x: Any, out: list) -> list:
    """Tensors and Python floats in an aten call's arguments (lists, tuples, dicts); torch's
    pytree is general but costs more than the op itself for small tensors (and so would a call
    per argument: the leaves of a list are taken in its loop)."""
    if isinstance(x, _LEAF):
        out.append(x)
        return out
    if isinstance(x, dict):
        x = x.values()
    elif not isinstance(x, (list, tuple)):
        return out
    for y in x:
        if isinstance(y, _LEAF):
            out.append(y)
        elif isinstance(y, _NESTED):
            flat_args(y, out)
    return out


_LEAF = (torch.Tensor, float)
_NESTED = (list, tuple, dict)


_FLOAT_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.complex32,
    }
    | {
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    }
)
_STRIDED = torch.strided


def is_float(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in _FLOAT_DTYPES
        and t.layout is _STRIDED
        and not t.is_meta
        and t.numel() > 0
    )


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)
_DOT_DTYPES = (torch.float32, torch.float64)


def tensor_flags(t: torch.Tensor) -> tuple[bool, bool]:
    """(has NaN, has Inf), checked once per op output, so it must be cheap.

    On CPU numpy reads the buffer in place, single-threaded: torch's own reductions start a
    parallel region per call, which costs milliseconds on a busy machine. A contiguous float
    buffer is screened with one BLAS dot product (x . x is finite only if every element is;
    one that overflows just costs the exact check); elsewhere a sum screens the same way.
    """
    dtype = t.dtype
    if dtype in _NUMPY_DTYPES and t.is_cpu:
        try:
            a = t.detach().numpy() if t.requires_grad else t.numpy()
        except RuntimeError:  # a lazy conj/neg view
            a = t.detach().resolve_conj().resolve_neg().numpy()
        if dtype in _DOT_DTYPES and a.flags.c_contiguous:
            v = a.reshape(-1)
            if math.isfinite(np.dot(v, v)):
                return False, False
        elif np.isfinite(a).all():
            return False, False
        return bool(np.isnan(a).any()), bool(np.isinf(a).any())
    total = t.sum().item()
    if math.isfinite(abs(total)):
        return False, False
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def all_finite(tensors: list) -> bool:
    """Whether every tensor in a list is finite, screened with one `_foreach_norm` (one
    kernel per list instead of one check per tensor); a norm that overflows, or a list the
    screen cannot take, falls back to checking each tensor."""
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            if math.isfinite(torch.stack(torch._foreach_norm(tensors)).sum().item()):
                return True
    except (RuntimeError, TypeError):  # mixed devices, complex, an unsupported dtype
        pass
    return not any(n or i for n, i in map(tensor_flags, tensors))


def host_copy(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().resolve_conj().numpy().copy()
    return np.asarray(t)


# Ops whose outputs need no check: "fill" makes finite values by construction (zeros, ones),
# "copy" copies its first input (finite when that is known finite), "garbage" returns
# uninitialised memory that is only ever overwritten (judging it would invent births).
_FILL = {
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "new_zeros",
    "new_ones",
    "arange",
    "eye",
    "zero",
    "randn",
    "rand",
    "randn_like",
    "rand_like",
    "normal",
    "uniform",
    "bernoulli",
    "randint",
    "randint_like",
    "randperm",
}
_COPY = {
    "clone",
    "_unsafe_view",
    "contiguous",
    "_to_copy",
    "_reshape_alias",
    "alias_copy",
    "view_copy",
    "t_copy",
    "transpose_copy",
    "permute_copy",
    "expand_copy",
}
_GARBAGE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
OP_KIND: dict[Any, str] = {}


def op_kind(func) -> str:
    name = func._schema.name.split("::", 1)[-1]
    if name in _FILL:
        return "fill"
    if name in _COPY:
        return "copy"
    if name in _GARBAGE:
        return "garbage"
    return "judge"


_WRITES: dict[Any, tuple] = {}
VIEW = ((-1, "view", False),)  # marks an op whose one output is a view of its first input


def written_args(func) -> tuple:
    """(position, name, is_list) of every argument the op writes, per its schema
    (``Tensor(a!)``, ``Tensor(a!)[]``, ``out=``); `VIEW` for a pure view op; cached per op."""
    got = _WRITES.get(func)
    if got is None:
        schema = func._schema
        got = tuple(
            (k, a.name, str(a.type).startswith("List"))
            for k, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        rets = schema.returns
        if (
            not got
            and len(rets) == 1
            and rets[0].alias_info is not None
            and not rets[0].alias_info.is_write
            and str(rets[0].type) == "Tensor"
            and schema.arguments
            and schema.arguments[0].alias_info is not None
        ):
            got = VIEW
        _WRITES[func] = got
    return got


def _arg(k: int, name: str, args: tuple, kwargs: dict):
    return args[k] if k < len(args) else kwargs.get(name)


def written_tensors(writes: tuple, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes, one group per written argument (a list argument is a list)."""
    groups = []
    for k, name, is_list in writes:
        x = _arg(k, name, args, kwargs)
        if x is None:
            continue
        groups.append([t for t in x if isinstance(t, torch.Tensor)] if is_list else (x,))
    return groups


_LIST_ARGS: dict[Any, tuple] = {}


def list_arguments(func, args: tuple, kwargs: dict) -> list[list]:
    pos = _LIST_ARGS.get(func)
    if pos is None:
        pos = _LIST_ARGS[func] = tuple(
            (k, a.name)
            for k, a in enumerate(func._schema.arguments)
            if str(a.type).startswith(("List[Tensor]", "List[Optional[Tensor]]"))
        )
    out = []
    for k, name in pos:
        x = _arg(k, name, args, kwargs)
        if x:
            out.append(list(x))
    return out


def per_index(func, args, kwargs, lists) -> bool:
    lens = {len(x) for x in list_arguments(func, args, kwargs)}
    return len(lens) == 1 and all(len(g) == next(iter(lens)) for g in lists)


def flat_nonlist(args: tuple, kwargs: dict) -> list:
    """The tensors and floats of an op's arguments that are not inside a list argument."""
    out = []
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, (torch.Tensor, float)):
            out.append(x)
    return out


def op_name(func) -> str:
    """``aten.sqrt`` for aten::sqrt.default; the overload is kept only when not ``default``."""
    name = str(func)  # e.g. aten.div.Tensor
    parts = name.split(".")
    if len(parts) == 3 and parts[2] == "default":
        return ".".join(parts[:2])
    return name
