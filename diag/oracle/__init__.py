"""Ground truth: the exact result of each op on the given inputs, rounded once to the output dtype.

Functions here carry the SAME names as the backend ops (`matmul`; `softmax` and `top_k` come
later), so the runner does ``getattr(diag.oracle, probe.op)(*inputs)``. Each op also has a
``<op>_result`` form returning an `OracleResult` with how the answer was obtained (method, exact
fallbacks, cache hit, time): nothing about the proof is hidden.

`diag.oracle.mp` is the slow mpmath reference the fast paths are tested against, bit for bit.
This package imports numpy, ml_dtypes and mpmath only (never jax or torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from diag.oracle import mp
from diag.oracle._args import check_matmul_args
from diag.oracle._matmul import _INPUT_DTYPES, matmul_core
from diag.oracle.cache import ORACLE_VERSION, CachedTruth, GroundTruthCache, default_cache_dir

__all__ = [
    "ORACLE_VERSION",
    "CachedTruth",
    "GroundTruthCache",
    "OracleResult",
    "default_cache_dir",
    "matmul",
    "matmul_result",
    "mp",
]


@dataclass(frozen=True)
class OracleResult:
    """A ground-truth value and how it was obtained.

    Attributes:
        value: the correctly rounded result.
        method: the fast path used ("f64-bound", "f64-ksplit-dd", "dd-exact-products", "empty").
        fallbacks: elements the BLAS fast path could not prove; each was then settled by an
            error-free TwoSum tree over its products or, failing that, an exact sum.
        elements: number of output elements.
        cache_hit: True if the value came from the ground-truth cache.
        seconds: wall time of this call.
        exact: of the fallbacks, elements that needed the exact (math.fsum) sum.
    """

    value: np.ndarray
    method: str
    fallbacks: int
    elements: int
    cache_hit: bool
    seconds: float
    exact: int = 0


def matmul_result(a, b, out_dtype=None, *, cache: Optional[GroundTruthCache] = None
                  ) -> OracleResult:
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
    a, b, out_dt, batch = check_matmul_args(a, b, out_dtype, "oracle.matmul", _INPUT_DTYPES)
    key = None
    if cache is not None:
        key = cache.key("matmul", [a, b], out_dt)
        hit = cache.get(key)
        if hit is not None:
            return OracleResult(value=hit.value, method=str(hit.meta.get("method", "")),
                                fallbacks=int(hit.meta.get("fallbacks", 0)),
                                elements=int(hit.value.size), cache_hit=True,
                                seconds=time.perf_counter() - t0,
                                exact=int(hit.meta.get("exact", 0)))
    m, n = a.shape[-2], b.shape[-1]
    value = np.empty(batch + (m, n), out_dt)
    a_b = np.broadcast_to(a, batch + a.shape[-2:])
    b_b = np.broadcast_to(b, batch + b.shape[-2:])
    methods: list[str] = []
    fallbacks = exact = 0
    for idx in np.ndindex(*batch):
        # Overflow to inf in casts and bounds is expected and handled (IEEE semantics).
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            v, method, fb, ex = matmul_core(a_b[idx], b_b[idx], out_dt)
        value[idx] = v
        fallbacks += fb
        exact += ex
        if method not in methods:
            methods.append(method)
    method = "+".join(methods) or "empty"
    if cache is not None:
        cache.put(key, value, {"op": "matmul", "method": method, "fallbacks": fallbacks,
                               "exact": exact})
    return OracleResult(value=value, method=method, fallbacks=fallbacks,
                        elements=int(value.size), cache_hit=False,
                        seconds=time.perf_counter() - t0, exact=exact)


def matmul(a, b, out_dtype=None) -> np.ndarray:
    """Correctly rounded ``a @ b``: `matmul_result(a, b, out_dtype).value`.

    Same name and argument order as the backend ops, so the runner can
    ``getattr(diag.oracle, "matmul")``.
    """
    return matmul_result(a, b, out_dtype).value
