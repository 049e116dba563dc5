"""A training run that goes non-finite is traced to the step, the op and the source line.

Claim: with a learning rate of 1e37 the first AdamW step moves every weight to ~1e37 (finite),
and step 1's forward pass overflows; `locate_nan` names step 1 and an op born in the
framework's own model file (jax_model.py / torch_model.py) in the forward phase; a finite run
(the float64 reference) has no non-finite step.
"""

from __future__ import annotations

import numpy as np
import pytest

from diag.train import TrainConfig, init_params, locate_nan, make_batches, run_reference
from diag.train.hunt import first_nonfinite_step
from tests.conftest import needs_jax, needs_torch

CFG = TrainConfig(layers=1, width=16, heads=2, vocab=32, seq=8, batch=4, steps=3, lr=1e37)


def _data(cfg):
    rng = np.random.default_rng(0)
    return init_params(cfg, rng), make_batches(cfg, rng)


def test_a_finite_run_has_no_nonfinite_step():
    cfg = TrainConfig(layers=1, width=16, heads=2, vocab=32, seq=8, batch=4, steps=3)
    assert first_nonfinite_step(cfg, run_reference(cfg, *_data(cfg))) is None


@pytest.mark.parametrize("impl, where", [pytest.param("jax", "jax_model.py", marks=needs_jax),
                                         pytest.param("torch", "torch_model.py",
                                                      marks=needs_torch)])
def test_overflow_at_step_1_is_traced_to_its_op_and_line(impl, where):
    params, batches = _data(CFG)
    found = locate_nan(impl, CFG, params, batches)
    assert found is not None and found["step"] == 1, found
    assert where in found["reason"] and "forward" in found["reason"], found["reason"]
    assert found["reason"].split()[0] in ("NaN", "Inf")


@needs_jax
def test_compare_ports_names_where_a_port_went_nonfinite():
    # Weights of 1e20 after step 0: products of a few overflow float32 (3.4e38), not float64.
    from dataclasses import replace

    from diag.train import compare_ports

    r = compare_ports("reference", "jax", cfg=replace(CFG, lr=1e20))
    assert r.verdict == "bug" and r.culprit == "port", r.reason
    assert "its first NaN/Inf, at step 1:" in r.reason and "jax_model.py" in r.reason
