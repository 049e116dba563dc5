"""PyTorch NaN hunter: one run under a dispatch mode that sees every aten op, forward and backward.

A `TorchDispatchMode` sits below autograd, so it sees the aten ops of the forward pass and the
ones autograd's engine runs for the backward pass (`torch.autograd.set_multithreading_enabled
(False)` keeps the engine on the calling thread, where the mode is active). An op runs during
the backward pass exactly when `torch._C._current_autograd_node()` is set; its forward line
comes from a tag diag puts on each autograd node as the forward pass creates it (or from
anomaly mode's traceback when the user turned that on; diag does not: it costs ~5x). Forward
lines come from the Python stack at dispatch time, skipping torch's frames and the hunt's own.

The function runs once, as the user would run it: a training step that updates parameters in
place is not repeated. Results that count ("sinks") are what the function returns, the
gradients autograd accumulated, and every tensor an op writes per its schema (an optimizer's
update, `_foreach_*_` and fused multi-tensor ops included). What it was given and left alone
is not a result: a -inf attention mask is a fact shown with the report, not a finding.
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
        if not torch.is_grad_enabled():  # no node is made (an optimizer's update)
            return out
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


_FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.complex64, torch.complex128, torch.complex32}
                          | {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                          "float8_e4m3fnuz", "float8_e5m2fnuz")
                             if hasattr(torch, n)})
_STRIDED = torch.strided


def _is_float(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype in _FLOAT_DTYPES and t.layout is _STRIDED
            and not t.is_meta and t.numel() > 0)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)
_DOT_DTYPES = (torch.float32, torch.float64)


def _flags(t: torch.Tensor) -> tuple[bool, bool]:
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


def _all_finite(tensors: list) -> bool:
    """Whether every tensor in a list is finite, screened with one `_foreach_norm` (one
    kernel per list instead of one check per tensor); a norm that overflows, or a list the
    screen cannot take, falls back to checking each tensor."""
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            if math.isfinite(torch.stack(torch._foreach_norm(tensors)).sum().item()):
                return True
    except (RuntimeError, TypeError):  # mixed devices, complex, an unsupported dtype
        pass
    return not any(n or i for n, i in map(_flags, tensors))


def _host(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().resolve_conj().numpy().copy()
    return np.asarray(t)


class _Birth:
    __slots__ = ("op", "kind", "phase", "src", "path", "ins", "out", "note", "pointwise")

    def __init__(self, op, kind, phase, src, path, ins, out, note, pointwise):
        self.op, self.kind, self.phase, self.src, self.path = op, kind, phase, src, path
        self.ins, self.out, self.note, self.pointwise = ins, out, note, pointwise


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
        self._known: dict[int, tuple[weakref.ref, tuple[int, ...], tuple[bool, bool]]] = {}
        # (birth its bad inputs descend from, whether it had bad inputs, what happened) for
        # the first op that raised.
        self.raised: tuple[int | None, bool, str] | None = None

    def flags(self, t: torch.Tensor) -> tuple[bool, bool]:
        """`_flags`, remembered per tensor until its version counter moves: torch bumps it on
        every in-place write, through any view, so a remembered answer is never stale."""
        got = self._known.get(id(t))
        if got is not None and got[0]() is t and t._version in got[1]:
            return got[2]
        f = _flags(t)
        self._known[id(t)] = (weakref.ref(t), (t._version,), f)
        return f

    def flags_written(self, t: torch.Tensor) -> tuple[bool, bool]:
        """Flags of a tensor an op just wrote. The mode runs below autograd's
        ADInplaceOrView kernel, which bumps the version after the op returns (multi-tensor
        `_foreach_*_` ops do not bump it at all): the answer holds for the version the tensor
        has now and the one it is about to have, until the next write, which the mode sees."""
        f = _flags(t)
        v = t._version
        self._known[id(t)] = (weakref.ref(t), (v, v + 1), f)
        return f

    def _finite_copy(self, args: tuple, outs: list) -> bool:
        """A copy of a tensor known finite is finite (same dtype: a narrowing cast can
        overflow)."""
        src = args[0] if args else None
        if not isinstance(src, torch.Tensor) or any(t.dtype != src.dtype for t in outs):
            return False
        got = self._known.get(id(src))
        return (got is not None and got[0]() is src and src._version in got[1]
                and got[2] == (False, False))

    def _all_finite_written(self, lists: list[list]) -> bool:
        """The fast path of a multi-tensor update: every tensor it wrote is finite (the
        common case) is settled with one screen each and no per-index bookkeeping."""
        written = [t for g in lists for t in g if _is_float(t)]
        if not _all_finite(written):
            return False
        for t in written:
            v = t._version
            self._known[id(t)] = (weakref.ref(t), (v, v + 1), (False, False))
            self._taint.pop(id(t), None)
        return True

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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in `torch._disable_dynamo`, which imports
        # torch._dynamo (and sympy: ~1.2 s) on the first op and costs a frame switch on every
        # op. The hunt does not run under torch.compile (its regions are opaque to it anyway).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = _writes(func)
        if writes is _VIEW:
            # A view holds its input's values: it cannot give birth, and carries the birth
            # of what it views. No check needed.
            out = func(*args, **kwargs)
            base = args[0] if args else None
            if isinstance(base, torch.Tensor) and isinstance(out, torch.Tensor):
                taint = self.taint_of(base)
                if taint is not None:
                    self._set_taint(out, taint)
            return out
        if writes:
            groups = _written(writes, args, kwargs)
            pre = {id(t): self.flags(t) for g in groups for t in g if _is_float(t)}
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self._note_raise(func, _flat(kwargs, _flat(args, [])), e)
            raise
        node = torch._C._current_autograd_node()
        if isinstance(out, (tuple, list)):
            outs = [t for t in (_flat(out, []) if any(isinstance(x, (tuple, list)) for x in out)
                                else out) if _is_float(t)]
        else:
            outs = [out] if _is_float(out) else []
        if node is not None and type(node).__name__ == "AccumulateGrad":
            self.grads.extend(weakref.ref(t) for t in outs)
        if not writes:
            if outs:
                kind = _KIND.get(func)
                if kind is None:
                    kind = _KIND[func] = _op_kind(func)
                if kind == "fill" or (kind == "copy" and self._finite_copy(args, outs)):
                    for t in outs:  # finite by construction: remember, skip the check
                        self._known[id(t)] = (weakref.ref(t), (t._version,), (False, False))
                elif kind != "garbage":
                    self._judge(func, node, (args, kwargs), outs, None, False)
            return out
        flat_in = _flat(kwargs, _flat(args, []))
        for g in groups:
            for t in g:
                if _is_float(t):
                    self.written[id(t)] = weakref.ref(t)
        lists = [g for g in groups if isinstance(g, list)]
        full = len(lists) == len(groups)
        lists = [g for g in lists if g]  # amsgrad's max_exp_avg_sqs is [] when unused
        if lists and full and _per_index(func, args, kwargs, lists):
            # A multi-tensor op (`_foreach_*_`, a fused optimizer) is one elementwise op per
            # index of its lists: judge each index on its own tensors, so a NaN already in one
            # parameter's gradient does not hide a NaN born in another's update.
            if self._all_finite_written(lists):
                return out
            n = len(lists[0])
            scalars = [x for x in _flat_nonlist(args, kwargs)]
            list_args = _list_args(func, args, kwargs)
            for i in range(n):
                written_i = [g[i] for g in lists if _is_float(g[i])]
                ins_i = [lst[i] for lst in list_args] + scalars
                self._judge(func, node, ins_i, written_i, pre, True)
            return out
        seen = {id(t) for t in outs}
        outs += [t for g in groups for t in g if _is_float(t) and id(t) not in seen]
        if outs:
            self._judge(func, node, flat_in, outs, pre, True)
        return out

    def _judge(self, func, node, flat_in, outs, pre, mutable) -> None:
        """Record a birth when `outs` hold a NaN no input held (or an Inf from finite inputs),
        and carry the birth each non-finite output descends from. `pre` holds the flags of
        tensors the op writes, taken before it ran."""
        out_flags = [self.flags_written(t) if mutable else self.flags(t) for t in outs]
        if not any(n or i for n, i in out_flags):
            if mutable:
                for t in outs:
                    self._set_taint(t, None)  # overwritten in place with finite values
            return
        if isinstance(flat_in, tuple):  # (args, kwargs), flattened only when needed
            flat_in = _flat(flat_in[1], _flat(flat_in[0], []))
        ins = [x for x in flat_in if _is_float(x)]
        in_flags = [pre[id(t)] if pre is not None and id(t) in pre else self.flags(t)
                    for t in ins]
        in_flags += [(x != x, x in (float("inf"), float("-inf")))
                     for x in flat_in if isinstance(x, float)]
        in_nan = any(n for n, _ in in_flags)
        in_bad = any(n or i for n, i in in_flags)
        out_nan = any(n for n, _ in out_flags)
        out_inf = any(i for _, i in out_flags)
        inherited = [self.taint_of(t) for t, (n, i) in zip(ins, in_flags) if n or i]
        inherited = [x for x in inherited if x is not None]
        taint = min(inherited) if inherited else None
        kind = None
        if (out_nan and not in_nan) or (out_inf and not in_bad):
            kind = "NaN" if out_nan and not in_nan else "Inf"
        elif not mutable and torch.Tag.pointwise in func.tags:
            # An elementwise op fed some non-finite elements (a -inf mask) can still give
            # birth elsewhere: x / 0 on the finite elements. Judge it element by element.
            kind = _pointwise_birth(flat_in, outs)
            if kind is not None:
                taint = None  # the new elements descend from this op, not from the inputs
        if kind is not None:
            self._record(func, node, flat_in, outs, out_flags, mutable, kind)
            if taint is None:
                taint = len(self.births) - 1
        for t, (n, i) in zip(outs, out_flags):
            self._set_taint(t, taint if (n or i) else None)

    def _note_raise(self, func, flat_in, error: Exception) -> None:
        """An op raised: keep which births its non-finite inputs descend from, if any."""
        if self.raised is not None:
            return
        bad = [(t, _flags(t)) for t in flat_in if _is_float(t)]
        bad = [(t, f) for t, f in bad if f[0] or f[1]]
        taints = [self.taint_of(t) for t, _ in bad]
        taints = [x for x in taints if x is not None]
        node = torch._C._current_autograd_node()
        file, line, fn = _source_from_stack() if node is None else _source_from_node(node,
                                                                                     self.key)
        where = f" at {os.path.basename(file)}:{line} ({fn})" if file else ""
        self.raised = (min(taints) if taints else None, bool(bad),
                       f"{_op_name(func)}{where} then raised {type(error).__name__}: "
                       f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}")

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
        if node is not None and isinstance(node, _CUSTOM_NODE):
            file, line, fn = _source_from_stack()
            if file:  # the custom autograd.Function's own backward code
                note = f"run by backward code at {os.path.basename(file)}:{line} ({fn}). {note}"
        note = note.strip()
        pointwise = torch.Tag.pointwise in func.tags
        self.births.append(_Birth(_op_name(func), kind, phase, src, path, ins, _host(bad),
                                  note, pointwise))


_CUSTOM_NODE = torch.autograd.function.BackwardCFunction


def _pointwise_birth(flat_in: list, outs: list) -> str | None:
    """``NaN`` when an elementwise op's output holds a NaN where no input does, ``Inf`` when it
    holds an Inf where every input is finite, else None (each non-finite element came in)."""
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            shape = outs[0].shape
            in_nan = torch.zeros(shape, dtype=torch.bool, device=outs[0].device)
            in_bad = in_nan.clone()
            for x in flat_in:
                if isinstance(x, float):
                    in_nan |= x != x
                    in_bad |= not math.isfinite(x)
                elif _is_float(x):
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

# Ops whose outputs need no check: "fill" makes finite values by construction (zeros, ones),
# "copy" copies its first input (finite when that is known finite), "garbage" returns
# uninitialised memory that is only ever overwritten (judging it would invent births).
_FILL = {"zeros", "zeros_like", "ones", "ones_like", "new_zeros", "new_ones", "arange",
         "eye", "zero", "randn", "rand", "randn_like", "rand_like", "normal", "uniform",
         "bernoulli", "randint", "randint_like", "randperm"}
_COPY = {"clone", "_unsafe_view", "contiguous", "_to_copy", "_reshape_alias", "alias_copy",
         "view_copy", "t_copy", "transpose_copy", "permute_copy", "expand_copy"}
_GARBAGE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_KIND: dict[Any, str] = {}


def _op_kind(func) -> str:
    name = func._schema.name.split("::", 1)[-1]
    if name in _FILL:
        return "fill"
    if name in _COPY:
        return "copy"
    if name in _GARBAGE:
        return "garbage"
    return "judge"


_WRITES: dict[Any, tuple] = {}
_VIEW = ((-1, "view", False),)  # marks an op whose one output is a view of its first input


def _writes(func) -> tuple:
    """(position, name, is_list) of every argument the op writes, per its schema
    (``Tensor(a!)``, ``Tensor(a!)[]``, ``out=``); `_VIEW` for a pure view op; cached per op."""
    got = _WRITES.get(func)
    if got is None:
        schema = func._schema
        got = tuple((k, a.name, str(a.type).startswith("List"))
                    for k, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
        rets = schema.returns
        if (not got and len(rets) == 1 and rets[0].alias_info is not None
                and not rets[0].alias_info.is_write and str(rets[0].type) == "Tensor"
                and schema.arguments and schema.arguments[0].alias_info is not None):
            got = _VIEW
        _WRITES[func] = got
    return got


def _arg(k: int, name: str, args: tuple, kwargs: dict):
    return args[k] if k < len(args) else kwargs.get(name)


def _written(writes: tuple, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes, one group per written argument (a list argument is a list)."""
    groups = []
    for k, name, is_list in writes:
        x = _arg(k, name, args, kwargs)
        if x is None:
            continue
        groups.append([t for t in x if isinstance(t, torch.Tensor)] if is_list else (x,))
    return groups


_LIST_ARGS: dict[Any, tuple] = {}


def _list_args(func, args: tuple, kwargs: dict) -> list[list]:
    pos = _LIST_ARGS.get(func)
    if pos is None:
        pos = _LIST_ARGS[func] = tuple((k, a.name) for k, a in enumerate(func._schema.arguments)
                                       if str(a.type).startswith(("List[Tensor]",
                                                                  "List[Optional[Tensor]]")))
    out = []
    for k, name in pos:
        x = _arg(k, name, args, kwargs)
        if x:
            out.append(list(x))
    return out


def _per_index(func, args, kwargs, lists) -> bool:
    lens = {len(x) for x in _list_args(func, args, kwargs)}
    return len(lens) == 1 and all(len(g) == next(iter(lens)) for g in lists)


def _flat_nonlist(args: tuple, kwargs: dict) -> list:
    """The tensors and floats of an op's arguments that are not inside a list argument."""
    out = []
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, (torch.Tensor, float)):
            out.append(x)
    return out


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
        inputs_at_index=values_at(b.ins, b.out.shape, idx) if b.pointwise else None,
        births=n_births, note=b.note)


def _modules_of(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, module) for the modules the function was given, is bound to, or refers to by
    name (a closure or global: ``diag nan``'s zero-argument steps)."""
    found = [("", x) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.nn.Module)]
    for cand in (fn, getattr(fn, "__self__", None)):
        if isinstance(cand, torch.nn.Module):
            found.append(("", cand))
    found += [(f"{n}.", x) for n, x in _referenced(fn) if isinstance(x, torch.nn.Module)]
    return found


def _referenced(fn: Callable) -> list[tuple[str, Any]]:
    """(name, value) of the closure cells and globals the function's code names."""
    fn = getattr(fn, "__wrapped__", fn)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    glob = getattr(fn, "__globals__", {})
    out += [(n, glob[n]) for n in code.co_names if n in glob]
    return out


def _named_inputs(fn: Callable, args: tuple, kwargs: dict) -> dict[int, tuple[str, Any]]:
    """id -> (name, tensor) for what the function was given: tensors in its arguments (or
    named by its closure), the parameters, gradients and buffers of modules it was given, is
    bound to or refers to, and an optimizer's state."""
    named: dict[int, tuple[str, Any]] = {}
    ref = _referenced(fn)
    for path, t in _tensor_paths((args, kwargs)) + [(n, x) for n, x in ref
                                                     if isinstance(x, torch.Tensor)]:
        named.setdefault(id(t), (path, t))
        if t.grad is not None:
            named.setdefault(id(t.grad), (f"gradient of {path}", t.grad))
    for prefix, m in _modules_of(fn, args, kwargs):
        for pname, p in m.named_parameters():
            named.setdefault(id(p), (f"parameter {prefix}{pname}", p))
            if p.grad is not None:
                named.setdefault(id(p.grad), (f"gradient of {prefix}{pname}", p.grad))
        for bname, b in m.named_buffers():
            named.setdefault(id(b), (f"buffer {prefix}{bname}", b))
    opts = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.optim.Optimizer)]
    opts += [x for _, x in ref if isinstance(x, torch.optim.Optimizer)]
    for opt in opts:
        for p, st in opt.state.items():
            pname = named.get(id(p), ("a parameter",))[0]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    named.setdefault(id(v), (f"optimizer state {k} of {pname}", v))
    return named


def _tensor_paths(tree: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(``args[1]['mask']``, tensor) for the tensors in ``(args, kwargs)``."""
    out = []
    if isinstance(tree, torch.Tensor):
        out.append((path, tree))
    elif isinstance(tree, (list, tuple)):
        for i, x in enumerate(tree):
            sub = ("args" if i == 0 else "kwargs") if path == "" else f"{path}[{i}]"
            out += _tensor_paths(x, sub)
    elif isinstance(tree, dict):
        for k, x in tree.items():
            out += _tensor_paths(x, f"{path}[{k!r}]")
    return out


def _arrived(named: dict[int, tuple[str, Any]], hunter: _Hunter) -> list[str]:
    """What the function was given that was already non-finite: facts, not findings (an
    additive attention mask holds -inf by design)."""
    facts = []
    for name, t in named.values():
        if _is_float(t):
            nan, inf = hunter.flags(t)
            if nan or inf:
                s = summarize(_host(t))
                what = ", ".join(f"{n} {k}" for n, k in ((s.nans, "NaN"), (s.infs, "Inf")) if n)
                facts.append(f"{name} held {what} on arrival")
    return facts


def _sinks(result: Any, named: dict, hunter: _Hunter):
    """Every tensor the function's effect is visible in: what it returns, the gradients
    autograd accumulated, and every tensor an op wrote (an optimizer's update, a buffer).
    What it was given and left alone is not a result, whatever it holds."""
    sinks: list[tuple[str, torch.Tensor]] = []
    sinks += [("result", t) for t in tree_leaves(result) if _is_float(t)]
    seen = {id(t) for _, t in sinks}
    for r in hunter.grads:
        t = r()
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            sinks.append((named.get(id(t), ("accumulated gradient",))[0], t))
    for k, r in hunter.written.items():
        t = r()
        if t is not None and k not in seen:
            seen.add(k)
            name = named.get(k, (None,))[0]
            sinks.append((f"{name} (written in place)" if name else "tensor written in place", t))
    return sinks


def locate(fn: Callable, args: tuple, kwargs: dict) -> NanReport | None:
    """See `diag.nan.locate`."""
    # The screens' dot products may overflow (then the exact check runs): not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        return _locate(fn, args, kwargs)


def _locate(fn: Callable, args: tuple, kwargs: dict) -> NanReport | None:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    hunter = _Hunter(key=object())
    named = _named_inputs(fn, args, kwargs)
    arrived = _arrived(named, hunter)

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
        return _raised(hunter, name, e, arrived)
    finally:
        for h in hooks:
            h.remove()
    # Gradients may have been made after `named` was built: name them too.
    named.update({k: v for k, v in _named_inputs(fn, args, kwargs).items() if k not in named})
    bad = []
    for where, t in _sinks(result, named, hunter):
        nan, inf = hunter.flags(t)
        if nan or inf:
            bad.append((where, t, "NaN" if nan else "Inf"))
    if not bad:
        return None
    roots = [hunter.taint_of(t) for _, t, _ in bad]
    roots = [r for r in roots if r is not None]
    if roots:
        return _with(_report(hunter.births[min(roots)], len(hunter.births)), arrived=arrived)
    if hunter.births and not arrived:
        rep = _report(hunter.births[0], len(hunter.births))
        return _with(rep, note=(
            f"{bad[0][0]} holds {bad[0][2]}; it could not be traced to one op (a view written "
            f"in place?), so this is the first op that produced one"))
    where, t, kind = bad[0]
    given = "; ".join(arrived) or "an input"
    return NanReport(framework="torch", primitive="input", kind=kind, source="", path=where,
                     phase="input", inputs=(), output=summarize(_host(t)),
                     births=len(hunter.births), arrived=tuple(arrived),
                     note=f"no op produced it: it reached {where} from what the function was "
                          f"given ({given})")


def _with(rep: NanReport, **changes) -> NanReport:
    if "arrived" in changes:
        changes["arrived"] = tuple(changes["arrived"])
    if rep.note and "note" in changes:
        changes["note"] = f"{changes['note']}. {rep.note}"
    return NanReport(**{**rep.__dict__, **changes})


def _raised(hunter: _Hunter, name: str, error: Exception, arrived: list[str]) -> NanReport:
    """The function raised. If the op that raised was fed NaN/Inf, that is the finding: report
    where it was born and what it made happen; otherwise it is an error like any other."""
    got = hunter.raised
    if got is None or not got[1]:
        first = (f"; {len(hunter.births)} NaN/Inf birth(s) were seen before it"
                 if hunter.births else "")
        raise NanHuntError(f"{name} raised {type(error).__name__}: {error}{first}") from error
    taint, _, what = got
    if taint is not None:
        return _with(_report(hunter.births[taint], len(hunter.births)), raised=what,
                     arrived=arrived)
    given = "; ".join(arrived) or "an input"
    return NanReport(framework="torch", primitive="input", kind="NaN", source="", path="",
                     phase="input", births=len(hunter.births), raised=what,
                     arrived=tuple(arrived),
                     note=f"no op produced it: the raising op was fed what the function was "
                          f"given ({given})")
