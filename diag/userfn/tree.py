"""A user's outputs and inputs as named leaves: any pytree, tuple, list or dict of arrays.

Paths are written as `jax.tree_util.keystr` writes them (``[0]``, ``['logits']``), the same
for JAX and PyTorch outputs, so a leaf has one name on every backend, in the reference, in the
records and in the baseline. Leaves become numpy arrays (bfloat16 through ml_dtypes), the form
the worker ships and the host judges.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from diag.userfn.load import UserFunctionError


def _is_leaf_array(x: Any) -> bool:
    if isinstance(x, (np.ndarray, np.generic, bool, int, float)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return True
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _walk(x: Any, path: str, out: list[tuple[str, Any]], left_out: list[str]) -> None:
    if x is None:
        left_out.append(path)
        return
    if isinstance(x, dict):  # a transformers ModelOutput too (its None fields are not items)
        for k, v in x.items():
            _walk(v, f"{path}[{k!r}]", out, left_out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", out, left_out)
    elif _is_leaf_array(x):
        out.append((path, x))
    elif dataclasses.is_dataclass(x) and not isinstance(x, type) and not _is_pytree(x):
        for f in dataclasses.fields(x):
            _walk(getattr(x, f.name), f"{path}.{f.name}", out, left_out)
    elif "jax" in sys.modules:
        import jax

        flat = jax.tree_util.tree_flatten_with_path(x)[0]
        if len(flat) == 1 and flat[0][1] is x:
            out.append((path, x))
            return
        for p, v in flat:
            _walk(v, path + jax.tree_util.keystr(p), out, left_out)
    else:
        out.append((path, x))


def _is_pytree(x: Any) -> bool:
    """A dataclass JAX flattens itself (a flax struct): its paths are JAX's."""
    jax = sys.modules.get("jax")
    return jax is not None and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def flatten(tree: Any, left_out: list[str] | None = None) -> list[tuple[str, Any]]:
    """(path, leaf) for each leaf, in order; None leaves are dropped (a model output's absent
    field) and their paths added to `left_out`. A lone array has the path ``""``; a
    dataclass's fields are ``.name``, as JAX writes them."""
    out: list[tuple[str, Any]] = []
    _walk(tree, "", out, left_out if left_out is not None else [])
    return out


def to_numpy(x: Any) -> np.ndarray:
    """A leaf as a numpy array, on the host (torch bfloat16 through ml_dtypes)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.resolve_conj().resolve_neg().numpy()
    return np.asarray(x)


def leaf_name(path: str) -> str:
    """How a leaf is shown: ``output`` for a lone array, else ``output[0]['logits']``."""
    return f"output{path}"


def numpy_leaves(
    tree: Any, what: str = "returned", left_out: list[str] | None = None
) -> list[tuple[str, np.ndarray]]:
    """`flatten` with every leaf as a numpy array of numbers (Python ints, bools and floats
    too: compared exactly, or as floats); the paths of None leaves go to `left_out`.

    Raises:
        UserFunctionError: nothing was returned, or a leaf is not an array of numbers.
    """
    flat = flatten(tree, left_out)
    if not flat:
        raise UserFunctionError(f"the function {what} no arrays (got {type(tree).__name__})")
    out = []
    for path, leaf in flat:
        if not _is_leaf_array(leaf):
            raise UserFunctionError(
                f"the function {what} a {type(leaf).__name__} at {leaf_name(path)}, not an "
                f"array: return arrays, or a tuple, list or dict of them"
            )
        arr = to_numpy(leaf)
        if arr.dtype.kind not in "biuf" and arr.dtype.name != "bfloat16":
            raise UserFunctionError(
                f"the function {what} {arr.dtype} values at {leaf_name(path)}: diag judges "
                f"arrays of floats, integers or booleans"
            )
        out.append((path, arr))
    return out
