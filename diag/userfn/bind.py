"""A user's function with its inputs replaced by shipped arrays: what makes every backend run
the same computation on bit-identical inputs.

The inputs of a user's function are the arrays among its arguments (any pytree) and, for
PyTorch, the state (parameters and buffers) of the modules it runs: the function itself when it
is an `nn.Module` or a module's method, the modules among its arguments, and those it reaches
as globals or closure cells (`diag.userfn.reach`). The host loads
the function, takes these arrays (`input_leaves`, in a fixed order), and ships them; each worker
loads the same function and binds its arguments to the shipped arrays on its device (`bind`).
A call starts from the shipped state every time (module state copied in place, tensors
cloned), so a training step that updates its model runs the same step on every timed call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diag.userfn.reach import reachable
from diag.userfn.tree import flatten, leaf_name, numpy_leaves, to_numpy


def _torch_walk(x: Any, path: str, out: list) -> None:
    import torch

    if isinstance(x, torch.Tensor):
        out.append((path, x))
    elif isinstance(x, dict):
        for k, v in x.items():
            _torch_walk(v, f"{path}[{k!r}]", out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _torch_walk(v, f"{path}[{i}]", out)


def _torch_modules(fn: Callable, args: tuple, kwargs: dict) -> list:
    import torch

    found = []
    owner = getattr(fn, "__self__", None)
    for m in (fn, owner):
        if isinstance(m, torch.nn.Module):
            found.append(m)

    def walk(x: Any) -> None:
        if isinstance(x, torch.nn.Module):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk((args, kwargs))
    # the modules the function reaches as globals or closure cells (a script's
    # ``fc1 = nn.Linear(...)``): shipped, moved to the device and reset like the others
    found += [s.value for s in reachable(fn) if isinstance(s.value, torch.nn.Module)]
    unique: list = []
    for m in found:
        if not any(m is u for u in unique):
            unique.append(m)
    return unique


def _torch_slots(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, tensor) of every input tensor: the arguments', then the modules' state."""
    slots: list[tuple[str, Any]] = []
    _torch_walk(args, "args", slots)
    _torch_walk(kwargs, "kwargs", slots)
    for i, m in enumerate(_torch_modules(fn, args, kwargs)):
        label = "module" if i == 0 else f"module{i}"
        slots += [(f"{label}.{k}", t) for k, t in m.state_dict(keep_vars=True).items()]
    return slots


def _jax_slots(args: tuple, kwargs: dict) -> tuple[list[int], list[tuple[str, Any]], Any, list]:
    import jax

    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    ]
    idx = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    names = [
        ("args" + paths[i][3:]) if paths[i].startswith("[0]") else "kwargs" + paths[i][3:]
        for i in idx
    ]
    return idx, [(n, flat[i]) for n, i in zip(names, idx)], treedef, flat


def input_leaves(
    fn: Callable, args: tuple, kwargs: dict, framework: str
) -> list[tuple[str, np.ndarray]]:
    """(name, host numpy array) of every input of the call, in the order `bind` takes them."""
    if framework == "torch":
        return [(n, to_numpy(t)) for n, t in _torch_slots(fn, args, kwargs)]
    return [(n, to_numpy(x)) for n, x in _jax_slots(args, kwargs)[1]]


def bind(fn: Callable, args: tuple, kwargs: dict, framework: str) -> Callable[..., dict]:
    """``call(*arrays) -> {output name: array}``: the function on `arrays` (device arrays,
    in `input_leaves`' order) in place of its own inputs; outputs named by `leaf_name`.

    Raises (when called):
        UserFunctionError: the function returned no arrays, or something that is not one.
    """
    if framework == "torch":
        return _bind_torch(fn, args, kwargs)
    idx, _, treedef, flat = _jax_slots(args, kwargs)

    def call(*arrays: Any) -> dict:
        import jax

        full = list(flat)
        for i, a in zip(idx, arrays):
            full[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return _named(fn(*a, **k), "jax")

    return call


def _named(out: Any, framework: str) -> dict:
    """The outputs by name, left on the device; a Python number (an ``int`` step count, a
    ``bool`` flag, a ``.item()``) or a numpy array as the framework's array, so every backend
    hands back arrays; the reason of `numpy_leaves` when a leaf is not a number (or there
    are none)."""
    flat = flatten(out)
    if not flat or not all(
        hasattr(v, "shape") and hasattr(v, "dtype") or isinstance(v, (bool, int, float))
        for _, v in flat
    ):
        numpy_leaves(out)  # raises UserFunctionError saying what the function returned
    return {leaf_name(p): _as_array(v, framework) for p, v in flat}


def _as_array(v: Any, framework: str) -> Any:
    if not isinstance(v, (bool, int, float, np.ndarray, np.generic)):
        return v
    if framework == "torch":
        import torch

        return torch.as_tensor(np.asarray(v) if isinstance(v, np.generic) else v)
    import jax.numpy as jnp

    return jnp.asarray(v)


def _bind_torch(fn: Callable, args: tuple, kwargs: dict) -> Callable[..., dict]:
    import torch

    slots = _torch_slots(fn, args, kwargs)
    n_args = sum(1 for n, _ in slots if n.startswith(("args", "kwargs")))
    grads = [t.requires_grad for _, t in slots[:n_args]]
    modules = _torch_modules(fn, args, kwargs)
    placed: list = []

    def replace(x: Any, it) -> Any:
        if isinstance(x, torch.Tensor):
            return next(it)
        if isinstance(x, dict):
            return type(x)((k, replace(v, it)) for k, v in x.items())
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(replace(v, it) for v in x)
        return x

    def call(*arrays: Any) -> dict:
        if arrays and not placed:  # the modules go to the device the inputs are on, once
            for m in modules:
                m.to(arrays[0].device)
            placed.append(True)
        with torch.no_grad():
            state = [t for _, t in _torch_slots(fn, args, kwargs)][n_args:]
            for target, x in zip(state, arrays[n_args:]):
                target.copy_(x)
        it = iter(a.clone().requires_grad_(g) for a, g in zip(arrays[:n_args], grads))
        a, k = replace((args, kwargs), it)
        return _named(fn(*a, **k), "torch")

    return call
