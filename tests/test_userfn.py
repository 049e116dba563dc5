"""A user's function as an op, in process (`diag.userfn`): loaded as `diag nan` loads it,
evaluated in float64 as its reference, judged leaf by leaf.

Claims: `load` reads FILE.py:FUNCTION and pkg.module:function and keys the function by the
sha256 of its module's source; the reference of a JAX function and of a PyTorch module is their
float64 evaluation (checked against the same math in numpy float64), and a function that
hard-codes bfloat16 gets diag.diverge's float64 shadow instead, saying so; a float output passes
within sqrt(u) of its dtype and fails beyond it; an integer output that differs from the
reference is a warn only where the reference's own choice moves when the inputs move by one
rounding (an exact tie), else a fail. Every expected answer is computed here in numpy float64.
"""

from __future__ import annotations

import hashlib
import math
import re
import textwrap

import numpy as np
import pytest

from diag import userfn
from diag.tolerance.userfn import userfn_output_allowance

JAX_MLP = '''
import jax
import jax.numpy as jnp
import numpy as np


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def make():
    rng = np.random.default_rng(1)
    params = {"w1": rng.standard_normal((16, 32)).astype(np.float32),
              "w2": rng.standard_normal((32, 8)).astype(np.float32)}
    return jax.jit(mlp), (params, rng.standard_normal((4, 16)).astype(np.float32))


def bf16_sum(x):
    return jnp.sum(x.astype(jnp.bfloat16), axis=-1).astype(jnp.float32)


def make_bf16():
    return bf16_sum, (np.random.default_rng(2).random((4, 512)).astype(np.float32),)


def greedy(logits):
    return jnp.argmax(logits, axis=-1)


def make_greedy():
    logits = np.zeros((2, 8), np.float32)
    logits[0, [2, 5]] = 3.0   # an exact tie: the reference picks index 2
    logits[1, 7] = 1.0        # a clear maximum
    return greedy, (logits,)
'''

TORCH_MLP = '''
import torch


def make():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    return model, (torch.randn(4, 16),)
'''


@pytest.fixture
def jax_file(tmp_path):
    path = tmp_path / "jax_model.py"
    path.write_text(JAX_MLP)
    return path


def test_load_reads_a_file_spec_and_keys_it_by_its_source(jax_file):
    u = userfn.load(f"{jax_file}:make")
    assert u.name == "jax_model.py:make" and u.framework == "jax"
    assert u.source_hash == hashlib.sha256(jax_file.read_bytes()).hexdigest()[:16]
    params, x = u.args
    got = np.asarray(u())
    want = np.tanh(x.astype(np.float64) @ params["w1"]) @ params["w2"]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_load_reads_a_module_spec(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(JAX_MLP)
    monkeypatch.chdir(tmp_path)
    u = userfn.load("mypkg.models:make")
    assert u.name == "mypkg.models:make" and u.framework == "jax"
    assert u.source_hash == hashlib.sha256((pkg / "models.py").read_bytes()).hexdigest()[:16]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("{d}/missing.py:f", "{d}/missing.py: no such file"),
        ("{f}:nope", "{f}: no function 'nope'"),
        ("{f}", "expected FILE.py:FUNCTION or package.module:function"),
        ("no_such_pkg_xyz.mod:f", "no_such_pkg_xyz.mod: no such module"),
    ],
)
def test_bad_specs_raise_a_one_line_error(jax_file, spec, message):
    fill = {"d": jax_file.parent, "f": jax_file}
    with pytest.raises(userfn.UserFunctionError) as e:
        userfn.load(spec.format(**fill))
    assert message.format(**fill) in str(e.value) and "\n" not in str(e.value)


def test_the_jax_reference_is_the_float64_evaluation(jax_file):
    u = userfn.load(f"{jax_file}:make")
    ref = userfn.reference(u.fn, u.args, u.kwargs, u.framework)
    params, x = u.args
    want = np.tanh(x.astype(np.float64) @ params["w1"].astype(np.float64)) @ params["w2"]
    ((path, got),) = ref.leaves
    assert ref.kind == "float64" and "float64 evaluation" in ref.description
    assert got.dtype == np.float64 and path == ""
    assert np.abs(got - want).max() <= 1e-13 * np.abs(want).max()


def test_the_torch_reference_doubles_a_copy_of_the_module(tmp_path):
    path = tmp_path / "torch_model.py"
    path.write_text(TORCH_MLP)
    u = userfn.load(f"{path}:make")
    assert u.framework == "torch"
    ref = userfn.reference(u.fn, u.args, u.kwargs, u.framework)
    sd = {k: v.detach().numpy().astype(np.float64) for k, v in u.fn.state_dict().items()}
    x = u.args[0].numpy().astype(np.float64)
    want = np.tanh(x @ sd["0.weight"].T + sd["0.bias"]) @ sd["2.weight"].T + sd["2.bias"]
    ((_, got),) = ref.leaves
    assert ref.kind == "float64"
    assert np.abs(got - want).max() <= 1e-13 * np.abs(want).max()
    assert next(u.fn.parameters()).dtype.is_floating_point  # the user's module is untouched
    assert str(next(u.fn.parameters()).dtype) == "torch.float32"


def test_a_hard_coded_bfloat16_gets_the_float64_shadow(jax_file):
    u = userfn.load(f"{jax_file}:make_bf16")
    ref = userfn.reference(u.fn, u.args, u.kwargs, u.framework)
    assert ref.kind == "shadow" and "shadow" in ref.description
    ((_, got),) = ref.leaves
    want = u.args[0].astype(np.float64).sum(axis=-1)  # the math the function means
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.parametrize("dtype,p", [("float32", 24), ("bfloat16", 8), ("float16", 11)])
def test_the_allowance_is_sqrt_of_the_unit_roundoff(dtype, p):
    assert userfn_output_allowance(dtype) == pytest.approx(math.sqrt(2.0**-p), rel=1e-15)


def _ref(value: np.ndarray, perturbed=()) -> userfn.Reference:
    return userfn.Reference("float64", "test", (("", value),), tuple(perturbed), "float32")


@pytest.mark.parametrize("rel,status", [(1e-4, "pass"), (1e-3, "fail")])
def test_a_float_output_is_held_to_its_allowance(rel, status):
    r = np.random.default_rng(3).standard_normal((8, 16))
    y = (r * (1 + rel)).astype(np.float32)
    want_err = np.abs(y.astype(np.float64) - r).max() / np.abs(r).max()
    (v,) = userfn.judge([("", y)], _ref(r))
    assert v.error == pytest.approx(want_err, rel=1e-12)
    assert v.allowed == 2.0**-12
    assert v.status == status == ("pass" if want_err <= 2.0**-12 else "fail")


def test_a_nan_the_reference_lacks_fails():
    r = np.ones(4)
    y = np.array([1, 1, np.nan, 1], np.float32)
    (v,) = userfn.judge([("", y)], _ref(r))
    assert v.status == "fail" and math.isinf(v.error)


def test_an_exact_tie_is_forced_by_rounding_and_a_clear_miss_fails(jax_file):
    u = userfn.load(f"{jax_file}:make_greedy")
    ref = userfn.reference(u.fn, u.args, u.kwargs, u.framework)
    (logits,) = u.args
    exact = logits.astype(np.float64).argmax(axis=-1)  # numpy: the first maximum
    assert list(ref.leaf("")) == list(exact) == [2, 7]
    assert ref.perturbed, "integer outputs get rounding-moved evaluations"
    (tie,) = userfn.judge([("", np.array([5, 7], np.int32))], ref)
    assert tie.status == "warn" and "forced by rounding" in tie.reason
    (miss,) = userfn.judge([("", np.array([2, 3], np.int32))], ref)
    assert miss.status == "fail" and "(1,): 3, reference 7" in miss.reason
    (same,) = userfn.judge([("", np.array([2, 7], np.int32))], ref)
    assert same.status == "pass"


def test_outputs_of_any_pytree_are_judged_leaf_by_leaf():
    r = {"logits": np.arange(6.0).reshape(2, 3) + 1, "token": np.array([2, 2])}
    ref = userfn.Reference(
        "float64", "test", tuple((p, a) for p, a in userfn.flatten(r)), (), "float32"
    )
    out = {"logits": (r["logits"] * (1 + 1e-2)).astype(np.float32), "token": np.array([2, 2])}
    verdicts = {v.path: v.status for v in userfn.judge(out, ref)}
    assert verdicts == {"['logits']": "fail", "['token']": "pass"}


def test_backends_that_differ_beyond_twice_the_allowance_warn():
    a = [("", np.ones(4, np.float32))]
    close = [("", np.full(4, 1 + 2.0**-13, np.float32))]
    far = [("", np.full(4, 1 + 2.0**-9, np.float32))]
    assert userfn.agreement(a, close)[0] == "pass"  # 2^-13 <= 2 * 2^-12
    assert userfn.agreement(a, far)[0] == "warn"


def test_a_function_returning_no_arrays_or_strings_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent('''
        import numpy as np
        def nothing():
            return (lambda x: None), (np.ones(2, np.float32),)
        def strings():
            return (lambda x: {"a": x, "b": "s"}), (np.ones(2, np.float32),)
    '''))
    for name, message in (("nothing", "returned no arrays"), ("strings", re.escape("a str at output['b']"))):
        u = userfn.load(f"{path}:{name}")
        with pytest.raises(userfn.UserFunctionError, match=message):
            userfn.reference(u.fn, u.args, u.kwargs, "jax")


def test_a_scalar_output_is_judged_as_one_element():
    r = np.float64(2.0)
    (good,) = userfn.judge([("", np.float32(2.0 * (1 + 1e-5)))], _ref(np.asarray(r)))
    (bad,) = userfn.judge([("", np.float32(2.0 * (1 + 1e-2)))], _ref(np.asarray(r)))
    assert (good.status, bad.status) == ("pass", "fail")
    assert bad.error == pytest.approx(abs(float(np.float32(2.0 * 1.01)) - 2.0) / 2.0, rel=1e-12)
