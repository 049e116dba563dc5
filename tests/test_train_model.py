"""The training run's two framework implementations compute the same function and the same
AdamW update: in float64, JAX (jax.numpy + optax) and PyTorch (torch.nn + torch.optim) agree
with each other and with the hand-written float64 reference to ~1e-13 relative, for the
correct model and for every planted porting bug (so a bug diag names is the bug, not a
difference in how it was planted).
"""

from __future__ import annotations

import numpy as np
import pytest

from diag.train.config import (PORT_BUGS, TrainConfig, init_params, make_batches, unpack,
                               with_bug)
from diag.train.reference import run_reference
from tests.conftest import needs_jax, needs_torch

SMALL = TrainConfig(layers=2, width=32, heads=4, vocab=64, seq=16, batch=4, steps=2)

# float64 runs differ only in rounding order: ~1e-13 measured; far below any planted bug
# (>= 1e-3 relative) and far above float64's 1.1e-16.
F64_RTOL = 1e-10


def _data(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return init_params(cfg, rng), make_batches(cfg, rng)


def _worst(a: dict, b: dict) -> tuple[float, str]:
    return max((float(np.linalg.norm((a[k] - b[k]).ravel())
                      / max(np.linalg.norm(b[k].ravel()), 1e-300)), k) for k in b)


def _jax64(cfg, p, t):
    import jax

    from diag.train import jax_model

    with jax.enable_x64(True):
        return jax_model.run(cfg, p, t, "float64")


def test_inputs_are_seeded_and_packed_in_layout_order():
    p1, t1 = _data(SMALL)
    p2, t2 = _data(SMALL)
    assert np.array_equal(p1, p2) and np.array_equal(t1, t2)
    assert p1.dtype == np.float32 and t1.shape == (SMALL.steps, SMALL.batch, SMALL.seq + 1)
    assert t1.min() >= 0 and t1.max() < SMALL.vocab and np.all(t1 == np.round(t1))
    params = unpack(SMALL, p1)
    assert np.all(params["h0.ln1.g"] == 1.0) and abs(params["wte"].std() - 0.02) < 0.002


@needs_jax
@needs_torch
# The correct model in the default run; each planted bug (~3 s each here) with -m slow.
@pytest.mark.parametrize("bug", [None, *(pytest.param(b, marks=pytest.mark.slow)
                                         for b in PORT_BUGS)])
def test_jax_torch_and_reference_agree_in_float64(bug):
    from diag.train import torch_model

    cfg = with_bug(SMALL, bug)
    p, t = _data(cfg)
    ref = run_reference(cfg, p, t)
    for name, got in (("jax", _jax64(cfg, p, t)), ("torch", torch_model.run(cfg, p, t,
                                                                             "float64"))):
        assert set(got) == set(ref)
        err, where = _worst(got, ref)
        assert err <= F64_RTOL, (name, bug, where, err)


@needs_torch
def test_a_planted_bug_changes_the_float64_run():
    # The agreement above means something only if each bug changes the result.
    p, t = _data(SMALL)
    ref = run_reference(SMALL, p, t)
    for bug in PORT_BUGS:
        err, where = _worst(run_reference(with_bug(SMALL, bug), p, t), ref)
        assert err > 1e-4, (bug, where, err)
