"""Ground truth: the exact result of each op on the given inputs, rounded once to the output dtype.

Functions here carry the SAME names as the backend ops (`matmul`, `softmax`, `top_k`), so the
runner does ``getattr(diag.oracle, probe.op)(*inputs)``. Each op also has a
``<op>_result`` form returning an `OracleResult` with how the answer was obtained (method, exact
fallbacks, cache hit, time): nothing about the proof is hidden.

`diag.oracle.mp` is the slow mpmath reference the fast paths are tested against, bit for bit.
This package imports numpy, ml_dtypes and mpmath only (never jax or torch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from diag.errors import UsageError
from diag.numerics import as_dtype, dtype_name
from diag.oracle import mp
from diag.oracle._args import check_matmul_args
from diag.oracle._gelu import GELU_DTYPES, gelu_core
from diag.oracle._matmul import MATMUL_INPUT_DTYPES, matmul_core
from diag.oracle._softmax import SOFTMAX_INPUT_DTYPES, SOFTMAX_OUTPUT_DTYPES, softmax_core
from diag.oracle._topk import check_k, rank_key, top_k_core
from diag.oracle.cache import ORACLE_VERSION, CachedTruth, GroundTruthCache, default_cache_dir

__all__ = [
    "ORACLE_VERSION",
    "CachedTruth",
    "GroundTruthCache",
    "OracleResult",
    "default_cache_dir",
    "gelu",
    "gelu_result",
    "matmul",
    "matmul_result",
    "mp",
    "rank_key",
    "softmax",
    "softmax_result",
    "top_k",
    "top_k_result",
]


@dataclass(frozen=True)
class OracleResult:
    """A ground-truth value and how it was obtained.

    Attributes:
        value: the correctly rounded result.
        method: the fast path used (matmul: "f64-bound", "f64-ksplit", "dd-exact-products";
            softmax: "f64-exp-bound"; top_k: "stable-sort"; "empty").
        fallbacks: elements the fast path could not prove; each was then settled exactly
            (matmul: Ozaki's split, an error-free extraction sum or an exact sum; softmax:
            mpmath).
        elements: number of output elements.
        cache_hit: True if the value came from the ground-truth cache.
        seconds: wall time of this call.
        exact: of the fallbacks, elements that needed the exact (math.fsum) sum.
        extra: op-specific facts (softmax: "undefined_rows", "nan_rows"; top_k: "indices").
    """

    value: np.ndarray
    method: str
    fallbacks: int
    elements: int
    cache_hit: bool
    seconds: float
    exact: int = 0
    extra: dict = field(default_factory=dict)


def _cached(hit: CachedTruth, t0: float, **extra) -> OracleResult:
    """An `OracleResult` for a cache hit, with the provenance the entry was stored with."""
    return OracleResult(
        value=hit.value,
        method=str(hit.meta.get("method", "")),
        fallbacks=int(hit.meta.get("fallbacks", 0)),
        elements=int(hit.value.size),
        cache_hit=True,
        seconds=time.perf_counter() - t0,
        exact=int(hit.meta.get("exact", 0)),
        extra=extra,
    )


def _computed(
    op: str,
    value: np.ndarray,
    method: str,
    t0: float,
    cache: GroundTruthCache | None,
    key: str | None,
    stored: dict,
    *,
    fallbacks: int = 0,
    exact: int = 0,
    extra: dict | None = None,
) -> OracleResult:
    """An `OracleResult` for a value just computed (the twin of `_cached`), first stored in
    `cache` under `key` when there is one, with its provenance: the op, the method and the
    op's own `stored` facts (the entry's meta, which `_cached` reads back)."""
    if cache is not None and key is not None:  # key is set whenever cache is
        cache.put(key, value, {"op": op, "method": method, **stored})
    return OracleResult(
        value=value,
        method=method,
        fallbacks=fallbacks,
        elements=int(value.size),
        cache_hit=False,
        seconds=time.perf_counter() - t0,
        exact=exact,
        extra=extra if extra is not None else {},
    )


def matmul_result(a, b, out_dtype=None, *, cache: GroundTruthCache | None = None) -> OracleResult:
    """Correctly rounded ``a @ b`` with its provenance.

    The exact product of the given inputs, rounded once, to nearest-even, to `out_dtype`; IEEE
    semantics for subnormals, signed zeros, inf and NaN of the exact sum.

    Args:
        a: [..., M, K] float32, bfloat16, float16 or float8 array.
        b: [..., K, N] array; batch dims broadcast as in numpy.
        out_dtype: output dtype (name or dtype); default the inputs' dtype.
        cache: optional `GroundTruthCache`; a hit skips the computation.

    Returns:
        `OracleResult`; `fallbacks` counts elements recomputed exactly (never hidden).

    Raises:
        UsageError: unsupported dtype, shapes that do not multiply, mixed dtypes without
            out_dtype.
    """
    t0 = time.perf_counter()
    a, b, out_dt, batch = check_matmul_args(a, b, out_dtype, "oracle.matmul", MATMUL_INPUT_DTYPES)
    key = None
    if cache is not None:
        key = cache.key("matmul", [a, b], out_dt)
        hit = cache.get(key)
        if hit is not None:
            return _cached(hit, t0)
    m, n = a.shape[-2], b.shape[-1]
    # 2-D: the core's own array is the value (no copy); batched: one slice per product.
    value = np.empty(batch + (m, n) if batch else (0, 0), out_dt)
    a_b = np.broadcast_to(a, batch + a.shape[-2:])
    b_b = np.broadcast_to(b, batch + b.shape[-2:])
    methods: list[str] = []
    fallbacks = exact = 0
    for idx in np.ndindex(*batch):
        # Overflow to inf in casts and bounds is expected and handled (IEEE semantics).
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            v, method, fb, ex = matmul_core(a_b[idx], b_b[idx], out_dt)
        if batch:
            value[idx] = v
        else:
            value = v
        fallbacks += fb
        exact += ex
        if method not in methods:
            methods.append(method)
    method = "+".join(methods) or "empty"
    stored = {"fallbacks": fallbacks, "exact": exact}
    return _computed(
        "matmul", value, method, t0, cache, key, stored, fallbacks=fallbacks, exact=exact
    )


def train_step_result(
    x, w1, w2, lr: float = 0.1, *, cache: GroundTruthCache | None = None
) -> OracleResult:
    """The training-step probe's reference: one SGD step of a small MLP in float64, each
    output rounded once to the inputs' dtype (`diag.oracle._train`; NOT an exact result: a
    float64 evaluation, whose error is far below the dtype's ulp at the probe's sizes).

    Returns:
        `OracleResult` with value = the loss (0-d array) and extra = {"w1", "w2"} (updated
        weights), method "float64-reference".
    """
    from diag.numerics import round_to_dtype
    from diag.oracle._train import train_step_core

    t0 = time.perf_counter()
    arrays = [np.asarray(a) for a in (x, w1, w2)]
    dt = arrays[0].dtype
    as_dtype(dt)
    x64, w1_64, w2_64 = (a.astype(np.float64) for a in arrays)
    loss, n1, n2 = train_step_core(x64, w1_64, w2_64, lr)
    with np.errstate(over="ignore", invalid="ignore"):
        value = round_to_dtype(np.asarray(loss), dt)
        extra = {"w1": round_to_dtype(n1, dt), "w2": round_to_dtype(n2, dt)}
    return OracleResult(
        value=value,
        method="float64-reference",
        fallbacks=0,
        elements=1 + n1.size + n2.size,
        cache_hit=False,
        seconds=time.perf_counter() - t0,
        extra=extra,
    )


def matmul(a, b, out_dtype=None) -> np.ndarray:
    """Correctly rounded ``a @ b``: `matmul_result(a, b, out_dtype).value`.

    Same name and argument order as the backend ops, so the runner can
    ``getattr(diag.oracle, "matmul")``.
    """
    return matmul_result(a, b, out_dtype).value


def _last_axis_input(x, who: str, allowed) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in allowed:
        raise UsageError(
            f"{who}: input is {x.dtype}; expected one of "
            f"{', '.join(dtype_name(d) for d in allowed)}"
        )
    if x.ndim == 0:
        raise UsageError(f"{who}: input is a scalar; expected [..., n]")
    return x


def softmax_result(
    x, out_dtype=None, *, cache: GroundTruthCache | None = None, _slack: float = 1.0
) -> OracleResult:
    """Correctly rounded softmax over the last axis, with its provenance.

    The exact ``exp(x_i - max) / sum_j exp(x_j - max)`` of the given inputs, rounded once
    (nearest-even) to `out_dtype`. -inf entries give exactly +0. Rows holding NaN or +inf give
    NaN (listed in ``extra["nan_rows"]``); rows that are all -inf have no defined result, give
    NaN and are listed in ``extra["undefined_rows"]`` (flat row numbers over the leading dims).
    How it is proven: diag/oracle/_softmax.py and docs/oracle.md.

    Args:
        x: [..., n] float32, bfloat16, float16 (or float8) array.
        out_dtype: output dtype (not float64); default x's dtype.
        cache: optional `GroundTruthCache`; a hit skips the computation.

    Returns:
        `OracleResult` with method "f64-exp-bound"; `fallbacks` counts elements settled by
        mpmath.

    Raises:
        UsageError: unsupported input or output dtype, or a 0-d input.
    """
    t0 = time.perf_counter()
    x = _last_axis_input(x, "oracle.softmax", SOFTMAX_INPUT_DTYPES)
    out_dt = as_dtype(out_dtype if out_dtype is not None else x.dtype)
    if out_dt not in SOFTMAX_OUTPUT_DTYPES:
        raise UsageError(
            f"oracle.softmax: output dtype {dtype_name(out_dt)} is not supported; "
            f"expected one of "
            f"{', '.join(dtype_name(d) for d in SOFTMAX_OUTPUT_DTYPES)}"
        )
    key = None
    if cache is not None:
        key = cache.key("softmax", [x], out_dt)
        hit = cache.get(key)
        if hit is not None:
            return _cached(
                hit,
                t0,
                undefined_rows=list(hit.meta.get("undefined_rows", [])),
                nan_rows=list(hit.meta.get("nan_rows", [])),
            )
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    value, fallbacks, undefined, nan_rows = softmax_core(flat, out_dt, _slack)
    value = value.reshape(x.shape)
    method = "f64-exp-bound" if value.size else "empty"
    extra = {"undefined_rows": undefined, "nan_rows": nan_rows}
    stored = {"fallbacks": fallbacks, **extra}
    return _computed(
        "softmax", value, method, t0, cache, key, stored, fallbacks=fallbacks, extra=extra
    )


def softmax(x, out_dtype=None) -> np.ndarray:
    """Correctly rounded softmax over the last axis: `softmax_result(x, out_dtype).value`."""
    return softmax_result(x, out_dtype).value


def gelu_result(
    x, out_dtype=None, *, cache: GroundTruthCache | None = None, _slack: float = 1.0
) -> OracleResult:
    """Correctly rounded tanh-approximate GELU, element by element, with its provenance.

    The exact ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` of each input, rounded once
    (nearest-even) to `out_dtype`; NaN -> NaN, +inf -> +inf, -inf -> -0. How it is proven:
    diag/oracle/_gelu.py.

    Returns:
        `OracleResult` with method "f64-exp-bound"; `fallbacks` counts elements settled by
        mpmath.

    Raises:
        UsageError: an input or output dtype other than float32, bfloat16, float16.
    """
    t0 = time.perf_counter()
    x = np.asarray(x)
    out_dt = as_dtype(out_dtype if out_dtype is not None else x.dtype)
    if x.dtype not in GELU_DTYPES or out_dt not in GELU_DTYPES:
        raise UsageError(
            f"oracle.gelu: dtypes {dtype_name(x.dtype)} -> {dtype_name(out_dt)} "
            f"are not supported; expected float32, bfloat16 or float16"
        )
    key = None
    if cache is not None:
        key = cache.key("gelu", [x], out_dt)
        hit = cache.get(key)
        if hit is not None:
            return _cached(hit, t0)
    value, fallbacks = gelu_core(x, out_dt, _slack)
    method = "f64-exp-bound" if value.size else "empty"
    stored = {"fallbacks": fallbacks}
    return _computed("gelu", value, method, t0, cache, key, stored, fallbacks=fallbacks)


def gelu(x, out_dtype=None) -> np.ndarray:
    """Correctly rounded tanh-approximate GELU: `gelu_result(x, out_dtype).value`."""
    return gelu_result(x, out_dtype).value


def top_k_result(x, k: int, *, cache: GroundTruthCache | None = None) -> OracleResult:
    """Exact top-k over the last axis in diag's total order, with its provenance.

    The order (docs/oracle.md): NaN above +inf, then descending value, -0 equal to +0, lower
    index first among equals. Values keep the input's bits.

    Args:
        x: [..., n] array of any float dtype diag knows.
        k: how many, 0 <= k <= n.
        cache: optional `GroundTruthCache` (values and indices are both stored).

    Returns:
        `OracleResult` whose value is [..., k] in x's dtype and ``extra["indices"]`` the [..., k]
        int64 indices.

    Raises:
        UsageError: unsupported dtype, 0-d input, or k not an integer in 0..n.
    """
    t0 = time.perf_counter()
    x = np.asarray(x)
    as_dtype(x.dtype)
    x = _last_axis_input(x, "oracle.top_k", (x.dtype,))
    k = check_k(k, x.shape[-1], "oracle.top_k")
    key = None
    if cache is not None:
        key = cache.key("top_k", [x], x.dtype, k=k)
        hit, hit_idx = cache.get(key), cache.get(key + "-indices")
        if hit is not None and hit_idx is not None:
            return _cached(hit, t0, indices=hit_idx.value.astype(np.int64))
    values, idx = top_k_core(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), k)
    values = values.reshape(x.shape[:-1] + (k,))
    idx = idx.reshape(x.shape[:-1] + (k,))
    method = "stable-sort" if values.size else "empty"
    if cache is not None and key is not None:  # key is set whenever cache is
        # Indices < 2**53 are exact in float64, which the cache stores bit for bit.
        cache.put(key + "-indices", idx.astype(np.float64), {"op": "top_k/indices"})
    return _computed("top_k", values, method, t0, cache, key, {"k": k}, extra={"indices": idx})


def top_k(x, k: int):
    """Exact top-k over the last axis: (values, indices) of `top_k_result(x, k)`.

    Same name and argument order as the backend ops (``jax.lax.top_k(x, k)``).
    """
    res = top_k_result(x, k)
    return res.value, res.extra["indices"]
