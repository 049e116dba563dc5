"""The shortcuts the shadow takes to its per-op figures give the figures computed the long way.

Each expected figure is computed here with numpy in float64, independently of diag: the largest
difference an op's own-error pass hands on, a reduction's ratio against gamma_n * sum|terms|
when a sample of its elements (or only an element outside the sample) breaks the cheap bound,
the carried error when the shadow is the reference; and the PyTorch shadow's float64 copies of
tensors it has not seen (a parameter read forward and backward, a value written through an alias
with a version counter of its own between two reads).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import diag.diverge
from diag.diverge.chunked import PART, max_absdiff_parts, own_error_parts
from diag.diverge.rules import (
    carried_error,
    carried_error_diff,
    max_absdiff,
    own_error,
    own_error_diff,
)
from diag.diverge.torch_facts import magnitude

F32 = np.dtype(np.float32)
U = 2.0**-24
TINY = float(np.finfo(np.float32).tiny)


def _ulp32(r: np.ndarray) -> np.ndarray:
    """One float32 ULP at r (the subnormal spacing below the normals), from frexp."""
    return np.ldexp(1.0, np.frexp(np.maximum(np.abs(r), TINY))[1] - 24)


@pytest.mark.parametrize("cls", ["rounded", "library", "reduction", "composite", "structural"])
@pytest.mark.parametrize("shape", [(7,), (64, 256), (300, 301)])
def test_the_difference_handed_on_is_max_abs_y_minus_r(cls, shape):
    rng = np.random.default_rng(sum(shape))
    r = rng.normal(0, 1, shape)
    y = r.astype(np.float32)
    want = float(np.max(np.abs(y.astype(np.float64) - r)))
    ulps, ratio, diff = own_error_diff(y, r, F32, cls, terms=4, longest=8)
    assert diff == want
    assert (ulps, ratio) == own_error(y, r, F32, cls, terms=4, longest=8)
    assert max_absdiff(y, r) == want
    assert carried_error(y, r, F32, diff) == carried_error(y, r, F32)
    assert carried_error(y, r, F32)[0] == want / float(np.max(np.abs(r)))
    assert carried_error_diff(y, r, F32)[2] == want


def test_a_non_finite_difference_is_not_handed_on():
    r = np.array([1.0, 2.0, 3.0])
    y = np.array([1.0, np.inf, 3.0], dtype=np.float32)
    assert own_error_diff(y, r, F32, "rounded")[2] is None
    assert max_absdiff(y, r) == math.inf
    assert carried_error(y, r, F32, None)[0] == math.inf
    assert carried_error_diff(y, r, F32)[2] == math.inf


def _reduction_case(seed: int, where: str):
    """A float32 matmul (128 x 512 outputs of 256 terms) and the facts of its bound; `where`
    the cheap bound g|r| breaks: everywhere (elements that cancel), at one element off any
    sample stride, or nowhere (positive terms: |r| = sum|terms|)."""
    rng = np.random.default_rng(seed)
    lo = 0.0 if where == "nowhere" else -1.0
    a, b = rng.uniform(lo, 1, (128, 256)), rng.uniform(lo, 1, (256, 512))
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    y = a32 @ b32
    r = a32.astype(np.float64) @ b32.astype(np.float64)
    mag = np.abs(a32).astype(np.float64) @ np.abs(b32).astype(np.float64)
    if where == "one":  # exact everywhere but one element, which cancels in float32 only
        y = r.astype(np.float32)
        r[77, 301], y[77, 301] = 1e-12, np.float32(64 * U)
    calls = []

    def facts():
        calls.append(1)
        return mag, np.full(r.shape, 256.0)

    return y, r, mag, facts, calls


@pytest.mark.parametrize("where", ["everywhere", "one", "nowhere"])
def test_a_reduction_ratio_is_the_textbook_one_whichever_way_it_is_reached(where):
    y, r, mag, facts, calls = _reduction_case(5, where)
    err = np.abs(y.astype(np.float64) - r)
    floor = 2.0 * _ulp32(r) + TINY
    g = 256 * U / (1 - 256 * U)
    cheap = float(np.max(err / (g * np.abs(r) + floor)))
    full = float(np.max(err / (g * mag + floor)))
    _, ratio, _ = own_error_diff(y, r, F32, "reduction", facts=facts, terms=256)
    if where == "nowhere":
        assert cheap <= 1.0 and not calls and ratio == cheap
    else:
        assert cheap > 1.0 and calls and ratio == full


@pytest.mark.parametrize("where", ["everywhere", "one", "nowhere"])
@pytest.mark.parametrize("count", ["per element", "one number"])
def test_a_large_reduction_taken_in_parts_has_the_textbook_ratio(where, count):
    y, r, mag, facts, calls = _reduction_case(5, where)
    assert y.size >= 2 * PART  # it is split
    err = np.abs(y.astype(np.float64) - r)
    floor = 2.0 * _ulp32(r) + TINY
    g = 256 * U / (1 - 256 * U)
    cheap = float(np.max(err / (g * np.abs(r) + floor)))
    full = float(np.max(err / (g * mag + floor)))
    got = facts if count == "per element" else (lambda: (facts()[0], 256.0))
    ulps, ratio, diff = own_error_parts(y, r, F32, "reduction", facts=got, terms=256)
    assert ulps == float(np.max(err / _ulp32(r)))
    assert diff == float(np.max(err))
    if where == "nowhere":
        assert cheap <= 1.0 and not calls and ratio == cheap
    else:
        assert cheap > 1.0 and calls and ratio == full


@pytest.mark.parametrize("cls", ["rounded", "library", "structural", "composite"])
def test_an_elementwise_op_taken_in_parts_has_the_figures_of_the_whole(cls):
    rng = np.random.default_rng(3)
    r = rng.normal(0, 1, (300, 301))
    y = (r * (1 + rng.uniform(-8, 8, r.shape) * U)).astype(np.float32)
    err = np.abs(y.astype(np.float64) - r)
    ulp = _ulp32(r)
    ulps, ratio, diff = own_error_parts(y, r, F32, cls, longest=301)
    assert ulps == float(np.max(err / ulp)) and diff == float(np.max(err))
    allowed = {"rounded": 2.0 * ulp + TINY, "library": 16.0 * ulp + TINY}
    allowed["structural"] = allowed["rounded"]
    g = 305 * U / (1 - 305 * U)
    allowed["composite"] = 2.0 * ulp + TINY + g * float(np.max(np.abs(r)))
    assert math.isclose(ratio, float(np.max(err / allowed[cls])), rel_tol=1e-15)
    assert max_absdiff_parts(y, r) == float(np.max(err))


def test_a_non_finite_element_in_one_part_is_judged_as_in_the_whole():
    r = np.ones(4 * PART)
    y = r.astype(np.float32)
    y[3 * PART + 5] = np.inf
    ulps, ratio, diff = own_error_parts(y, r, F32, "rounded")
    assert ulps == math.inf and ratio == math.inf and diff is None
    assert max_absdiff_parts(y, r) == math.inf


def test_a_parameter_read_forward_and_backward_has_its_float64_gradient():
    rng = np.random.default_rng(2)
    x64, w64 = rng.normal(0, 1, (32, 48)), rng.normal(0, 0.2, (48, 48))
    x = torch.tensor(x64, dtype=torch.float32)
    w = torch.nn.Parameter(torch.tensor(w64, dtype=torch.float32))

    def step():
        h = torch.tanh(x @ w)
        (h * h).mean().backward()
        g = w.grad
        w.grad = None
        return g * 1.0

    got = step()
    xs, ws = x.double().numpy(), w.detach().double().numpy()  # the inputs as rounded
    h = np.tanh(xs @ ws)
    want = xs.T @ ((2.0 * h / h.size) * (1.0 - h * h))
    rep = diag.diverge.shadow(step)
    assert rep.result_error == pytest.approx(
        float(np.max(np.abs(got.numpy() - want)) / np.max(np.abs(want))), rel=1e-6
    )


def test_a_write_through_an_alias_reaches_the_next_read():
    w = torch.tensor(np.random.default_rng(3).normal(0, 1, 1000), dtype=torch.float32)
    w0 = w.clone()

    def fn():
        a = w * 3.0  # the first read of w
        w.data.mul_(1.1)  # an alias with a version counter of its own
        return w * 3.0 + 0.0 * a

    try:
        rep = diag.diverge.shadow(fn)
        w1 = w.clone()  # the values the second read saw
    finally:
        w.copy_(w0)
    got = (w1 * 3.0).double().numpy()
    want = w1.double().numpy() * 3.0  # the float64 shadow restarts from them
    assert rep.result_error == pytest.approx(
        float(np.max(np.abs(got - want)) / np.max(np.abs(want))), rel=1e-9
    )


def test_a_kept_magnitude_follows_its_views_and_writes_and_dies_with_its_tensor():
    rng = np.random.default_rng(2)
    w = torch.tensor(rng.normal(0, 1, (512, 256)))  # float64, large enough to be kept
    mags: dict = {}
    assert np.array_equal(magnitude(w, mags).numpy(), np.abs(w.numpy()))
    assert np.array_equal(magnitude(w.t(), mags).numpy(), np.abs(w.numpy().T))
    assert np.array_equal(magnitude(w[100:400], mags).numpy(), np.abs(w.numpy()[100:400]))
    assert len(mags) == 1  # the view read the kept |w|
    w.mul_(-3.0)  # a write: the next read is of the new values
    assert np.array_equal(magnitude(w.t(), mags).numpy(), np.abs(w.numpy().T))
    assert len(mags) == 1  # the new values replaced the old ones
    del w
    assert not mags  # kept no longer than the tensor


def test_a_matmul_under_inference_mode_is_judged_with_its_magnitudes():
    rng = np.random.default_rng(4)
    a = torch.tensor(rng.normal(0, 1, (64, 512)), dtype=torch.float32)
    b = torch.tensor(rng.normal(0, 1, (512, 512)), dtype=torch.float32)

    def fn():
        with torch.inference_mode():
            return (a @ b) @ b

    rep = diag.diverge.shadow(fn)
    want = (a.double() @ b.double()) @ b.double()  # the float64 shadow: no rounding between
    assert rep.n_ops >= 2
    got = float(np.max(np.abs(fn().double().numpy() - want.numpy())))
    assert math.isclose(rep.result_error, got / float(np.max(np.abs(want.numpy()))), rel_tol=1e-9)
