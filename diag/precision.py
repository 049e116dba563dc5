"""Which arithmetic a matmul really uses: precision fingerprints and CPU emulators.

Why this exists: the same float32 matmul is different math on different hardware. Under
`Precision.DEFAULT` it is one bf16 pass on TPU, TF32 on recent NVIDIA GPUs (under JAX's
defaults, or torch with `allow_tf32`), and full float32 on CPU. Nothing in a framework's API
says which one ran, so `fingerprint` *measures* it: it feeds a matmul crafted inputs whose
exact products are known and reads back how many significand bits of each input survived,
whether the product was split into several passes, and how wide the accumulator is, then
names the closest algorithm with JAX's `DotAlgorithmPreset` names.

The emulators compute those algorithms on CPU with numpy, bit-faithful to their definitions
(below), so that (a) the fingerprint can be tested against known answers and (b) a user
without a TPU can see what TPU default precision does to their probe (the `emu-*` backends).
An emulation is a model of an algorithm, never a hardware result.

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

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

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
        Algorithm("TF32_TF32_F32", "tf32", "tf32", 1,
                  "inputs rounded to TF32 (10 significand bits), float32 accumulation: "
                  "NVIDIA tensor cores with TF32 allowed"),
        Algorithm("TF32_TF32_F32_X3", "tf32x3", "tf32", 3,
                  "each input split into 2 TF32 pieces, 3 products, float32 accumulation"),
        Algorithm("BF16_BF16_F32", "bf16x1", "bf16", 1,
                  "inputs rounded to bf16 (7 significand bits), float32 accumulation: "
                  "one MXU pass, TPU's DEFAULT precision"),
        Algorithm("BF16_BF16_F32_X3", "bf16x3", "bf16", 3,
                  "each input split into 2 bf16 pieces, 3 products, float32 accumulation: "
                  "TPU's HIGH precision"),
        Algorithm("BF16_BF16_F32_X6", "bf16x6", "bf16", 6,
                  "each input split into 3 bf16 pieces, the 6 largest products, float32 "
                  "accumulation: TPU's HIGHEST precision"),
        Algorithm("F16_F16_F32", "f16", "f16", 1,
                  "inputs rounded to float16 (10 significand bits, range +-65504), float32 "
                  "accumulation"),
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
        raise ValueError(f"diag: unknown dot algorithm '{label}'; known: "
                         f"{', '.join(ALGORITHMS)}") from None
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


# ---------------------------------------------------------------------------------------------
# Fingerprint


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
        raise ValueError(f"diag: the matmul returned shape {out.shape} for "
                         f"{a.shape} @ {b.shape}, expected {(a.shape[0], b.shape[1])}")
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
    ranges = np.array([1.5 * 2.0 ** -30, 2.0 ** 17])
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
        up = 1.0 + 2.0 ** -prefix
        tie, abv = g_ties[prefix - 1], g_above[prefix - 1]
        if abv == up and tie == 1.0:
            rounding = "nearest-even"
        elif abv == up and tie == up:
            rounding = "nearest-away"
        elif abv == 1.0 and tie == 1.0:
            rounding = "toward zero"
        ev.append(f"{side}: tie 1+2^-{prefix + 1} -> {_fmt(tie)}, just above -> {_fmt(abv)}: "
                  f"rounding {rounding or 'unrecognised'}")
    elif prefix == _F32_MANT and not np.any(g_dense != dense):
        rounding = "exact"

    # Rounding to nearest leaves at most half an ulp of p bits (2^-(p+1) on [1, 2)),
    # truncation up to a whole ulp (2^-p).
    err = float(np.max(np.abs(g_dense - dense)))
    dense_bits = _F32_MANT if err == 0 else min(
        _F32_MANT, int(math.floor(-math.log2(err))) - (0 if rounding == "toward zero" else 1))
    ev.append(f"{side}: {_DENSE} values in [1,2) with 23-bit significands: max error "
              + ("0 (all exact)" if err == 0 else f"{err:.3g} = 2^{math.log2(err):.1f}")
              + f" -> {dense_bits} bits")

    f16_range = bool(g_range[0] != ranges[0] and not np.isfinite(g_range[1]))
    if g_range[0] != ranges[0] or g_range[1] != ranges[1]:
        ev.append(f"{side}: 1.5*2^-30 -> {_fmt(g_range[0])}, 2^17 -> {_fmt(g_range[1])}: "
                  + ("float16 range" if f16_range else "range loss of an unknown format"))
    return {"prefix": prefix, "consistent": consistent, "dense_bits": dense_bits,
            "dense_err": err, "rounding": rounding, "f16_range": f16_range,
            "range_ok": bool(g_range[0] == ranges[0] and g_range[1] == ranges[1])}


def _accumulator(matmul: Callable, ev: list[str]) -> tuple[str, int]:
    """Accumulator width: 1 + 2^-j over two terms, and 2^24 + 1 - 2^24 in every order."""
    js = np.arange(1, 31)
    rows = len(js) + 3
    a = np.zeros((rows, _K), np.float32)
    b = np.zeros((_K, _K), np.float32)
    b[:3, :] = 1.0
    a[:len(js), 0] = 1.0
    a[:len(js), 1] = np.exp2(-js.astype(np.float64))
    # Products 2^24, 1, -2^24 (as 2^12 * 2^12 so float16 inputs hold them), the 1 first,
    # second or last; row len(js) + r is read in column 1 + r.
    for r, pos in enumerate((1, 0, 2)):
        big = [k for k in range(3) if k != pos]
        a[len(js) + r, big] = (4096.0, -4096.0)
        a[len(js) + r, pos] = 1.0
        b[:3, 1 + r] = 4096.0
        b[pos, 1 + r] = 1.0
    got = _call(matmul, a, b)
    sums = got[:len(js), 0]
    kept = sums == 1.0 + np.exp2(-js.astype(np.float64))
    bits = int(np.argmin(kept)) if not kept.all() else len(js)
    cancel = np.array([got[len(js) + r, 1 + r] for r in range(3)])
    ev.append(f"accumulator: 1+2^-j summed exactly for j <= {bits}; 2^24+1-2^24 in 3 orders "
              f"-> {', '.join(_fmt(c) for c in cancel)}")
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
    ev.append(f"products of dense values: {n_ok}/{got.size} correctly rounded to float32, "
              f"max error {err_ulp:.3g} ulp")
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
            sb["prefix"], sb["dense_bits"], sb["f16_range"]):
        ev.append(f"A and B are treated differently (A keeps {input_bits[0]} bits, "
                  f"B {input_bits[1]}): no single algorithm")
    elif not (sa["consistent"] and sb["consistent"]):
        ev.append("bits beyond the first lost one survive: not a rounding to fewer bits")
    elif accumulator != "float32" and not accumulator.startswith("wider"):
        ev.append(f"accumulator {accumulator}: no float32-accumulating algorithm fits")
    else:
        label, passes = _classify(sa, n_ok == n_all, err_ulp, ev)
    if label != "F32_F32_F32" and rounding == "exact":
        rounding = None  # a split that keeps every bit says nothing about its rounding
    return Fingerprint(label=label, input_bits=input_bits, passes=passes,
                       accumulator=accumulator, input_rounding=rounding, evidence=tuple(ev))


def _classify(s: dict, all_rounded: bool, err_ulp: float,
              ev: list[str]) -> tuple[str, int | None]:
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


from diag.features import features  # noqa: E402  (its own module; re-exported here)
