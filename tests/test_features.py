"""`diag.arith.precision.features`: every parameter of every unit model is recovered from crafted
inputs, what cannot be observed comes back `unknown` with its evidence, and the CPU
backends' verdicts agree with independent checks made on this machine (never a hard-coded
CPU fact: what a BLAS does with FMA, blocking and order differs between machines).
"""

from __future__ import annotations

import json
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from diag.arith.features import ORDERS, ROUNDINGS, UNITS, Unit, features
from tests.conftest import run_diag

FIELDS = ("product_exact", "extra_bits", "rounding", "block_fma_width", "order", "subnormals")


def expected(u: Unit) -> dict:
    return {"product_exact": u.product_exact,
            "extra_bits": u.extra_bits if u.extra_bits is not None else ">=9",
            "rounding": u.rounding, "block_fma_width": u.block, "order": u.order,
            "subnormals": u.subnormals}


def measured(f) -> dict:
    return {k: getattr(f, k) for k in FIELDS}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(UNITS))
def test_recovers_every_published_unit(name, dtype):
    u = UNITS[name]
    want = expected(u)
    if dtype != "float32" and not u.product_exact:
        want["product_exact"] = True  # a narrow product fits float32: rounding it is a no-op
    assert measured(features(u, dtype)) == want


@pytest.mark.parametrize("name", ["cpu-fma", "cpu-nofma"])
def test_recovers_float32_units(name):
    assert measured(features(UNITS[name], "float32")) == expected(UNITS[name])


def test_float32_block_unit_cannot_show_its_products():
    """x^2 = 1 + 2^-22 + 2^-46 needs 23 extra alignment bits to be seen: a block unit with
    0 extra bits loses it whether or not the product was exact, and says so."""
    f = features(UNITS["v100"], "float32")
    assert f.product_exact == "unknown"
    assert {k: v for k, v in measured(f).items() if k != "product_exact"} == {
        k: v for k, v in expected(UNITS["v100"]).items() if k != "product_exact"}
    detail = next(d for d in f.details if d.name == "product_exact")
    assert "cannot tell apart True, False" in detail.note


_BASE = Unit(True, 4, 0, "toward_zero")
_GRID = ([replace(_BASE, rounding=r) for r in ROUNDINGS]
         + [replace(_BASE, block=w) for w in (1, 2, 3, 8, 32)]
         + [replace(_BASE, extra_bits=e) for e in (1, 3, None)]
         + [replace(_BASE, order=o) for o in ORDERS]
         + [replace(_BASE, subnormals="flushed"), Unit(True, 8, 2, "nearest", "reverse"),
            Unit(True, 1, None, "down", subnormals="flushed")])


@pytest.mark.parametrize("unit", _GRID, ids=lambda u: f"{u.block}-{u.extra_bits}-"
                         f"{u.rounding}-{u.order}-{u.subnormals}")
def test_recovers_each_parameter(unit):
    assert measured(features(unit, "bfloat16")) == expected(unit)


def test_indistinguishable_models_are_unknown_not_guessed():
    """Pairwise order over single products is the same arithmetic as blocks of two: the
    answer is `unknown`, naming both, never one of them."""
    f = features(Unit(True, 1, None, "nearest", "pairwise"), "bfloat16")
    assert f.block_fma_width == "unknown" and f.order == "pairwise"
    note = next(d.note for d in f.details if d.name == "block_fma_width")
    assert "1, 2" in note


def test_unknown_when_no_hypothesis_fits_with_evidence():
    """A unit that adds one ulp to every nonzero result fits no rounding mode."""
    def off_by_one_ulp(a, b):
        c = a.astype(np.float32) @ b.astype(np.float32)
        return np.where(c != 0, np.nextafter(c, np.float32(np.inf)), c)

    f = features(off_by_one_ulp, "float32")
    assert f.rounding == "unknown"
    d = next(d for d in f.details if d.name == "rounding")
    assert "no hypothesis" in d.note
    misses = [ev for ev in d.evidence if ev["output"] not in ev["predicted"].values()]
    assert misses  # the row that rules every mode out is in the evidence
    ev = misses[0]
    assert set(ev["predicted"]) == set(ROUNDINGS)
    nearest = np.float32(ev["predicted"]["nearest"])
    assert ev["output"] == float(np.nextafter(nearest, np.float32(np.inf)))
    # What depends on the rounding is not decided on a guess.
    assert f.extra_bits == "unknown" and f.block_fma_width == "unknown"


def test_narrow_output_makes_the_accumulator_unobservable():
    def bf16_out(a, b):
        return UNITS["v100"](a, b).astype(ml_dtypes.bfloat16)

    f = features(bf16_out, "bfloat16")
    assert f.output_dtype == "bfloat16"
    assert f.rounding == "unknown" and f.extra_bits == "unknown"
    assert all("the output is bfloat16" in d.note for d in f.details)


def test_rejects_unsupported_dtype_and_wrong_shape():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        features(UNITS["v100"], "int8")
    with pytest.raises(ValueError, match="returned shape"):
        features(lambda a, b: (a.astype(np.float32) @ b.astype(np.float32))[:-1], "float32")


# ---------------------------------------------------------------------------------------------
# CPU backends: the verdict agrees with what an independent check measures here.


def _numpy(a, b):
    return a.astype(np.float32) @ b.astype(np.float32)


def _torch(a, b):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.asarray(a, np.float32)) @ torch.from_numpy(
        np.asarray(b, np.float32))


def _jax(a, b):
    jnp = pytest.importorskip("jax.numpy")
    return np.asarray(jnp.matmul(a, b))


def _direct(matmul, terms):
    """C[0, 0] of a 64 x 64 matmul whose row 0 / column 0 hold the products `terms`."""
    a = np.zeros((64, 64), np.float32)
    b = np.zeros((64, 64), np.float32)
    for k, (x, y) in terms.items():
        a[0, k], b[k, 0] = x, y
    return float(np.asarray(matmul(a, b), np.float64)[0, 0])


@pytest.mark.parametrize("matmul", [_numpy, _torch, _jax], ids=["numpy", "torch", "jax"])
def test_cpu_verdict_agrees_with_direct_checks(matmul):
    f = features(matmul, "float32")
    assert f.output_dtype == "float32"
    # Subnormals: a float32 subnormal input times 2^30 survives, or it was flushed.
    sub = _direct(matmul, {0: (3 * 2.0 ** -149, 2.0 ** 30)})
    assert f.subnormals in ("kept", "flushed", "unknown")
    if f.subnormals != "unknown":
        assert (sub != 0) == (f.subnormals == "kept")
    # Rounding: 2^24 + 3 formed as 3 + 2^23 + 2^23, ties-to-even gives 2^24 + 4.
    tie = _direct(matmul, {0: (3.0, 1.0), 1: (2.0 ** 12, 2.0 ** 11), 2: (2.0 ** 12, 2.0 ** 11)})
    if f.rounding == "nearest":
        assert tie == 2.0 ** 24 + 4
    elif f.rounding == "toward_zero":
        assert tie == 2.0 ** 24 + 2
    # Product exactness: 2^-46 survives only from an exact product in a fused sum.
    x = 1 + 2.0 ** -23
    fused = {_direct(matmul, {0: (-(1 + 2.0 ** -22), 1.0), 1: (x, x)}),
             _direct(matmul, {0: (x, x), 1: (-(1 + 2.0 ** -22), 1.0)})}
    if f.product_exact is True:
        assert 2.0 ** -46 in fused
    elif f.product_exact is False:
        assert fused == {0.0}
    # Each decided feature rests on evidence the backend reproduces when asked again.
    again = features(matmul, "float32")
    assert measured(again) == measured(f)


def test_diag_env_deep_json_through_the_real_script():
    r = run_diag("env", "--deep", "--json", "--no-fingerprints", timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    rows = [(name, f) for fw in report["frameworks"].values()
            for name, info in fw["backends"].items() for f in info.get("features", [])]
    assert rows, "no backend reported features"
    for name, f in rows:
        assert "error" not in f, (name, f)
        assert set(FIELDS) <= set(f)
        assert f["dtype"] in ("float32", "bfloat16", "float16")
        for d in f["details"]:
            assert d["value"] == f[d["name"]]
            assert d["value"] != "unknown" or d["note"]
    # The default setting is measured on float32, bf16 and fp16 inputs.
    dtypes = {f["dtype"] for name, f in rows if f["precision"] == "default"}
    assert dtypes == {"float32", "bfloat16", "float16"}


def test_diag_env_without_deep_measures_no_features():
    r = run_diag("env", "--json", "--no-fingerprints", timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert all("features" not in info for fw in report["frameworks"].values()
               for info in fw["backends"].values())
