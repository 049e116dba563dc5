"""The float64 copies the PyTorch shadow shares between the references of nearby ops
(`diag.diverge.torch_copies.Recent`): shared only while the values are the same."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import diag.diverge  # noqa: E402
from diag.diverge.torch_copies import Recent  # noqa: E402


def _x() -> torch.Tensor:
    return torch.tensor(np.random.default_rng(0).normal(0.0, 1.0, (8, 16)), dtype=torch.float32)


def test_a_new_tensor_over_the_same_memory_and_layout_shares_the_copy():
    x = _x()
    recent = Recent(4)
    first = recent.of(x)
    assert first.dtype == torch.float64
    np.testing.assert_array_equal(first.numpy(), x.numpy().astype(np.float64))
    assert recent.of(x.view(8, 16)) is first  # another tensor object, the same values
    other = recent.of(x.t())  # the same memory read in another layout
    assert other is not first
    np.testing.assert_array_equal(other.numpy(), x.numpy().T.astype(np.float64))


def test_a_write_gives_a_new_copy_of_the_new_values():
    x = _x()
    recent = Recent(4)
    old = recent.of(x)
    x[0].mul_(2.0)  # through a view: the version moves
    moved = recent.of(x)
    assert moved is not old
    np.testing.assert_array_equal(moved.numpy(), x.numpy().astype(np.float64))
    alias = x.data  # shares the memory, not the version counter
    alias.add_(1.0)
    recent.forget([alias])  # the shadow reports every write it runs (the version did not move)
    np.testing.assert_array_equal(recent.of(x).numpy(), x.numpy().astype(np.float64))


def test_only_the_latest_are_kept():
    xs = [_x() + k for k in range(3)]
    recent = Recent(2)
    first = recent.of(xs[0])
    recent.of(xs[1])
    recent.of(xs[2])
    assert recent.of(xs[0]) is not first


def test_a_write_through_an_alias_between_two_reads_reaches_the_second_reference():
    """h is read by two products with a write through ``h.data`` between them (an alias
    without h's version counter): the second product's float64 reference must see the new
    values. IEEE multiplication is correctly rounded, so each product's own error is at most
    half a ULP: a reference computed from the old values would show it far past its bound."""
    x = _x()

    def step(x):
        h = torch.tanh(x)  # rounded: carries an error, so the references widen it
        a = h * 3.0
        h.data.mul_(2.0)
        b = h * 3.0
        return a + b

    keep: dict = {}
    from diag.diverge import torch_shadow

    torch_shadow.shadow(step, (x,), {}, keep=keep)
    products = [e for e in keep["ledger"].entries if e.primitive == "aten.mul" and e.shape]
    assert len(products) == 2
    for e in products:
        assert e.own_ulps <= 0.5, (e.index, e.own_ulps)
    report = diag.diverge.shadow(step, x)
    assert report.first is None or "own error" not in report.first.reason
