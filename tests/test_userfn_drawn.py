"""A suite entry naming a function with ``inputs``, ``shape``, ``dtype`` and ``seed``: the
function is called on arrays drawn by diag's input makers, through the real `diag` script.

The expected verdicts are decided here: the same arrays drawn with numpy from the seed (the
maker's documented draw: standard normal, cast to float32), the function's float32 arithmetic
in numpy against float64, normwise, compared with sqrt(u) of float32.
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
    import torch

    def shifted(x, y):
        return (x + 1e5) - 1e5 + y

    def scaled(x, y):
        return x * 0.5 + y
    """
)

SUITE = textwrap.dedent(
    """
    [suite]
    name = "drawn"

    [[probe]]
    name = "NAME"
    fn = "mine.py:NAME"
    inputs = "normal"
    shape = [[32, 16], [32, 16]]
    dtype = "float32"
    seed = 11
    """
)


def _expected(name: str) -> str:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.standard_normal((32, 16)).astype(np.float32)
    if name == "shifted":
        got = (x + np.float32(1e5)) - np.float32(1e5) + y
    else:
        got = x * np.float32(0.5) + y
    ref = x.astype(np.float64) * (1.0 if name == "shifted" else 0.5) + y.astype(np.float64)
    err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
    return "pass" if err <= SQRT_U32 else "fail"


@pytest.mark.parametrize("name", ["scaled", "shifted"])
def test_drawn_inputs(tmp_path, name):
    (tmp_path / "mine.py").write_text(SOURCE)
    (tmp_path / "s.toml").write_text(SUITE.replace("NAME", name))
    proc = run_diag("run", "--suite", str(tmp_path / "s.toml"), "-b", "torch-cpu",
                    "--no-report", "--json", "-o", str(tmp_path / "runs"))
    assert "Traceback" not in proc.stderr, proc.stderr
    (rec,) = [r for r in json.loads(proc.stdout)["records"] if r["kind"] == "probe"]
    assert rec["status"] == _expected(name)
    assert proc.returncode == (0 if rec["status"] == "pass" else 1)


@pytest.mark.parametrize(("line", "field"), [('inputs = "nope"', "inputs"),
                                             ('dtype = "int7"', "dtype"),
                                             ("shape = [0, 3]", "shape")])
def test_a_bad_draw_is_one_line(tmp_path, line, field):
    (tmp_path / "mine.py").write_text(SOURCE)
    text = SUITE.replace("NAME", "scaled")
    key = line.split(" ")[0]
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(key)) + "\n" + line
    (tmp_path / "s.toml").write_text(text)
    proc = run_diag("run", "--suite", str(tmp_path / "s.toml"), "-b", "torch-cpu", "--no-report")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"probe[0].{field}" in lines[0]
