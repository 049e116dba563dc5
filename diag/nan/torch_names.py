"""What a PyTorch function was given and what its effect shows in, by the names users know.

Arguments, the parameters, gradients and buffers of the modules it uses, an optimizer's state
(inputs, named for the report), and its results, accumulated gradients and tensors written in
place (the sinks a NaN must reach to count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from diag.interp.torch_ops import host_copy, is_float
from diag.nan.summary import summarize


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


def named_inputs(fn: Callable, args: tuple, kwargs: dict) -> dict[int, tuple[str, Any]]:
    """id -> (name, tensor) for what the function was given: tensors in its arguments (or
    named by its closure), the parameters, gradients and buffers of modules it was given, is
    bound to or refers to, and an optimizer's state."""
    named: dict[int, tuple[str, Any]] = {}
    ref = _referenced(fn)
    for path, t in _tensor_paths((args, kwargs)) + [
        (n, x) for n, x in ref if isinstance(x, torch.Tensor)
    ]:
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
        for param, st in opt.state.items():
            pname = named.get(id(param), ("a parameter",))[0]
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


def arrived(
    named: dict[int, tuple[str, Any]], flags: Callable[[torch.Tensor], tuple[bool, bool]]
) -> list[str]:
    """What the function was given that was already non-finite: facts, not findings (an
    additive attention mask holds -inf by design)."""
    facts = []
    for name, t in named.values():
        if is_float(t):
            nan, inf = flags(t)
            if nan or inf:
                s = summarize(host_copy(t))
                what = ", ".join(f"{n} {k}" for n, k in ((s.nans, "NaN"), (s.infs, "Inf")) if n)
                facts.append(f"{name} held {what} on arrival")
    return facts


def gradient_versions(named: dict[int, tuple[str, Any]]) -> dict[int, tuple[int, int]]:
    """id of each named tensor that requires grad -> (id, version) of its ``.grad`` now."""
    got = {}
    for k, (_, t) in named.items():
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad is not None:
            got[k] = (id(t.grad), t.grad._version)
    return got


def sinks(
    result: Any,
    named: dict,
    grads: list,
    written: dict,
    grads_before: dict[int, tuple[int, int]] | None = None,
):
    """Every tensor the function's effect is visible in: what it returns, the gradients
    autograd accumulated (`grads`: weak references), the ``.grad`` of every named tensor that
    backward set or changed (`grads_before`: `gradient_versions` before the call; autograd
    hands a fresh gradient over without an op the mode could see), and every tensor an op
    wrote (`written`: id -> weak reference; an optimizer's update, a buffer). What it was given
    and left alone is not a result, whatever it holds."""
    sinks: list[tuple[str, torch.Tensor]] = []
    sinks += [("result", t) for t in tree_leaves(result) if is_float(t)]
    seen = {id(t) for _, t in sinks}
    if grads_before is not None:
        for k, now in gradient_versions(named).items():
            grad = named[k][1].grad
            if grads_before.get(k) != now and id(grad) not in seen and is_float(grad):
                seen.add(id(grad))
                sinks.append((f"gradient of {named[k][0].removeprefix('parameter ')}", grad))
    for r in grads:
        t = r()
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            sinks.append((named.get(id(t), ("accumulated gradient",))[0], t))
    for k, r in written.items():
        t = r()
        if t is not None and k not in seen:
            seen.add(k)
            name = named.get(k, (None,))[0]
            sinks.append((f"{name} (written in place)" if name else "tensor written in place", t))
    return sinks
