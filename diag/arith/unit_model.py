"""A numpy model of a matmul unit (`Unit`) and the published units (`UNITS`).

The model, after Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
cores" (2021, Sec. 3), is described in `diag.arith.features`, which decides a unit's features by
comparing its outputs with what this model predicts under each hypothesis; kept apart so the
model can be read, tested and used as an emulation on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "ACC_BITS",
    "BLOCK_WIDTHS",
    "K_PROBE",
    "MAX_EXTRA_BITS",
    "ORDERS",
    "ROUNDINGS",
    "UNITS",
    "Unit",
    "as_unit_dtype",
]

K_PROBE = 64
ACC_BITS = 24  # float32 significand bits (the accumulator)
_EXACT_BITS = 29  # `extra_bits=None`: bits kept below the last place (int64 sums)
ROUNDINGS = ("nearest", "nearest_away", "toward_zero", "up", "down")
ORDERS = ("sequential", "reverse", "pairwise")
MAX_EXTRA_BITS = 8  # extra bits hypotheses 0..8; more is reported as ">=9"
BLOCK_WIDTHS = tuple(range(1, 17)) + (32, 64)

_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def as_unit_dtype(dtype: Any) -> np.dtype:
    d = np.dtype(dtype) if not isinstance(dtype, str) else _DTYPES.get(dtype)
    if d is None or d.name not in _DTYPES:
        raise ValueError(f"diag: features need float32, bfloat16 or float16 inputs, not {dtype!r}")
    return d


def _min_normal(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).tiny)


@dataclass(frozen=True)
class Unit:
    """A numpy model of a matmul unit's arithmetic (see the module docstring).

    Attributes:
      product_exact: products exact (True) or rounded to float32 before the addition.
      block: products added per fused step (w; the accumulator is the w+1-th addend).
      extra_bits: bits kept below float32's last place when aligning; None: exact.
      rounding: of each step's sum: one of `ROUNDINGS`.
      order: one of `ORDERS`.
      subnormals: `kept` or `flushed` (inputs and each step's result).
      source: the paper and table whose measurements the parameters follow.
    """

    product_exact: bool = True
    block: int = 1
    extra_bits: int | None = None
    rounding: str = "nearest"
    order: str = "sequential"
    subnormals: str = "kept"
    source: str = ""

    def __call__(self, a: Any, b: Any) -> np.ndarray:
        """`a @ b` ([M, K] x [K, N], any float dtype) as this unit computes it, float32."""
        a, b = np.asarray(a), np.asarray(b)
        x, y = a.astype(np.float64), b.astype(np.float64)
        if self.subnormals == "flushed":
            x = np.where(np.abs(x) < _min_normal(a.dtype), 0.0, x)
            y = np.where(np.abs(y) < _min_normal(b.dtype), 0.0, y)
        return self._accumulate(x[:, :, None] * y[None, :, :])  # <= 48 bits: exact

    def diagonal(self, a: Any, b: Any) -> np.ndarray:
        """The diagonal of `self(a, b)` only (what `features` reads), at a fraction of the cost."""
        a, b = np.asarray(a), np.asarray(b)
        n = min(a.shape[0], b.shape[1])
        x, y = a[:n].astype(np.float64), b[:, :n].astype(np.float64)
        if self.subnormals == "flushed":
            x = np.where(np.abs(x) < _min_normal(a.dtype), 0.0, x)
            y = np.where(np.abs(y) < _min_normal(b.dtype), 0.0, y)
        return self._accumulate((x * y.T)[:, :, None])[:, 0]

    def _accumulate(self, prods: np.ndarray) -> np.ndarray:
        """prods [M, K, N] (exact) -> the float32 sums this unit forms."""
        if not self.product_exact:
            prods = prods.astype(np.float32).astype(np.float64)
        idx = list(range(prods.shape[1]))
        if self.order == "reverse":
            idx.reverse()
        blocks = [idx[i : i + self.block] for i in range(0, len(idx), self.block)]
        zero = np.zeros((prods.shape[0], prods.shape[2]))
        if self.order == "pairwise":
            level = [self._step([zero] + [prods[:, k, :] for k in blk]) for blk in blocks]
            while len(level) > 1:
                level = [self._step(level[i : i + 2]) for i in range(0, len(level), 2)]
            return level[0].astype(np.float32)
        acc = zero
        for blk in blocks:
            acc = self._step([acc] + [prods[:, k, :] for k in blk])
        return acc.astype(np.float32)

    def _step(self, terms: list[np.ndarray]) -> np.ndarray:
        """One fused step: align to the largest exponent, add exactly, round to float32."""
        t = np.stack(terms)
        nz = t != 0
        _, e = np.frexp(np.where(nz, t, 1.0))
        emax = np.max(np.where(nz, e.astype(np.int64), -10_000), axis=0) - 1  # of the largest
        extra = _EXACT_BITS if self.extra_bits is None else self.extra_bits
        qexp = emax - (ACC_BITS - 1) - extra  # the aligned addends are multiples of 2^qexp
        ints = np.trunc(np.ldexp(t, -qexp[None])).astype(np.int64)
        s = ints.sum(axis=0)
        out = _round_int(s, qexp, self.rounding)
        out = np.where(nz.any(axis=0), out, 0.0)
        if self.subnormals == "flushed":
            out = np.where(np.abs(out) < _min_normal(np.dtype(np.float32)), 0.0, out)
        return out


def _round_int(s: np.ndarray, qexp: np.ndarray, mode: str) -> np.ndarray:
    """s * 2^qexp (int64 s) rounded to float32's 24 bits (and its subnormal grid)."""
    mag = np.abs(s)
    msb = np.frexp(mag.astype(np.float64))[1].astype(np.int64) - 1  # frexp gives int32
    msb = np.where((mag >> np.maximum(msb, 0)) == 0, msb - 1, msb)
    msb = np.where((mag >> np.minimum(msb + 1, 62)) != 0, msb + 1, msb)
    # Keep 24 bits, or fewer where the result falls below float32's normal range.
    sh = np.maximum(msb - (ACC_BITS - 1), -149 - qexp)
    sh = np.clip(sh, 0, 62)
    q = mag >> sh
    rem = mag - (q << sh)
    half = np.where(sh > 0, np.left_shift(np.int64(1), np.maximum(sh - 1, 0)), 1)
    pos = s > 0
    up = {
        "nearest": (rem > half) | ((rem == half) & (sh > 0) & (q % 2 == 1)),
        "nearest_away": (sh > 0) & (rem >= half),
        "toward_zero": np.zeros_like(pos),
        "up": (rem > 0) & pos,
        "down": (rem > 0) & ~pos,
    }[mode]
    val = np.ldexp((q + up).astype(np.float64), sh + qexp)
    return np.where(s < 0, -val, val)


# Published behaviours. FTTN's summary (as quoted in diag's issue 20): extra bits 0 / 1 / >=2
# and block FMA width 4 / 8 / >=16 for V100 / A100 / H100, truncation (round toward zero) in
# every NVIDIA tensor core tested; Fasi et al. (2021, Sec. 4, Tables 2-4): exact products,
# truncation, block of 4 on V100 and T4 (fp16), 8 on A100 (fp16/bf16). The CPU rows are the
# two ways a scalar loop can add: IEEE FMA, or a rounded multiply then an add.
UNITS: dict[str, Unit] = {
    "v100": Unit(
        True, 4, 0, "toward_zero", source="Fasi et al. 2021 (V100 fp16, Sec. 4); FTTN 2024 (V100)"
    ),
    "t4": Unit(True, 4, 0, "toward_zero", source="Fasi et al. 2021 (T4 fp16, Sec. 4)"),
    "a100": Unit(
        True,
        8,
        1,
        "toward_zero",
        source="Fasi et al. 2021 (A100 fp16/bf16 block 8); FTTN 2024 (1 extra bit)",
    ),
    "h100": Unit(
        True,
        16,
        2,
        "toward_zero",
        source="FTTN 2024 (H100: block >= 16, >= 2 extra bits; lower bounds)",
    ),
    "cpu-fma": Unit(True, 1, None, "nearest", source="IEEE 754 fused multiply-add loop"),
    "cpu-nofma": Unit(False, 1, None, "nearest", source="IEEE 754 multiply, then add"),
}
