"""The probe table: one frozen record per op, as data.

A probe says which op a case runs (the same name in every backend module and in
`diag.oracle`), which dtypes and parameters it takes, how its inputs are made, which
parameters are forwarded to the backend op, and the error bound it is judged by. Quirks live
in the record, never in `if op == ...` in the runner or the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

__all__ = ["Probe", "PROBES", "INPUT_MAKERS", "get_probe"]


def _normal(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _uniform(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype(dtype)


def _positive(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # No cancellation: every product is positive, so relative error is well defined.
    return rng.uniform(0.0, 1.0, shape).astype(dtype)


def _wide(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    # Signed values spread over ~2^-12 .. 2^12 (representable in fp16 and bf16 alike):
    # large dynamic range within one dot product, with cancellation.
    mag = np.exp2(rng.uniform(-12.0, 12.0, shape))
    return (np.where(rng.random(shape) < 0.5, -mag, mag)).astype(dtype)


INPUT_MAKERS: dict[str, Callable] = {
    "normal": _normal,
    "uniform": _uniform,
    "positive": _positive,
    "wide": _wide,
}


def _matmul_shapes(params: dict) -> list[tuple[int, ...]]:
    batch = tuple(params.get("batch", ()))
    m, k, n = params["m"], params["k"], params["n"]
    return [batch + (m, k), batch + (k, n)]


def _matmul_bound(inputs: list[np.ndarray], truth: np.ndarray, params: dict) -> np.ndarray:
    """Largest |computed - truth| a backend may show if it computes as it claims.

    The claim: products of the given inputs summed in float32 (also for bf16/fp16 inputs,
    as every framework documents), then rounded once to the output dtype. With P = |A||B|,
    e the exact product and s the float32 sum (the textbook bound |s - e| <= gamma_K P, plus
    K * eta for float32 underflow in the partial sums):
      float32 output:   |s - e| <= gamma_K P
      narrower output:  |fl(s) - e| <= (1 + u) gamma_K P + u |e| + eta_out / 2
    and the truth itself is |truth - e| <= u |e| + eta_out / 2, with |e| <= t / (1 - u)
    for t = |truth| and u the output's unit roundoff, eta_out its least subnormal.
    """
    from diag import numerics

    a, b = (np.asarray(x, dtype=np.float64) for x in inputs)
    k = a.shape[-1]
    with np.errstate(invalid="ignore"):  # inf * 0: the truth is NaN there and not judged
        absprod = np.matmul(np.abs(a), np.abs(b))
    out = truth.dtype
    u = numerics.unit_roundoff(out)
    eta_out = float(ml_dtypes.finfo(out).smallest_subnormal)
    exact_mag = np.abs(truth.astype(np.float64)) / (1 - u)
    bound = numerics.gamma(k, np.float32) * absprod + k * float(
        np.finfo(np.float32).smallest_subnormal)
    if u > numerics.unit_roundoff(np.float32):  # a final rounding to a narrower output
        bound *= 1 + u
        bound += u * exact_mag + eta_out / 2
    bound += u * exact_mag + eta_out / 2  # the truth's own rounding
    return bound


@dataclass(frozen=True)
class Probe:
    """One op as data.

    Attributes:
      op: the op name; `getattr(backend_module, op)` and `getattr(diag.oracle, op)`.
      params: parameter names a suite entry may set, with their Python types.
      op_args: the parameters forwarded to the backend op (the rest shape the inputs).
      dtypes: dtypes this probe supports.
      input_shapes: case params -> the shapes of the op's inputs.
      bound: (inputs, truth, params) -> per-element float64 bound on |computed - truth|.
      claim: a short phrase for reasons: what arithmetic the bound assumes.
    """

    op: str
    params: dict
    op_args: tuple[str, ...]
    dtypes: tuple[str, ...]
    input_shapes: Callable[[dict], list[tuple[int, ...]]]
    bound: Callable[[list, np.ndarray, dict], np.ndarray]
    claim: str


PROBES: dict[str, Probe] = {
    p.op: p
    for p in (
        Probe(
            op="matmul",
            params={"m": int, "k": int, "n": int, "batch": list,
                    "precision": str, "precision_via": str},
            op_args=("precision", "precision_via"),
            dtypes=("float32", "bfloat16", "float16"),
            input_shapes=_matmul_shapes,
            bound=_matmul_bound,
            claim="float32 accumulation",
        ),
    )
}

PRECISIONS = ("default", "high", "highest", "medium")
PRECISION_VIA = ("argument", "config")


def get_probe(op: str) -> Probe:
    return PROBES[op]
