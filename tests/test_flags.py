"""Claims about `diag.settings.flags` and `diag env`: flags are parsed as XLA parses them, a flag XLA
refuses is named (exit 2) instead of killing a process, each settings rule fires on exactly
the values it is about, and the report and run.json carry the findings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diag.settings import environment
from diag.arith.precision import fingerprint
from diag.settings.flags import (RULES, BadFlag, findings, host_findings, host_flags, parse_flags,
                        validate_xla_flags)
from diag.report.settings import report_context
from tests.conftest import needs_jax, needs_torch

DIAG = [sys.executable, "-m", "diag.cli"]


def diag(*args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run(DIAG + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_flags_parse_with_quotes_bare_booleans_and_last_wins():
    flags = parse_flags("--xla_dump_to='/tmp/a b' --xla_cpu_enable_fast_math "
                        "--xla_allow_excess_precision=true --xla_allow_excess_precision=false")
    assert [(f.name, f.value) for f in flags] == [
        ("xla_dump_to", "/tmp/a b"), ("xla_cpu_enable_fast_math", "true"),
        ("xla_allow_excess_precision", "true"), ("xla_allow_excess_precision", "false")]
    parsed = host_flags({"XLA_FLAGS": "--a=1 --a=2", "LIBTPU_INIT_ARGS": "--b"})
    assert parsed["XLA_FLAGS"]["flags"] == {"a": "2"}
    assert parsed["LIBTPU_INIT_ARGS"]["flags"] == {"b": "true"}


@pytest.mark.parametrize("text, bad", [("xla_foo=1", "xla_foo=1"), ("--ok=1 -x", "-x"),
                                       ("--a='unclosed", "--a='unclosed")])
def test_malformed_flags_raise_naming_the_token(text, bad):
    with pytest.raises(BadFlag) as e:
        parse_flags(text, "XLA_FLAGS")
    assert e.value.flag == bad and e.value.exit_code == 2
    assert str(e.value).startswith(f"diag: XLA_FLAGS: bad flag '{bad}'")
    # run.json never fails on them: the error is recorded instead.
    assert "error" in host_flags({"XLA_FLAGS": text})["XLA_FLAGS"]


@needs_jax
def test_unknown_xla_flag_is_named_by_a_throwaway_process():
    with pytest.raises(BadFlag) as e:
        validate_xla_flags({**os.environ, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false "
                                                       "--xla_no_such_flag=3"})
    assert e.value.flag == "--xla_no_such_flag=3"
    assert "XLA does not know this flag" in str(e.value)
    ok = validate_xla_flags({**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false"})
    assert ok.startswith("ok")
    assert validate_xla_flags({"PATH": os.environ["PATH"]}).startswith("nothing to validate")


def _rules_fired(**facts):
    return {f["rule"] for f in findings(facts)}


def test_each_env_rule_fires_only_on_its_risky_values():
    assert "xla-use-bf16" in _rules_fired(env={"XLA_USE_BF16": "1"})
    assert "xla-use-bf16" not in _rules_fired(env={"XLA_USE_BF16": "0"})
    assert "nvidia-tf32-override" in _rules_fired(env={"NVIDIA_TF32_OVERRIDE": "1"})
    assert "nvidia-tf32-override" not in _rules_fired(env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert "torch-tf32-cublas-override" in _rules_fired(
        env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})


def test_excess_precision_note_unless_turned_off():
    unset = findings({"env": {}, "flags": host_flags({})})
    assert [(f["rule"], f["value"]) for f in unset] == [
        ("xla-excess-precision", "unset (default true)")]
    off = host_flags({"LIBTPU_INIT_ARGS": "--xla_allow_excess_precision=false"})
    assert findings({"env": {}, "flags": off}) == []
    fast = host_flags({"XLA_FLAGS": "--xla_cpu_enable_fast_math=true "
                                    "--xla_allow_excess_precision=false"})
    assert [f["rule"] for f in findings({"env": {}, "flags": fast})] == ["xla-cpu-fast-math"]


def test_framework_rules_need_the_framework_and_the_hardware():
    jax = {"jax_default_matmul_precision": None, "jax_debug_nans": False}
    assert "jax-matmul-precision" in _rules_fired(jax=jax, backends=["jax-cpu", "jax-tpu"])
    assert "jax-matmul-precision" not in _rules_fired(jax=jax, backends=["jax-cpu"])
    assert "jax-matmul-precision" not in _rules_fired(
        jax={"jax_default_matmul_precision": "highest"}, backends=["jax-tpu"])
    torch = {"float32_matmul_precision": "highest", "cudnn.allow_tf32": True,
             "cuda.matmul.allow_tf32": False}
    assert "torch-cudnn-tf32" not in _rules_fired(torch=torch, backends=["torch-cpu"])
    assert "torch-cudnn-tf32" in _rules_fired(torch=torch, backends=["torch-cuda"])
    assert "torch-matmul-precision" in _rules_fired(
        torch={**torch, "float32_matmul_precision": "medium"}, backends=["torch-cpu"])
    # Not examined (no worker ran): framework rules are skipped, not guessed.
    assert _rules_fired(jax=None, torch=None, backends=["jax-tpu", "torch-cuda"]) == {
        "xla-excess-precision"}


def test_every_rule_says_why_and_what_instead():
    assert len({r.id for r in RULES}) == len(RULES)
    for r in RULES:
        assert r.severity in ("risk", "note") and r.source in ("env", "xla", "jax", "torch",
                                                                "torch_xla")
        assert r.why and r.instead and not r.why.endswith(".")


def test_run_json_environment_carries_flags_and_findings(monkeypatch):
    monkeypatch.setenv("XLA_USE_BF16", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
    env = environment.collect([])
    assert env["flags"]["XLA_FLAGS"]["flags"] == {"xla_allow_excess_precision": "false"}
    assert [f["rule"] for f in env["findings"]] == ["xla-use-bf16"]
    assert host_findings() == env["findings"]


def test_report_shows_findings_and_fingerprints():
    from diag.report.html import render_report

    meta = {"run_id": "r", "state": "finished",
            "environment": {"findings": host_findings({"XLA_USE_BF16": "1"}),
                            "flags": host_flags({})},
            "backends": {"jax-tpu": {"fingerprints": [
                {"precision": "default", "via": "none", "label": "BF16_BF16_F32",
                 "input_bits": [7, 7], "accumulator": "float32",
                 "evidence": ["A: 1+2^-j read back exactly for j <= 7"]}]}}}
    ctx = report_context(meta)
    assert [f["rule"] for f in ctx["settings_findings"]] == ["xla-excess-precision",
                                                            "xla-use-bf16"]
    html = render_report(meta, [])
    assert 'id="settings-findings"' in html and "XLA_USE_BF16" in html
    assert 'id="fingerprint-table"' in html and "BF16_BF16_F32" in html
    plain = render_report({"run_id": "r", "environment": {}}, [])
    assert 'id="fingerprint-table"' not in plain
    assert "records no settings findings" in plain


@needs_jax
@pytest.mark.parametrize("flags, named", [
    ("--xla_cpu_enable_fast_math=false --xla_nope=1", "'--xla_nope=1'"),
    ("--xla_cpu_enable_fast_math=maybe", "'--xla_cpu_enable_fast_math=maybe'"),
])
def test_diag_env_with_a_bad_xla_flag_exits_2_naming_it(flags, named):
    out = diag("env", "--no-fingerprints", env={"XLA_FLAGS": flags})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: XLA_FLAGS: bad flag " + named)
    assert out.stdout == ""


def _torch_label_under(precision: str) -> str:
    """The fingerprint of torch-cpu's matmul under a precision setting, in this process."""
    import torch

    def mm(a, b):
        return torch.from_numpy(a) @ torch.from_numpy(b)

    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        return fingerprint(mm).label
    finally:
        torch.set_float32_matmul_precision(previous)


@needs_jax
@needs_torch
def test_diag_env_json_on_cpu_reads_f32_and_measures_torch_medium():
    out = diag("env", "--json", env={"XLA_USE_BF16": "1"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["exit_code"] == 0
    fps = {(name, fp["precision"], fp["via"]): fp["label"]
           for fw in report["frameworks"].values() for name, info in fw["backends"].items()
           for fp in info["fingerprints"]}
    assert fps[("jax-cpu", "default", "none")] == "F32_F32_F32"
    assert fps[("torch-cpu", "default", "none")] == "F32_F32_F32"
    # every JAX setting computes float32 on CPU (field notes); torch 'highest' is float32 by
    # its documentation; 'medium' is oneDNN's choice per CPU (bf16 on some, float32 on
    # others): what `diag env` reports must be what this CPU does, measured here directly.
    assert {v for (name, _, _), v in fps.items() if name == "jax-cpu"} == {"F32_F32_F32"}
    assert fps[("torch-cpu", "highest", "config")] == "F32_F32_F32"
    assert fps[("torch-cpu", "medium", "config")] == _torch_label_under("medium")
    rules = {f["rule"] for f in report["findings"]}
    assert {"xla-use-bf16", "xla-excess-precision"} <= rules
    assert "torch-cudnn-tf32" not in rules  # no CUDA here
    assert report["env"]["XLA_USE_BF16"] == "1"
