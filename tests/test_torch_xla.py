"""The torch-xla-<platform> backend, run by a worker under its own Python, through the real CLI.

torch_xla needs its own torch, so it lives in a venv of its own (scripts/torch-xla-env.sh
DEST); these tests get that venv's Python from DIAG_TEST_TORCH_XLA_PYTHON and are marked
`torch_xla` (out of the fast default; CI creates the env and runs them: .ci/run). Without the
variable they skip, saying so. The usage-error paths of `--python` need no torch_xla and run
in the fast default.

Claims: torch-xla-cpu records sit next to eager torch's with agreement records between them
(the same torch code, compiled by XLA); a worker under another Python imports diag from the
checkout; DIAG_PYTHON_TORCH_XLA maps the Python as `--python` does; `diag env` reports and
audits torch_xla's settings, measuring whether XLA_USE_BF16 really computes float32 in bf16;
the host never imports torch_xla.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO_ROOT, run_diag

XLA_PYTHON = os.environ.get("DIAG_TEST_TORCH_XLA_PYTHON")
needs_env = pytest.mark.skipif(
    not XLA_PYTHON, reason="DIAG_TEST_TORCH_XLA_PYTHON is unset: create the env with "
                           "scripts/torch-xla-env.sh DEST and set it to DEST/bin/python")

SUITE = """
[suite]
name = "xla_small"
seed = 11

[[probe]]
name = "mm"
op = "matmul"
inputs = "normal"
dtypes = ["float32", "bfloat16"]
shapes = [[64, 4, 64], [32, 256, 16]]

[[probe]]
name = "sm"
op = "softmax"
inputs = "normal5"
dtypes = ["float32", "bfloat16"]
shape = [8, 512]
"""


def _suite(tmp_path) -> str:
    path = tmp_path / "xla_small.toml"
    path.write_text(SUITE)
    return str(path)


def _records(proc) -> list[dict]:
    return json.loads(proc.stdout)["records"]


# ---------------------------------------------------------------------------------------------
# Usage errors (no torch_xla needed): exit 2 before anything runs, one `diag:` line


@pytest.mark.parametrize("value, says", [
    ("torch-xla", "expects FRAMEWORK=PATH"),
    ("tensorflow=/usr/bin/python3", "unknown framework 'tensorflow'"),
    ("torch-xla=/nonexistent/bin/python", "is not an executable file"),
])
def test_bad_python_option_is_usage_error(value, says, tmp_path):
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-xla-cpu",
                    "--python", value, "--out", str(tmp_path / "runs"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("diag: ") and says in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_bad_python_in_environment_variable_is_usage_error(tmp_path):
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-xla-cpu",
                    "--out", str(tmp_path / "runs"), timeout=120,
                    env={"DIAG_PYTHON_TORCH_XLA": str(tmp_path / "missing-python")})
    assert proc.returncode == 2, proc.stderr
    assert "DIAG_PYTHON_TORCH_XLA" in proc.stderr and "not an executable file" in proc.stderr


def test_python_without_torch_xla_is_an_error_record_naming_the_import(tmp_path):
    """diag's own Python has no torch_xla here: the named backend cannot start (exit 4)."""
    pytest.importorskip("numpy")
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("this Python has torch_xla")
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-xla-cpu",
                    "--python", f"torch-xla={sys.executable}", "--json", "--no-report",
                    "--out", str(tmp_path / "runs"), timeout=300)
    assert proc.returncode == 4, proc.stderr
    (rec,) = _records(proc)
    assert rec["status"] == "error" and rec["backend"] == "torch-xla-cpu"
    assert "importing torch_xla failed" in rec["reason"] and "torch_xla" in rec["reason"]


def test_torch_xla_not_installed_names_the_set_up_command(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("this Python has torch_xla")
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-xla-cpu",
                    "--json", "--no-report", "--out", str(tmp_path / "runs"), timeout=300,
                    env={"DIAG_PYTHON_TORCH_XLA": ""})
    assert proc.returncode == 4, proc.stderr
    (rec,) = _records(proc)
    assert rec["status"] == "error" and "scripts/torch-xla-env.sh" in rec["reason"]


# ---------------------------------------------------------------------------------------------
# Real torch_xla, in its own environment


@pytest.mark.torch_xla
@needs_env
def test_torch_xla_records_sit_next_to_eager_torch_with_agreement(tmp_path):
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-cpu,torch-xla-cpu",
                    "--python", f"torch-xla={XLA_PYTHON}", "--json", "--no-report",
                    "--out", str(tmp_path / "runs"), env={"DIAG_PYTHON_TORCH_XLA": ""},
                    timeout=600)
    records = _records(proc)
    xla = [r for r in records if r["backend"] == "torch-xla-cpu"]
    eager = [r for r in records if r["backend"] == "torch-cpu"]
    pairs = [r for r in records if r.get("kind") == "agreement"]
    assert len(xla) == len(eager) == 6, proc.stderr
    assert len(pairs) == 6 and {r["backend"] for r in pairs} == {"torch-cpu|torch-xla-cpu"}
    assert all(r["framework"]["name"] == "torch_xla" and r["framework"]["version"]
               for r in xla)
    # torch_xla appends its fast-math default to the flags XLA got; diag records them.
    assert all("--xla_cpu_enable_fast_math=false" in r["settings"]["XLA_FLAGS"] for r in xla)
    assert all("--xla_dump_to" not in r["settings"]["XLA_FLAGS"] for r in xla)
    # float32 on XLA:CPU is plain float32: every float32 record passes its bound.
    assert all(r["status"] == "pass" for r in xla if r["dtype"] == "float32"), \
        [r["reason"] for r in xla if r["status"] != "pass"]
    statuses = [r["status"] for r in records]
    expected = 4 if "error" in statuses else 1 if "fail" in statuses else 0
    assert proc.returncode == expected
    # Timings are measured with the device wait: a run time is positive and was sampled.
    assert all(r["timings"]["run_s_median"] > 0 for r in xla)


@pytest.mark.torch_xla
@needs_env
def test_env_reports_and_audits_torch_xla_settings(tmp_path):
    """Mapped by DIAG_PYTHON_TORCH_XLA (what --python sets), not the flag."""
    results = {}
    for use_bf16 in ("", "1"):
        env = {"DIAG_PYTHON_TORCH_XLA": XLA_PYTHON, "XLA_USE_BF16": use_bf16}
        if not use_bf16:
            env["XLA_USE_BF16"] = "0"
        proc = run_diag("env", "--json", "--no-fingerprints", env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        results[use_bf16] = json.loads(proc.stdout)
    for use_bf16, report in results.items():
        info = report["frameworks"]["torch_xla"]["backends"]["torch-xla-cpu"]
        settings = info["settings"]
        assert "--xla_cpu_enable_fast_math=false" in settings["XLA_FLAGS"]
        assert settings["mat_mul_precision"] in ("default", "high", "highest")
        fired = {f["rule"] for f in report["findings"]}
        # The finding follows what the worker measured, not what the variable says.
        assert ("torch-xla-float32-as-bf16" in fired) == settings["float32_computed_as_bf16"]
    assert results["1"]["frameworks"]["torch_xla"]["backends"]["torch-xla-cpu"][
        "settings"]["XLA_USE_BF16"] == "1"


def test_host_never_imports_torch_xla():
    """The runner's host side names torch_xla but never loads it (a subprocess, fresh)."""
    import subprocess

    code = ("import sys, diag, diag.run.runner, diag.worker.host, diag.settings.environment, diag.cli; "
            "print('torch_xla' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.stdout.strip() == "False", out.stderr


CHAIN = """
[suite]
name = "chain"
seed = 5

[[probe]]
name = "gelu"
op = "gelu"
inputs = ["normal5"]
dtypes = ["bfloat16"]
shape = [64, 2048]
"""


@pytest.mark.torch_xla
@needs_env
def test_excess_precision_ab_on_a_bf16_chain_shows_the_difference_and_its_hlo(tmp_path):
    """The GELU chain as models write it, in bf16: XLA keeps parts of it in float32 unless
    --xla_allow_excess_precision=false. The env is pinned (torch-xla 2.9.0 on CPU), where the
    setting changes the results (measured: 9639 of 131072 elements) and adds converts."""
    suite = tmp_path / "chain.toml"
    suite.write_text(CHAIN)
    proc = run_diag("run", "--suite", str(suite), "--backend", "torch-xla-cpu",
                    "--python", f"torch-xla={XLA_PYTHON}", "--json", "--no-report",
                    "--ab", "XLA_FLAGS=--xla_allow_excess_precision=false",
                    "--out", str(tmp_path / "runs"), timeout=600)
    data = json.loads(proc.stdout)
    by_backend = {r["backend"]: r for r in data["records"]}
    a, b = by_backend["torch-xla-cpu"], by_backend["torch-xla-cpu+B"]
    assert "--xla_allow_excess_precision=false" in b["settings"]["XLA_FLAGS"]
    assert "--xla_allow_excess_precision=false" not in a["settings"]["XLA_FLAGS"]
    ab = by_backend["torch-xla-cpu|torch-xla-cpu+B"]
    assert ab["kind"] == "ab" and ab["status"] == "warn", ab["reason"]
    assert a["metrics"]["output_digests"] != b["metrics"]["output_digests"]
    assert ab["metrics"]["changed_outputs"] == ["output"]
    assert 0 < ab["metrics"]["difference"]["mismatched"] < 64 * 2048
    hlo = ab["metrics"]["hlo_diff"]
    # The diff of the optimised HLO XLA compiled, kept in the run folder.
    diff = (tmp_path / "runs" / os.path.basename(data["run_dir"]) / hlo["path"]).read_text()
    assert "convert" in hlo["ops"] and hlo["ops"]["convert"][1] > hlo["ops"]["convert"][0]
    assert "+" in diff and "bf16" in diff and hlo["changed_lines"] > 0
    assert proc.returncode == 0 and data["counts"]["fail"] == 0 == data["counts"]["error"]


@pytest.mark.torch_xla
@needs_env
def test_flag_xla_refuses_is_named_before_the_run_for_torch_xla_alone(tmp_path):
    """No JAX backend planned: torch_xla's own discovery starts its runtime, so XLA reads
    XLA_FLAGS there and the bad flag is a usage error (exit 2), not a crashed worker."""
    proc = run_diag("run", "--suite", _suite(tmp_path), "--backend", "torch-xla-cpu",
                    "--python", f"torch-xla={XLA_PYTHON}", "--out", str(tmp_path / "runs"),
                    env={"XLA_FLAGS": "--xla_no_such_flag_for_diag=1"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--xla_no_such_flag_for_diag=1" in proc.stderr and proc.stderr.startswith("diag: ")
    assert not (tmp_path / "runs").exists()
