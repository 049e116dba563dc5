"""`diag diverge` through the real console script: exit 1 when a divergent op or tap is found,
0 when none is, 2 for bad usage; the table names the op and line; --json carries the figures.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import run_diag

pytest.importorskip("jax")
pytest.importorskip("torch")

TARGETS = textwrap.dedent('''
    import numpy as np
    import torch
    import diag


    def cancel(a, b):
        s = a + b
        return s - a


    def planted():
        return cancel, (torch.full((8,), 1.0), torch.full((8,), 1e-6))


    def clean():
        return torch.tanh, (torch.linspace(-1, 1, 64),)


    def raises():
        def f(x):
            return torch.log(x) + undefined_name  # noqa: F821
        return f, (torch.ones(3),)


    def run_a():
        diag.tap("h", torch.linspace(-1, 1, 64) * 2)


    def run_b():
        diag.tap("h", torch.linspace(-1, 1, 64) * 2.5)
''')


SUB_LINE = f"targets.py:{TARGETS.splitlines().index('    return s - a') + 1} (cancel)"


@pytest.fixture()
def targets(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(TARGETS)
    return path


def test_a_planted_divergence_exits_1_and_names_the_line(targets):
    r = run_diag("diverge", f"{targets}:planted", timeout=120)
    assert r.returncode == 1, r.stderr
    assert f"first divergent op aten.sub at {SUB_LINE}" in " ".join(r.stdout.split())
    r = run_diag("diverge", f"{targets}:planted", "--json", timeout=120)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["found"] is True
    first = doc["report"]["first"]
    assert first["primitive"] == "aten.sub" and first["source"] == SUB_LINE
    assert first["carried"] > first["threshold"]


def test_a_clean_function_exits_0(targets):
    r = run_diag("diverge", f"{targets}:clean", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["report"]["first"] is None


def test_two_targets_compare_their_taps(targets):
    r = run_diag("diverge", f"{targets}:run_a", f"{targets}:run_b", "--json", timeout=120)
    assert r.returncode == 1, r.stderr
    first = json.loads(r.stdout)["report"]["first"]
    assert first["name"] == "h" and first["max_rel"] == pytest.approx(0.5 / 2.5, rel=1e-6)
    r = run_diag("diverge", f"{targets}:run_a", f"{targets}:run_a", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no divergent tap" in r.stdout and "1 shared taps within" in r.stdout


def test_a_function_that_raises_exits_4_with_one_line(targets):
    r = run_diag("diverge", f"{targets}:raises", timeout=120)
    assert r.returncode == 4, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: f raised NameError")


@pytest.mark.parametrize("argv", [
    ("diverge",),
    ("diverge", "no_colon_here"),
    ("diverge", "missing_file.py:f"),
    ("diverge", "a.py:f", "b.py:g", "c.py:h"),
])
def test_bad_usage_exits_2_with_one_line(argv, tmp_path):
    r = run_diag(*argv, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag:")


def test_the_readme_examples_run_as_documented():
    """examples/diverge_*.py, as the README shows them: exit 1 planted, 0 fixed."""
    from tests.conftest import REPO_ROOT

    ex = REPO_ROOT / "examples"
    r = run_diag("diverge", f"{ex}/diverge_layer_norm.py:planted", "--json", timeout=120)
    assert r.returncode == 1, r.stderr
    first = json.loads(r.stdout)["report"]["first"]
    assert first["primitive"] == "sub" and first["source"].startswith("diverge_layer_norm.py:14")
    assert run_diag("diverge", f"{ex}/diverge_layer_norm.py:fixed", timeout=120).returncode == 0
    r = run_diag("diverge", f"{ex}/diverge_port.py:run_jax", f"{ex}/diverge_port.py:run_torch",
                 "--json", timeout=120)
    assert r.returncode == 1 and json.loads(r.stdout)["report"]["first"]["name"] == "mlp.act"
    r = run_diag("diverge", f"{ex}/diverge_port.py:run_jax",
                 f"{ex}/diverge_port.py:run_torch_fixed", timeout=120)
    assert r.returncode == 0, r.stdout
