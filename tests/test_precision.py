"""Claims about `diag.arith.precision`: the emulators compute their algorithms' definitions, and the
fingerprint names each algorithm from its crafted-input measurements (and says UNKNOWN,
with evidence, when no single algorithm fits); jax-cpu and torch-cpu read F32_F32_F32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from diag.arith.precision import ALGORITHMS, emulate, emulator, fingerprint, round_to
from tests.conftest import needs_jax, needs_torch


@pytest.mark.parametrize("label", list(ALGORITHMS))
def test_each_emulator_is_recognised_by_its_own_name(label):
    fp = fingerprint(emulator(label))
    assert fp.label == label, fp.evidence
    assert fp.passes == ALGORITHMS[label].passes
    assert fp.accumulator == "float32"
    assert len(fp.evidence) >= 5


def test_single_pass_input_bits_and_rounding_are_measured():
    bits = {label: fingerprint(emulator(label)) for label in
            ("F32_F32_F32", "TF32_TF32_F32", "BF16_BF16_F32", "F16_F16_F32")}
    assert {k: v.input_bits for k, v in bits.items()} == {
        "F32_F32_F32": (23, 23), "TF32_TF32_F32": (10, 10), "BF16_BF16_F32": (7, 7),
        "F16_F16_F32": (10, 10)}
    assert bits["BF16_BF16_F32"].input_rounding == "nearest-even"
    assert bits["F32_F32_F32"].input_rounding == "exact"


def _bf16_by(rounding):
    def matmul(a, b):
        def r(x):
            u = x.astype(np.float32).view(np.uint32)
            if rounding == "truncate":  # XLA's Triton split rounds toward zero
                u = u & np.uint32(0xFFFF0000)
            else:  # ties away from zero, as PTX cvt.rna does
                u = (u + np.uint32(0x8000)) & np.uint32(0xFFFF0000)
            return u.view(np.float32).astype(np.float64)
        return (r(a) @ r(b)).astype(np.float32)
    return matmul


@pytest.mark.parametrize("rounding, expected", [("truncate", "toward zero"),
                                                ("away", "nearest-away")])
def test_input_rounding_mode_is_read_from_ties(rounding, expected):
    fp = fingerprint(_bf16_by(rounding))
    assert fp.label == "BF16_BF16_F32"
    assert fp.input_rounding == expected


def test_inputs_treated_differently_read_unknown_with_evidence():
    def half_bf16(a, b):  # only A is rounded to bf16
        return round_to(a, "bf16") @ b

    fp = fingerprint(half_bf16)
    assert fp.label == "UNKNOWN"
    assert fp.input_bits == (7, 23)
    assert any("A and B are treated differently" in e for e in fp.evidence)


def test_wider_accumulator_is_detected_by_cancellation():
    fp = fingerprint(lambda a, b: (a.astype(np.float64) @ b.astype(np.float64)))
    assert fp.accumulator == "wider than float32"
    assert any("2^24+1-2^24 in 3 orders -> 1, 1, 1" in e for e in fp.evidence)
    assert fingerprint(np.matmul).accumulator == "float32"


def test_a_matmul_returning_the_wrong_shape_is_an_error():
    with pytest.raises(ValueError, match="diag: the matmul returned shape"):
        fingerprint(lambda a, b: (a @ b)[:1])


def test_tf32_rounding_is_nearest_even_to_10_bits():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10000).astype(np.float32)
    ties = np.float32(1) + np.float32(2.0 ** -11) * np.array([1, 3], np.float32)  # 1+2^-11, 1+3*2^-11
    x = np.concatenate([x, ties, -ties])
    m, e = np.frexp(x.astype(np.float64))  # m in [0.5, 1): 11 significant bits = 2^11 steps
    expected = np.ldexp(np.round(m * 2.0 ** 11) / 2.0 ** 11, e)  # np.round: half to even
    np.testing.assert_array_equal(round_to(x, "tf32").astype(np.float64), expected)
    assert round_to(ties, "tf32").tolist() == [1.0, 1.0 + 2.0 ** -9]


def _sequential_reference(a, b, fmt):
    """Independent scalar reference: round inputs, exact products, sequential f32 sums."""
    ra, rb = round_to(a, fmt).astype(np.float64), round_to(b, fmt).astype(np.float64)
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = np.float32(0)
            for k in range(a.shape[1]):
                acc = np.float32(acc + np.float32(ra[i, k] * rb[k, j]))
            out[i, j] = acc
    return out


@pytest.mark.parametrize("label, fmt", [("BF16_BF16_F32", "bf16"), ("TF32_TF32_F32", "tf32"),
                                        ("F16_F16_F32", "f16"), ("F32_F32_F32", "f32")])
def test_single_pass_emulators_match_a_scalar_reference(label, fmt):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 37)).astype(np.float32)
    b = rng.standard_normal((37, 6)).astype(np.float32)
    np.testing.assert_array_equal(emulate(label, a, b), _sequential_reference(a, b, fmt))


def test_more_passes_are_closer_to_exact():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = {label: float(np.max(np.abs(emulate(label, a, b) - exact)))
           for label in ("BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6",
                         "F32_F32_F32")}
    assert err["BF16_BF16_F32"] > 100 * err["BF16_BF16_F32_X3"]
    assert err["BF16_BF16_F32_X3"] > 10 * err["BF16_BF16_F32_X6"]
    assert err["BF16_BF16_F32_X6"] < 4 * err["F32_F32_F32"]


def test_emulator_keeps_the_input_dtype_and_float16_overflows():
    a = np.full((2, 3), 1.5, ml_dtypes.bfloat16)
    assert emulate("BF16_BF16_F32", a, a.T).dtype == ml_dtypes.bfloat16
    big = np.array([[2.0 ** 17]], np.float32)
    assert np.isinf(emulate("F16_F16_F32", big, np.ones((1, 1), np.float32))[0, 0])
    with pytest.raises(ValueError, match="unknown dot algorithm 'BF16'"):
        emulate("BF16", big, big)


def test_bf16_emulation_reproduces_the_growing_d4_gap():
    """[d,4] x [4,d]: one bf16 pass drifts from float32 more as d grows; 3 passes ~1e-4."""
    rng = np.random.default_rng(20261122)
    gaps = {}
    for d in (64, 1024):
        a = rng.standard_normal((d, 4)).astype(np.float32)
        b = rng.standard_normal((4, d)).astype(np.float32)
        f32 = emulate("F32_F32_F32", a, b)
        gaps[d] = (float(np.max(np.abs(emulate("BF16_BF16_F32", a, b) - f32))),
                   float(np.max(np.abs(emulate("BF16_BF16_F32_X3", a, b) - f32))))
    assert gaps[1024][0] > gaps[64][0] > 0.01
    assert gaps[1024][1] < gaps[1024][0] / 50


@needs_jax
def test_jax_cpu_reads_f32_under_every_precision():
    import jax
    import jax.numpy as jnp

    assert fingerprint(jnp.matmul).label == "F32_F32_F32"
    fp = fingerprint(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.DEFAULT))
    assert fp.label == "F32_F32_F32"


@needs_torch
def test_torch_cpu_reads_f32_by_default_and_what_it_computes_under_medium():
    """'highest' is float32 by torch's documentation. Under 'medium' oneDNN decides per CPU
    (bf16 on some, plain float32 on an AMD EPYC with avx512_bf16 and no AMX): the fingerprint
    must name what the CPU does, checked against the error of a product vs float64."""
    import torch

    def mm(a, b):
        return torch.from_numpy(a) @ torch.from_numpy(b)

    rng = np.random.default_rng(11)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((64, 256), (256, 64)))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fingerprint(mm).label == "F32_F32_F32"
        torch.set_float32_matmul_precision("medium")
        fp = fingerprint(mm)
        ratio = np.max(np.abs(mm(a, b).numpy() - exact) / scale)
    finally:
        torch.set_float32_matmul_precision(previous)
    # The float32 bound of a 256-term dot product, relative to sum |a_i b_i|.
    gamma = 256 * 2.0**-24 / (1 - 256 * 2.0**-24)
    if fp.label == "BF16_BF16_F32":
        assert fp.input_rounding == "nearest-even"
        assert ratio > gamma  # bf16 inputs: far outside what float32 allows
    else:
        assert fp.label == "F32_F32_F32", fp.evidence
        assert ratio <= gamma


EMU_SUITE = """
[suite]
name = "emu"
seed = 3

[[probe]]
name = "d4"
op = "matmul"
dtypes = ["float32"]
shape = ["d", 4, "d"]
sweep = { d = [256] }
"""


@needs_jax
def test_emulated_backend_runs_next_to_jax_cpu_and_warns(tmp_path):
    import diag

    suite = tmp_path / "emu.toml"
    suite.write_text(EMU_SUITE)
    result = diag.run(str(suite), backends=["emu-bf16x1", "jax-cpu"], out=tmp_path / "runs",
                      repeats=1)
    by = {r["backend"]: r for r in result.records}
    emu = by["emu-bf16x1"]
    assert emu["device"]["platform"] == "emulated"
    assert "not hardware" in emu["device"]["kind"]
    assert emu["status"] == "warn" and emu["metrics"]["bound_ratio"] > 1
    assert by["jax-cpu"]["status"] == "pass"
    agreement = by["emu-bf16x1|jax-cpu"]  # pair names are sorted
    assert agreement["kind"] == "agreement" and agreement["status"] == "warn"
    assert result.exit_code == 0


def test_emulated_backends_are_opt_in():
    from diag.backends import BACKENDS

    emus = [s for s in BACKENDS.values() if s.name.startswith("emu-")]
    assert {s.platform for s in emus} <= set(ALGORITHMS)
    assert all(not s.default and s.promised == () and s.ops == ("matmul",) for s in emus)
