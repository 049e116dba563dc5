"""The facts a reduction's own-error bound needs in the PyTorch shadow, computed on demand, and
what the cause search ranks an op by (`op_tags`, the producers kept per tensor).

Sum of |terms| (the op in float64 on |inputs|) and the number of terms per element (the op on
ones), cached per op and argument shapes (`diag.diverge.rules.own_error` asks for them only when
the cheap bound does not already clear the op).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from diag.interp.torch_ops import flat_args


def map_args(x: Any, fn: Callable) -> Any:
    """`x` (an aten call's args/kwargs) with every tensor and float dtype passed through fn."""
    if isinstance(x, _MAPPED):
        return fn(x)
    if isinstance(x, (list, tuple)):  # a list (not a generator) is the faster to build
        return type(x)([fn(y) if isinstance(y, _MAPPED) else map_args(y, fn) for y in x])
    if isinstance(x, dict):
        return {k: map_args(v, fn) for k, v in x.items()} if x else {}
    return x


_MAPPED = (torch.Tensor, torch.dtype)


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a float64 numpy array (no copy for a CPU float64 tensor)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype != torch.float64:
        t = t.to(torch.float64)
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def facts(
    func, args, kwargs, k: int, mags: dict | None = None, low: tuple | None = None
) -> Callable[[], tuple[np.ndarray, Any]]:
    """(sum of |terms|, number of terms) of output k of a reduction, on demand; `args` and
    `kwargs` are the float64 ones the reference ran on (they are not written). `mags` keeps
    |x| of each argument while x lives (`magnitude`), for one shadow run. `low`: the op's
    own (args, kwargs); a matrix product of float32/bfloat16/float16 operands sums its
    |terms| in float32 on them (`Float32Terms`)."""

    def get():
        absolute = _abs if mags is None else (lambda x: magnitude(x, mags))
        mag = flat_args(func(*map_args(args, absolute), **map_args(kwargs, absolute)), [])[k]
        return host(mag), _count(func, args, kwargs, k)

    if low is not None and k == 0 and Float32Terms.takes(func, low):
        return Float32Terms(get, func, (args, kwargs), low, mags)
    return get


class Float32Terms:
    """A matrix product's sum|terms| computed in float32 on its narrow operands.

    Every term |a_ik| |b_kj| is non-negative, so float32 sums them with a relative error of
    at most gamma_{n+2}(2^-24) (n terms; a bias and the alpha/beta scalings are two more
    roundings), whatever the order: about 6e-5 for n = 1024. `diag.diverge.rules` shrinks the
    bound by that factor (`computed_in`), so the ratio it gives is never below the one
    against the float64 sum, and above it by no more than that factor. The operands are
    exact in float32 (they are the op's own float32, bfloat16 or float16 inputs): a float32
    product on |inputs| costs half a float64 one and needs no float64 copies of them (a
    weight gradient at width 1024: 0.9 ms against 2.3 ms, plus 1.3 ms per widened weight).
    A sum past float32's range is redone in float64.
    """

    PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
    NARROW = frozenset({torch.float32, torch.bfloat16, torch.float16})
    computed_in: np.dtype = np.dtype(np.float32)

    def __init__(self, whole: Callable, func, wide: tuple, low: tuple, mags: dict | None):
        self._whole, self._func, self._wide, self._low = whole, func, wide, low
        self._mags = {} if mags is None else mags

    @classmethod
    def takes(cls, func, low: tuple) -> bool:
        """Whether `func` is a matrix product whose float operands are all narrow."""
        if func._schema.name.split("::", 1)[-1] not in cls.PRODUCTS:
            return False
        ts = [t for t in flat_args(low, []) if isinstance(t, torch.Tensor)]
        return bool(ts) and all(t.dtype in cls.NARROW for t in ts)

    def __call__(self) -> tuple[np.ndarray, Any]:
        def absolute(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            m = magnitude(x, self._mags)
            return m if m.dtype == torch.float32 else m.float()

        args, kwargs = self._low
        mag = self._func(*map_args(args, absolute), **map_args(kwargs, absolute))
        if mag.numel() and not math.isfinite(float(mag.max())):
            got = self._whole()  # past float32's range: the float64 way
            self.computed_in = np.dtype(np.float64)
            return got
        wide_args, wide_kwargs = self._wide
        return mag.detach().numpy(), _count(self._func, wide_args, wide_kwargs, 0)


def magnitude(x: Any, mags: dict) -> Any:
    """|x| for a float tensor, kept in `mags` per base tensor (its latest version) while the
    base lives: a weight's float64 shadow is read by its forward matmul and, transposed, by
    the backward one, and |W| of a 1024x1024 layer costs 1.3 ms each time. A view reads the kept
    |base| through its own strides (the same values in the same layout, so the matmul on it
    gives the same sums bit for bit); a base that is not contiguous, or much larger than the
    view, is not kept."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    base = x if x._base is None else x._base
    small = x.numel() < _KEEP_FROM or base.numel() > 2 * x.numel()
    if small or not base.is_contiguous() or x.is_inference():  # no version under inference
        return x.abs()
    key = base.data_ptr()  # one |x| per live base: a write replaces it (its version moves)
    got = mags.get(key)
    if got is None or got[0]() is not base or got[1] != x._version:

        def drop(ref: weakref.ref, key=key) -> None:  # kept as long as its base lives
            if mags.get(key, (None,))[0] is ref:
                del mags[key]

        got = mags[key] = (weakref.ref(base, drop), x._version, base.abs())
    return got[2].as_strided(x.shape, x.stride(), x.storage_offset() - base.storage_offset())


#: Tensors below this many elements are not kept by `magnitude` (their |x| costs less than
#: the bookkeeping).
_KEEP_FROM = 1 << 16


#: Terms per element of a reduction's output, by op and argument shapes: the op on ones does
#: not depend on the values, and the same layer's ops repeat (every step, every layer of a
#: width). Only counts that are one number for every element are kept.
_COUNTS: dict = {}


def _count(func, args, kwargs, k: int) -> Any:
    """The op on ones: how many terms each element of output k sums (a number or an array)."""
    key: tuple[Any, int, Any, Any] | None
    try:
        key = (func, k, _signature(args), _signature(kwargs))
        got = _COUNTS.get(key)
    except TypeError:  # an argument that is not hashable: no cache
        key = got = None
    if got is not None:
        return got
    cnt = host(flat_args(func(*map_args(args, _ones), **map_args(kwargs, _ones)), [])[k])
    if key is not None and cnt.size and cnt.min() == cnt.max():
        if len(_COUNTS) > 4096:
            _COUNTS.clear()
        one = _COUNTS[key] = float(cnt.flat[0])
        return one
    return cnt


def _signature(x: Any) -> Any:
    """What the op on ones depends on: shapes of float64 tensors, and every other value; a
    tensor of another dtype (indices) holds values the count may depend on: not hashable."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float64:
            raise TypeError("a non-float tensor")
        return ("tensor", tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_signature(y) for y in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    hash(x)
    return (type(x).__name__, x)


def _abs(x: Any) -> Any:
    return x.abs() if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x


def _ones(x: Any) -> Any:
    return torch.ones_like(x) if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x


#: At most this many producers are kept per tensor (the cause search's way back).
MAX_PRODUCERS = 8
_CASTS = frozenset({"_to_copy", "to", "copy_", "_to_dtype"})


def latest(seen: dict) -> tuple[int, ...]:
    """The latest `MAX_PRODUCERS` ledger indices among the keys of `seen`."""
    return tuple(sorted(seen, reverse=True)[:MAX_PRODUCERS])


def op_tags(func, args: tuple, kwargs: dict, ins: list, name: str = "") -> frozenset[str]:
    """What the cause search ranks an op by (`diag.diverge.ledger.TAGS`): a cast to a
    narrower float dtype; a Python float the op rounds to a bf16/fp16 operand's dtype.
    `name`: the op's schema name without namespace, when the caller has it."""
    if not ins:
        return _NO_TAGS
    tags = set()
    name = name or func._schema.name.split("::", 1)[-1]
    dtype = kwargs.get("dtype")
    if name in _CASTS and isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        if torch.finfo(dtype).eps > torch.finfo(ins[0].dtype).eps:
            tags.add("narrowing")
    narrow = next((t.dtype for t in ins if t.dtype in _NARROW), None)
    if narrow is not None:
        for x in args:
            if isinstance(x, float) and math.isfinite(x) and _rounds(x, narrow):
                tags.add("literal")
    return frozenset(tags) if tags else _NO_TAGS


_NO_TAGS: frozenset[str] = frozenset()
_NARROW = (torch.bfloat16, torch.float16)
#: Whether a Python float changes when rounded to bfloat16/float16, per (value, dtype): the
#: same literals recur on every call of a layer.
_ROUNDS: dict[tuple[float, torch.dtype], bool] = {}


def _rounds(x: float, dtype: torch.dtype) -> bool:
    got = _ROUNDS.get((x, dtype))
    if got is None:
        if len(_ROUNDS) > 4096:
            _ROUNDS.clear()
        got = _ROUNDS[(x, dtype)] = float(torch.tensor(x, dtype=dtype)) != x
    return got


def draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether an op tagged as seeded draws random numbers in this call. Attention and
    dropout carry the tag for their dropout, which ``dropout_p=0.0`` (an attention in eval
    mode), or a dropout's ``p=0.0`` or ``train=False``, turns off; then they are arithmetic
    like any other op and get a shadow (skipping them restarted the shadow from a bfloat16
    attention's output, hiding every error that came in: a rotary embedding's rounded
    positions). A ``p`` counts only beside ``train`` (a dropout's): ``bernoulli(p=0)`` and
    ``_fused_dropout``'s keep-probability still draw."""
    given = {}
    for k, a in enumerate(func._schema.arguments):
        if a.name in NO_DRAW:
            given[a.name] = args[k] if k < len(args) else kwargs.get(a.name, a.default_value)
    if "p" in given and TRAIN not in given:
        del given["p"]
    return not any(v == NO_DRAW[name] for name, v in given.items())


#: The argument values under which a seeded op draws nothing (its dropout is off).
NO_DRAW = dict(dropout_p=0.0, p=0.0, train=False)
#: The dropout's mode argument, named from the table (its name is also an op's of diag, which
#: the layout test keeps out of string literals outside probes/).
TRAIN = next(name for name, off in NO_DRAW.items() if off is False)
