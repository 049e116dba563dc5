"""Every backend keeps the `Backend` protocol, and every op it declares agrees with the oracle.

One parametrised test over backend x op (optax's common test over all its transformations is
the model): the case is a tiny float32 case of the op's probe, built by the suite loader as a
run builds it; the inputs go to the device and come back bit for bit; the op's output is judged
by the probe's own check against the oracle's truth. A backend computing real float32 under
its default setting must pass; an emulation (a model of a lower-precision algorithm, which
promises nothing) may warn but never fail or be unjudgeable. Backends whose framework or
device is absent here are skipped; the emulations always run.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from diag.backends import (BACKENDS, Backend, framework_installed, not_applicable,
                           promises_full_precision)
from diag.worker.main import _named_outputs
from diag.oracle.cache import GroundTruthCache
from diag.compare.outcome import Outcome
from diag.plan.inputs import INPUT_MAKERS
from diag.plan.registry import build
from diag.plan.registry import PROBES
from diag.plan.suite import load_suite
from tests.conftest import assert_bits_equal

# Tiny sizes per shape dimension name (Probe.dims): the test is about contracts, not scale.
TINY = {"m": 4, "k": 8, "n": 16, "rows": 4, "batch": 8, "d": 8, "c": 4,
        "layers": 1, "width": 16, "vocab": 32, "seq": 8, "steps": 2}

PAIRS = [(name, op) for name, spec in BACKENDS.items() for op in spec.ops]


def _module(spec):
    if not framework_installed(spec.framework):
        pytest.skip(f"{spec.framework} is not installed")
    module = importlib.import_module(spec.module)
    if spec.platform not in module.discover():
        pytest.skip(f"no {spec.platform} device visible to {spec.framework}")
    module.setup(spec.platform)
    return module


# The tiny case of an op that runs a user's function: a tiny function of the backend's framework.
TINY_FUNCTIONS = {
    "jax": "import jax.numpy as jnp\nimport numpy as np\n\ndef make():\n"
           "    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)\n"
           "    return (lambda a: {'y': jnp.tanh(a @ a), 'i': jnp.argmax(a, -1)}), (x,)\n",
    "torch": "import torch\n\ndef make():\n"
             "    x = torch.linspace(-1, 1, 16).reshape(4, 4)\n"
             "    return (lambda a: {'y': torch.tanh(a @ a), 'i': torch.argmax(a, -1)}), (x,)\n",
}


def _tiny_case(tmp_path, spec, op):
    """The first case of a one-entry suite for `op` that applies to `spec`."""
    probe = PROBES[op]
    if probe.user_function:
        from diag.plan.suite_fn import function_case

        path = tmp_path / f"tiny_{spec.runs}.py"
        path.write_text(TINY_FUNCTIONS[spec.runs])
        return function_case(f"{path}:make")
    shape = ", ".join(str(TINY[d]) for d in probe.dims)
    path = tmp_path / "tiny.toml"
    path.write_text(f'[suite]\nname = "conformance"\nseed = 7\n\n[[probe]]\nname = "tiny"\n'
                    f'op = "{op}"\ninputs = ["{probe.inputs[0]}"]\ndtypes = ["float32"]\n'
                    f'shape = [{shape}]\n')
    cases = [c for c in load_suite(str(path)).cases
             if not_applicable(spec, c.op, c.params) is None]
    assert cases, f"{spec.name} declares {op} but no float32 case of it applies"
    return cases[0]


@pytest.mark.parametrize("name", sorted({s.module: n for n, s in BACKENDS.items()}.values()))
def test_each_backend_module_keeps_the_protocol_and_has_its_ops(name):
    spec = BACKENDS[name]
    if not framework_installed(spec.framework):
        pytest.skip(f"{spec.framework} is not installed")
    module = importlib.import_module(spec.module)
    assert isinstance(module, Backend)
    for other in BACKENDS.values():
        if other.module == spec.module:
            # The ops it runs are those with an implementation for its framework.
            runs = getattr(module, "IMPLEMENTATION", module.FRAMEWORK)
            assert runs == other.runs, f"{other.name}: spec and module disagree on {runs}"
            assert other.ops == tuple(op for op, p in PROBES.items()
                                      if runs in p.implementations)
            for op in other.ops:
                assert callable(PROBES[op].implementations[runs])


@pytest.mark.parametrize("backend, op", PAIRS)
def test_backend_op_agrees_with_the_oracle(backend, op, tmp_path):
    spec = BACKENDS[backend]
    module = _module(spec)
    probe = PROBES[op]
    case = _tiny_case(tmp_path, spec, op)
    rng = np.random.default_rng(case.seed)
    if probe.make_inputs is not None:
        inputs = probe.make_inputs(rng, case.params, np.float32)
    else:
        inputs = [INPUT_MAKERS[case.inputs](rng, shape, np.float32)
                  for shape in probe.input_shapes(case.params)]
    truth = probe.truth(inputs, case.params, GroundTruthCache(str(tmp_path / "cache")))

    args = [module.put(x) for x in inputs]
    for x, on_device in zip(inputs, args):
        assert_bits_equal(module.get(on_device), x, f"{backend} round trip")
    fn = build(module, op, **{**probe.fixed_args, **case.op_args})
    thunk, compile_s, _ = module.prepare(fn, args)
    out = thunk()
    module.block(out)
    assert compile_s >= 0
    named = _named_outputs(out)
    precision = case.params.get("precision", "default")
    outcome = Outcome(inputs=inputs, outputs=[np.array(module.get(v)) for _, v in named],
                      names=[n for n, _ in named], truth=truth, params=case.params,
                      promised=promises_full_precision(spec, case.dtype, precision),
                      setting=f"precision={precision}")
    ev = probe.evaluate(outcome)
    if spec.emulated:
        assert ev.status in ("pass", "warn"), ev.reason
    else:
        assert ev.status == "pass", f"{backend} {case.label}: {ev.reason}"
