"""`diag nan` on a zero-argument JAX training step that donates its own module-level state
(``donate_argnums`` on params held as globals, ``global params`` rebound, optax Adam with
eps=0): the hunt copies what the function reaches before each call, so the donated buffers
it evaluates next still exist, and names the op; the user's globals are theirs afterwards.

The expected birth is decided here: Adam's first update with a zero gradient is
``0 / (sqrt(0) + 0)`` in float64 numpy, NaN; the line is the one marked in the file.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from tests.conftest import marked_line, run_diag

pytest.importorskip("optax")

STEP = '''
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))}
opt = optax.adam(1e-2, eps=0.0)
opt_state = opt.init(params)
x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32))


@partial(jax.jit, donate_argnums=(0, 1))
def _update(p, s):
    loss, g = jax.value_and_grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p)
    g = jax.tree_util.tree_map(jnp.zeros_like, g)  # a layer whose gradient vanished
    u, s = opt.update(g, s, p)  # marker: update
    return optax.apply_updates(p, u), s, loss


def step():
    global params, opt_state
    params, opt_state, loss = _update(params, opt_state)
    return loss, params["w"]
'''


def _adam_first_update_with_zero_gradient() -> np.ndarray:
    g = np.zeros(4)
    mu, nu = 0.1 * g, 0.001 * g * g
    with np.errstate(invalid="ignore"):
        return (mu / 0.1) / (np.sqrt(nu / 0.001) + 0.0)


def test_diag_nan_names_the_op_of_a_step_donating_its_global_state(tmp_path):
    assert np.isnan(_adam_first_update_with_zero_gradient()).all()
    path = tmp_path / "donating.py"
    path.write_text(STEP)
    proc = run_diag("nan", f"{path}:step")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = marked_line(path, "marker: update")
    assert f"diag nan: NaN born in div at donating.py:{line} (_update)" in proc.stdout


def test_the_hunt_leaves_the_users_donated_globals_alive_and_unchanged(tmp_path):
    from diag.nan import hunt

    path = tmp_path / "donating_lib.py"
    path.write_text(STEP)
    spec = importlib.util.spec_from_file_location("donating_lib", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["donating_lib"] = mod
    spec.loader.exec_module(mod)
    before, w = mod.params, np.asarray(mod.params["w"]).copy()
    report = hunt(mod.step, (), {}, framework="jax")
    assert report is not None and report.primitive == "div"
    assert mod.params is before and not before["w"].is_deleted()
    assert np.array_equal(np.asarray(mod.params["w"]), w)
