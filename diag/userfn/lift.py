"""A user's function with every floating tensor it reaches copied, and widened to float64 for
its reference: the function as written, with the model it holds as a global in float64 too.

The float64 reference evaluates the function's own code; the numbers it reaches are its
arguments and the globals and closure cells its code names (`diag.userfn.reach`). Each is
copied, never changed in place: PyTorch values are deep-copied together (one memo, so an
optimizer passed beside its model still holds the copy's parameters), then modules
``.double()``, float tensors and an optimizer's state widened; JAX values are pytrees (arrays,
Flax linen parameter dicts, optax states) whose float leaves are widened, and Flax NNX modules
are split into graph and state, widened, and merged into a fresh module. For the block the
slots point at the copies (`diag.userfn.reach.swapped`); afterwards they hold the user's own
objects again, whatever happened. Copies without widening (``widen=False``) are what a run that
must not change the user's state uses (the float64 shadow; `diag nan` on a step that donates
its own global buffers).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from diag.userfn.reach import Slot, reachable, swapped

__all__ = ["Lifted", "lifted"]

_NARROW = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Lifted:
    """The function, its arguments, and what was copied (and widened) for the block.

    Attributes:
        fn, args, kwargs: what to call: copies where they hold state (a module, an optimizer).
        labels: one entry per global or closure cell whose floats were widened
            (``global fc1 (Linear)``): what the record says was lifted.
    """

    fn: Callable
    args: tuple
    kwargs: dict
    labels: tuple[str, ...]


def _torch_holds(x: Any, depth: int = 0) -> bool:
    """Whether `x` holds torch state a call may read or write: a tensor, a module, an
    optimizer, or a learning-rate scheduler (copied with its optimizer, so stepping it moves
    the copy's learning rate, not the user's)."""
    torch = sys.modules["torch"]
    held = (
        torch.Tensor,
        torch.nn.Module,
        torch.optim.Optimizer,
        torch.optim.lr_scheduler.LRScheduler,
    )
    if isinstance(x, held):
        return True
    if depth < 4 and isinstance(x, dict):
        return any(_torch_holds(v, depth + 1) for v in x.values())
    if depth < 4 and isinstance(x, (list, tuple)):
        return any(_torch_holds(v, depth + 1) for v in x)
    return False


def _torch_narrow(x: Any, depth: int = 0) -> bool:
    """Whether `x` holds a float tensor narrower than float64 (a module's state included)."""
    torch = sys.modules["torch"]
    if isinstance(x, torch.nn.Module):
        return any(_torch_narrow(t) for t in x.state_dict().values())
    if isinstance(x, torch.Tensor):
        return x.is_floating_point() and x.dtype != torch.float64
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    return depth < 4 and any(_torch_narrow(v, depth + 1) for v in items)


def _torch_widen(x: Any, seen: set[int], tensors: bool = True, depth: int = 0) -> None:
    """Widen in place (a private copy) the modules, optimizer states and, with `tensors`, the
    float tensors `x` holds. Each keeps its identity (``.double()`` and ``.data`` keep the
    Parameter objects), so an optimizer's references to a module's parameters stay valid."""
    torch = sys.modules["torch"]
    if id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, torch.nn.Module):
        x.double()
    elif isinstance(x, torch.optim.Optimizer):
        for state in x.state.values():
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    state[k] = v.to(torch.float64)
    elif isinstance(x, torch.Tensor):
        if tensors and x.is_floating_point() and x.dtype != torch.float64:
            with torch.no_grad():
                x.data = x.data.to(torch.float64)
                if x.grad is not None:
                    x.grad = x.grad.to(torch.float64)
    elif depth < 4 and isinstance(x, (dict, list, tuple)):
        for v in x.values() if isinstance(x, dict) else x:
            _torch_widen(v, seen, tensors, depth + 1)


def _torch(fn: Callable, args: tuple, kwargs: dict, slots: list[Slot], widen: bool) -> tuple:
    held = [s for s in slots if _torch_holds(s.value)]
    everything = (fn, args, kwargs, [s.value for s in held])
    fn2, args2, kwargs2, values = copy.deepcopy(everything, _nonleaf_copies(everything, {}))
    labels: list[str] = []
    if widen:
        seen: set[int] = set()
        for x in (fn2, getattr(fn2, "__self__", None), *values):
            _torch_widen(x, seen)
        # the arguments' tensors are widened by the reference itself (which moves them by
        # one rounding for integer outputs): here only their modules and optimizers
        _torch_widen((args2, kwargs2), seen, tensors=False)
        labels = [f"{s.label} ({type(s.value).__name__})" for s in held if _torch_narrow(s.value)]
    return fn2, args2, kwargs2, held, values, labels


def _nonleaf_copies(x: Any, memo: dict, depth: int = 0) -> dict:
    """A deepcopy memo holding a detached copy of every tensor autograd made (torch refuses to
    deep-copy those: "Only Tensors created explicitly by the user support the deepcopy
    protocol"), keeping its requires_grad."""
    torch = sys.modules["torch"]
    if isinstance(x, torch.Tensor):
        if x.grad_fn is not None:
            memo[id(x)] = x.detach().clone().requires_grad_(x.requires_grad)
    elif depth < 6 and isinstance(x, (dict, list, tuple)):
        for v in x.values() if isinstance(x, dict) else x:
            _nonleaf_copies(v, memo, depth + 1)
    return memo


def _jax_leaf(widen: bool) -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            if widen and str(x.dtype) in _NARROW:
                return jnp.asarray(np.asarray(x).astype(np.float64))
            return jnp.array(x, copy=True)  # a private buffer: the user's may be donated
        if isinstance(x, np.ndarray) and widen and str(x.dtype) in _NARROW:
            return x.astype(np.float64)
        return x

    return leaf


def _jax_value(x: Any, widen: bool) -> tuple[Any, int]:
    """A copy of a JAX value (float leaves widened), and how many leaves were widened."""
    import jax

    nnx = sys.modules.get("flax.nnx")
    leaf = _jax_leaf(widen)
    if nnx is not None and nnx.graph.is_graph_node(x):
        graph, state = nnx.split(x)
        n = _count_narrow(state) if widen else 0
        return nnx.merge(graph, jax.tree_util.tree_map(leaf, state)), n
    try:
        n = _count_narrow(x) if widen else 0
        return jax.tree_util.tree_map(leaf, x), n
    except Exception:  # noqa: BLE001 - not a pytree JAX can map: left as it is
        return x, 0


def _count_narrow(x: Any) -> int:
    import jax

    return sum(
        1
        for v in jax.tree_util.tree_leaves(x)
        if isinstance(v, (jax.Array, np.ndarray)) and str(v.dtype) in _NARROW
    )


def _jax(
    slots: list[Slot], widen: bool, graph_nodes: bool = True
) -> tuple[list[Slot], list, list[str]]:
    import jax

    held, values, labels = [], [], []
    for s in slots:
        if not graph_nodes and _is_graph_node(s.value):
            continue
        if not any(
            isinstance(v, (jax.Array, np.ndarray))
            for v in jax.tree_util.tree_leaves(s.value, is_leaf=_is_graph_node)
        ) and not _is_graph_node(s.value):
            continue
        v, n = _jax_value(s.value, widen)
        held.append(s)
        values.append(v)
        if n and hasattr(s.value, "dtype"):
            labels.append(f"{s.label} (array)")
        elif n:
            labels.append(f"{s.label} ({type(s.value).__name__}, {n} array{'s' * (n > 1)})")
    return held, values, labels


def _is_graph_node(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and nnx.graph.is_graph_node(x)


@contextlib.contextmanager
def lifted(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    framework: str,
    *,
    widen: bool = True,
    graph_nodes: bool = True,
) -> Iterator[Lifted]:
    """For the block: the function's reachable state copied (float64 with `widen`) and its
    globals and closure cells pointing at the copies; the user's own objects afterwards.

    PyTorch: `fn`, `args` and `kwargs` are deep-copied with the state (modules and optimizers
    among them widened with it; their tensors are left to the caller, which widens arguments
    itself). JAX: they are returned as given (arrays are immutable; the caller widens them).
    Without `graph_nodes`, Flax NNX objects are left in place (the NaN hunt splits them and
    updates the user's objects once, as one call would have left them).
    """
    slots = reachable(fn)
    if framework == "torch":
        fn, args, kwargs, held, values, labels = _torch(fn, args, kwargs, slots, widen)
    else:
        held, values, labels = _jax(slots, widen, graph_nodes)
    by_slot = {id(s): v for s, v in zip(held, values)}
    with swapped(slots, [by_slot.get(id(s), s.value) for s in slots]):
        yield Lifted(fn, args, kwargs, tuple(labels))
