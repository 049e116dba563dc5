"""One tolerance policy: `diag.tolerance.tolerance(op, dtype, claim)` returns the documented
bounds, the runner's matmul bound IS the bound tests/test_numerics.py proves (plus the output's
and the truth's roundings, term by term), and the agreement factor is defined once and used by
every agreement check.
"""

from __future__ import annotations

import ast
import pathlib

import ml_dtypes
import numpy as np
import pytest

from diag import numerics, oracle, tolerance as tol_mod
from diag.compare import agreement
from diag.errors import UsageError
from diag.plan.registry import PROBES
from diag.tolerance import (AGREEMENT_FACTOR, TOPK_EXACT_RECALL, TRAIN_LOSS_ULP_SCREEN,
                            matmul_bound, matmul_error_bound, softmax_error_bound,
                            softmax_ulp_tolerance, tolerance)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _product(dtype, m=16, k=512, n=16, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    return a, b, oracle.matmul(a, b)


def test_every_probe_has_a_tolerance():
    # A row of diag/tolerance/, or the op module's own (`Probe.tolerance`).
    for op, probe in PROBES.items():
        for dtype in probe.dtypes:
            t = probe.tolerance_of(dtype)
            assert t.op == op and t.dtype == dtype and t.claim == "float32" and t.why
            if probe.tolerance is None:
                assert (tolerance(op, dtype).why, tolerance(op, dtype).ulp is None) == (
                    t.why, t.ulp is None)


def test_unknown_op_is_a_usage_error():
    with pytest.raises(UsageError, match="no tolerance for op 'conv'"):
        tolerance("conv", "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matmul_tolerance_is_the_bound_numerics_proved_plus_the_roundings(dtype):
    """One matmul bound: the runner's is gamma_K |A||B| (`matmul_error_bound`, proved in
    test_numerics) + K float32 underflows, widened by the output's rounding where the output is
    narrower than float32, plus the truth's own rounding."""
    a, b, truth = _product(numerics.as_dtype(dtype))
    looked_up = tolerance("matmul", dtype).bound([a, b], truth)
    np.testing.assert_array_equal(looked_up, matmul_bound([a, b], truth))
    core = matmul_error_bound(a, b, "float32") + a.shape[-1] * float(
        np.finfo(np.float32).smallest_subnormal)
    u = numerics.unit_roundoff(dtype)
    half_eta = float(ml_dtypes.finfo(truth.dtype).smallest_subnormal) / 2
    rounding = u * np.abs(truth.astype(np.float64)) / (1 - u) + half_eta
    if dtype == "float32":
        expected = core + rounding
    else:
        expected = core * (1 + u) + rounding + rounding
    np.testing.assert_array_equal(looked_up, expected)


def test_matmul_claim_changes_the_gamma():
    """Claiming bf16 accumulation allows gamma_K(bf16), far more than float32's."""
    a, b, truth = _product(np.float32, k=64)
    f32 = tolerance("matmul", "float32", "float32").bound([a, b], truth)
    bf16 = tolerance("matmul", "float32", "bfloat16").bound([a, b], truth)
    assert (bf16 > f32).all()
    # Equal up to float64 rounding of the differences (|bound| ~ 10, one ulp ~ 2e-15).
    np.testing.assert_allclose(
        bf16 - f32, matmul_error_bound(a, b, "bfloat16") - matmul_error_bound(a, b, "float32")
        + 64 * (float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)
                - float(np.finfo(np.float32).smallest_subnormal)), rtol=1e-13)


def test_softmax_tolerance_is_the_documented_bound_and_ulp_form():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 1024)).astype(ml_dtypes.bfloat16)
    truth = oracle.softmax(x)
    t = tolerance("softmax", "bfloat16")
    np.testing.assert_array_equal(t.bound(x, truth), softmax_error_bound(x, truth))
    np.testing.assert_array_equal(t.loose_bound(x, truth),
                                  softmax_error_bound(x, truth, elementwise_dtype="bfloat16"))
    assert (t.loose_bound(x, truth) >= t.bound(x, truth)).all()
    assert t.ulp({"n": 1024}) == softmax_ulp_tolerance("bfloat16", 1024)
    assert t.agreement_ulp({"n": 1024}) == AGREEMENT_FACTOR * softmax_ulp_tolerance("bfloat16",
                                                                                      1024)


def test_structural_ops_have_their_rules():
    assert tolerance("top_k", "bfloat16").recall == TOPK_EXACT_RECALL == 1.0
    assert tolerance("approx_max_k", "float32").recall is None  # the caller's promise applies
    assert tolerance("greedy_token", "float16").bound is None
    train = tolerance("train_step", "float32")
    assert train.ulp({}) == TRAIN_LOSS_ULP_SCREEN == 64
    with pytest.raises(UsageError, match="top_k has no ULP tolerance"):
        tolerance("top_k", "float32").agreement_ulp({})


def test_agreement_allows_exactly_the_factor_times_the_bound():
    """Two outputs apart by just under / just over AGREEMENT_FACTOR * bound land on either side
    of bound_ratio 1."""
    x = np.array([1.0, 2.0], np.float64)
    bound = np.array([0.25, 0.25])
    y_in = x + AGREEMENT_FACTOR * 0.25
    y_out = x + AGREEMENT_FACTOR * 0.25 * 1.5
    assert agreement(x, y_in, bound)["bound_ratio"] == 1.0
    assert agreement(x, y_out, bound)["bound_ratio"] == 1.5


def test_agreement_factor_is_defined_once():
    """No module in diag/ multiplies a tolerance by a literal 2 for agreement, nor defines the
    factor again: `AGREEMENT_FACTOR` lives in diag/tolerance.py alone."""
    defined = []
    sources = [*(ROOT / "diag").rglob("*.py"), *(ROOT / "probes").rglob("*.py")]
    for path in sources:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if "AGREEMENT_FACTOR" in names:
                    defined.append(path.relative_to(ROOT).as_posix())
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                    and isinstance(node.left, ast.Constant) and node.left.value == 2
                    and "tolerance" in ast.unparse(node.right)):
                pytest.fail(f"{path}: {ast.unparse(node)} doubles a tolerance; "
                            f"use diag.tolerance.AGREEMENT_FACTOR")
    assert defined == ["diag/tolerance/__init__.py"]
    users = [p.relative_to(ROOT).as_posix() for p in sources
             if "AGREEMENT_FACTOR" in p.read_text() or "agreement_ulp" in p.read_text()]
    assert {"diag/compare/elementwise.py", "probes/softmax.py"} <= set(users)


def test_every_tolerance_constant_carries_its_derivation():
    """Each module-level number in diag/tolerance/ (the op rows, the gate's allowances,
    diverge's thresholds) has a comment right above it saying why."""
    names = set()
    for path in sorted((ROOT / "diag" / "tolerance").glob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        constants = [n for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant)
                     and isinstance(n.value.value, (int, float))]
        names |= {t.id for n in constants for t in n.targets}
        for node in constants:
            above = lines[node.lineno - 2].strip()
            assert above.startswith("#:"), f"{path.name}:{node.lineno} has no derivation comment"
    assert names >= {"AGREEMENT_FACTOR", "TOPK_EXACT_RECALL", "TRAIN_LOSS_ULP_SCREEN",
                     "SOFTMAX_EXP_ULP", "DIVERGE_ROUNDED_ULP", "DIVERGE_COMPOSITE_EXTRA_STEPS"}
    assert tol_mod.__doc__ and "derivation" in tol_mod.__doc__


def test_a_bound_is_the_same_bits_on_one_blas_thread_as_on_many():
    # `diag run` limits the host's BLAS to one thread (diag.run.runner): the bound of a stored
    # entry or of an earlier run must not depend on it. BLAS threads split a product's rows
    # and columns, not its K sum; checked on the shipped suites' kinds of K.
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(3)
    for m, k, n in [(512, 4, 384), (256, 512, 256), (64, 16384, 64)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        many = matmul_error_bound(a, b, "float32")
        with threadpool_limits(limits=1, user_api="blas"):
            one = matmul_error_bound(a, b, "float32")
        assert np.array_equal(one.view(np.uint64), many.view(np.uint64)), (m, k, n)
