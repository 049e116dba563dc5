"""The dot algorithms by name (JAX's `DotAlgorithmPreset`), as data, and their CPU emulators.

A matmul's arithmetic is named after these (`diag.arith.precision.fingerprint`), and the `emu-*`
backends run them. An emulation is a model of an algorithm, never a hardware result.

Emulator definitions (`ALGORITHMS`; sources: JAX `jax.lax.DotAlgorithmPreset` docs, whose
names are `LHS_RHS_ACCUM` with `_X3`/`_X6` meaning "3 (6) operations to emulate higher
precision"; XLA's dot-algorithm rewriter and Triton's `BF16DotTC` pass for the split):

- Input conversion: every float32 input is rounded to the algorithm's input format with
  round-to-nearest, ties-to-even (bf16 via `ml_dtypes`, fp16 via numpy, TF32 by rounding
  away the low 13 significand bits). Hardware may convert differently: PTX's
  `cvt.rna.tf32.f32` rounds ties away from zero, and XLA's GPU Triton emitter truncates
  toward zero when it splits for `BF16_BF16_F32_X6`. The fingerprint reports the rounding it
  observes (`input_rounding`) for single-pass algorithms; the bit counts are the same.
- Products are exact: a bf16*bf16 (8+8 bits), TF32*TF32 or fp16*fp16 (11+11 bits) product
  fits in float32's 24 bits, so it is formed in float32 without error. `F32_F32_F32`
  rounds each product to float32 (no fused multiply-add).
- Multi-pass: `x = hi + mid + lo` with `hi = r(x)`, `mid = r(x - hi)`, `lo = r(x - hi - mid)`
  (each subtraction exact in float32). `_X3` sums `hi*lo + lo*hi + hi*hi`; `_X6` sums the six
  largest cross terms `mid*mid + hi*lo + lo*hi + hi*mid + mid*hi + hi*hi`.
- Accumulation: one float32 accumulator per output element, starting at 0. The passes run
  smallest term first (as Triton chains its dots: small terms first, `hi*hi` last), and
  within a pass the K products are added sequentially in index order, each addition rounded
  to nearest-even in float32. Deterministic on every machine.
- Output: rounded once (nearest-even) to the common dtype of the inputs, as frameworks
  return bf16 for a bf16 x bf16 matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["ALGORITHMS", "Algorithm", "emulate", "emulator", "round_to"]


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> TF32 (10 explicit significand bits, float32's exponent), nearest-even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (u & 0x7F800000) != 0x7F800000
    # Adding 0x0FFF plus the lowest kept bit then clearing 13 bits rounds to nearest-even;
    # a carry into the exponent is the correct rounding up (to inf at the top of the range).
    bias = np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))
    rounded = (u + bias) & np.uint32(0xFFFFE000)
    return np.where(finite, rounded, u).view(np.float32)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is what the conversion does
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _round_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


# Input formats: (explicit significand bits, rounding function float32 -> float32 values).
_FORMATS: dict[str, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    "f32": (23, _round_f32),
    "tf32": (10, _round_tf32),
    "bf16": (7, _round_bf16),
    "f16": (10, _round_f16),
}


def round_to(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round float32 values to an input format (`f32`, `tf32`, `bf16`, `f16`), nearest-even.

    Returns float32 arrays holding the rounded values (all exactly representable).
    """
    return _FORMATS[fmt][1](x)


# Cross terms of a split (i, j) = piece i of A times piece j of B, 0 = hi, 1 = mid, 2 = lo;
# listed smallest first, the order they are accumulated in.
_TERMS = {
    1: ((0, 0),),
    3: ((0, 1), (1, 0), (0, 0)),
    6: ((1, 1), (0, 2), (2, 0), (0, 1), (1, 0), (0, 0)),
}


@dataclass(frozen=True)
class Algorithm:
    """A dot algorithm as data: input format, passes, and its `DotAlgorithmPreset` name.

    Attributes:
      label: JAX's `DotAlgorithmPreset` name (`BF16_BF16_F32_X3`).
      short: the suffix of its emulated backend name (`bf16x3` -> `emu-bf16x3`).
      fmt: the format each input is rounded (or split) into.
      passes: how many products per input pair (1, 3 or 6).
      what: one line for people.
    """

    label: str
    short: str
    fmt: str
    passes: int
    what: str

    @property
    def pieces(self) -> int:
        return {1: 1, 3: 2, 6: 3}[self.passes]


ALGORITHMS: dict[str, Algorithm] = {
    a.label: a
    for a in (
        Algorithm("F32_F32_F32", "f32", "f32", 1, "float32 products and accumulation"),
        Algorithm(
            "TF32_TF32_F32",
            "tf32",
            "tf32",
            1,
            "inputs rounded to TF32 (10 significand bits), float32 accumulation: "
            "NVIDIA tensor cores with TF32 allowed",
        ),
        Algorithm(
            "TF32_TF32_F32_X3",
            "tf32x3",
            "tf32",
            3,
            "each input split into 2 TF32 pieces, 3 products, float32 accumulation",
        ),
        Algorithm(
            "BF16_BF16_F32",
            "bf16x1",
            "bf16",
            1,
            "inputs rounded to bf16 (7 significand bits), float32 accumulation: "
            "one MXU pass, TPU's DEFAULT precision",
        ),
        Algorithm(
            "BF16_BF16_F32_X3",
            "bf16x3",
            "bf16",
            3,
            "each input split into 2 bf16 pieces, 3 products, float32 accumulation: "
            "TPU's HIGH precision",
        ),
        Algorithm(
            "BF16_BF16_F32_X6",
            "bf16x6",
            "bf16",
            6,
            "each input split into 3 bf16 pieces, the 6 largest products, float32 "
            "accumulation: TPU's HIGHEST precision",
        ),
        Algorithm(
            "F16_F16_F32",
            "f16",
            "f16",
            1,
            "inputs rounded to float16 (10 significand bits, range +-65504), float32 accumulation",
        ),
    )
}


def _split(x: np.ndarray, fmt: str, pieces: int) -> list[np.ndarray]:
    """x = sum of `pieces` values in `fmt`; each remainder is exact in float32."""
    out, rest = [], np.asarray(x, np.float32)
    for _ in range(pieces):
        p = round_to(rest, fmt)
        out.append(p)
        with np.errstate(invalid="ignore"):  # inf - inf: the piece stays inf, rest NaN
            rest = (rest - p).astype(np.float32)
    return out


def emulate(label: str, a: Any, b: Any) -> np.ndarray:
    """`a @ b` computed with the dot algorithm `label`, as defined in this module's docstring.

    Args:
      label: a key of `ALGORITHMS` (`BF16_BF16_F32`, ...).
      a, b: array-likes of shape [..., M, K] and [..., K, N] (float32, bfloat16 or float16;
        batch dimensions broadcast as in `np.matmul`).

    Returns:
      The product, in the common dtype of the inputs.

    Raises:
      ValueError: an unknown algorithm or shapes that do not multiply.
    """
    try:
        algo = ALGORITHMS[label]
    except KeyError:
        raise ValueError(
            f"diag: unknown dot algorithm '{label}'; known: {', '.join(ALGORITHMS)}"
        ) from None
    a, b = np.asarray(a), np.asarray(b)
    out_dtype = np.result_type(a.dtype, b.dtype)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"diag: cannot multiply shapes {a.shape} and {b.shape}")
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    pa, pb = _split(a32, algo.fmt, algo.pieces), _split(b32, algo.fmt, algo.pieces)
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = np.zeros(shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i, j in _TERMS[algo.passes]:
            x, y = pa[i], pb[j]
            for k in range(a.shape[-1]):
                # Both float32: the product is exact for every narrow format (see above) and
                # rounded once for F32_F32_F32; the sum is rounded once per step.
                acc += x[..., :, k, None] * y[..., None, k, :]
    return acc.astype(out_dtype)


def emulator(label: str) -> Callable[[Any, Any], np.ndarray]:
    """A matmul function `(a, b) -> a @ b` that emulates `label` (see `emulate`)."""
    if label not in ALGORITHMS:
        emulate(label, np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))

    def matmul(a, b):
        return emulate(label, a, b)

    matmul.__name__ = f"emulate_{ALGORITHMS[label].short}"
    return matmul
