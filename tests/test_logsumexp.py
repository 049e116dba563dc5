"""logsumexp (probes/logsumexp.py): the oracle is correctly rounded, the bound holds for real
backends and catches a wrong row, and the op runs end to end through `diag run`.

The oracle's fast path (float64 with a rigorous half-width) must give the same bits as its
interval-arithmetic path (`mpmath.iv`, forced on every row by a huge slack) and as an
independent mpmath evaluation at 60 digits, on adversarial rows: -inf masks, all -inf, one
finite element, NaN and +inf, large logits (1e4, near float32's largest), all equal (S = n
exactly), ties one ulp apart, subnormals and a huge dynamic range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import mpmath
import numpy as np
import pytest

from diag import numerics
from diag.compare.outcome import Outcome
from diag.probes import logsumexp as lse
from tests.conftest import needs_jax, needs_torch

DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]


def _adversarial(dt, n: int = 48, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    fi = ml_dtypes.finfo(dt)
    big = float(fi.max)
    rows = [rng.standard_normal(n), 5 * rng.standard_normal(n),
            1e4 + rng.standard_normal(n) if dt != np.float16 else 6e4 + rng.random(n),
            np.full(n, -np.inf), np.r_[np.full(n - 1, -np.inf), 2.5],
            np.r_[np.full(n // 2, -np.inf), rng.standard_normal(n - n // 2)],
            np.full(n, 0.7), np.r_[np.full(n - 1, -3.0), np.nan],
            np.r_[np.full(n - 1, -3.0), np.inf], big * (1 - rng.random(n) / 4),
            -big * rng.random(n), float(fi.smallest_subnormal) * rng.integers(1, 9, n),
            rng.standard_normal(n) * np.exp2(rng.integers(-40, 12, n))]
    x = np.stack([np.asarray(r, np.float64) for r in rows]).astype(dt)
    # Two logits one ulp apart, the rest far below: S = 1 + exp(-ulp) + tiny.
    x[0, :2] = numerics.from_bits(numerics.bits_view(np.array([3.0, 3.0], dt))
                                  + np.array([0, 1]).astype(numerics.bits_view(x).dtype), dt)
    return x


def _mp_reference(row: np.ndarray, dt) -> float:
    """logsumexp of one row by mpmath at 60 digits, rounded to `dt` (via float64, checked not
    to land on a rounding boundary of `dt`, where that double rounding could differ)."""
    r = row.astype(np.float64)
    if np.isnan(r).any():
        return float("nan")
    if (r == np.inf).any():
        return float("inf")
    finite = r[np.isfinite(r)]
    if finite.size == 0:
        return float("-inf")
    with mpmath.workdps(60):
        m = mpmath.mpf(float(finite.max()))
        y = m + mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(float(v)) - m) for v in finite))
        y64 = float(y)
    c = numerics.round_to_dtype(np.array([y64]), dt)
    lo, hi = lse._boundaries(c[0], dt)
    assert y64 not in (lo, hi)  # not on a boundary: rounding via float64 is single rounding
    return float(c[0])


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_the_fast_path_matches_interval_arithmetic_and_mpmath_bit_for_bit(dt):
    x = _adversarial(dt)
    fast = lse.logsumexp_result(x)
    slow = lse.logsumexp_result(x, _slack=2.0**52)
    assert slow.fallbacks >= 8  # every row with two or more finite elements went to mpmath.iv
    want = np.array([_mp_reference(row, dt) for row in x])
    for got in (fast.value, slow.value):
        assert got.dtype == dt and got.shape == (x.shape[0],)
        g = got.astype(np.float64)
        same = (g == want) | (np.isnan(g) & np.isnan(want))
        assert same.all(), (dt, np.flatnonzero(~same), g[~same], want[~same])
        assert (numerics.bits_view(got) == numerics.bits_view(fast.value)).all()
    assert fast.value[3].astype(np.float64) == -np.inf  # all -inf
    assert fast.value[4].astype(np.float64) == 2.5  # one finite element: exactly it
    assert np.isnan(fast.value[7].astype(np.float64)) and fast.value[8] == np.inf


def test_long_rows_with_masks_are_decided_in_float64():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 65536)).astype(np.float32)
    x[1, ::2] = -np.inf
    x[2] += 1e4
    res = lse.logsumexp_result(x)
    assert res.fallbacks == 0 and res.method == "f64-ball"
    want = [_mp_reference(x[r, :512], np.dtype(np.float32)) for r in range(2)]
    head = lse.logsumexp_result(x[:2, :512]).value.astype(np.float64)
    assert list(head) == want


def test_the_rounding_boundaries_are_the_midpoints_and_the_overflow_threshold():
    f32 = np.dtype(np.float32)
    lo, hi = lse._boundaries(np.float32(1.0), f32)
    assert (lo, hi) == (1.0 - 2.0**-25, 1.0 + 2.0**-24)
    top = float(np.finfo(np.float32).max)
    assert lse._boundaries(np.float32(top), f32)[1] == top + 2.0**103  # max + half its ulp
    assert lse._boundaries(np.float32(-2.0), f32) == (-2.0 - 2.0**-23, -2.0 + 2.0**-24)
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    assert lse._boundaries(np.float32(0.0), f32) == (-tiny / 2, tiny / 2)


def test_numpys_float64_exp_and_log_are_within_the_assumed_ulps():
    rng = np.random.default_rng(9)
    d = -rng.random(2000) * 700
    s = 1 + rng.random(2000) * 262144
    for f, mf, arg, allowed in ((np.exp, mpmath.exp, d, lse.EXP_ULP),
                                (np.log, mpmath.log, s, lse.LOG_ULP)):
        got = f(arg)
        with mpmath.workdps(40):
            want = np.array([float(mf(mpmath.mpf(float(v)))) for v in arg])
        ulps = np.abs(got - want) / np.spacing(np.abs(want))
        assert ulps.max() <= 1 <= allowed  # measured: at most 1 ulp (the oracle assumes 4)


def _outcome(x, out, truth):
    return Outcome(inputs=[x], outputs=[out], names=["output"], truth=truth,
                   params={"dtype": numerics.dtype_name(x.dtype)}, promised=True,
                   setting="precision=default")


def test_a_float32_sum_passes_and_a_row_off_by_1000_ulps_fails():
    rng = np.random.default_rng(1)
    x = (5 * rng.standard_normal((4, 4096))).astype(np.float32)
    truth = lse.logsumexp_result(x)
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    good = (np.log(np.sum(np.exp(x - m.astype(np.float32)), axis=1, dtype=np.float32))
            + m[:, 0].astype(np.float32)).astype(np.float32)
    ev = lse.evaluate(_outcome(x, good, truth))
    assert ev.status == "pass", ev.reason
    bad = good.copy()
    bad[2] = numerics.from_bits(numerics.bits_view(bad[2:3]) + 1000, "float32")[0]
    ev = lse.evaluate(_outcome(x, bad, truth))
    assert ev.status == "fail" and ev.metrics["worst"]["index"] == "(2)"
    v = lse.agree(_outcome(x, good, truth), _outcome(x, bad, truth),
                  ("a", "b"), lse.error_bound(x, truth.value))
    status, metrics = v.status, v.metrics
    # Two backends apart by more than twice the bound: flagged (the fail is the bad one's own).
    assert status == "warn" and metrics["bound_ratio"] > 1


@needs_jax
@needs_torch
def test_diag_run_judges_logsumexp_on_jax_and_torch(tmp_path):
    suite = tmp_path / "lse.toml"
    suite.write_text('[suite]\nname = "lse"\nseed = 1\n\n[[probe]]\nname = "lse"\n'
                     'op = "logsumexp"\ninputs = ["normal5", "masked_half", "fully_masked", '
                     '"near_1e4"]\ndtypes = ["float32", "bfloat16"]\nshapes = [[4, 32768]]\n')
    diag = Path(sys.executable).parent / "diag"
    done = subprocess.run([str(diag), "run", "--suite", str(suite), "--backend",
                           "jax-cpu,torch-cpu", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    probes = [r for r in records if r["kind"] == "probe"]
    assert len(probes) == 16 and {r["op"] for r in probes} == {"logsumexp"}
    assert all(r["status"] in ("pass", "warn") for r in probes), [r["reason"] for r in probes]
    assert all(r["status"] != "fail" for r in records if r["kind"] == "agreement")
