"""The float64 reference of the training run, checked against mpmath.

Claim: on a tiny configuration, the hand-written forward, backward and AdamW evaluated in
float64 stay within 1e-12 relative (per tensor, every step) of the same code evaluated at 40
decimal digits, i.e. the reference's own error is ~1e4 float64 roundoffs after 3 steps and
nowhere near a float32 ulp (6e-8). docs/train.md states how that extends to N steps.
"""

from __future__ import annotations

import mpmath
import numpy as np

from diag.train.config import TrainConfig, init_params, make_batches
from diag.train.reference import FLOAT64, mp_arith, run_reference

TINY = TrainConfig(layers=1, width=8, heads=2, vocab=16, seq=4, batch=2, steps=3)


def test_float64_reference_matches_mpmath_on_a_tiny_model():
    rng = np.random.default_rng(1)
    p, t = init_params(TINY, rng), make_batches(TINY, rng)
    ref = run_reference(TINY, p, t, FLOAT64)
    with mpmath.workdps(40):
        exact = run_reference(TINY, p, t, mp_arith(40))
    worst = 0.0
    for name, value in ref.items():
        e = exact[name].astype(np.float64)
        for step in range(TINY.steps):
            err = np.linalg.norm((value[step] - e[step]).ravel()) / np.linalg.norm(
                e[step].ravel())
            worst = max(worst, float(err))
    assert worst <= 1e-12, worst
    # and the run did move: a reference that never updates would pass trivially
    assert not np.allclose(ref["param/head.w"][-1], ref["param/head.w"][0])


def test_the_reference_loss_falls_on_the_synthetic_corpus():
    cfg = TrainConfig(layers=1, width=32, heads=2, vocab=64, seq=16, batch=8, steps=12,
                      lr=1e-2)
    rng = np.random.default_rng(0)
    loss = run_reference(cfg, init_params(cfg, rng), make_batches(cfg, rng))["loss"]
    assert loss[-1] < loss[0] - 0.1, loss
