"""The user's JAX call as a pure function of arrays, and the names of those arrays.

Flax NNX modules, optimizers and RNG streams carry state a call writes; it is split out before
the hunt runs so the hunt starts from what the user's call started from.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class Program:
    """The user's call as a pure function of arrays: ``flat(*arrays) -> (result, new_state)``.

    JAX arrays are immutable, so a plain function's arguments are its own snapshot. Flax NNX
    modules, optimizers and RNG streams are not: their calls write new values into
    `nnx.Variable`s. Those are split (`nnx.split`) into a graph and a state of arrays before
    anything runs; `flat` merges a fresh copy from the state, calls the function, and returns
    the state it left behind, which counts as a result (a NaN written into a parameter is as
    bad as a NaN returned). The hunt therefore always starts from the state the user's call
    started from, and the user's objects are updated once at the end (`write_back`), as one
    call would have left them.
    """

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        nnx = sys.modules.get("flax.nnx")
        self._refs = _referenced_nodes(nnx, fn) if nnx is not None else []
        self.nnx = (
            nnx if nnx is not None and (self._refs or _holds_nnx(nnx, fn, args, kwargs)) else None
        )
        if self.nnx is None:
            leaves, self._treedef = jax.tree_util.tree_flatten((args, kwargs))
            self._leaves = leaves
            self._dyn = [i for i, x in enumerate(leaves) if is_array(x)]
            self.arrays = [jnp.asarray(leaves[i]) for i in self._dyn]
            paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
            self.names = [_arg_name(jax.tree_util.keystr(paths[i][0])) for i in self._dyn]
            self.state_names = []
            return
        nnx = self.nnx  # the module itself here (not None)
        # The callee is a module (or a bound method of one): its state is split with the rest.
        self_obj = fn if nnx.graph.is_graph_node(fn) else getattr(fn, "__self__", None)
        if self_obj is not None and not nnx.graph.is_graph_node(self_obj):
            self_obj = None
        method: Any = fn  # a bound method of self_obj when it is not fn itself
        self._method = None if self_obj is None or self_obj is fn else method.__func__
        self._obj = (self_obj, args, kwargs, tuple(node for _, _, node in self._refs))
        self._graph, state = nnx.split(self._obj)
        flat_state = jax.tree_util.tree_flatten_with_path(state)
        self._state_def = jax.tree_util.tree_structure(state)
        self.arrays = [x for _, x in flat_state[0]]
        self.names = [_state_name(jax.tree_util.keystr(p)) for p, _ in flat_state[0]]
        # Only Variables are state a call can write; raw arrays in the arguments are inputs.
        var_state = jax.tree_util.tree_flatten_with_path(nnx.state(self._obj, nnx.Variable))
        self._var_def = jax.tree_util.tree_structure(nnx.state(self._obj, nnx.Variable))
        self.state_names = [_state_name(jax.tree_util.keystr(p)) for p, _ in var_state[0]]
        ref_names = [name for _, name, _ in self._refs]
        self.names = [_ref_name(n, ref_names) for n in self.names]
        self.state_names = [_ref_name(n, ref_names) for n in self.state_names]

    def flat(self, *arrays):
        if self.nnx is None:
            full = list(self._leaves)
            for i, a in zip(self._dyn, arrays):
                full[i] = a
            a, k = jax.tree_util.tree_unflatten(self._treedef, full)
            return self.fn(*a, **k), ()
        nnx = self.nnx
        state = jax.tree_util.tree_unflatten(self._state_def, list(arrays))
        obj = nnx.merge(self._graph, state)
        self_obj, a, k, refs = obj
        # The modules the function names (a global, a closure cell) are swapped for their
        # fresh copies for the call: NNX forbids writing the originals from inside a trace.
        with _swapped(self._refs, refs):
            if self._method is not None:
                out = self._method(self_obj, *a, **k)
            elif self_obj is not None:
                out = self_obj(*a, **k)
            else:
                out = self.fn(*a, **k)
        return out, jax.tree_util.tree_leaves(nnx.state(obj, nnx.Variable))

    def write_back(self, new_state: list) -> None:
        """Leave the user's NNX objects as one call of the function would have left them."""
        # jax's PyTreeDef stub lacks num_leaves (the object has it)
        if self.nnx is None or len(new_state) != self._var_def.num_leaves:  # type: ignore[attr-defined]
            return
        self.nnx.update(self._obj, jax.tree_util.tree_unflatten(self._var_def, new_state))


def _referenced_nodes(nnx, fn: Callable) -> list[tuple[Any, str, Any]]:
    """(holder, name, node) for each NNX module or Variable the function's code names: a
    global (holder: the globals dict) or a closure cell (holder: the cell)."""
    fn = getattr(fn, "__wrapped__", fn)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []

    def is_node(x):
        return nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)

    found = []
    glob = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in glob and is_node(glob[name]):
            found.append((glob, name, glob[name]))
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if is_node(value):
            found.append((cell, name, value))
    return found


@contextlib.contextmanager
def _swapped(refs: list, copies: tuple):
    """Point each global or closure cell in `refs` at its copy for the duration."""

    def put(holder, name, value):
        if isinstance(holder, dict):
            holder[name] = value
        else:
            holder.cell_contents = value

    for (holder, name, _), copy in zip(refs, copies):
        put(holder, name, copy)
    try:
        yield
    finally:
        for holder, name, node in refs:
            put(holder, name, node)


def _ref_name(name: str, ref_names: list[str]) -> str:
    """``global[0].l.kernel`` -> ``model.l.kernel`` (the name the function uses)."""
    m = re.match(r"global\[(\d+)\]", name)
    return f"{ref_names[int(m[1])]}{name[m.end() :]}" if m else name


def _holds_nnx(nnx, fn, args, kwargs) -> bool:
    def is_node(x):
        return nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)

    cands = [fn, getattr(fn, "__self__", None)]
    cands += jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_node)
    return any(is_node(x) for x in cands if x is not None)


def _arg_name(keystr: str) -> str:
    """``[0][1]['w']`` (of the ``(args, kwargs)`` pair) -> ``args[1]['w']``."""
    if keystr.startswith("[0]"):
        return f"args{keystr[3:]}"
    if keystr.startswith("[1]"):
        return f"kwargs{keystr[3:]}"
    return keystr


def _state_name(keystr: str) -> str:
    """``[1][0]['l']['kernel'].value`` (of NNX's ``(self, args, kwargs)``) ->
    ``args[0].l.kernel``."""
    keystr = keystr.replace(".value", "")
    keystr = re.sub(r"\['([A-Za-z_][A-Za-z0-9_]*)'\]", r".\1", keystr)
    if keystr.startswith("[0]"):
        return f"the module{keystr[3:]}"
    if keystr.startswith("[1]"):
        return f"args{keystr[3:]}"
    if keystr.startswith("[2]"):
        return f"kwargs{keystr[3:]}"
    if keystr.startswith("[3]"):
        return f"global{keystr[3:]}"
    return keystr
