"""diag's floating-point units are right: dtype names, ULP distances, unit roundoff, gamma,
error bounds and single correct rounding from float64 (checked against mpmath).
"""

from __future__ import annotations

import ml_dtypes
import mpmath
import numpy as np
import pytest

from diag.errors import UsageError
from diag.numerics import (
    NAN_ULP, as_dtype, bits_view, dtype_name, from_bits, gamma,
    round_to_dtype, ulp_distance, unit_roundoff,
)
from diag.oracle import mp
from diag.tolerance import matmul_error_bound

LOW = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]


def test_dtype_registry_round_trips_names():
    for name in LOW + ["float64"]:
        dt = as_dtype(name)
        assert dtype_name(dt) == name and as_dtype(dt) == dt
    assert as_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert as_dtype(np.float16) == np.dtype(np.float16)
    with pytest.raises(UsageError, match="unknown dtype 'int7'"):
        as_dtype("int7")
    with pytest.raises(UsageError, match="unsupported dtype int32"):
        as_dtype(np.int32)


def test_unit_roundoff_and_gamma():
    assert unit_roundoff("float32") == 2.0**-24
    assert unit_roundoff("bfloat16") == 2.0**-8
    assert unit_roundoff("float16") == 2.0**-11
    assert unit_roundoff("float64") == 2.0**-53
    assert gamma(4, "bfloat16") == pytest.approx(4 * 2.0**-8 / (1 - 4 * 2.0**-8), rel=1e-15)
    assert gamma(256, "bfloat16") == np.inf and gamma(300, "bfloat16") == np.inf
    np.testing.assert_array_equal(gamma(np.array([0, 2048]), "float16"), [0.0, np.inf])


def test_matmul_error_bound_holds_for_float32_and_is_violated_by_bf16_pass():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 512)).astype(np.float32)
    b = rng.standard_normal((512, 64)).astype(np.float32)
    exact = (a.astype(np.float64) @ b.astype(np.float64))  # error ~2**-44: negligible here
    f32 = a @ b
    assert (np.abs(f32 - exact) <= matmul_error_bound(a, b, "float32")).all()
    # One bf16 pass (inputs rounded to bf16) breaks the float32 bound somewhere.
    bf = ml_dtypes.bfloat16
    one_pass = a.astype(bf).astype(np.float32) @ b.astype(bf).astype(np.float32)
    assert (np.abs(one_pass - exact) > matmul_error_bound(a, b, "float32")).any()


def test_ulp_distance_basics():
    f = np.float32
    x = np.array([0.0, -0.0, 1.0, 1.0, -1.0, np.inf, np.nan, np.nan, 1.0], f)
    y = np.array([-0.0, 0.0, np.nextafter(f(1), f(2)), 1.0, np.nextafter(f(-1), f(0)),
                  np.finfo(f).max, np.nan, 1.0, np.nan], f)
    np.testing.assert_array_equal(ulp_distance(x, y), [0, 0, 1, 0, 1, 1, 0, NAN_ULP, NAN_ULP])
    tiny = np.array([np.finfo(f).smallest_subnormal], f)
    assert ulp_distance(tiny, -tiny)[0] == 2  # across zero: -s, 0, +s
    assert ulp_distance(np.array([-np.inf], f), np.array([np.inf], f))[0] == 2 * 0x7F800000
    assert ulp_distance(np.array([-np.inf], f), np.array([np.inf], f))[0] < NAN_ULP


@pytest.mark.parametrize("name", LOW)
def test_ulp_distance_counts_neighbours_in_every_low_dtype(name):
    dt = as_dtype(name)
    width = dt.itemsize * 8
    if width == 8:
        vals = np.arange(256, dtype=np.uint8).view(dt)
    else:
        vals = np.random.default_rng(1).integers(0, 2**width, 2000).astype(f"u{dt.itemsize}").view(dt)
    with np.errstate(invalid="ignore"):
        v64 = vals.astype(np.float64)
    ok = ~np.isnan(v64)
    vals, v64 = vals[ok], v64[ok]
    order = np.argsort(v64, kind="stable")
    # Sorted distinct values: the distance between neighbours in the sorted list equals the
    # number of representable values between them (all values are present for 8-bit types).
    d = ulp_distance(vals[order][1:], vals[order][:-1])
    if width == 8:
        uniq = np.unique(v64)
        assert uniq.size == vals.size - 1  # +0 and -0 collapse
        same = v64[order][1:] == v64[order][:-1]
        assert (d[same] == 0).all() and (d[~same] == 1).all()
    assert (d >= 0).all()


def test_ulp_distance_rejects_mixed_dtypes():
    with pytest.raises(UsageError, match="dtypes differ"):
        ulp_distance(np.zeros(1, np.float32), np.zeros(1, np.float16))


def test_bits_view_round_trip():
    x = np.array([-0.0, np.inf, 1.5], ml_dtypes.bfloat16)
    bits = bits_view(x)
    assert bits.dtype == np.uint16 and bits[0] == 0x8000
    assert (bits_view(from_bits(bits, "bfloat16")) == bits).all()
    with pytest.raises(UsageError, match="cannot hold"):
        from_bits(bits, "float32")


def _crafted_f64(name):
    """Values near midpoints, ties, subnormals and overflow of the target, as float64."""
    dt = as_dtype(name)
    fi = ml_dtypes.finfo(dt)
    p = int(fi.nmant) + 1
    tiny, big = float(fi.smallest_subnormal), float(fi.max)
    emax = int(fi.maxexp) - 1
    vals = []
    for base in [1.0, 1.5, 3.0, 2.0 ** (emax - 1), float(fi.smallest_normal), tiny * 4]:
        h = base * 2.0 ** -p  # half ulp (within the binade)
        for off in [h, -h, h / 2, 3 * h]:
            for eps in [0.0, 2.0**-40, -(2.0**-40)]:
                vals.append(base + off * (1 + eps))
    vals += [tiny / 2, tiny * 1.5, tiny / 2 * (1 + 2.0**-40), tiny / 4, big,
             big + big * 2.0 ** -p, big + big * 2.0 ** (-p - 1), 1e300, 0.0, -0.0, np.inf,
             1 + 2.0**-8 + 2.0**-30]
    rng = np.random.default_rng(2)
    vals += list(rng.standard_normal(300) * 2.0 ** rng.integers(-30, 30, 300))
    vals = np.array(vals)
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("name", LOW)
def test_round_to_dtype_equals_mpmath_single_rounding(name):
    x = _crafted_f64(name)
    got = round_to_dtype(x, name)
    want = np.array([mp.round_mpf(mpmath.mpf(float(v)), name) for v in x], as_dtype(name))
    zero = x == 0
    want[zero] = x[zero].astype(as_dtype(name))  # round_mpf leaves the sign of zero to callers
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    same = (bits_view(got) == bits_view(want)) | (np.isnan(g64) & np.isnan(w64))
    assert same.all(), list(zip(x[~same], g64[~same], w64[~same]))


def test_round_to_dtype_avoids_the_double_rounding_of_ml_dtypes():
    x = np.array([1 + 2.0**-8 + 2.0**-30])
    assert float(x.astype(ml_dtypes.bfloat16)[0]) == 1.0  # ml_dtypes rounds twice
    assert float(round_to_dtype(x, "bfloat16")[0]) == 1 + 2.0**-7
    assert float(round_to_dtype(np.array([464.0]), "float8_e4m3fn")[0]) == 448.0
    assert np.isnan(float(round_to_dtype(np.array([465.0]), "float8_e4m3fn")[0]))


def test_ulp_distance_of_scalars_keeps_their_shape():
    one = np.float32(1.0)
    d = ulp_distance(np.asarray(one), np.asarray(np.nextafter(one, np.float32(2))))
    assert d.shape == () and int(d) == 1
    assert int(ulp_distance(np.asarray(np.float32(np.nan)), np.asarray(one))) == NAN_ULP
