"""PyTorch NaN hunter: one run under a dispatch mode that sees every aten op, forward and backward.

A `TorchDispatchMode` sits below autograd, so it sees the aten ops of the forward pass and the
ones autograd's engine runs for the backward pass (`torch.autograd.set_multithreading_enabled
(False)` keeps the engine on the calling thread, where the mode is active). An op runs during
the backward pass exactly when `torch._C._current_autograd_node()` is set; its forward line
comes from a tag diag puts on each autograd node as the forward pass creates it (or from
anomaly mode's traceback when the user turned that on; diag does not: it costs ~5x). Forward lines come from the Python stack at dispatch time, skipping torch's frames
and the hunt's own.

The function runs once, as the user would run it: a training step that updates parameters in
place is not repeated. Results that count ("sinks") are what the function returns, the
arguments it was given, the parameters and gradients of modules it was given or is bound to,
gradients autograd accumulated, and tensors written in place (an optimizer's update).
"""

from __future__ import annotations

import math
import os
import re
import sys
import sysconfig
import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diag.nan import NanHuntError, NanReport
from diag.nan._summary import first_bad_index, summarize, values_at

# torch's frames and the hunt's own; diag's probe ops (diag/backends) are the code being hunted
# when the training-step probe calls the hunt, so they count as the user's.
_SKIP_DIRS = (os.path.normcase(os.path.dirname(torch.__file__)) + os.sep,
              os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"]) + os.sep
_TB_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


_USER_FILE: dict[str, bool] = {}


def _user_file(path: str) -> bool:
    r = _USER_FILE.get(path)
    if r is None:
        p = os.path.normcase(os.path.abspath(path))
        r = _USER_FILE[path] = not (p.startswith(_SKIP_DIRS) or p.startswith(_STDLIB)
                                    or path.startswith("<"))
    return r


def _source_from_stack() -> tuple[str, int, str]:
    f = sys._getframe(1)
    while f is not None:
        if _user_file(f.f_code.co_filename):
            return f.f_code.co_filename, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return "", 0, ""


class _Lines(TorchFunctionMode):
    """Tags each autograd node made by a torch call with the user line that made it.

    Runs above autograd, where a call's outputs already have their `grad_fn`. Nodes a call
    made without returning them (inside a composite op, a custom Function's) are reached
    through `next_functions` and get the same line; tagging stops at nodes already tagged.
    """

    def __init__(self, key: object):
        super().__init__()
        self.key = key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = None
        for t in _flat(out, []):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            stack = [node] if node is not None else []
            while stack:
                n = stack.pop()
                if n is None or type(n).__name__ == "AccumulateGrad":
                    continue
                md = n.metadata
                if md.get("diag_src", (None,))[0] is self.key:
                    continue
                if src is None:
                    src = _source_from_stack()
                md["diag_src"] = (self.key, src)
                stack.extend(fn for fn, _ in n.next_functions)
        return out


def _source_from_node(node, key: object) -> tuple[str, int, str]:
    """The forward line of an autograd node: our tag, else anomaly mode's traceback if the
    user turned it on."""
    try:
        md = node.metadata
    except Exception:  # noqa: BLE001 - nodes without metadata
        return "", 0, ""
    tag = md.get("diag_src")
    if tag is not None and tag[0] is key:
        return tag[1]
    tb = md.get("traceback_")
    for entry in reversed(tb or []):
        m = _TB_LINE.search(entry)
        if m and _user_file(m["file"]):
            return m["file"], int(m["line"]), m["func"]
    return "", 0, ""


def _flat(x: Any, out: list) -> list:
    """Tensors and Python floats in an aten call's arguments (lists, tuples, dicts); torch's
    pytree is general but costs more than the op itself for small tensors."""
    if isinstance(x, (torch.Tensor, float)):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _flat(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flat(y, out)
    return out


def _is_float(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta
            and (t.is_floating_point() or t.is_complex()) and t.numel() > 0)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)


def _flags(t: torch.Tensor) -> tuple[bool, bool]:
    """(has NaN, has Inf), checked once per op output, so it must be cheap.

    On CPU numpy reads the buffer in place, single-threaded: torch's own reductions start a
    parallel region per call, which costs milliseconds on a busy machine. Elsewhere a sum is
    finite only if every element is; an overflowing sum just costs the exact check.
    """
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES:
        try:
            a = t.detach().numpy()
        except RuntimeError:  # a lazy conj/neg view
            a = t.detach().resolve_conj().resolve_neg().numpy()
        if np.isfinite(a).all():
            return False, False
        return bool(np.isnan(a).any()), bool(np.isinf(a).any())
    total = t.sum().item()
    if math.isfinite(abs(total)):
        return False, False
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def _host(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().resolve_conj().numpy().copy()
    return np.asarray(t)


class _Birth:
    __slots__ = ("op", "kind", "phase", "src", "path", "ins", "out", "note")

    def __init__(self, op, kind, phase, src, path, ins, out, note):
        self.op, self.kind, self.phase, self.src, self.path = op, kind, phase, src, path
        self.ins, self.out, self.note = ins, out, note


class _Hunter(TorchDispatchMode):
    """Judges every aten op's outputs; records births and the birth each bad tensor is from."""

    def __init__(self, key: object):
        super().__init__()
        self.key = key
        self.births: list[_Birth] = []
        self._taint: dict[int, tuple[weakref.ref, int]] = {}
        self.written: dict[int, weakref.ref] = {}  # by id: an optimizer writes each often
        self.grads: list[weakref.ref] = []
        self.modules: list[str] = []

    def taint_of(self, t: torch.Tensor) -> int | None:
        got = self._taint.get(id(t))
        if got is not None and got[0]() is t:
            return got[1]
        return None

    def _set_taint(self, t: torch.Tensor, taint: int | None) -> None:
        if taint is None:
            self._taint.pop(id(t), None)
        else:
            self._taint[id(t)] = (weakref.ref(t), taint)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mutable = func._schema.is_mutable
        flat_in = _flat(kwargs, _flat(args, []))
        pre = ({id(t): _flags(t) for t in flat_in if _is_float(t)} if mutable else None)
        out = func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        outs = [t for t in _flat(out, []) if _is_float(t)]
        if mutable:
            for t in outs:
                self.written[id(t)] = weakref.ref(t)
        if node is not None and type(node).__name__ == "AccumulateGrad":
            self.grads.extend(weakref.ref(t) for t in outs)
        if not outs:
            return out
        out_flags = [_flags(t) for t in outs]
        if not any(n or i for n, i in out_flags):
            for t in outs:
                self._set_taint(t, None)  # overwritten in place with finite values
            return out
        ins = [x for x in flat_in if _is_float(x)]
        in_flags = [pre[id(t)] if pre is not None and id(t) in pre else _flags(t) for t in ins]
        in_flags += [(x != x, x in (float("inf"), float("-inf")))
                     for x in flat_in if isinstance(x, float)]
        in_nan = any(n for n, _ in in_flags)
        in_bad = any(n or i for n, i in in_flags)
        out_nan = any(n for n, _ in out_flags)
        out_inf = any(i for _, i in out_flags)
        inherited = [self.taint_of(t) for t, (n, i) in zip(ins, in_flags) if n or i]
        inherited = [x for x in inherited if x is not None]
        taint = min(inherited) if inherited else None
        if (out_nan and not in_nan) or (out_inf and not in_bad):
            self._record(func, node, flat_in, outs, out_flags, mutable,
                         "NaN" if out_nan and not in_nan else "Inf")
            if taint is None:
                taint = len(self.births) - 1
        for t, (n, i) in zip(outs, out_flags):
            self._set_taint(t, taint if (n or i) else None)
        return out

    def _record(self, func, node, flat_in, outs, out_flags, mutable, kind) -> None:
        if node is None:
            src, phase = _source_from_stack(), "forward"
            path = "/".join(self.modules)
        else:
            src, phase = _source_from_node(node, self.key), "backward"
            path = type(node).__name__
        ins = [_host(x) for x in flat_in
               if (isinstance(x, torch.Tensor) and x.numel() > 0) or
               isinstance(x, float)]
        bad = next(t for t, (n, i) in zip(outs, out_flags) if n or i)
        note = ("the op writes its input in place: input summaries show it after the op"
                if mutable else "")
        if node is not None:
            file, line, fn = _source_from_stack()
            if file:  # a custom autograd.Function's own backward code
                note = f"run by backward code at {os.path.basename(file)}:{line} ({fn}). {note}"
        note = note.strip()
        self.births.append(_Birth(_op_name(func), kind, phase, src, path, ins, _host(bad),
                                  note))


def _op_name(func) -> str:
    """``aten.sqrt`` for aten::sqrt.default; the overload is kept only when not ``default``."""
    name = str(func)  # e.g. aten.div.Tensor
    parts = name.split(".")
    if len(parts) == 3 and parts[2] == "default":
        return ".".join(parts[:2])
    return name


def _report(b: _Birth, n_births: int) -> NanReport:
    file, line, func = b.src
    src = f"{os.path.basename(file)}:{line} ({func})" if file else ""
    idx = first_bad_index(b.out, b.kind)
    return NanReport(
        framework="torch", primitive=b.op, kind=b.kind, source=src, path=b.path, phase=b.phase,
        inputs=tuple(summarize(a) for a in b.ins), output=summarize(b.out), file=file,
        line=line, function=func, bad_index=idx,
        inputs_at_index=values_at(b.ins, b.out.shape, idx), births=n_births, note=b.note)


def _modules_of(fn: Callable, args: tuple, kwargs: dict) -> list[torch.nn.Module]:
    found = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.nn.Module)]
    for cand in (fn, getattr(fn, "__self__", None)):
        if isinstance(cand, torch.nn.Module):
            found.append(cand)
    return found


def _sinks(result: Any, fn: Callable, args: tuple, kwargs: dict, hunter: _Hunter):
    """Every tensor the function's effect is visible in, with where it is, weakest name last."""
    named: list[tuple[str, torch.Tensor]] = []
    named += [("result", t) for t in tree_leaves(result) if _is_float(t)]
    for t in tree_leaves((args, kwargs)):
        if _is_float(t):
            named.append(("argument", t))
            if t.grad is not None:
                named.append(("argument gradient", t.grad))
    for m in _modules_of(fn, args, kwargs):
        for pname, p in m.named_parameters():
            named.append((f"parameter {pname}", p))
            if p.grad is not None:
                named.append((f"gradient of {pname}", p.grad))
    named += [("accumulated gradient", r()) for r in hunter.grads if r() is not None]
    named += [("tensor written in place", r()) for r in hunter.written.values()
              if r() is not None]
    return named


def locate(fn: Callable, args: tuple, kwargs: dict) -> NanReport | None:
    """See `diag.nan.locate`."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    hunter = _Hunter(key=object())

    def enter(module, inputs):
        hunter.modules.append(type(module).__name__)

    def leave(module, inputs, output):
        if hunter.modules:
            hunter.modules.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        with torch.autograd.set_multithreading_enabled(False), _Lines(hunter.key), hunter:
            result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise NanHuntError(f"{name} raised {type(e).__name__}: {e}") from e
    finally:
        for h in hooks:
            h.remove()
    bad = []
    for where, t in _sinks(result, fn, args, kwargs, hunter):
        nan, inf = _flags(t)
        if nan or inf:
            bad.append((where, t, "NaN" if nan else "Inf"))
    if not bad:
        return None
    roots = [hunter.taint_of(t) for _, t, _ in bad]
    roots = [r for r in roots if r is not None]
    if roots:
        return _report(hunter.births[min(roots)], len(hunter.births))
    if hunter.births:
        rep = _report(hunter.births[0], len(hunter.births))
        return NanReport(**{**rep.__dict__, "note": (
            f"{bad[0][0]} holds {bad[0][2]}; it could not be traced to one op (a view written "
            f"in place?), so this is the first op that produced one")})
    where, t, kind = bad[0]
    return NanReport(framework="torch", primitive="input", kind=kind, source="", path=where,
                     phase="input", inputs=(), output=summarize(_host(t)), births=0,
                     note=f"no op produced it: {where} already held {kind}")

