"""An elementwise op fed non-finite elements is judged element by element, on CPU in numpy.

Claims under test: `pointwise_birth` names a NaN born where no input held one (0/0 beside a
-inf mask), an Inf born from finite elements (1/0 beside a NaN), and nothing when every
non-finite output element came in (a masked add, broadcast masks included); inputs that do not
broadcast to the output give no verdict. The expected answers are decided by construction, and
the numpy path (float32, float64, float16) agrees with the torch path (bfloat16) on each.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from diag.nan.torch_pointwise import pointwise_birth  # noqa: E402

INF, NAN = math.inf, math.nan
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _t(values, dt):
    return torch.tensor(values, dtype=dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_birth_beside_non_finite_inputs_is_named(dt):
    x, y = _t([1.0, -INF, 0.0], dt), _t([0.0, 1.0, 0.0], dt)
    assert pointwise_birth([x, y], [x / y]) == "NaN"  # [inf, -inf, nan]: 0/0 is born
    x2, y2 = _t([1.0, NAN, 2.0], dt), _t([0.0, 1.0, 1.0], dt)
    assert pointwise_birth([x2, y2], [x2 / y2]) == "Inf"  # 1/0 beside a NaN that came in


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_non_finite_elements_that_came_in_are_no_birth(dt):
    scores = _t([[0.5, 1.0, -2.0], [3.0, 0.0, 1.0]], dt)
    mask = _t([0.0, -INF, -INF], dt)  # broadcast over rows, as a causal mask row
    assert pointwise_birth([scores, mask], [scores + mask]) is None
    assert pointwise_birth([scores, 2.0, NAN], [scores * NAN]) is None  # NaN given as a float


def test_inputs_that_do_not_broadcast_give_no_verdict():
    big, out = torch.zeros(4, 3), torch.full((3,), NAN)
    assert pointwise_birth([big], [out]) is None
    assert pointwise_birth([big.to(torch.bfloat16)], [out.to(torch.bfloat16)]) is None
