"""`diag run FILE.py:FUNCTION` through the real `diag` script: a user's JAX and PyTorch
functions on jax-cpu and torch-cpu, judged against their float64 evaluation; planted precision
bugs fail naming the first divergent op and its line; bad input is one line and exit 2; the
drift gate keys a function by its source (a rerun passes, a planted change drifts).

Every expected verdict is decided here: the function's float32 result is computed in this
process and its normwise error against numpy float64 compared with sqrt(u) of float32, so the
test holds whatever CPU computes it.
"""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, run_diag

SQRT_U32 = 2.0**-12

MODELS = '''
import jax
import jax.numpy as jnp
import numpy as np
import torch


def mlp(params, x):
    return {"logits": jnp.tanh(x @ params["w1"]) @ params["w2"],
            "token": jnp.argmax(jnp.tanh(x @ params["w1"]) @ params["w2"], axis=-1)}


def jax_mlp():
    rng = np.random.default_rng(0)
    params = {"w1": (rng.standard_normal((16, 32)) / 4).astype(np.float32),
              "w2": (rng.standard_normal((32, 8)) / 4).astype(np.float32)}
    return jax.jit(mlp), (params, rng.standard_normal((4, 16)).astype(np.float32))


def variance(x):
    mean_sq = jnp.mean(x * x, axis=-1)
    return mean_sq - jnp.mean(x, axis=-1) ** 2


def jax_variance():
    rng = np.random.default_rng(1)
    return variance, (1000.0 + rng.standard_normal((8, 256)).astype(np.float32),)


def torch_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    return model, (torch.randn(4, 16),)


def bf16_sum(x):
    return x.to(torch.bfloat16).sum(dim=-1).float()


def torch_bf16_sum():
    return bf16_sum, (torch.rand(4, 2048),)


def sgd_step(model, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return {"loss": loss.detach(), "weight": model[0].weight.detach().clone()}


def torch_step():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return sgd_step, (model, torch.randn(32, 8), torch.randn(32, 1))
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("userfn") / "models.py"
    path.write_text(MODELS)
    return path


def _run(*args, cwd=None, env=None):
    proc = run_diag("run", *args, "--no-report", "--json", cwd=cwd, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout)


def _probe(data, backend):
    (rec,) = [r for r in data["records"] if r["backend"] == backend and r["kind"] == "probe"]
    return rec


def _normwise(y: np.ndarray, r: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - r).max() / np.abs(r).max())


def _load(models, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"m_{name}", models)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


def test_a_jax_function_passes_on_jax_cpu_against_its_float64_evaluation(models, tmp_path):
    proc, data = _run(f"{models}:jax_mlp", "-b", "jax-cpu", "-o", str(tmp_path),
                      "--ab", "XLA_FLAGS=--xla_allow_excess_precision=false")
    fn, (params, x) = _load(models, "jax_mlp")
    h = np.tanh(x.astype(np.float64) @ params["w1"].astype(np.float64))
    r = h @ params["w2"].astype(np.float64)
    y = np.asarray(fn(params, x)["logits"])
    expected = "pass" if _normwise(y, r) <= SQRT_U32 and (
        np.asarray(fn(params, x)["token"]) == r.argmax(-1)).all() else "fail"
    rec = _probe(data, "jax-cpu")
    assert rec["status"] == expected == "pass"
    assert rec["oracle"]["method"].startswith("float64 evaluation of the same function")
    assert rec["metrics"]["reference_kind"] == "float64"
    assert {o["path"] for o in rec["metrics"]["outputs"]} == {"['logits']", "['token']"}
    assert rec["params"]["source_hash"] and rec["params"]["framework"] == "jax"
    ab = [r for r in data["records"] if r["kind"] == "ab"]
    assert len(ab) == 1 and ab[0]["status"] in ("pass", "warn")
    assert proc.returncode == 0
    # A JAX function never runs on a torch backend.
    assert not [r for r in data["records"] if r["backend"].startswith("torch")
                and r["status"] != "skip"]


def test_a_torch_module_passes_on_torch_cpu(models, tmp_path):
    proc, data = _run(f"{models}:torch_mlp", "-b", "torch-cpu", "-o", str(tmp_path))
    rec = _probe(data, "torch-cpu")
    assert rec["status"] == "pass" and proc.returncode == 0
    assert rec["params"]["framework"] == "torch"
    (out,) = rec["metrics"]["outputs"]
    assert 0 <= out["error"] <= out["allowed"] == SQRT_U32


def test_a_torch_training_step_takes_the_same_step_on_every_timed_call(models, tmp_path):
    import copy

    fn, (model, x, y) = _load(models, "torch_step")
    wide = copy.deepcopy(model).double()
    r = fn(wide, x.double(), y.double())  # the step in float64, decided here
    got = fn(copy.deepcopy(model), x, y)
    expected = all(_normwise(np.atleast_1d(got[k].numpy()), np.atleast_1d(r[k].numpy()))
                   <= SQRT_U32 for k in ("loss", "weight"))
    proc, data = _run(f"{models}:torch_step", "-b", "torch-cpu", "-o", str(tmp_path),
                      "--repeats", "3", "--repeat-budget", "inf")
    rec = _probe(data, "torch-cpu")
    assert rec["status"] == ("pass" if expected else "fail") == "pass", rec["reason"]
    assert rec["timings"]["run_s_samples"] and len(rec["timings"]["run_s_samples"]) == 3


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_cancelling_variance_fails_naming_the_subtraction_and_its_line(models, tmp_path):
    fn, (x,) = _load(models, "jax_variance")
    x64 = x.astype(np.float64)
    r = (x64 * x64).mean(-1) - x64.mean(-1) ** 2
    assert _normwise(np.asarray(fn(x)), r) > SQRT_U32  # the bug is real in float32
    proc, data = _run(f"{models}:jax_variance", "-b", "jax-cpu", "-o", str(tmp_path))
    rec = _probe(data, "jax-cpu")
    line = _line_of(MODELS, "return mean_sq - jnp.mean(x, axis=-1) ** 2")
    assert rec["status"] == "fail" and proc.returncode == 1
    assert f"first divergent op: sub at models.py:{line} (variance)" in rec["reason"]


def test_a_bf16_accumulation_in_a_torch_function_fails_naming_its_line(models, tmp_path):
    fn, (x,) = _load(models, "torch_bf16_sum")
    r = x.double().sum(-1).numpy()
    assert _normwise(fn(x).numpy(), r) > SQRT_U32  # 2048 bf16 additions lose the digits
    proc, data = _run(f"{models}:torch_bf16_sum", "-b", "torch-cpu", "-o", str(tmp_path))
    rec = _probe(data, "torch-cpu")
    line = _line_of(MODELS, "return x.to(torch.bfloat16).sum(dim=-1).float()")
    assert rec["status"] == "fail" and proc.returncode == 1
    assert rec["metrics"]["reference_kind"] == "shadow"
    assert f"aten._to_copy at models.py:{line} (bf16_sum)" in rec["reason"]


BAD = '''
import time
import numpy as np
import jax.numpy as jnp


def raises():
    raise RuntimeError("broken fixture")


def nothing():
    return (lambda x: None), (np.ones(3, np.float32),)


def strings():
    return (lambda x: {"a": x * 2, "b": "hello"}), (np.ones(3, np.float32),)


def call_raises():
    def f(x):
        raise ValueError("bad shapes")
    return f, (np.ones(3, np.float32),)


def hangs():
    def f(x):
        time.sleep(3600)
        return x
    return f, (jnp.ones(3, jnp.float32),)
'''


@pytest.mark.parametrize(
    "target,message",
    [
        ("missing.py:f", "missing.py: no such file"),
        ("bad.py:nope", "bad.py: no function 'nope'"),
        ("bad.py", "expected FILE.py:FUNCTION or package.module:function, got 'bad.py'"),
        ("no_such_pkg_xyz.mod:f", "no_such_pkg_xyz.mod: no such module"),
        ("bad.py:raises", "raises raised RuntimeError: broken fixture"),
        ("bad.py:nothing", "the function returned no arrays"),
        ("bad.py:strings", "the function returned a str at output['b'], not an array"),
        ("bad.py:call_raises", "f raised ValueError when evaluated in float64: bad shapes"),
        ("bad.py:hangs --timeout 5", "did not return within 5 s (--timeout)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, target, message):
    (tmp_path / "bad.py").write_text(BAD)
    proc = run_diag("run", *target.split(), "-b", "jax-cpu", "--no-report", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: ") and message in lines[0], lines


def test_a_suite_entry_names_a_function_beside_the_probes(models, tmp_path):
    suite = tmp_path / "mine.toml"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "models.py").write_text(MODELS)
    suite.write_text(textwrap.dedent('''
        [suite]
        name = "mine"

        [[probe]]
        name = "model"
        fn = "sub/models.py:jax_mlp"

        [[probe]]
        name = "mm"
        op = "matmul"
        dtypes = ["float32"]
        shapes = [[8, 8, 8]]
    '''))
    proc, data = _run("--suite", str(suite), "-b", "jax-cpu", "-o", str(tmp_path / "r"))
    probes = {r["probe"]: r["status"] for r in data["records"] if r["kind"] == "probe"}
    assert probes == {"mine.model": "pass", "mine.mm": "pass"} and proc.returncode == 0


def test_a_suite_entry_with_a_bad_function_names_the_field(tmp_path):
    suite = tmp_path / "bad.toml"
    suite.write_text('[[probe]]\nname = "m"\nfn = "nowhere.py:f"\n')
    proc = run_diag("run", "--suite", str(suite), "--no-report")
    assert proc.returncode == 2
    assert "field 'probe[0].fn'" in proc.stderr and "nowhere.py: no such file" in proc.stderr


@pytest.mark.slow
def test_the_gate_keys_a_function_by_its_source(models, tmp_path):
    model = tmp_path / "model.py"
    model.write_text(MODELS)
    base = tmp_path / "base.json"
    _, first = _run(f"{model}:jax_mlp", "-b", "jax-cpu", "-o", str(tmp_path / "r"))
    assert run_diag("baseline", first["run_dir"], "-o", str(base)).returncode == 0
    _, again = _run(f"{model}:jax_mlp", "-b", "jax-cpu", "-o", str(tmp_path / "r"))
    rerun = run_diag("check", again["run_dir"], "--baseline", str(base))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    planted = MODELS.replace('@ params["w2"],', '@ params["w2"] * 1.0,')  # a planted change
    assert planted != MODELS
    model.write_text(planted)
    _, changed = _run(f"{model}:jax_mlp", "-b", "jax-cpu", "-o", str(tmp_path / "r"))
    drift = run_diag("check", changed["run_dir"], "--baseline", str(base))
    assert drift.returncode == 1
    assert "function model.py:jax_mlp source" in drift.stdout + drift.stderr
    assert "the function's source changed" in drift.stdout + drift.stderr


def test_the_example_passes_and_its_planted_bug_names_its_line(tmp_path):
    example = REPO_ROOT / "examples" / "user_function.py"
    line = _line_of(example.read_text(), "var = (x * x).mean(-1, keepdims=True) - mean * mean")
    for name, wrong in (("jax_block", False), ("planted", True)):  # decided in numpy float64
        fn, (params, x) = _load(example, name)
        x64, p64 = x.astype(np.float64), {k: v.astype(np.float64) for k, v in params.items()}
        h = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        r = np.tanh(h @ p64["w1"]) @ p64["w2"]
        assert (_normwise(np.asarray(fn(params, x)["hidden"]), r) > SQRT_U32) == wrong
    _, good = _run(f"{example}:jax_block", "-b", "jax-cpu", "-o", str(tmp_path))
    assert _probe(good, "jax-cpu")["status"] == "pass"
    proc, bad = _run(f"{example}:planted", "-b", "jax-cpu", "-o", str(tmp_path))
    rec = _probe(bad, "jax-cpu")
    assert rec["status"] == "fail" and proc.returncode == 1
    assert f"first divergent op: sub at user_function.py:{line} (planted_block)" in rec["reason"]


@pytest.mark.slow
def test_preflight_checks_a_users_function(models):
    proc = run_diag("preflight", "--probe", f"{models}:jax_variance", "--json", timeout=600)
    findings = json.loads(proc.stdout)["findings"]
    mine = [f for f in findings if "jax_variance" in f["check"]]
    assert mine and all(f["status"] == "fail" for f in mine)
    assert "first divergent op: sub" in mine[0]["what"] and proc.returncode == 1


@pytest.mark.slow
def test_a_traced_run_of_a_users_function(models, tmp_path):
    proc, data = _run(f"{models}:jax_mlp", "-b", "jax-cpu", "-o", str(tmp_path), "--trace")
    assert _probe(data, "jax-cpu")["status"] == "pass"
    shown = run_diag("trace", data["run_dir"])
    assert shown.returncode == 0 and "jax_mlp" in shown.stdout


@pytest.mark.torch_xla
@pytest.mark.skipif(not os.environ.get("DIAG_TEST_TORCH_XLA_PYTHON"),
                    reason="DIAG_TEST_TORCH_XLA_PYTHON is unset: create the env with "
                           "scripts/torch-xla-env.sh DEST and set it to DEST/bin/python")
def test_a_torch_function_runs_on_torch_xla_cpu(models, tmp_path):
    xla = os.environ["DIAG_TEST_TORCH_XLA_PYTHON"]
    proc, data = _run(f"{models}:torch_mlp", "-b", "torch-cpu,torch-xla-cpu",
                      "--python", f"torch-xla={xla}", "-o", str(tmp_path))
    assert _probe(data, "torch-cpu")["status"] == "pass"
    assert _probe(data, "torch-xla-cpu")["status"] == "pass"
    (agree,) = [r for r in data["records"] if r["kind"] == "agreement"]
    assert agree["status"] in ("pass", "warn") and proc.returncode == 0
