"""The fast matmul oracle equals the exact mpmath reference BIT FOR BIT.

Claims under test: on random and adversarial inputs (midpoints +- 2**-70, exact ties, 2**40
cancellation, huge dynamic range, subnormal results, overflow, inf/NaN, signed zeros) in float32,
bfloat16 and float16, `diag.oracle.matmul` returns exactly `diag.oracle.mp.matmul`; the long-K
(K-split, double-double) path agrees too; and the naive shortcuts (mpmath at 50 digits then
float() then cast; float64 matmul then cast) are wrong on a case the suite can show.
"""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diag.oracle as oracle
from diag.errors import UsageError
from diag.numerics import bits_view, precision_bits
from diag.oracle import mp
from tests.conftest import BF16, DTYPES, IDS, assert_bits_equal



def exact_in(values, dt):
    """Cast to dt, asserting no value was rounded (the crafted cases must be representable)."""
    arr = np.asarray(values, dtype=np.float64)
    out = arr.astype(dt)
    back = out.astype(np.float64)
    same = (back == arr) | (np.isnan(arr) & np.isnan(back))
    assert same.all() and (np.signbit(back) == np.signbit(arr)).all(), (values, dt)
    return out


# --- random inputs, >= 10k elements per dtype -------------------------------------------------

@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_random_10k_elements_match_mp_bit_for_bit(dt):
    rng = np.random.default_rng(1234)
    m, k, n = 100, 8, 101
    # Mixed magnitudes (2**+-6 within a row) make the sums cancel and round in varied places.
    a = (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 7, (m, k))).astype(dt)
    b = (rng.standard_normal((k, n)) * 2.0 ** rng.integers(-6, 7, (k, n))).astype(dt)
    res = oracle.matmul_result(a, b)
    assert res.elements == m * n >= 10_000
    assert_bits_equal(res.value, mp.matmul(a, b), f"{dt} random")
    # The proof decides almost everything; what it does not is counted, not hidden.
    assert res.fallbacks < m * n // 100


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_integer_inputs_with_many_exact_ties_match_mp(dt):
    # Small integers give exact sums; many land exactly on midpoints of bf16/fp16.
    rng = np.random.default_rng(7)
    a = rng.integers(-40, 41, (40, 6)).astype(dt)
    b = rng.integers(-40, 41, (6, 40)).astype(dt)
    assert_bits_equal(oracle.matmul(a, b), mp.matmul(a, b), f"{dt} integer ties")


# --- crafted cases ----------------------------------------------------------------------------

def crafted_cases(dt):
    """(name, a_row, b_col, expected float or None) with every value exact in dt."""
    p = precision_bits(dt)
    fi = ml_dtypes.finfo(dt)
    big, tiny = float(fi.max), float(fi.smallest_subnormal)
    emax = int(fi.maxexp) - 1
    if dt == np.float16:
        # fp16 cannot hold 2**-35; put the midpoint at 2**15 and the nudge at 2**-24 * 2**-24:
        # 2**-48 absolute is 2**-63 relative, the closest fp16 gets to 2**-70.
        s, nud, cancel, small = 15, (2.0**-24, 2.0**-24), 30, -10
    else:
        s, nud, cancel, small = 0, (2.0**-35, 2.0**-35), 40, 0
    one = 2.0**s
    h = 2.0 ** (s - p)  # half an ulp at 2**s
    half_s = (2.0 ** (s // 2), 2.0 ** (s - s // 2))
    c2 = (2.0 ** (cancel // 2), 2.0 ** (cancel - cancel // 2))
    x = 1 + 2.0 ** (1 - p)  # needs all p bits
    cases = [
        ("tie down to even", [half_s[0], h], [half_s[1], 1], one),
        ("tie up to even", [x * one, h], [1, 1], one * (1 + 2.0 ** (2 - p))),
        ("just above midpoint", [half_s[0], h, nud[0]], [half_s[1], 1, nud[1]], one * x),
        ("just below midpoint", [half_s[0], h, -nud[0]], [half_s[1], 1, nud[1]], one),
        # big terms 2**40 times the result (2**30 + 2**10 in fp16, whose range is smaller)
        ("2**40 cancellation", [c2[0], x, -c2[0]], [c2[1], 2.0**small, c2[1]], x * 2.0**small),
        ("overflow on tie", [big, 2.0 ** (emax - p)], [1, 1], np.inf),
        ("max finite below tie", [big, 2.0 ** (emax - p - 1)], [1, 1], big),
        ("overflow", [big, big], [1, 1], np.inf),
        ("negative overflow", [-big], [2], -np.inf),
        ("subnormal tie to zero", [tiny], [0.5], 0.0),
        ("subnormal tie up to even", [tiny * 3], [0.5], tiny * 2),
        ("subnormal round up", [tiny * 3], [0.25], tiny),
        ("negative subnormal tie", [-tiny], [0.5], -0.0),
        ("huge dynamic range to subnormal", [big, tiny, -big], [1, 1, 1], tiny),
        ("inf", [np.inf, 1], [1, 1], np.inf),
        ("-inf * -1", [-np.inf], [-1], np.inf),
        ("inf - inf", [np.inf, np.inf], [1, -1], np.nan),
        ("inf * 0", [np.inf, 1], [0, 1], np.nan),
        ("nan", [np.nan, 1], [1, 1], np.nan),
        ("inf plus big finite", [np.inf, big], [1, big], np.inf),
        ("-0 + -0", [-0.0, -0.0], [1, 1], -0.0),
        ("-0 + +0", [-0.0, 0.0], [1, 1], 0.0),
        ("0 * -1", [0.0], [-1], -0.0),
        ("-0 * -0", [-0.0], [-0.0], 0.0),
        ("exact cancellation", [1, -1], [1, 1], 0.0),
        ("cancellation plus -0", [1, -1, -0.0], [1, 1, 1], 0.0),
    ]
    return cases


def crafted_matrices(dt):
    cases = crafted_cases(dt)
    k = max(len(c[1]) for c in cases)
    # Pad with (-0) * (+0) = -0: it changes no sum and keeps "all terms -0" cases intact.
    a = np.full((len(cases), k), -0.0)
    b = np.full((k, len(cases)), 0.0)
    for i, (_, ar, bc, _) in enumerate(cases):
        a[i, : len(ar)] = ar
        b[: len(bc), i] = bc
    return cases, exact_in(a, dt), exact_in(b, dt)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_crafted_cases_have_the_expected_correctly_rounded_value(dt):
    cases, a, b = crafted_matrices(dt)
    got = oracle.matmul(a, b)
    ref = mp.matmul(a, b)
    for i, (name, _, _, want) in enumerate(cases):
        if want is None:
            continue
        want = exact_in([want], dt)[0]
        assert bits_view(got[i, i]) == bits_view(want) or (np.isnan(want) and np.isnan(got[i, i])), (
            f"{dt} {name}: oracle {got[i, i]!r}, want {want!r}")
        assert bits_view(ref[i, i]) == bits_view(want) or (np.isnan(want) and np.isnan(ref[i, i])), (
            f"{dt} {name}: mp {ref[i, i]!r}, want {want!r}")


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_crafted_cross_products_match_mp(dt):
    # Every (row, column) pair of the crafted set, not just the diagonal: mixes of specials,
    # zeros, extremes. NaN payloads aside, bits must agree.
    _, a, b = crafted_matrices(dt)
    got, ref = oracle.matmul(a, b), mp.matmul(a, b)
    nan_g, nan_r = np.isnan(got.astype(np.float32)), np.isnan(ref.astype(np.float32))
    assert (nan_g == nan_r).all()
    assert_bits_equal(np.where(nan_g, 0, got).astype(dt), np.where(nan_r, 0, ref).astype(dt),
                      f"{dt} crafted cross")


def test_cancellation_by_2_40_is_exact_in_float32():
    a = exact_in([[2.0**40, 1 + 2.0**-23, -(2.0**40)]], np.float32)
    b = exact_in([[1.0], [1.0], [1.0]], np.float32)
    got = oracle.matmul_result(a, b)
    assert got.value[0, 0] == np.float32(1 + 2.0**-23)
    # float64 loses the small term's low bits next to 2**40; the proof fails and the exact
    # fallback answers. The count says so.
    assert got.fallbacks == 1


def test_output_dtype_can_differ_from_inputs():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((30, 7)).astype(np.float32)
    b = rng.standard_normal((7, 30)).astype(np.float32)
    for od in ["bfloat16", "float16", "float64"]:
        assert_bits_equal(oracle.matmul(a, b, od), mp.matmul(a, b, od), f"f32 -> {od}")


# --- the naive approaches are wrong, the oracle is right --------------------------------------

def naive_mp_float_cast(a, b):
    """mpmath at 50 digits, then float(), then cast: rounds twice."""
    with mpmath.workdps(50):
        s = mpmath.fsum(mpmath.mpf(float(x)) * mpmath.mpf(float(y)) for x, y in zip(a[0], b[:, 0]))
        return np.float32(float(s))


def test_naive_mp_then_float_then_cast_is_wrong_where_oracle_is_right():
    # Exact sum 1 + 2**-24 + 2**-60: just above the float32 midpoint, so it rounds UP to
    # 1 + 2**-23. float() drops 2**-60 (below half a float64 ulp), leaving the exact midpoint,
    # which then rounds to even: 1.0.
    a = exact_in([[1.0, 2.0**-24, 2.0**-30]], np.float32)
    b = exact_in([[1.0], [1.0], [2.0**-30]], np.float32)
    right = np.float32(1 + 2.0**-23)
    assert naive_mp_float_cast(a, b) == np.float32(1.0) != right
    assert oracle.matmul(a, b)[0, 0] == right
    assert mp.matmul(a, b)[0, 0] == right


def test_float64_matmul_then_cast_is_wrong_where_oracle_is_right():
    a = exact_in([[1.0, 2.0**-24, 2.0**-30]], np.float32)
    b = exact_in([[1.0], [1.0], [2.0**-30]], np.float32)
    naive = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert naive[0, 0] == np.float32(1.0)
    assert oracle.matmul(a, b)[0, 0] == np.float32(1 + 2.0**-23)


def test_float64_to_bf16_cast_double_rounds_but_oracle_does_not():
    a = exact_in([[1.0, 2.0**-8, 2.0**-30]], BF16)
    b = exact_in([[1.0], [1.0], [1.0]], BF16)
    naive = (a.astype(np.float64) @ b.astype(np.float64)).astype(BF16)
    assert float(naive[0, 0]) == 1.0
    assert float(oracle.matmul(a, b)[0, 0]) == 1 + 2.0**-7 == float(mp.matmul(a, b)[0, 0])


# --- long K: the K-split double-double path ---------------------------------------------------

def test_long_k_uses_ksplit_and_matches_mp_on_a_sample():
    rng = np.random.default_rng(5)
    k = 65536
    a = rng.standard_normal((3, k)).astype(np.float32)
    b = rng.standard_normal((k, 3)).astype(np.float32)
    res = oracle.matmul_result(a, b)
    assert res.method == "f64-ksplit"
    sample = [(0, 0), (1, 2), (2, 1)]
    want = mp.matmul(a, b, elements=sample)
    assert_bits_equal(np.array([res.value[i, j] for i, j in sample]), want, "K=65536")


def test_long_k_crafted_midpoint_needs_and_gets_the_exact_answer():
    # 65536 terms summing exactly to the float32 midpoint 2**16 (1 + 2**-24) plus 2**-70:
    # the true value rounds up; any float64 evaluation sees the tie.
    k = 65536
    a = np.ones((1, k), np.float32)
    b = np.ones((k, 1), np.float32)
    a[0, 0], b[0, 0] = 2.0**-35, 2.0**-35  # 2**-70 instead of 1
    a[0, 1], b[1, 0] = 2.0**-4, 2.0**-4    # 2**-8 (half an ulp at 2**16) instead of 1
    a[0, 2] = 3.0                          # 3 instead of 1: total 65536 + 2**-8 + 2**-70
    res = oracle.matmul_result(a, b)
    assert res.method == "f64-ksplit"
    assert float(res.value[0, 0]) == 2.0**16 * (1 + 2.0**-23)
    assert float(mp.matmul(a, b)[0, 0]) == 2.0**16 * (1 + 2.0**-23)
    assert res.fallbacks == 1


# --- batching, properties, errors -------------------------------------------------------------

def test_batched_broadcast_matches_per_slice():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 3, 4, 5)).astype(np.float16)
    b = rng.standard_normal((3, 5, 6)).astype(np.float16)
    got = oracle.matmul(a, b)
    assert got.shape == (2, 3, 4, 6)
    for i in range(2):
        for j in range(3):
            assert_bits_equal(got[i, j], mp.matmul(a[i, j], b[j]), f"batch {i},{j}")
    assert_bits_equal(mp.matmul(a, b, elements=[(1, 2, 3, 5)]), got[1, 2, 3, 5][None], "elements")


def any_bits(dt):
    width = dt.itemsize * 8
    return st.integers(0, 2**width - 1).map(lambda v: np.array(v, f"u{dt.itemsize}").view(dt))


@st.composite
def matmul_inputs(draw):
    dt = draw(st.sampled_from(DTYPES))
    m, k, n = draw(st.integers(1, 4)), draw(st.integers(0, 6)), draw(st.integers(1, 4))
    # Half the time arbitrary bit patterns (NaN, inf, subnormals, -0), else modest normals.
    elems = st.one_of(any_bits(dt), st.floats(-8, 8, width=16).map(lambda v: np.array(v).astype(dt)))
    a = np.array(draw(st.lists(elems, min_size=m * k, max_size=m * k)), dtype=dt).reshape(m, k)
    b = np.array(draw(st.lists(elems, min_size=k * n, max_size=k * n)), dtype=dt).reshape(k, n)
    return a, b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(matmul_inputs())
def test_property_oracle_equals_mp_on_any_bits(ab):
    a, b = ab
    got, ref = oracle.matmul(a, b), mp.matmul(a, b)
    nan_g = np.isnan(got.astype(np.float32))
    assert (nan_g == np.isnan(ref.astype(np.float32))).all()
    assert_bits_equal(np.where(nan_g, 0, got).astype(a.dtype),
                      np.where(nan_g, 0, ref).astype(a.dtype), "property")


@pytest.mark.parametrize("bad, msg", [
    ((np.ones((2, 3)), np.ones((3, 2))), "float64 inputs"),
    ((np.ones((2, 3), np.float32), np.ones((4, 2), np.float32)), "do not multiply"),
    ((np.ones(3, np.float32), np.ones(3, np.float32)), "do not multiply"),
    ((np.ones((2, 3), np.float32), np.ones((3, 2), np.float16)), "pass out_dtype"),
    ((np.ones((2, 2, 3), np.float32), np.ones((3, 3, 2), np.float32)), "do not broadcast"),
])
def test_bad_input_raises_usage_error_saying_what_to_fix(bad, msg):
    with pytest.raises(UsageError, match=msg):
        oracle.matmul(*bad)


def test_unknown_out_dtype_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown dtype"):
        oracle.matmul(np.ones((1, 1), np.float32), np.ones((1, 1), np.float32), "float7")


def test_empty_contraction_is_plus_zero():
    got = oracle.matmul(np.ones((2, 0), np.float32), np.ones((0, 3), np.float32))
    assert got.shape == (2, 3) and (bits_view(got) == 0).all()


def test_oracle_exposes_backend_op_names():
    assert getattr(oracle, "matmul") is oracle.matmul
    res = oracle.matmul_result(np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32))
    assert res.method == "f64-bound" and not res.cache_hit and res.elements == 4
    assert res.fallbacks == 0 and res.seconds >= 0


def test_import_oracle_loads_no_framework():
    code = ("import sys, diag.oracle, diag.numerics; "
            "bad = [m for m in ('jax', 'torch', 'torch_xla') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_medium_k_ksplit_path_matches_mp_on_a_sample(dt):
    rng = np.random.default_rng(11)
    k = 3000  # above KSPLIT_THRESHOLD: blocked double-double path
    a = rng.standard_normal((6, k)).astype(dt)
    b = rng.standard_normal((k, 5)).astype(dt)
    res = oracle.matmul_result(a, b)
    assert res.method == "f64-ksplit"
    sample = [(i, j) for i in range(6) for j in range(5) if (i + j) % 3 == 0]
    want = mp.matmul(a, b, elements=sample)
    assert_bits_equal(np.array([res.value[i, j] for i, j in sample]), want, f"{dt} K=3000")


@pytest.mark.parametrize("scale, what", [(2.0**70, "f32 bound overflows: float64 bound"),
                                         (2.0**-70, "f32 bound underflows: refined"),
                                         (1.0, "plain")])
def test_long_k_extreme_magnitudes_cancellation_and_zero_rows(scale, what):
    rng = np.random.default_rng(13)
    k = 2048
    a = (rng.standard_normal((4, k)) * scale).astype(np.float32)
    b = (rng.standard_normal((k, 3)) * scale).astype(np.float32)
    a[0, :2] = [2.0**40 * scale, -(2.0**40) * scale]  # huge terms that cancel exactly
    b[:2, 0] = [1.0, 1.0]
    a[1] = -0.0   # row of zeros: every product is -0 * x, sign decides
    b[:, 2] = 0.0
    res = oracle.matmul_result(a, b)
    want = mp.matmul(a, b)
    assert_bits_equal(res.value, want, what)
    assert np.signbit(res.value[1, 2]) == np.signbit(want[1, 2])


def test_float64_output_matches_mp_including_specials():
    cases, a, b = crafted_matrices(np.dtype(np.float32))
    got, ref = oracle.matmul(a, b, "float64"), mp.matmul(a, b, "float64")
    nan = np.isnan(got)
    assert (nan == np.isnan(ref)).all()
    assert_bits_equal(np.where(nan, 0, got), np.where(nan, 0, ref), "f64 out crafted")


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(matmul_inputs())
def test_property_oracle_equals_mp_on_any_bits_many(ab):
    test_property_oracle_equals_mp_on_any_bits.hypothesis.inner_test(ab)


@pytest.mark.slow
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_long_k_65536_more_samples_all_dtypes(dt):
    rng = np.random.default_rng(17)
    k = 65536
    a = rng.standard_normal((4, k)).astype(dt)
    b = rng.standard_normal((k, 4)).astype(dt)
    res = oracle.matmul_result(a, b)
    sample = [(i, j) for i in range(4) for j in range(4) if (i * 4 + j) % 2 == 0]
    want = mp.matmul(a, b, elements=sample)
    assert_bits_equal(np.array([res.value[i, j] for i, j in sample]), want, f"{dt} K=65536")


def test_float64_output_long_k_matches_mp_on_a_sample():
    rng = np.random.default_rng(19)
    a = rng.standard_normal((3, 1500)).astype(np.float32)
    b = rng.standard_normal((1500, 3)).astype(np.float32)
    res = oracle.matmul_result(a, b, "float64")
    assert res.method == "dd-exact-products"
    sample = [(0, 0), (1, 2), (2, 1)]
    want = mp.matmul(a, b, "float64", elements=sample)
    assert_bits_equal(np.array([res.value[i, j] for i, j in sample]), want, "f64 out K=1500")
