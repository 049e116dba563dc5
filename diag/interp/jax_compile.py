"""One equation on concrete values, with as few compilations as possible.

Evaluating a training step equation by equation means running hundreds of small programs; on
CPU compiling each (~10-100 ms) costs far more than running it. Three things keep that down:

* one `jax.jit` per primitive and parameters, whose cache is keyed by the inputs' shapes and
  dtypes: a step's layers repeat the same few signatures;
* elementwise equations (every operand the output's shape, or a scalar) run on flat copies
  padded to a power of two (`bucket`): an optimizer's update of twenty parameter shapes
  compiles each of its ops once or twice instead of twenty times. Each element is computed by
  the same code whatever the length, and the padding is cut off again;
* the programs are kept in JAX's persistent compilation cache (`persistent_cache`), so a second
  hunt in a fresh process loads them instead of compiling.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

_COMPILED: dict = {}  # (primitive, parameters) -> jitted bind, or _DIRECT
_DIRECT = object()  # marks a primitive that binds directly, uncompiled

# Primitives whose output element i depends on operand element i alone, with no parameter that
# names a shape or an axis.
ELEMENTWISE = frozenset(
    """
abs acos acosh add asin asinh atan atan2 atanh cbrt ceil clamp cos cosh digamma div erf erf_inv
erfc exp exp2 expm1 floor igamma igammac integer_pow is_finite lgamma log log1p logistic max min
mul ne eq lt le gt ge neg nextafter pow rem round rsqrt select_n sign sin sinh sqrt square sub
tan tanh not and or xor add_any
""".split()
)
_MIN_BUCKET = 256
CACHE_MAX_BYTES = 256 * 2**20  # the persistent cache folder's bound


def bind_params(e) -> tuple[tuple, dict]:
    """(sub-functions, parameters) to bind equation `e`'s primitive with."""
    try:
        params = e.primitive.get_bind_params(e.params)
    except AttributeError:  # pragma: no cover - older JAX
        params = e.params
    if isinstance(params, tuple):  # (subfuns, params) in some JAX versions
        return tuple(params[0]), params[1]
    return (), params


def bind(e, vals: list, params: dict | None = None, *, bucket: bool = False) -> list:
    """Run one first-order equation on concrete values; its outputs as a list.

    Args:
        e: the equation.
        vals: its operands (JAX or numpy arrays, Python scalars).
        params: replaces the equation's own parameters (``diag.diverge`` widens their dtypes
            to float64).
        bucket: run an elementwise equation on CPU on flat operands padded to a power of two.
    """
    subfuns, own = bind_params(e)
    params = own if params is None else params
    prim = e.primitive
    fn: Any = _compiled(prim, params) if not subfuns else _DIRECT  # a jitted bind or _DIRECT
    if bucket and _ON_CPU and prim.name in _MOVES:
        moved = _move(prim.name, vals, params)
        if moved is not None:
            return [moved]
    if fn is not _DIRECT:
        try:
            if bucket and prim.name in ELEMENTWISE and _ON_CPU:
                flat = _bucketed(fn, vals, tuple(e.outvars[0].aval.shape))
                if flat is not None:
                    return flat
            out = fn(*vals)
            return list(out) if prim.multiple_results else [out]
        except Exception:  # noqa: BLE001 - a primitive jit cannot wrap alone (shard_map)
            _COMPILED[(prim, tuple(sorted(params.items())))] = _DIRECT
    out = prim.bind(*subfuns, *vals, **params)
    return list(out) if prim.multiple_results else [out]


def _broadcast(x, p: dict):
    dims = [1] * len(p["shape"])
    for i, d in enumerate(p["broadcast_dimensions"]):
        dims[d] = np.shape(x)[i]
    return np.broadcast_to(np.asarray(x).reshape(dims), tuple(p["shape"]))


# Equations that only move or repeat values (no arithmetic: exact in numpy), with the numpy
# that does it; on CPU numpy reads JAX's buffers in place, and nothing is compiled.
_MOVES = {
    "reshape": lambda x, p: (
        np.reshape(np.asarray(x), tuple(p["new_sizes"])) if p.get("dimensions") is None else None
    ),
    "broadcast_in_dim": _broadcast,
    "transpose": lambda x, p: np.transpose(np.asarray(x), tuple(p["permutation"])),
    "squeeze": lambda x, p: np.squeeze(np.asarray(x), axis=tuple(p["dimensions"])),
}


def _move(name: str, vals: list, params: dict):
    """The numpy form of a move-only equation, or None when it does not apply."""
    if len(vals) != 1 or not hasattr(vals[0], "shape") or vals[0].dtype == object:
        return None
    try:
        return _MOVES[name](vals[0], params)
    except (TypeError, ValueError, KeyError):
        return None


def _compiled(prim, params: dict):
    try:
        key = (prim, tuple(sorted(params.items())))
        fn = _COMPILED.get(key)
    except TypeError:  # an unhashable parameter
        return _DIRECT
    if fn is None:
        fn = _COMPILED[key] = jax.jit(partial(_bind_one, prim, params))
    return fn


def _bind_one(prim, params: dict, *vals):
    out = prim.bind(*vals, **params)
    return list(out) if prim.multiple_results else out


def _bucketed(fn, vals: list, shape: tuple[int, ...]) -> list | None:
    """`fn` on flat copies of the full-shape operands padded to a power of two; the output cut
    back to `shape`. None when an operand is neither full-shape nor a scalar."""
    n = int(np.prod(shape, dtype=np.int64))
    size = max(_MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
    if size == n:
        return None  # already a bucket size: nothing to gain
    flat = []
    for v in vals:
        vs = np.shape(v)
        if vs == ():
            flat.append(v)
        elif tuple(vs) == shape:
            a = np.asarray(v).reshape(-1)
            flat.append(np.concatenate([a, np.zeros(size - n, a.dtype)]))
        else:
            return None
    out = fn(*flat)
    return [np.asarray(out)[:n].reshape(shape)]


_ON_CPU = jax.default_backend() == "cpu"


def cache_folder() -> Path:
    """``$DIAG_CACHE_DIR/jax-ops``, else ``~/.cache/diag/jax-ops``."""
    env = os.environ.get("DIAG_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "diag"
    return root / "jax-ops"


@contextlib.contextmanager
def persistent_cache(folder: Path | None = None) -> Iterator[None]:
    """Compile into (and load from) JAX's persistent compilation cache under `folder` for the
    duration, every program however fast it compiled; the user's own setting is restored
    after. A user who configured a cache folder keeps theirs."""
    if jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]  # flags: no stubs
        yield
        return
    folder = folder or cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: compile without the cache
        yield
        return
    # jax.config's flags are set at run time: its stubs declare none of them.
    before = (
        jax.config.jax_persistent_cache_min_compile_time_secs,  # type: ignore[attr-defined]
        jax.config.jax_compilation_cache_max_size,  # type: ignore[attr-defined]
    )
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX evicts the least recently used programs past this size (a program of one equation
    # is a few KiB: ~170 files, 0.7 MB, for a Flax/optax step).
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    _reset()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[0])
        jax.config.update("jax_compilation_cache_max_size", before[1])
        _reset()


def _reset() -> None:
    """Make JAX re-read the cache settings (it reads them once, at its first compilation)."""
    try:
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except Exception:  # noqa: BLE001 - private API: without it the setting may not apply
        pass
