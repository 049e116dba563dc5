"""A user's function called on arrays drawn by diag's input makers
(`diag.plan.makers.INPUT_MAKERS`), as a suite entry asks for with ``inputs``, ``shape``,
``dtype`` and ``seed``:

    [[probe]]
    name = "softplus"
    fn = "mine.py:softplus"      # the function itself, called with the drawn arrays
    inputs = "normal"
    shape = [[64, 128]]           # one shape per argument ([64, 128] alone: one argument)
    dtype = "float32"
    seed = 3

The arrays are drawn with numpy from the seed, as the ops' inputs are, so they are
bit-identical in the host and in every worker; a PyTorch function gets them as tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from diag import numerics
from diag.interp import names_framework
from diag.userfn.load import UserFunctionError


def draw_spec(inputs: str, shapes: list, dtype: str, seed: int) -> str:
    """The canonical text of a draw (what cases and workers carry).

    Raises:
        UserFunctionError: an unknown maker or dtype, or a shape that is not a list of sizes.
    """
    from diag.plan.makers import INPUT_MAKERS

    if inputs not in INPUT_MAKERS:
        raise UserFunctionError(f"inputs: one of {', '.join(INPUT_MAKERS)}, got {inputs!r}")
    if shapes and all(isinstance(n, int) for n in shapes):
        shapes = [shapes]
    if not shapes or not all(
        isinstance(s, list) and all(isinstance(n, int) and n > 0 for n in s) for s in shapes
    ):
        raise UserFunctionError(
            f"shape: a list of positive sizes (or one per argument), got {shapes!r}"
        )
    try:
        known = isinstance(dtype, str) and numerics.is_supported(dtype)
    except (TypeError, ValueError):
        known = False
    if not known:
        raise UserFunctionError(f"dtype: a float dtype diag knows, got {dtype!r}")
    return json.dumps({"inputs": inputs, "shapes": shapes, "dtype": dtype, "seed": int(seed)})


def drawn_arrays(draw: str) -> list[np.ndarray]:
    """The arrays of a draw: one per shape, from one generator seeded with the draw's seed."""
    from diag.plan.makers import INPUT_MAKERS

    d = json.loads(draw)
    rng = np.random.default_rng(d["seed"])
    maker = INPUT_MAKERS[d["inputs"]]
    dtype = numerics.as_dtype(d["dtype"])
    return [np.asarray(maker(rng, tuple(s), dtype)) for s in d["shapes"]]


def _is_torch(fn: Callable) -> bool:
    """Whether `fn` computes with PyTorch: its code names torch, or, naming neither framework,
    its module imported torch and not JAX."""
    named = names_framework(fn)
    if named is not None:
        return named == "torch"
    tops = {
        v.__name__.partition(".")[0]
        for v in getattr(fn, "__globals__", {}).values()
        if isinstance(v, ModuleType)
    }
    return "torch" in tops and "jax" not in tops


def drawn_call(fn: Callable, draw: str) -> tuple[Callable, tuple, dict]:
    """(fn, the drawn arrays, {}); tensors for a PyTorch function (`_is_torch`)."""
    arrays: list[Any] = drawn_arrays(draw)
    if _is_torch(fn):
        import torch

        arrays = [torch.from_numpy(a.copy()) for a in arrays]
    return fn, tuple(arrays), {}
