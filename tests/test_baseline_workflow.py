"""The CI workflow example is real: valid YAML whose diag commands exist and, run as written
on the shipped `ci` suite, gate a run against its baseline and leave a report and a JUnit file
that validates.
"""

from __future__ import annotations

import os
import re
import subprocess
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
    assert "report.html" in upload["with"]["path"] and "junit.xml" in upload["with"]["path"]


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
