"""`diag run` tells the truth at first contact: every verdict and exit code it prints holds.

Claims, each through the real `diag` script (or the `diag.run` call a library user makes):
- XLA_FLAGS/LIBTPU_INIT_ARGS that a JAX worker would abort on stop a run that plans a JAX
  backend with exit 2 naming the flag, before any run folder; a torch-only run ignores them.
- A backend named with --backend that cannot run is an `error` (exit 4); in a default run
  the same backend is a `skip`.
- A suite with no case for the chosen backends is exit 2 naming the ops and why.
- A planted overflow (`expect = "nonfinite"`) passes when diag catches it and fails when the
  outputs stay finite; the shipped train_step suite is a gate (exit 0) on jax-cpu.
- An emulated backend never fails, even where it overflows to Inf.
- An output that cannot be judged (wrong shape, too few outputs) is an `error` record for
  that case and the run goes on.
- The B side of an A/B run extends the A side's environment, a caller's `env=` included.
- A case needing more host memory than the limit is exit 2 with the figure; --max-memory
  moves the limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import diag
from diag.backends import framework_installed, get_spec, not_applicable
from diag.errors import SuiteError, UsageError
from diag.records.results import read_records
from diag.plan.suite import load_suite
from tests.conftest import TINY_SUITE, needs_jax, needs_torch, run_diag


def _suite(tmp_path: Path, text: str, name: str = "s.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _records(out: Path) -> list[dict]:
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    return list(read_records(run_dir))


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("diag: "), stderr
    return lines[0]


ONE_MATMUL = """
[suite]
name = "one"
seed = 5

[[probe]]
name = "mm"
op = "matmul"
dtypes = ["float32"]
shapes = [[16, 8, 16]]
"""


# ---------------------------------------------------------------------------------------------
# Flags


@needs_jax
@pytest.mark.parametrize("var, value, named", [
    ("XLA_FLAGS", "--xla_nonexistent_flag=1", "XLA_FLAGS: bad flag '--xla_nonexistent_flag=1'"),
    ("XLA_FLAGS", "--xla_cpu_enable_fast_math=maybe",
     "XLA_FLAGS: bad flag '--xla_cpu_enable_fast_math=maybe'"),
    ("LIBTPU_INIT_ARGS", "not_a_flag", "LIBTPU_INIT_ARGS: bad flag 'not_a_flag'"),
])
def test_run_with_a_flag_xla_refuses_exits_2_naming_it(tmp_path, var, value, named):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, ONE_MATMUL), "--backend", "jax-cpu",
                   "--out", str(out), "--no-report", env={var: value})
    assert res.returncode == 2, res.stderr
    assert _one_line(res.stderr).startswith(f"diag: {named}")
    assert not out.exists()  # refused before any run folder


@needs_jax
def test_an_ab_setting_with_a_bad_flag_exits_2_naming_it(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, ONE_MATMUL), "--backend", "jax-cpu",
                   "--out", str(out), "--no-report", "--ab", "XLA_FLAGS=--xla_nope_b=1")
    assert res.returncode == 2, res.stderr
    assert _one_line(res.stderr).startswith("diag: XLA_FLAGS: bad flag '--xla_nope_b=1'")
    assert not out.exists()


@needs_torch
def test_bad_xla_flags_do_not_stop_a_run_without_jax(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, ONE_MATMUL), "--backend", "torch-cpu",
                   "--out", str(out), "--no-report", "--repeats", "1",
                   env={"XLA_FLAGS": "--xla_nonexistent_flag=1"})
    assert res.returncode == 0, res.stderr
    (rec,) = _records(out)
    assert (rec["backend"], rec["status"]) == ("torch-cpu", "pass")


# ---------------------------------------------------------------------------------------------
# Backends that cannot run


def _no_torch(tmp_path: Path) -> dict:
    """An environment where `torch` is found but cannot be imported (a broken install)."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch is broken here (test)')\n")
    return {"PYTHONPATH": str(fake.parent)}


@needs_jax
def test_a_named_backend_that_cannot_run_is_an_error_and_exit_4(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, ONE_MATMUL), "--backend",
                   "jax-cpu,torch-cpu", "--out", str(out), "--no-report", "--repeats", "1",
                   env=_no_torch(tmp_path))
    assert res.returncode == 4, res.stderr
    recs = {r["backend"]: r for r in _records(out)}
    assert recs["torch-cpu"]["status"] == "error"
    assert "not run although asked for" in recs["torch-cpu"]["reason"]
    assert "torch is broken here (test)" in recs["torch-cpu"]["reason"]
    assert recs["jax-cpu"]["status"] == "pass"  # the run went on
    meta = json.loads(next(out.iterdir()).joinpath("run.json").read_text())
    assert meta["verdict"] == "error" and meta["counts"]["error"] == 1


@needs_jax
def test_a_backend_absent_from_a_default_run_is_a_skip(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, ONE_MATMUL), "--out", str(out),
                   "--no-report", "--repeats", "1", env=_no_torch(tmp_path))
    recs = _records(out)
    torch = [r for r in recs if r["backend"].startswith("torch-")]
    assert torch and all(r["status"] == "skip" for r in torch)
    assert "torch is broken here (test)" in torch[0]["reason"]
    assert not [r for r in recs if r["status"] in ("error", "fail")]
    assert res.returncode == 0, res.stderr


def test_missing_framework_named_in_the_library_call_is_an_error(tmp_path, monkeypatch):
    real = framework_installed
    monkeypatch.setattr("diag.worker.host.framework_installed",
                        lambda fw: False if fw == "torch" else real(fw))
    result = diag.run(_suite(tmp_path, ONE_MATMUL), ["torch-cpu"], out=tmp_path, repeats=1)
    (rec,) = result.records
    assert rec["status"] == "error" and "torch is not installed" in rec["reason"]
    assert result.exit_code == 4


# ---------------------------------------------------------------------------------------------
# A suite with nothing to run


def test_a_suite_with_no_case_for_the_backends_exits_2_naming_why(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", "train_step", "--backend", "emu-bf16x1", "--out", str(out))
    assert res.returncode == 2, res.stderr
    line = _one_line(res.stderr)
    assert "suite 'train_step' has no case that runs on emu-bf16x1" in line
    assert "the suite's ops: train_step" in line
    assert "emu-bf16x1 implements only matmul" in line
    assert not out.exists()


def test_a_suite_whose_settings_no_backend_takes_exits_2(tmp_path):
    text = ONE_MATMUL + 'precision = "highest"\nprecision_via = "argument"\n'
    with pytest.raises(UsageError, match="torch takes matmul precision only via "
                                                     "config"):
        diag.run(_suite(tmp_path, text), ["torch-cpu"], out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_precision_level_the_per_op_argument_cannot_express_exits_2(tmp_path):
    """jax.lax.Precision has no MEDIUM (only jax_default_matmul_precision='bfloat16' does):
    the backend's data (`BackendSpec.argument_precisions`) says so, not a jax special case."""
    text = ONE_MATMUL + 'precision = "medium"\nprecision_via = "argument"\n'
    with pytest.raises(UsageError, match="jax's per-op precision argument has no level "
                                         "'medium'; use precision_via='config'"):
        diag.run(_suite(tmp_path, text), ["jax-cpu"], out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# Planted outcomes


PLANTED = """
[suite]
name = "planted"
seed = 20261122

[[probe]]
name = "overflows"
op = "train_step"
inputs = "mlp_huge"
dtypes = ["float16"]
shapes = [[16, 64, 8]]
expect = "nonfinite"

[[probe]]
name = "stays_finite"
op = "train_step"
inputs = "mlp"
dtypes = ["float16"]
shapes = [[16, 64, 8]]
expect = "nonfinite"
"""


@needs_jax
def test_a_planted_overflow_passes_when_caught_and_fails_when_absent(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, PLANTED), "--backend", "jax-cpu",
                   "--out", str(out), "--no-report", "--repeats", "1")
    recs = {r["probe"]: r for r in _records(out)}
    caught, absent = recs["planted.overflows"], recs["planted.stays_finite"]
    assert caught["status"] == "pass", caught["reason"]
    assert caught["reason"].startswith("planted NaN/Inf caught")
    assert caught["metrics"]["expect_caught"] is True
    assert caught["metrics"]["unexpected_nonfinite"] > 0  # the NaN really is there
    assert "born in" in caught["reason"]  # and the hunt named where
    assert absent["status"] == "fail"
    assert "every output is finite" in absent["reason"]
    assert absent["metrics"]["unexpected_nonfinite"] == 0
    assert res.returncode == 1, res.stderr


@needs_jax
@pytest.mark.slow  # ~30 s loaded; the planted-overflow test above keeps train_step fast
def test_the_shipped_train_step_suite_is_a_gate(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", "train_step", "--backend", "jax-cpu", "--out", str(out),
                   "--no-report", "--repeats", "1")
    recs = [r for r in _records(out) if r["kind"] == "probe"]
    (planted,) = [r for r in recs if r["metrics"].get("expect") == "nonfinite"]
    assert planted["status"] == "pass" and planted["dtype"] == "float16"
    assert planted["metrics"]["unexpected_nonfinite"] > 0
    assert all(r["status"] == "pass" for r in recs), [r["reason"] for r in recs]
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("value, expected", [
    ('"nan"', "expected one of nonfinite, got 'nan'"),
    ("1", "expected a string, got int 1"),
])
def test_suite_expect_is_validated(tmp_path, value, expected):
    text = ONE_MATMUL + f"expect = {value}\n"
    res = run_diag("run", "--suite", _suite(tmp_path, text), "--out", str(tmp_path / "runs"))
    assert res.returncode == 2
    line = _one_line(res.stderr)
    assert "field 'probe[0].expect'" in line and expected in line


# ---------------------------------------------------------------------------------------------
# Emulations warn, never fail


WIDE_FP16 = """
[suite]
name = "wide"
seed = 20261122

[[probe]]
name = "wide_range"
op = "matmul"
inputs = "wide"
dtypes = ["float16"]
shapes = [[128, 512, 128]]
"""


def test_an_emulation_that_overflows_warns_and_never_fails(tmp_path):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, WIDE_FP16), "--backend", "emu-bf16x1",
                   "--out", str(out), "--no-report", "--repeats", "1")
    (rec,) = _records(out)
    # One bf16 pass pushes some fp16 sums near 65504 over it: Inf where the truth is finite.
    assert rec["metrics"]["unexpected_nonfinite"] > 0
    assert rec["status"] == "warn"
    assert "an emulation promises nothing" in rec["reason"]
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------------------------
# Outputs that cannot be judged


TOPK = """
[suite]
name = "topk"
seed = 2

[[probe]]
name = "top_k"
op = "top_k"
dtypes = ["float32"]
shapes = [[4, 256]]
k = [1, 4]
"""


@needs_jax
@pytest.mark.parametrize("suite, fault, case, why", [
    (TINY_SUITE, "truncate@jax-cpu:c0001", "16x4x16 bfloat16",
     "MalformedOutput: returned bfloat16[16, 15], expected bfloat16[16, 16]"),
    (TINY_SUITE, "drop_output@jax-cpu:c0001", "16x4x16 bfloat16",
     "MalformedOutput: returned 0 outputs, expected 1"),
    (TOPK, "truncate@jax-cpu:c0001", "4x256 float32 normal k=4",
     "], expected [4, 4] each"),  # the first output the backend sends lost a column
    (TOPK, "drop_output@jax-cpu:c0001", "4x256 float32 normal k=4",
     "MalformedOutput: no "),  # the last output the backend sends is missing
], ids=["matmul-truncate", "matmul-drop", "top_k-truncate", "top_k-drop"])
def test_an_output_that_cannot_be_judged_is_an_error_record_and_the_run_goes_on(
        tmp_path, suite, fault, case, why):
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, suite), "--backend", "jax-cpu",
                   "--out", str(out), "--no-report", "--repeats", "1",
                   env={"DIAG_WORKER_FAULT": fault})
    assert res.returncode == 4, res.stderr
    recs = _records(out)
    (bad,) = [r for r in recs if r["status"] == "error"]
    assert bad["case"] == case and bad["backend"] == "jax-cpu"
    assert bad["reason"].startswith("jax-cpu: cannot judge the output")
    assert why in bad["reason"]
    # Every other case was judged: the run went on past the malformed one.
    others = [r for r in recs if r is not bad]
    jax_cpu = get_spec("jax-cpu")
    planned = [c for c in load_suite(str(tmp_path / "s.toml")).cases
               if not_applicable(jax_cpu, c.op, c.params) is None]
    assert len(others) == len(planned) - 1
    assert all(r["status"] in ("pass", "warn") for r in others)


# ---------------------------------------------------------------------------------------------
# A/B keeps the caller's environment


@needs_jax
def test_ab_b_side_extends_the_environment_the_a_worker_got(tmp_path):
    a_flag = "--xla_cpu_enable_fast_math=false"
    b_flag = "--xla_allow_excess_precision=false"
    result = diag.run(_suite(tmp_path, ONE_MATMUL), ["jax-cpu"], out=tmp_path, repeats=1,
                      env={"XLA_FLAGS": a_flag}, ab=[f"XLA_FLAGS={b_flag}"])
    meta = json.loads((result.run_dir / "run.json").read_text())
    # What each worker reported it started with (jax_backend.setup reads its environment).
    assert meta["backends"]["jax-cpu"]["settings"]["XLA_FLAGS"] == a_flag
    assert meta["backends"]["jax-cpu+B"]["settings"]["XLA_FLAGS"] == f"{a_flag} {b_flag}"
    assert meta["ab"]["env"]["XLA_FLAGS"] == f"{a_flag} {b_flag}"
    assert result.exit_code == 0


def test_parse_ab_appends_to_the_given_base_not_the_process_environment(monkeypatch):
    from diag.run.runner import parse_ab

    monkeypatch.setenv("XLA_FLAGS", "--from_os=1")
    assert parse_ab(["XLA_FLAGS=--b=1"], base={"XLA_FLAGS": "--a=1"}) == {
        "XLA_FLAGS": "--a=1 --b=1"}
    assert parse_ab(["XLA_FLAGS=--b=1"], base={}) == {"XLA_FLAGS": "--b=1"}


# ---------------------------------------------------------------------------------------------
# Host memory


def test_a_case_too_big_for_host_memory_exits_2_with_the_figure(tmp_path):
    text = ONE_MATMUL.replace("[[16, 8, 16]]", "[[100000, 100000, 100000]]")
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", _suite(tmp_path, text), "--backend", "emu-bf16x1",
                   "--out", str(out))
    assert res.returncode == 2, res.stderr
    line = _one_line(res.stderr)
    assert "field 'probe[0].shape'" in line and "100000x100000x100000 float32" in line
    figure = float(line.split("needs about ")[1].split(" GiB")[0])
    assert figure > 74.5  # at least one float64 draw of one input (1e10 elements)
    assert "--max-memory" in line
    assert not out.exists()


def test_max_memory_moves_the_limit(tmp_path):
    text = ONE_MATMUL.replace("[[16, 8, 16]]", "[[1024, 4, 1024]]")
    suite = _suite(tmp_path, text)
    out = tmp_path / "runs"
    res = run_diag("run", "--suite", suite, "--backend", "emu-bf16x1", "--out", str(out),
                   "--max-memory", "0.01", "--no-report")
    assert res.returncode == 2, res.stderr
    assert "more than the limit of 0.01 GiB (--max-memory)" in _one_line(res.stderr)
    assert not out.exists()
    res = run_diag("run", "--suite", suite, "--backend", "emu-bf16x1", "--out", str(out),
                   "--max-memory", "4", "--no-report", "--repeats", "1")
    assert res.returncode == 0, res.stderr
    with pytest.raises(SuiteError, match=r"needs about 0\.\d+ GiB .* \(--max-memory\)"):
        diag.run(suite, ["emu-bf16x1"], out=out, max_memory=0.01)
