"""diag.testing.assert_numerics: a team's own function judged against float64, no rtol/atol.

Claims: on every example (examples/decoder_torch.py, decoder_flax.py, sampler_jax.py,
train_step_torch.py) the clean variant passes and the planted one fails, with a message that
names the failing output, the first divergent op and its line in the example file. Whether
each variant should pass is decided here, independently of diag: its outputs are compared with
a float64 evaluation of the intended computation (torch.float64, JAX x64, numpy), and an output
is within what float32 allows when its normwise error is at most sqrt(u) (the allowance
docs/testing.md states), beyond it when it is NaN where the float64 result is finite, or when
a token differs where the float64 margin is far above what a float32 rounding can move.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import HAS_JAX, HAS_TORCH, needs_jax, needs_torch, run_diag

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SQRT_U32 = float(np.finfo(np.float32).eps / 2) ** 0.5  # float32: 2.44e-4


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax's dataclass modules look their module up there
    spec.loader.exec_module(module)
    return module


def _line(name: str, text: str) -> str:
    """``name.py:LINE`` of the one line of the example holding `text` (found by reading it)."""
    lines = (EXAMPLES / f"{name}.py").read_text().splitlines()
    hits = [i + 1 for i, s in enumerate(lines) if text in s and not s.lstrip().startswith("#")]
    assert len(hits) == 1, (text, hits)
    return f"{name}.py:{hits[0]}"


def _normwise(y, r) -> float:
    y = np.asarray(y, np.float64)
    r = np.asarray(r, np.float64)
    if np.isnan(y).any() and not np.isnan(r).any():
        return float("inf")
    return float(np.abs(y - r).max() / np.abs(r).max())


def _fails(fn, *args, **kwargs) -> str:
    from diag.testing import assert_numerics

    with pytest.raises(AssertionError) as info:
        assert_numerics(fn, *args, **kwargs)
    return str(info.value)


# --- PyTorch: GPT-2 forward (transformers, random weights) -----------------------------------


@needs_torch
def test_gpt2_torch_clean_passes_and_fp16_softmax_fails_at_the_exp():
    pytest.importorskip("transformers")
    import torch

    from diag.testing import assert_numerics

    ex = _example("decoder_torch")
    model, (ids,) = ex.clean()
    planted, _ = ex.planted()
    with torch.no_grad():
        truth = ex.clean()[0].double()(ids)  # the intended math, in float64
        clean_err = _normwise(model(ids), truth)
        planted_err = _normwise(planted(ids), truth)
    assert clean_err <= SQRT_U32 < planted_err  # decided without diag

    verdicts = assert_numerics(model, ids)
    assert [v.status for v in verdicts] == ["pass"]
    msg = _fails(planted, ids)
    assert msg.startswith("diag: Logits on torch-cpu: 1 of 1 outputs beyond")
    assert "normwise error inf" in msg
    # the float16 cast and the exp share the line; the first op past the allowance is one of them
    assert f"at {_line('decoder_torch', 'torch.exp(scores.to(torch.float16))')} " in msg
    assert "first divergent op: aten.exp" in msg or "first divergent op: aten._to_copy" in msg
    assert "reference: float64 shadow" in msg  # the function hard-codes float16 inside


# --- PyTorch: one AdamW training step ----------------------------------------------------------


def _train_truth(ex, params, x, y):
    return ex.train_step({k: v.double() for k, v in params.items()}, x.double(), y)


def _train_errors(out, truth) -> list[float]:
    (loss, p), (loss64, p64) = out, truth
    return [_normwise(loss, loss64)] + [_normwise(p[k], p64[k]) for k in p64]


@needs_torch
def test_adamw_step_clean_passes_and_one_pass_variance_fails_at_the_sub():
    from diag.testing import assert_numerics

    ex = _example("train_step_torch")
    params, x, y = ex._inputs()
    truth = _train_truth(ex, params, x, y)
    assert max(_train_errors(ex.train_step(params, x, y), truth)) <= SQRT_U32
    planted_errs = _train_errors(ex.train_step_one_pass(params, x, y), truth)
    assert max(planted_errs) > SQRT_U32

    verdicts = assert_numerics(ex.train_step, params, x, y)
    assert {v.status for v in verdicts} == {"pass"} and len(verdicts) == 5  # loss + 4 params
    msg = _fails(ex.train_step_one_pass, params, x, y)
    n_beyond = sum(e > SQRT_U32 for e in planted_errs)
    assert f": {n_beyond} of 5 outputs beyond" in msg
    assert "output[0] (float32): normwise error" in msg  # the loss
    assert f"first divergent op: aten.sub at {_line('train_step_torch', 'var = (x * x)')} " in msg


@needs_torch
def test_a_given_reference_replaces_the_float64_evaluation():
    from diag.testing import assert_numerics

    ex = _example("train_step_torch")
    params, x, y = ex._inputs()

    def float64_step(params, x, y):
        return _train_truth(ex, params, x, y)

    verdicts = assert_numerics(ex.train_step, params, x, y, reference=float64_step)
    assert {v.status for v in verdicts} == {"pass"}
    msg = _fails(ex.train_step_one_pass, params, x, y, reference=float64_step)
    assert "reference: outputs of test_a_given_reference" in msg
    assert "aten.sub" in msg


@needs_torch
def test_backends_this_process_cannot_run_are_a_usage_error():
    import torch

    from diag.errors import UsageError
    from diag.testing import assert_numerics

    x = torch.ones(4)
    assert [v.status for v in assert_numerics(torch.exp, x, backends=["torch-cpu"])] == ["pass"]
    with pytest.raises(UsageError, match="runs here on torch-cpu only; give assert_numerics a"):
        assert_numerics(torch.exp, x, backends=["jax-cpu"])


# --- JAX: a sampler step, a Flax decoder ----------------------------------------------------


@needs_jax
def test_sampler_clean_passes_and_softmax_without_max_fails_at_the_exp():
    from diag.testing import assert_numerics

    ex = _example("sampler_jax")
    (logits,) = ex.clean()[1]
    x = np.asarray(logits, np.float64)
    truth = x.argmax(-1)  # softmax is monotone and top-k keeps the maximum: the true token
    top2 = np.sort(x, -1)[:, -2:]
    clean_tokens = np.asarray(ex.sample_step(logits))
    planted_tokens = np.asarray(ex.sample_step_no_max(logits))
    assert (clean_tokens == truth).all()
    wrong = planted_tokens != truth
    assert wrong.any()
    # those rows' best two logits are far apart against a float32 rounding: not forced by it
    gap = (top2[:, 1] - top2[:, 0])[wrong]
    assert (gap > 64 * np.spacing(np.float32(np.abs(x).max()))).all()

    assert [v.status for v in assert_numerics(ex.sample_step, logits)] == ["pass"]
    msg = _fails(ex.sample_step_no_max, logits)
    assert f"output: {int(wrong.sum())} of {wrong.size} values differ from the reference" in msg
    assert f"first divergent op: exp at {_line('sampler_jax', 'jnp.exp(logits')} " in msg


@needs_jax
@pytest.mark.slow  # ~25 s on 2 busy cores: flax init and two jit compiles per dtype
def test_flax_decoder_clean_passes_and_fp16_softmax_fails_at_the_exp():
    pytest.importorskip("flax")
    import jax

    from diag.testing import assert_numerics

    ex = _example("decoder_flax")
    params, ids = ex._inputs()
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
        truth = np.asarray(ex.Decoder("float32").apply(p64, ids))
    assert truth.dtype == np.float64
    assert _normwise(ex.forward(params, ids), truth) <= SQRT_U32
    assert _normwise(ex.forward_fp16_softmax(params, ids), truth) > SQRT_U32

    assert [v.status for v in assert_numerics(ex.forward, params, ids)] == ["pass"]
    msg = _fails(ex.forward_fp16_softmax, params, ids)
    assert "forward_fp16_softmax on jax-cpu: 1 of 1 outputs beyond" in msg
    assert f"at {_line('decoder_flax', 'jnp.exp(scores.astype(jnp.float16))')} " in msg


# --- what a user sees in pytest ------------------------------------------------------------

USER_TEST = """
import numpy as np
import torch

from diag.testing import assert_numerics

X = torch.from_numpy(np.random.default_rng(0).normal(1000.0, 1.0, (8, 64)).astype(np.float32))


def standardise_one_pass(x):
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) / torch.sqrt(var)


def standardise(x):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True))


def test_clean():
    assert_numerics(standardise, X)


def test_planted():
    assert_numerics(standardise_one_pass, X)
"""


@needs_torch
def test_pytest_shows_the_reason_and_the_line_not_diags_frames(tmp_path):
    x = np.random.default_rng(0).normal(1000.0, 1.0, (8, 64)).astype(np.float32)
    # numpy float32, as the user's code computes it: the one-pass variance loses its bits
    x32 = x.astype(np.float32)
    m = x32.mean(-1, keepdims=True, dtype=np.float32)
    one_pass = (x32 - m) / np.sqrt((x32 * x32).mean(-1, keepdims=True) - m * m)
    x64 = x.astype(np.float64)
    c = x64 - x64.mean(-1, keepdims=True)
    truth = c / np.sqrt((c * c).mean(-1, keepdims=True))
    assert _normwise(one_pass, truth) > SQRT_U32

    f = tmp_path / "test_user.py"
    f.write_text(textwrap.dedent(USER_TEST))
    planted_line = "    var = (x * x).mean(-1, keepdim=True) - mean * mean"
    line = 1 + f.read_text().splitlines().index(planted_line)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(f)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "1 failed, 1 passed" in out
    assert "AssertionError: diag: standardise_one_pass on torch-cpu: 1 of 1 outputs beyond" in out
    assert f"first divergent op: aten.sub at test_user.py:{line} (standardise_one_pass)" in out
    assert "diag/testing.py" not in out  # the assertion, not diag's frames


def test_import_diag_testing_imports_no_framework():
    code = (
        "import sys, diag.testing; "
        "print(sorted(m for m in ('jax', 'torch', 'torch_xla', 'flax') if m in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# --- a FILE.py:FUNCTION spec: each backend in its own worker (diag run) -----------------------


@needs_torch
@pytest.mark.slow  # two worker processes and the host's float64 run: ~30 s on 2 busy cores
def test_a_spec_runs_in_workers_and_fails_like_diag_run():
    from diag.testing import assert_numerics

    ex = _example("train_step_torch")
    params, x, y = ex._inputs()
    truth = _train_truth(ex, params, x, y)
    assert max(_train_errors(ex.train_step_one_pass(params, x, y), truth)) > SQRT_U32

    spec = f"{EXAMPLES / 'train_step_torch.py'}:planted"
    with pytest.raises(AssertionError) as info:
        assert_numerics(spec, backends=["torch-cpu"])
    msg = str(info.value)
    assert msg.startswith(f"diag: {spec}: 1 of 1 records failed")
    assert f"first divergent op: aten.sub at {_line('train_step_torch', 'var = (x * x)')} " in msg
    clean = assert_numerics(f"{EXAMPLES / 'train_step_torch.py'}:clean", backends=["torch-cpu"])
    assert [v.status for v in clean] == ["pass"] * 5


def test_a_spec_takes_no_arguments():
    from diag.errors import UsageError
    from diag.testing import assert_numerics

    with pytest.raises(UsageError, match="pass no arguments with a FILE.py:FUNCTION spec"):
        assert_numerics("model.py:forward", 1.0)


@needs_jax
def test_a_token_only_rounding_can_flip_warns_and_passes():
    import jax
    import jax.numpy as jnp

    from diag.testing import NumericsWarning, assert_numerics

    # pairs of adjacent float32 values whose products with 0.7 round to one float32 value: the
    # float32 argmax takes the first, float64 the second, and one rounding of the inputs
    # (half a spacing) can reorder the pair: the dtype cannot resolve it
    a = np.random.default_rng(0).uniform(1, 2, 4096).astype(np.float32)
    b = np.nextafter(a, np.float32(3))
    tie = (a * np.float32(0.7)) == (b * np.float32(0.7))
    x = np.stack([a[tie][:8], b[tie][:8]], -1)
    assert len(x) == 8 and (np.argmax(x.astype(np.float64) * 0.7, -1) == 1).all()

    scale = jax.jit(lambda x: jnp.argmax(x * 0.7, -1))
    assert (np.asarray(scale(jnp.asarray(x))) == 0).all()
    with pytest.warns(NumericsWarning, match="8 of 8 values differ.*forced by rounding"):
        verdicts = assert_numerics(scale, jnp.asarray(x))
    assert [v.status for v in verdicts] == ["warn"]


# --- the same examples through the real `diag run` script ---------------------------------

EXAMPLE_RUNS = [
    ("decoder_torch", "torch-cpu", HAS_TORCH and importlib.util.find_spec("transformers")),
    ("decoder_flax", "jax-cpu", HAS_JAX and importlib.util.find_spec("flax")),
    ("sampler_jax", "jax-cpu", HAS_JAX),
    ("train_step_torch", "torch-cpu", HAS_TORCH),
]


@pytest.mark.slow  # a host and a worker process per run: 25-60 s each on 2 busy cores
@pytest.mark.parametrize("variant, code", [("clean", 0), ("planted", 1)])
@pytest.mark.parametrize("name, backend, present", EXAMPLE_RUNS, ids=[e[0] for e in EXAMPLE_RUNS])
def test_each_example_runs_with_diag_run(tmp_path, name, backend, present, variant, code):
    if not present:
        pytest.skip(f"{name} needs a framework that is not installed")
    spec = f"{EXAMPLES / name}.py:{variant}"
    p = run_diag("run", spec, "--backend", backend, "--out", str(tmp_path), timeout=600)
    assert p.returncode == code, p.stdout + p.stderr
    if code:
        assert "first divergent op" in p.stdout
