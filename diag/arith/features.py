"""Arithmetic features of a matmul unit, beyond its algorithm's name.

Why this exists: two units that `diag.arith.precision.fingerprint` gives the same name (say
`BF16_BF16_F32`) still differ in how they add: whether products are exact, how many bits
below the accumulator's last place survive the alignment of the addends (extra bits),
whether the sum is rounded to nearest or truncated, how many products one fused step adds
(block FMA width), in which order the steps run, and whether subnormals survive. Those
differences are what makes one model drift between GPU generations. Fasi, Higham, Mikaitis
and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ Comput. Sci. 7:e330 (2021)
measured them on V100/T4/A100 with crafted inputs; the FTTN suite (Li, Laguna, Gopalakrishnan
et al., 2024) extended the tests to H100 and AMD MI100/MI250X. `features` runs tests of the
same kind on any matmul callable.

The model (`Unit`), after Fasi et al. (2021, Sec. 3, the model of a tensor core's
D = C + sum of w products): inputs are held in the input format (subnormals flushed to zero
when `subnormals="flushed"`); products are exact (or rounded to float32 when
`product_exact=False`, a multiply then an add without FMA); the K products are taken in
blocks of `block` (w) consecutive indices, and each step adds the accumulator and one block
in one fused operation: every addend is aligned to the largest exponent among them, keeping
`extra_bits` bits below float32's last place (bits shifted further are truncated, as a
sign-magnitude shifter does; `None`: nothing shifted out that matters, an exact sum as in an
IEEE FMA), the aligned values are added exactly, and the sum is rounded once to float32 with
`rounding`. `order` says in which order the blocks are visited (`sequential`: index order;
`reverse`; `pairwise`: each block from zero, then a tree of two-operand fused additions).
"Exact" is exact to 29 bits below float32's last place (the sum is formed in int64), far
beyond what any test here can tell apart.

How `features` decides (each feature in turn, with the ones decided before it fixed): it
builds crafted inputs whose products are sums of one or two powers of two (exact in every
input format), computes what each hypothesis predicts for them with `Unit`, calls the
matmul, and keeps the hypotheses whose predictions equal the output bit for bit. One match
is the answer; none, or several that the inputs cannot tell apart, is `unknown` with the
evidence (the products summed, the output, and what each hypothesis predicted). Every
pattern of a test is one output element C[i, i] (row i of A against column i of B; the rest
of C is ignored), with K = 64 zero-padded products, the size `fingerprint` uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np

from diag.arith.unit_model import (  # the model each hypothesis is run through
    ACC_BITS,
    BLOCK_WIDTHS,
    K_PROBE,
    MAX_EXTRA_BITS,
    ORDERS,
    ROUNDINGS,
    UNITS,
    Unit,
    as_unit_dtype,
)

__all__ = ["UNITS", "Feature", "Features", "Unit", "features"]


@dataclass(frozen=True)
class Feature:
    """One measured feature: its value (or `unknown`) and the evidence it rests on."""

    name: str
    value: Any
    evidence: tuple[dict, ...] = field(default_factory=tuple)
    note: str = ""


@dataclass(frozen=True)
class Features:
    """What a matmul unit was measured to do (see `features`)."""

    dtype: str
    output_dtype: str
    product_exact: Any
    extra_bits: Any
    rounding: Any
    block_fma_width: Any
    order: Any
    subnormals: Any
    details: tuple[Feature, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["details"] = [asdict(f) for f in self.details]
        for f in d["details"]:
            f["evidence"] = list(f["evidence"])
        return d


# ---------------------------------------------------------------------------------------------
# Crafted inputs


def _split(t: float) -> tuple[float, float]:
    """t (at most 2 significant bits) as a * b with both factors near sqrt(|t|)."""
    if t == 0:
        return 0.0, 0.0
    m, e = np.frexp(t)  # t = m * 2^e, 0.5 <= |m| < 1
    lo = (e - 1) // 2
    return float(np.ldexp(m, e - lo)), float(np.ldexp(1.0, lo))


class _Battery:
    """Patterns (each a list of (k, a, b)), laid out on the diagonal of one matmul."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.rows: list[list[tuple[int, float, float]]] = []
        self.labels: list[str] = []

    def add(self, label: str, terms: list[tuple[int, float]] | list[tuple[int, float, float]]):
        row = []
        for term in terms:
            k, *v = term
            a, b = _split(v[0]) if len(v) == 1 else v
            row.append((k, a, b))
        self.rows.append(row)
        self.labels.append(label)

    def extend(self, other: _Battery) -> _Battery:
        self.rows += other.rows
        self.labels += other.labels
        return self

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        n = max(len(self.rows), K_PROBE)  # at least 64 x 64: BLAS picks kernels by size
        a = np.zeros((n, K_PROBE), np.float64)
        b = np.zeros((K_PROBE, n), np.float64)
        for i, row in enumerate(self.rows):
            for k, x, y in row:
                a[i, k], b[k, i] = x, y
        a, b = a.astype(self.dtype), b.astype(self.dtype)
        for m, want in (
            (a, [(i, k, x) for i, r in enumerate(self.rows) for k, x, _ in r]),
            (b, [(k, i, y) for i, r in enumerate(self.rows) for k, _, y in r]),
        ):
            for i, j, v in want:
                if float(m[i, j]) != v:  # a construction bug, not a measurement
                    raise AssertionError(f"{v!r} is not exact in {self.dtype.name}")
        return a, b


def _run(matmul: Callable, bat: _Battery) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    a, b = bat.matrices()
    with np.errstate(all="ignore"):
        out = np.asarray(matmul(a, b))
    n = len(bat.rows)
    if out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"diag: the matmul returned shape {out.shape} for {a.shape} @ "
            f"{b.shape}, expected {(a.shape[0], b.shape[1])}"
        )
    return a, b, np.diagonal(out)[:n].astype(np.float64), out.dtype.name


def _diag(unit, a, b) -> np.ndarray:
    return unit.diagonal(a, b) if hasattr(unit, "diagonal") else np.diagonal(unit(a, b))


def _decide(
    name: str,
    matmul: Callable,
    bat: _Battery,
    hyps: dict[Any, Unit],
    out_dtype: list[str],
    note: str = "",
) -> tuple[Feature, list[Any]]:
    """Run the battery; keep the hypotheses that predict every output bit for bit."""
    a, b, got, odt = _run(matmul, bat)
    out_dtype[:] = [odt]
    with np.errstate(all="ignore"):
        preds = {
            h: _diag(u, a, b)[: len(got)].astype(odt).astype(np.float64) for h, u in hyps.items()
        }
    fits = [h for h, p in preds.items() if np.array_equal(p, got)]
    evidence = []
    for i, label in enumerate(bat.labels):
        vals = {str(h): float(p[i]) for h, p in preds.items()}
        if len(set(vals.values())) > 1 or got[i] not in vals.values():
            evidence.append(
                {
                    "input": label,
                    "products": [[k, float(x) * float(y)] for k, x, y in bat.rows[i]],
                    "output": float(got[i]),
                    "predicted": vals,
                }
            )
    value = fits[0] if len(fits) == 1 else "unknown"
    if len(fits) > 1:
        note = (note + "; " if note else "") + (
            f"the inputs cannot tell apart {', '.join(map(str, fits))}"
        )
    elif not fits:
        note = (note + "; " if note else "") + "no hypothesis predicts the outputs"
    return Feature(name, value, tuple(evidence[:12]), note), fits


# ---------------------------------------------------------------------------------------------
# The tests


def _rounding(dtype) -> _Battery:
    """2^24 + s as [s, 2^23, 2^23] (s first, exact in any aligned adder): ties at 2^24."""
    bat = _Battery(dtype)
    for s in (1.0, 3.0):
        for sign in (1.0, -1.0):
            bat.add(
                f"{sign * s:g} + 2^23 + 2^23",
                [(0, sign * s), (1, sign * 2.0**23), (2, sign * 2.0**23)],
            )
    return bat


def _extra_bits(dtype, p: int) -> _Battery:
    """1 - d: d below float32's last place, kept only with enough extra alignment bits."""
    bat = _Battery(dtype)
    for k in range(1, MAX_EXTRA_BITS + 2):  # truncation: any kept bit moves 1 - 2^-(23+k) down
        bat.add(f"1 - 2^-{23 + k}", [(0, 1.0), (1, -(2.0 ** -(23 + k)))])
        bat.add(f"1 + 2^-{23 + k}", [(0, 1.0), (1, 2.0 ** -(23 + k))])  # rounding up
    bat.add("1 - 3*2^-25", [(0, 1.0), (1, -3 * 2.0**-25)])
    bat.add("1 + 3*2^-25", [(0, 1.0), (1, 3 * 2.0**-25)])
    for k in range(2, MAX_EXTRA_BITS + 2):  # 0.75 ulp below 1, truncated to 0.5 or 0 ulp
        bat.add(f"1 - 3*2^-{24 + k}", [(0, 1.0), (1, -3 * 2.0 ** -(24 + k))])
        bat.add(f"1 + 3*2^-{24 + k}", [(0, 1.0), (1, 3 * 2.0 ** -(24 + k))])
    for j in range(1, p):  # nearest: a tie 1 - 2^-25 tipped by 2^-(25+j), one product
        for sign in (-1.0, 1.0):
            bat.add(
                f"1 {'-+'[sign > 0]} 2^-25*(1+2^-{j})",
                [(0, 1.0, 1.0), (1, sign * (1 + 2.0**-j) * 2.0**-13, 2.0**-12)],
            )
            bat.add(
                f"1 {'-+'[sign > 0]} 2^-24*(1+2^-{j})",
                [(0, 1.0, 1.0), (1, sign * (1 + 2.0**-j) * 2.0**-12, 2.0**-12)],
            )
    return bat


def _block(dtype, extra: int | None) -> _Battery:
    """Where a fused step ends: what is lost with the 1 in one step survives across steps."""
    bat = _Battery(dtype)
    h = 2.0**-24
    for m in range(2, K_PROBE):
        if extra is None or extra >= 1:  # [1, h, h]: 1 + 2^-23 only if one step adds all
            bat.add(f"1@0 + 2^-24@1 + 2^-24@{m}", [(0, 1.0), (1, h), (m, h)])
        if extra is not None:  # [1, -1, s]: s lost in alignment if it joins the 1
            s = 2.0 ** -(25 + extra)
            bat.add(f"1@0 - 1@1 + 2^-{25 + extra}@{m}", [(0, 1.0), (1, -1.0), (m, s)])
    bat.add("1@0 + 2^-24@2 + 2^-24@3", [(0, 1.0), (2, h), (3, h)])
    s = 2.0 ** -(25 + extra) if extra is not None else h
    for a in range(1, K_PROBE - 2):  # 1, -1 in one step, or across a boundary that keeps 1
        bat.add(f"1@{a} - 1@{a + 1} + {s:g}@{a + 2}", [(a, 1.0), (a + 1, -1.0), (a + 2, s)])
    for row, label in list(zip(bat.rows, bat.labels)):  # mirrored, for backward orders
        bat.rows.append([(K_PROBE - 1 - k, x, y) for k, x, y in row])
        bat.labels.append(f"{label}, k -> {K_PROBE - 1}-k")
    return bat


def _order(dtype, width: int, extra: int | None) -> _Battery:
    """1, -1 and a small s at three places: s survives only when added to a zero sum."""
    import itertools

    bat = _Battery(dtype)
    s = 2.0 ** -(25 + (extra or 0)) if extra is not None else 2.0**-24
    for spots in (
        (0, width, 2 * width),
        (0, 2 * width, 3 * width),
        (0, width, 3 * width),
        (0, 1, K_PROBE - 1),
        (0, K_PROBE // 2, K_PROBE - 1),
    ):
        places = tuple(min(p, K_PROBE - 1) for p in spots)
        if len(set(places)) < 3:
            continue
        for perm in itertools.permutations((1.0, -1.0, s)):
            bat.add(" + ".join(f"{v:g}@{k}" for v, k in zip(perm, places)), list(zip(places, perm)))
    return bat


def _products(dtype, p: int) -> _Battery:
    """An exact product next to its rounded value's negation, in both orders."""
    bat = _Battery(dtype)
    x = 1 + 2.0 ** -(p - 1)
    bat.add(f"({x!r})^2 alone", [(0, x, x)])
    if p == ACC_BITS:  # x^2 = 1 + 2^-22 + 2^-46: only the fused sum with -(1 + 2^-22) shows 2^-46
        c = -(1 + 2.0**-22)
        bat.add("-(1+2^-22)@0 + x^2@1", [(0, c, 1.0), (1, x, x)])
        bat.add("x^2@0 - (1+2^-22)@1", [(0, x, x), (1, c, 1.0)])
    return bat


def _subnormals(dtype) -> _Battery:
    """A subnormal input times a power of two, and (where reachable) a subnormal output."""
    bat = _Battery(dtype)
    sub = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    scale = 2.0 ** (10 if dtype.name == "float16" else 30)  # into float32's normal range
    bat.add(f"subnormal input 3*{sub:g} * {scale:g}", [(0, 3 * sub, scale)])
    if dtype.name != "float16":  # float16 products never reach float32's subnormals
        bat.add("2^-70 * 2^-70 (float32 subnormal)", [(0, 2.0**-70, 2.0**-70)])
    return bat


class _NarrowProducts:
    """Hypothesis: each product rounded (to nearest) to the input format before adding."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype

    def diagonal(self, a, b):
        return np.diagonal(self(a, b))

    def __call__(self, a, b):
        x, y = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
        prods = (x[:, :, None] * y[None, :, :]).astype(self.dtype).astype(np.float64)
        return prods.sum(axis=1).astype(np.float32)


class _Steps:
    """The features measured so far, in order: each step runs its battery through `matmul`
    and keeps the hypotheses (units) that predict every output bit."""

    def __init__(self, matmul: Callable, dt: np.dtype):
        self.matmul, self.dt = matmul, dt
        self.p = {"float32": 24, "bfloat16": 8, "float16": 11}[dt.name]
        self.odt: list[str] = []
        self.details: list[Feature] = []

    def step(self, name, battery, hyps, needs=(), note=""):
        """Decide feature `name`: (its value, the hypotheses that fit); `unknown` without
        running it when a feature it `needs` is unknown."""
        missing = [f.name for f in self.details if f.name in needs and f.value == "unknown"]
        if missing:  # its hypotheses would rest on a guess
            self.details.append(Feature(name, "unknown", (), f"needs {', '.join(missing)}"))
            return "unknown", []
        feature, fits = _decide(name, self.matmul, battery(), hyps, self.odt, note)
        self.details.append(feature)
        return feature.value, fits

    def result(self) -> Features:
        details = self.details
        odt = self.odt
        if odt and odt[0] != "float32":
            details = [
                replace(
                    f,
                    note=(f.note + "; " if f.note else "")
                    + f"the output is {odt[0]}: sums below its precision are not "
                    f"observable",
                )
                for f in details
            ]
        v = {f.name: f.value for f in details}
        return Features(
            dtype=self.dt.name,
            output_dtype=odt[0] if odt else "?",
            product_exact=v["product_exact"],
            extra_bits=v["extra_bits"],
            rounding=v["rounding"],
            block_fma_width=v["block_fma_width"],
            order=v["order"],
            subnormals=v["subnormals"],
            details=tuple(details),
        )


def _width_and_order(s: _Steps, base: Unit, extra: int | None) -> Unit:
    """Block FMA width and order, measured together: a reversed or pairwise order moves the
    block boundaries. Two features come out of the one battery."""
    dt = s.dt

    def width_order():
        bat = _block(dt, extra)
        for w in (1, 2, 3, 4, 8, 16):
            bat.extend(_order(dt, w, extra))
        return bat

    _, fits = s.step(
        "block_fma_width",
        width_order,
        {(w, o): replace(base, block=w, order=o) for w in BLOCK_WIDTHS for o in ORDERS},
        needs=("rounding", "extra_bits"),
    )
    joint = s.details.pop()
    for name, i in (("block_fma_width", 0), ("order", 1)):
        vals = sorted({f[i] for f in fits}, key=str)
        value = vals[0] if len(vals) == 1 else "unknown"
        note = (
            ""
            if len(vals) == 1
            else joint.note
            if not vals
            else (f"the inputs cannot tell apart {', '.join(map(str, vals))}")
        )
        s.details.append(Feature(name, value, joint.evidence if i == 0 else (), note))
    w, o = s.details[-2].value, s.details[-1].value
    return replace(
        base, block=w if isinstance(w, int) else 1, order=o if o in ORDERS else "sequential"
    )


def _product_exact(s: _Steps, base: Unit) -> Unit:
    dt, p = s.dt, s.p
    if p == ACC_BITS:  # float32: the exact product shows only through a fused sum
        pe, _ = s.step(
            "product_exact",
            lambda: _products(dt, p),
            {True: base, False: replace(base, product_exact=False)},
            needs=("rounding", "extra_bits", "block_fma_width", "order"),
        )
    else:  # a product of two narrow inputs fits float32: read it alone
        pe, _ = s.step(
            "product_exact",
            lambda: _products(dt, p),
            {True: base, "rounded to the input format": _NarrowProducts(dt)},
        )
    return replace(base, product_exact=pe if isinstance(pe, bool) else True)


def features(matmul: Callable[[np.ndarray, np.ndarray], Any], dtype: Any = "float32") -> Features:
    """Measure the arithmetic features of a matmul with crafted inputs (module docstring).

    Args:
      matmul: `(a, b) -> a @ b` on numpy matrices of `dtype` (a jax or CPU torch result is
        read with `np.asarray`). Called 5 times (fewer when a feature is `unknown`),
        shapes from [64, 64] x [64, 64] up to about [430, 64] x [64, 430].
      dtype: the inputs' dtype: float32, bfloat16 or float16. Features of the accumulation
        are only observable when the output keeps float32's 24 bits; with a bf16 or fp16
        output they come back `unknown`, saying so.

    Returns:
      `Features`: product_exact (True/False), extra_bits (an int, or ">=9" when every bit
      tested survived), rounding (`nearest` = to nearest, ties to even, `nearest_away`,
      `toward_zero`, `up`, `down`), block_fma_width (int), order (`sequential`, `reverse`,
      `pairwise`), subnormals (`kept`/`flushed`); each `unknown` when no hypothesis, or
      more than one, fits; `details` holds each feature's evidence.

    Raises:
      ValueError: an unsupported dtype, or the matmul returned the wrong shape.
    """
    s = _Steps(matmul, as_unit_dtype(dtype))
    dt, p = s.dt, s.p
    base = Unit()
    r, _ = s.step(
        "rounding", lambda: _rounding(dt), {r: replace(base, rounding=r) for r in ROUNDINGS}
    )
    base = replace(base, rounding=r if r in ROUNDINGS else "nearest")
    hyps: dict[Any, Unit] = {e: replace(base, extra_bits=e) for e in range(MAX_EXTRA_BITS + 1)}
    hyps[f">={MAX_EXTRA_BITS + 1}"] = replace(base, extra_bits=None)
    e, _ = s.step("extra_bits", lambda: _extra_bits(dt, p), hyps, needs=("rounding",))
    extra = e if isinstance(e, int) else None
    base = replace(base, extra_bits=extra)
    base = _width_and_order(s, base, extra)
    base = _product_exact(s, base)
    s.step(
        "subnormals",
        lambda: _subnormals(dt),
        {sub: replace(base, subnormals=sub) for sub in ("kept", "flushed")},
    )
    return s.result()
