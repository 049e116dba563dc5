"""A reference function the user names (`diag run FILE.py:FUNCTION --reference FILE.py:REF`,
a suite entry's ``reference = "file.py:ref"``), through the real `diag` script: a reference
that agrees passes, one that differs fails, a bad reference spec is one line and exit 2.

The expected verdicts are decided here: the function's float32 result against each reference,
normwise, compared with sqrt(u) of float32 in numpy float64.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from tests.conftest import run_diag

SQRT_U32 = 2.0**-12

SOURCE = textwrap.dedent(
    """
    import jax.numpy as jnp
    import numpy as np

    X = np.linspace(-3, 3, 64, dtype=np.float32)

    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    def ref_good(x):
        return np.log1p(np.exp(np.asarray(x, np.float64)))

    def ref_bad(x):
        return np.log1p(np.exp(np.asarray(x, np.float64))) * 1.01

    def make():
        return softplus, (X,)
    """
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("userref")
    (path / "f.py").write_text(SOURCE)
    return path


def _expected(scale: float) -> str:
    import jax.numpy as jnp

    x = np.linspace(-3, 3, 64, dtype=np.float32)
    y = np.asarray(jnp.log1p(jnp.exp(x)), np.float64)
    r = np.log1p(np.exp(x.astype(np.float64))) * scale
    return "pass" if np.abs(y - r).max() / np.abs(r).max() <= SQRT_U32 else "fail"


def _probe(proc):
    data = json.loads(proc.stdout)
    (rec,) = [r for r in data["records"] if r["kind"] == "probe"]
    return rec


@pytest.mark.parametrize(("ref", "scale"), [("ref_good", 1.0), ("ref_bad", 1.01)])
def test_cli_reference(folder, ref, scale):
    proc = run_diag(
        "run", "f.py:make", "--reference", f"f.py:{ref}", "-b", "jax-cpu", "--no-report",
        "--json", "-o", str(folder / "runs"), cwd=folder,
    )
    rec = _probe(proc)
    assert rec["status"] == _expected(scale)
    assert proc.returncode == (0 if rec["status"] == "pass" else 1)
    assert f"reference function f.py:{ref}" in rec["metrics"]["reference"]
    assert rec["metrics"]["reference_kind"] == "user"


def test_suite_entry_reference(folder):
    (folder / "s.toml").write_text(textwrap.dedent(
        """
        [suite]
        name = "mine"

        [[probe]]
        name = "softplus"
        fn = "f.py:make"
        reference = "f.py:ref_bad"
        """
    ))
    proc = run_diag("run", "--suite", str(folder / "s.toml"), "-b", "jax-cpu", "--no-report",
                    "--json", "-o", str(folder / "runs"))
    rec = _probe(proc)
    assert rec["status"] == _expected(1.01)
    assert "reference function f.py:ref_bad" in rec["metrics"]["reference"]


@pytest.mark.parametrize("spec", ["f.py:nope", "f.py", "missing.py:ref"])
def test_bad_reference_is_one_line(folder, spec):
    proc = run_diag("run", "f.py:make", "--reference", spec, "-b", "jax-cpu", "--no-report",
                    cwd=folder)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag:") and "Traceback" not in proc.stderr


def test_reference_without_a_function(folder):
    proc = run_diag("run", "--reference", "f.py:ref_good", "--no-report", cwd=folder)
    assert proc.returncode == 2 and "--reference needs FILE.py:FUNCTION" in proc.stderr
