"""`diag nan` and `diag diverge` at the edges, through the real console script: a target that
never returns (--timeout: one `diag:` line, exit 4), a target that calls sys.exit(3) (diag never
borrows the README's exit 3 for a bad host), two runs with no tap name in common (exit 2 with
the names each side tapped), and the diverge verdict's wording for an infinite difference.
"""

from __future__ import annotations

import math
import textwrap
import time

import pytest

from tests.conftest import run_diag

pytest.importorskip("torch")

TARGETS = textwrap.dedent('''
    import sys
    import time

    import torch
    from diag import tap


    def forever():
        while True:
            time.sleep(0.05)


    def exits():
        sys.exit(3)


    def run_a():
        tap("x", torch.ones(3))


    def run_b():
        tap("y", torch.ones(3))


    def untapped():
        return torch.ones(3)


    def fine():
        return torch.tanh, (torch.linspace(-1, 1, 8),)
''')


@pytest.fixture()
def targets(tmp_path):
    path = tmp_path / "edges.py"
    path.write_text(TARGETS)
    return path


@pytest.mark.parametrize("command", [["nan", "{t}:forever"],
                                     ["diverge", "{t}:forever"],
                                     ["diverge", "{t}:run_a", "{t}:forever"]])
def test_a_target_that_never_returns_ends_at_timeout_with_one_line_and_exit_4(targets,
                                                                              command):
    argv = [a.format(t=targets) for a in command] + ["--timeout", "1"]
    start = time.monotonic()
    proc = run_diag(*argv, timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: ") and "--timeout 1 s" in lines[0]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 100


def test_timeout_does_not_cut_a_target_that_finishes(targets):
    proc = run_diag("nan", f"{targets}:fine", "--timeout", "300")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no NaN/Inf produced" in proc.stdout


@pytest.mark.parametrize("command", ["nan", "diverge"])
def test_sys_exit_in_the_target_is_not_diags_exit_code(targets, command):
    proc = run_diag(command, f"{targets}:exits")
    assert proc.returncode not in (0, 1, 3), proc.stdout + proc.stderr
    assert proc.returncode == (2 if command == "nan" else 4)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "called sys.exit(3)" in lines[0] and lines[0].startswith("diag:")


@pytest.mark.parametrize("b, seen_b", [("run_b", "y"), ("untapped", "no taps")])
def test_compare_with_no_tap_in_common_is_exit_2_naming_both_sides(targets, b, seen_b):
    proc = run_diag("diverge", f"{targets}:run_a", f"{targets}:{b}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("diag: nothing to compare") and len(line.splitlines()) == 1
    assert "run A: x" in line and f"run B: {seen_b}" in line


def test_an_infinite_tap_difference_is_said_in_words():
    from diag import render
    from diag.diverge import CompareReport, TapRecord

    tap = TapRecord(name="h", index=0, dtype="float32", shape=(3,), max_rel=math.inf,
                    mean_rel=math.inf, allowed=1.5e-5, ratio=math.inf)
    parts = [str(p) for p in render.diverge_tables(CompareReport(first=tap, taps=(tap,)))]
    verdict = parts[-1]
    assert "infx" not in verdict and "beyond any allowance" in verdict
    assert "non-finite" in verdict


def test_a_curve_of_zero_differences_is_not_drawn_as_a_range():
    from diag import render
    from diag.diverge import CompareReport, TapRecord

    taps = tuple(TapRecord(name=f"t{i}", index=i, dtype="float32", shape=(3,), max_rel=0.0,
                           mean_rel=0.0, allowed=1.5e-5, ratio=0.0) for i in range(2))
    parts = [str(p) for p in render.diverge_tables(CompareReport(first=None, taps=taps))]
    curve = next(p for p in parts if p.startswith("difference along"))
    assert curve == "difference along 2 taps: 0 at every one"
