"""The verdict policy: the claimed arithmetic's error bound decides, ULPs inform.

should_pass / should_fail pairs on real products: a float32 sum passes, one bf16 pass (what
TPU's DEFAULT precision does to an f32 matmul) breaks the float32 bound.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from diag import numerics, oracle
from diag.compare import agreement, compare, judge, judge_agreement
from diag.tolerance import matmul_bound

PARAMS = {"m": 256, "k": 256, "n": 256}


@pytest.fixture(scope="module")
def product():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    truth = oracle.matmul(a, b)
    return a, b, truth, matmul_bound([a, b], truth, PARAMS)


def _bf16_one_pass(a, b):
    """Inputs rounded to bf16, products exact, float32 accumulation: TPU DEFAULT for f32."""
    a16 = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    b16 = b.astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.matmul(a16, b16)


def test_correctly_rounded_output_should_pass_with_zero_ulp(product):
    a, b, truth, bound = product
    m = compare(truth.copy(), truth, bound)
    assert m["max_ulp"] == 0 and m["frac_not_correctly_rounded"] == 0
    assert m["bound_ratio"] == 0 and m["bound_exceeded"] == 0
    assert judge(m, promised=True, claim="float32 accumulation", setting="x")[0] == "pass"


def test_float32_sum_should_pass_though_not_correctly_rounded(product):
    a, b, truth, bound = product
    m = compare(np.matmul(a, b), truth, bound)
    assert m["frac_not_correctly_rounded"] > 0.1  # a float32 sum is rarely correctly rounded
    assert 0 < m["bound_ratio"] < 1
    status, reason = judge(m, promised=True, claim="float32 accumulation", setting="x")
    assert status == "pass" and reason.startswith("within the float32 accumulation bound")


def test_one_bf16_pass_should_fail_where_float32_is_promised(product):
    a, b, truth, bound = product
    m = compare(_bf16_one_pass(a, b), truth, bound)
    assert m["bound_ratio"] > 10 and m["bound_exceeded"] > 0.5 * truth.size
    status, reason = judge(m, promised=True, claim="float32 accumulation",
                           setting="precision=highest")
    assert status == "fail"
    assert f"in {m['bound_exceeded']} / {truth.size} elements" in reason
    assert m["worst"]["index"] in reason


def test_one_bf16_pass_is_a_warning_where_the_setting_permits_it(product):
    a, b, truth, bound = product
    m = compare(_bf16_one_pass(a, b), truth, bound)
    status, reason = judge(m, promised=False, claim="float32 accumulation",
                           setting="precision=default")
    assert status == "warn" and "precision=default permits" in reason


def test_nan_where_the_exact_result_is_finite_should_fail(product):
    a, b, truth, bound = product
    out = np.matmul(a, b)
    out[3, 4] = np.nan
    out[5, 6] = np.inf
    m = compare(out, truth, bound)
    assert m["nan_count"] == 1 and m["inf_count"] == 1 and m["unexpected_nonfinite"] == 2
    status, reason = judge(m, promised=False, claim="c", setting="s")
    assert status == "fail" and reason.startswith("2 / 65536 elements are NaN/Inf")


def test_nan_expected_by_the_exact_math_is_not_a_failure():
    a = np.array([[np.inf, 1.0]], dtype=np.float32)
    b = np.array([[0.0], [1.0]], dtype=np.float32)  # inf * 0 = NaN exactly
    truth = oracle.matmul(a, b)
    assert np.isnan(truth[0, 0])
    with np.errstate(invalid="ignore"):
        out = np.matmul(a, b)
    m = compare(out, truth, matmul_bound([a, b], truth, {}))
    assert m["unexpected_nonfinite"] == 0 and m["nan_count"] == 1


def test_agreement_passes_when_difference_is_explained_by_rounding(product):
    a, b, truth, bound = product
    x = np.matmul(a, b)
    y = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    m = agreement(x, y, bound)
    assert m["mismatched"] > 0 and m["bound_ratio"] <= 1
    assert judge_agreement(m, "p", "q", "float32 accumulation")[0] == "pass"
    same = agreement(x, x.copy(), bound)
    assert same["mismatched"] == 0 and same["max_ulp_between"] == 0
    assert judge_agreement(same, "p", "q", "c") == ("pass", "p and q agree bit for bit")


def test_agreement_warns_on_a_drift_no_correct_pair_can_show(product):
    """The JAX-on-TPU vs PyTorch drift: bf16 one-pass against float32 on the same inputs."""
    a, b, truth, bound = product
    m = agreement(_bf16_one_pass(a, b), np.matmul(a, b), bound)
    status, reason = judge_agreement(m, "jax-tpu", "torch-cpu", "float32 accumulation")
    assert status == "warn" and m["bound_ratio"] > 1
    assert reason.startswith("jax-tpu and torch-cpu differ in")


def test_ulp_metrics_see_a_one_ulp_nudge(product):
    a, b, truth, bound = product
    nudged = truth.copy()
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(np.inf))
    m = compare(nudged, truth, bound)
    assert m["max_ulp"] == 1 and m["frac_not_correctly_rounded"] == 1 / truth.size
    assert int(numerics.ulp_distance(nudged, truth).sum()) == 1


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(64, 4, 64), (32, 1024, 32), (16, 8192, 16)])
def test_float32_accumulation_then_one_rounding_always_keeps_the_bound(dtype, shape):
    """What every framework claims for bf16/fp16 inputs; double rounding included (f32 -> out)."""
    m, k, n = shape
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    truth = oracle.matmul(a, b)
    out = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(dtype)
    m_ = compare(out, truth, matmul_bound([a, b], truth, {}))
    assert m_["bound_ratio"] <= 1, m_["worst"]


def test_accumulating_in_half_precision_breaks_the_float32_claim():
    """A sum kept in fp16 (each partial sum rounded) is what the bound exists to catch."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 4096)).astype(np.float16)
    b = rng.standard_normal((4096, 8)).astype(np.float16)
    truth = oracle.matmul(a, b)
    acc = np.zeros((8, 8), np.float16)
    for i in range(a.shape[1]):  # sequential fp16 accumulation of exact-in-f32 products
        acc = (acc.astype(np.float32) + np.outer(a[:, i], b[i, :]).astype(np.float32)).astype(
            np.float16)
    m_ = compare(acc, truth, matmul_bound([a, b], truth, {}))
    assert m_["bound_ratio"] > 1 and m_["bound_exceeded"] > 0
