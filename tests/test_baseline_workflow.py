"""The CI workflow example is real: valid YAML whose diag commands exist and, run as written
on the shipped `ci` suite, gate a run against its baseline and leave a report and a JUnit file
that validates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import xmlschema
import yaml

from conftest import REPO_ROOT, diag_script, needs_jax, needs_torch, run_diag

WORKFLOW = REPO_ROOT / "examples" / "github-actions.yml"
XSD = REPO_ROOT / "tests" / "data" / "junit-jenkins.xsd"


def _steps():
    doc = yaml.safe_load(WORKFLOW.read_text())
    (job,) = doc["jobs"].values()
    return job["steps"]


def test_workflow_is_valid_yaml_and_names_real_commands():
    steps = _steps()
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)
    text = WORKFLOW.read_text()
    # Command lines: in a step's script, or indented in the header's set-up comment.
    verbs = set(re.findall(r"(?m)^\s*(?:#\s{2,})?(?:run:\s+)?diag (\w+)", text))
    assert {"run", "baseline", "check"} <= verbs
    for verb in sorted(verbs):
        r = run_diag(verb, "--help")
        assert r.returncode == 0, (verb, r.stderr)
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    for name in ("report.html", "drift.html", "junit.xml"):
        assert name in upload["with"]["path"], name


def test_install_step_installs_this_checkout_not_a_name_from_a_public_index(tmp_path):
    """diag is not on PyPI: a bare `pip install "diag[...]"` fails (or installs whatever
    someone registered under that name). The step, run as written in a copy of the checkout,
    must resolve diag from the checkout itself: pip's dry run without dependencies (only
    setuptools, diag's build requirement, comes from the configured index) proves what it
    would install."""
    (install,) = [s["run"] for s in _steps() if "pip install" in s.get("run", "")]
    assert install.startswith("pip install ")
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT, checkout, ignore=shutil.ignore_patterns(
        ".git", "reports", "*.egg-info", "__pycache__", ".venv*", "build", "dist"))
    dry = install.replace("pip install ", f"{sys.executable} -m pip install --dry-run "
                          "--no-deps --report report.json ", 1)
    r = subprocess.run(["bash", "-e", "-c", dry], cwd=checkout, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((checkout / "report.json").read_text())
    (item,) = report["install"]
    assert item["metadata"]["name"] == "diag"
    assert item["download_info"]["url"] == checkout.as_uri()
    extras = set(item.get("requested_extras") or [])
    declared = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    assert {"jax", "torch"} <= extras <= declared


@needs_jax
@needs_torch
def test_workflow_steps_gate_the_ci_suite(tmp_path):
    """Run the workflow's own shell steps, in order, as the runner would (bash, GITHUB_ENV)."""
    runs = [s for s in _steps() if "run" in s and "pip install" not in s["run"]]
    github_env = tmp_path / "github_env"
    github_env.touch()
    env = {**os.environ, "GITHUB_ENV": str(github_env),
           "PATH": str(Path(diag_script()).parent) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                           if os.environ.get("PYTHONPATH") else "")}

    def step(script: str) -> subprocess.CompletedProcess:
        for line in github_env.read_text().splitlines():
            name, _, value = line.partition("=")
            env[name] = value
        return subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    first = step(runs[0]["run"])
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / github_env.read_text().split("=", 1)[1].strip()
    assert (run_dir / "report.html").is_file()
    # The one-time set-up the workflow's header names: save the baseline, "commit" it.
    (tmp_path / "ci").mkdir()
    saved = subprocess.run(["diag", "baseline", str(run_dir), "-o", "ci/diag-baseline.json"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert saved.returncode == 0, saved.stderr
    check = step(runs[1]["run"])
    assert check.returncode == 0, check.stdout + check.stderr
    assert "no drift" in check.stdout
    xmlschema.XMLSchema(str(XSD)).validate(str(tmp_path / "junit.xml"))
    # The drift view the upload step names, written by the check step.
    view = (tmp_path / "drift.html").read_text("utf-8")
    assert 'data-exit="0"' in view and "NO DRIFT" in view
