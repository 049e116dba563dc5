"""Which arithmetic a matmul really uses: precision fingerprints and CPU emulators.

Why this exists: the same float32 matmul is different math on different hardware. Under
`Precision.DEFAULT` it is one bf16 pass on TPU, TF32 on recent NVIDIA GPUs (under JAX's
defaults, or torch with `allow_tf32`), and full float32 on CPU. Nothing in a framework's API
says which one ran, so `fingerprint` *measures* it: it feeds a matmul crafted inputs whose
exact products are known and reads back how many significand bits of each input survived,
whether the product was split into several passes, and how wide the accumulator is, then
names the closest algorithm with JAX's `DotAlgorithmPreset` names.

The emulators compute those algorithms on CPU with numpy, bit-faithful to their definitions
(in `diag.arith.dot_algorithms`, their own module, re-exported here), so that (a) the fingerprint
can be tested against known answers and (b) a user without a TPU can see what TPU default
precision does to their probe (the `emu-*` backends).
An emulation is a model of an algorithm, never a hardware result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from diag.arith.dot_algorithms import ALGORITHMS, Algorithm, emulate, emulator, round_to

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Fingerprint",
    "emulate",
    "emulator",
    "features",
    "fingerprint",
    "round_to",
]

_F32_MANT = 23  # explicit significand bits of float32


@dataclass(frozen=True)
class Fingerprint:
    """What a matmul was measured to compute.

    Attributes:
      label: the closest `DotAlgorithmPreset` name, or `UNKNOWN` when the measurements do not
        match one algorithm (never a guess).
      input_bits: (A, B) explicit significand bits each input keeps (float32 23, TF32 and
        float16 10, bf16 7; a multi-pass split counts the bits its pieces cover together).
      passes: 1, 3 or 6 products per input pair (None when unknown).
      accumulator: `float32`, `wider than float32` or `narrower than float32 (N bits)`.
      input_rounding: how single-pass inputs are rounded (`nearest-even`, `nearest-away`,
        `toward zero`), `exact` for float32, None when not observable.
      evidence: short lines saying what was measured.
    """

    label: str
    input_bits: tuple[int, int]
    passes: int | None
    accumulator: str
    input_rounding: str | None
    evidence: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["input_bits"] = list(self.input_bits)
        d["evidence"] = list(self.evidence)
        return d


# Every probe contracts over K = 64 (zero padded): XLA rewrites a K=1 dot as a multiply that
# bypasses the matrix unit, and libraries pick kernels by size (measured: torch-cpu under
# set_float32_matmul_precision('medium') multiplies in bf16 at K >= 32, in float32 at K = 8).
_K = 64
_DENSE = 64  # dense-significand probe values per side


def _dense_values(seed: int) -> np.ndarray:
    """Fixed values in [1, 2) with all 23 explicit significand bits drawn at random."""
    mant = np.random.default_rng(seed).integers(1, 1 << 23, _DENSE, dtype=np.uint32)
    return (np.uint32(0x3F800000) | mant).view(np.float32)


def _call(matmul: Callable, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.asarray(matmul(a.astype(np.float32), b.astype(np.float32)))
    if out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"diag: the matmul returned shape {out.shape} for "
            f"{a.shape} @ {b.shape}, expected {(a.shape[0], b.shape[1])}"
        )
    return out.astype(np.float64)


def _side(matmul: Callable, values: np.ndarray, side: str) -> np.ndarray:
    """values as one input (the other input 1), each value x read back as fl_alg(x * 1)."""
    n = len(values)
    ones = np.zeros((_K, max(n, _K)), np.float32)
    ones[0, :] = 1.0
    probe = np.zeros((max(n, _K), _K), np.float32)
    probe[:n, 0] = values
    if side == "A":  # C[i, 0] = a_i * 1
        return _call(matmul, probe, ones)[:n, 0]
    # B side: C[0, j] = 1 * b_j
    return _call(matmul, ones.T.copy(), probe.T.copy())[0, :n]


def _side_measure(matmul: Callable, side: str, ev: list[str]) -> dict[str, Any]:
    """Bits kept by one input: single bits, dense significands, rounding, float16 range."""
    js = np.arange(1, _F32_MANT + 1)
    # Rows: 1 + 2^-j (j = 1..23); ties 1 + 2^-(p+1) and above-half 1 + 2^-(p+1) + 2^-(p+3)
    # for p = 1..20; dense values; 1.5 * 2^-30 (below fp16's subnormals) and 2^17 (above
    # fp16's largest, 65504).
    single = 1.0 + np.exp2(-js.astype(np.float64))
    ps = np.arange(1, 21)
    ties = 1.0 + np.exp2(-(ps + 1.0))
    above = ties + np.exp2(-(ps + 3.0))
    dense = _dense_values(1 if side == "A" else 2).astype(np.float64)
    ranges = np.array([1.5 * 2.0**-30, 2.0**17])
    values = np.concatenate([single, ties, above, dense, ranges])
    got = _side(matmul, values.astype(np.float32), side)
    n1, n2 = len(single), len(single) + len(ps)
    n3, n4 = n2 + len(ps), n2 + len(ps) + _DENSE
    g_single, g_ties, g_above = got[:n1], got[n1:n2], got[n2:n3]
    g_dense, g_range = got[n3:n4], got[n4:]

    kept = g_single == single
    prefix = int(np.argmin(kept)) if not kept.all() else _F32_MANT
    lost = js[~kept]
    line = f"{side}: 1+2^-j read back exactly for j <= {prefix}"
    if prefix < _F32_MANT:
        line += f"; 1+2^-{prefix + 1} -> {_fmt(g_single[prefix])}"
    if len(lost) and (lost.min() != prefix + 1 or kept[prefix:].any()):
        line += f"; lost bits {lost.tolist()}"
    ev.append(line)
    consistent = not kept[prefix:].any()

    rounding = None
    if prefix < _F32_MANT and 1 <= prefix <= len(ps):
        up = 1.0 + 2.0**-prefix
        tie, abv = g_ties[prefix - 1], g_above[prefix - 1]
        if abv == up and tie == 1.0:
            rounding = "nearest-even"
        elif abv == up and tie == up:
            rounding = "nearest-away"
        elif abv == 1.0 and tie == 1.0:
            rounding = "toward zero"
        ev.append(
            f"{side}: tie 1+2^-{prefix + 1} -> {_fmt(tie)}, just above -> {_fmt(abv)}: "
            f"rounding {rounding or 'unrecognised'}"
        )
    elif prefix == _F32_MANT and not np.any(g_dense != dense):
        rounding = "exact"

    # Rounding to nearest leaves at most half an ulp of p bits (2^-(p+1) on [1, 2)),
    # truncation up to a whole ulp (2^-p).
    err = float(np.max(np.abs(g_dense - dense)))
    dense_bits = (
        _F32_MANT
        if err == 0
        else min(
            _F32_MANT, int(math.floor(-math.log2(err))) - (0 if rounding == "toward zero" else 1)
        )
    )
    ev.append(
        f"{side}: {_DENSE} values in [1,2) with 23-bit significands: max error "
        + ("0 (all exact)" if err == 0 else f"{err:.3g} = 2^{math.log2(err):.1f}")
        + f" -> {dense_bits} bits"
    )

    f16_range = bool(g_range[0] != ranges[0] and not np.isfinite(g_range[1]))
    if g_range[0] != ranges[0] or g_range[1] != ranges[1]:
        ev.append(
            f"{side}: 1.5*2^-30 -> {_fmt(g_range[0])}, 2^17 -> {_fmt(g_range[1])}: "
            + ("float16 range" if f16_range else "range loss of an unknown format")
        )
    return {
        "prefix": prefix,
        "consistent": consistent,
        "dense_bits": dense_bits,
        "dense_err": err,
        "rounding": rounding,
        "f16_range": f16_range,
        "range_ok": bool(g_range[0] == ranges[0] and g_range[1] == ranges[1]),
    }


def _accumulator(matmul: Callable, ev: list[str]) -> tuple[str, int]:
    """Accumulator width: 1 + 2^-j over two terms, and 2^24 + 1 - 2^24 in every order."""
    js = np.arange(1, 31)
    rows = len(js) + 3
    a = np.zeros((rows, _K), np.float32)
    b = np.zeros((_K, _K), np.float32)
    b[:3, :] = 1.0
    a[: len(js), 0] = 1.0
    a[: len(js), 1] = np.exp2(-js.astype(np.float64))
    # Products 2^24, 1, -2^24 (as 2^12 * 2^12 so float16 inputs hold them), the 1 first,
    # second or last; row len(js) + r is read in column 1 + r.
    for r, pos in enumerate((1, 0, 2)):
        big = [k for k in range(3) if k != pos]
        a[len(js) + r, big] = (4096.0, -4096.0)
        a[len(js) + r, pos] = 1.0
        b[:3, 1 + r] = 4096.0
        b[pos, 1 + r] = 1.0
    got = _call(matmul, a, b)
    sums = got[: len(js), 0]
    kept = sums == 1.0 + np.exp2(-js.astype(np.float64))
    bits = int(np.argmin(kept)) if not kept.all() else len(js)
    cancel = np.array([got[len(js) + r, 1 + r] for r in range(3)])
    ev.append(
        f"accumulator: 1+2^-j summed exactly for j <= {bits}; 2^24+1-2^24 in 3 orders "
        f"-> {', '.join(_fmt(c) for c in cancel)}"
    )
    if bits < _F32_MANT:
        return f"narrower than float32 ({bits} bits)", bits
    if bits > _F32_MANT or bool(np.all(cancel == 1.0)):
        return "wider than float32", bits
    return "float32", bits


def _products(matmul: Callable, ev: list[str]) -> tuple[int, int, float]:
    """Dense x dense products (K padded with zeros): how many are correctly rounded."""
    x, y = _dense_values(3), _dense_values(4)
    a = np.zeros((_DENSE, _K), np.float32)
    b = np.zeros((_K, _DENSE), np.float32)
    a[:, 0], b[0, :] = x, y
    got = _call(matmul, a, b)
    exact = np.outer(x.astype(np.float64), y.astype(np.float64))  # 48 bits: exact in float64
    rounded = exact.astype(np.float32).astype(np.float64)
    ulp = np.spacing(rounded.astype(np.float32)).astype(np.float64)
    err_ulp = float(np.max(np.abs(got - exact) / ulp))
    n_ok = int(np.sum(got == rounded))
    ev.append(
        f"products of dense values: {n_ok}/{got.size} correctly rounded to float32, "
        f"max error {err_ulp:.3g} ulp"
    )
    return n_ok, got.size, err_ulp


def _fmt(x: float) -> str:
    if not np.isfinite(x):
        return str(x)
    if x == 1.0 or x == 0.0:
        return f"{x:g}"
    return f"{x:.9g}"


def fingerprint(matmul: Callable[[np.ndarray, np.ndarray], Any]) -> Fingerprint:
    """Measure which dot algorithm a matmul uses, with crafted inputs.

    The callable gets two float32 numpy matrices and may return any array-like (a jax or
    CPU torch array is converted with `np.asarray`). It is called 4 times with shapes up to
    [129, 64] x [64, 129]; every contraction is over K=64 with zero padding (see `_K`: a
    tiny K can take another code path than the matmuls it is meant to describe).

    What is measured (each lands in `evidence`):
      - per input, which bits j of 1+2^-j survive (the other input is 1), the rounding of
        ties, a float16-range test, and the error on 64 values with dense 23-bit
        significands (multi-pass splits keep single bits but not dense significands);
      - the accumulator: 1 + 2^-j summed over two terms, and 2^24 + 1 - 2^24 in three
        orders (a float32 accumulator loses the 1 in some order, a wider one never);
      - whether dense x dense products are correctly rounded (float32 yes; a 6-pass bf16
        split, which keeps every input bit, is off by an ulp or so on some).

    Args:
      matmul: `(a, b) -> a @ b` for float32 matrices.

    Returns:
      A `Fingerprint`; its label is `UNKNOWN` (with the evidence) when the measurements fit
      no single algorithm.

    Raises:
      ValueError: the callable returned the wrong shape.
    """
    ev: list[str] = []
    sa = _side_measure(matmul, "A", ev)
    sb = _side_measure(matmul, "B", ev)
    accumulator, _ = _accumulator(matmul, ev)
    n_ok, n_all, err_ulp = _products(matmul, ev)

    def bits(s):
        return min(s["prefix"], s["dense_bits"])

    input_bits = (bits(sa), bits(sb))
    rounding = sa["rounding"] if sa["rounding"] == sb["rounding"] else None
    label, passes = "UNKNOWN", None
    if (sa["prefix"], sa["dense_bits"], sa["f16_range"]) != (
        sb["prefix"],
        sb["dense_bits"],
        sb["f16_range"],
    ):
        ev.append(
            f"A and B are treated differently (A keeps {input_bits[0]} bits, "
            f"B {input_bits[1]}): no single algorithm"
        )
    elif not (sa["consistent"] and sb["consistent"]):
        ev.append("bits beyond the first lost one survive: not a rounding to fewer bits")
    elif accumulator != "float32" and not accumulator.startswith("wider"):
        ev.append(f"accumulator {accumulator}: no float32-accumulating algorithm fits")
    else:
        label, passes = _classify(sa, n_ok == n_all, err_ulp, ev)
    if label != "F32_F32_F32" and rounding == "exact":
        rounding = None  # a split that keeps every bit says nothing about its rounding
    return Fingerprint(
        label=label,
        input_bits=input_bits,
        passes=passes,
        accumulator=accumulator,
        input_rounding=rounding,
        evidence=tuple(ev),
    )


def _classify(s: dict, all_rounded: bool, err_ulp: float, ev: list[str]) -> tuple[str, int | None]:
    """The algorithm whose signature the (equal) per-input measurements match."""
    prefix, dense = s["prefix"], s["dense_bits"]
    if s["f16_range"] and prefix == 10 and dense == 10:
        return "F16_F16_F32", 1
    if not s["range_ok"]:
        ev.append("inputs lose range in a way no known algorithm does")
        return "UNKNOWN", None
    if prefix == dense == 7:
        return "BF16_BF16_F32", 1
    if prefix == dense == 10:
        return "TF32_TF32_F32", 1
    if prefix == _F32_MANT:
        if dense == _F32_MANT:
            if all_rounded:
                return "F32_F32_F32", 1
            if err_ulp <= 4:
                return "BF16_BF16_F32_X6", 6
        elif 15 <= dense <= 19:
            return "BF16_BF16_F32_X3", 3
        elif 20 <= dense <= 22:
            return "TF32_TF32_F32_X3", 3
    ev.append(f"no known algorithm keeps {prefix} single bits and {dense} dense bits")
    return "UNKNOWN", None


from diag.arith.features import features  # noqa: E402  (its own module; re-exported here)
