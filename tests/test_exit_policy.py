"""One exit-code policy (`diag.errors`): what a command found decides its code, the same way
for every command. The codes are the documented ones (0 good, 1 a numerical check failed or
drifted, 2 bad usage or a bad file, 3 a bad device or host, 4 a worker crashed); when a
command found several things, the worst wins: a bad device outranks the crash or wrong number
it may cause, a crash outranks a failed check (what did not run may have failed too), and any
finding outranks a file that could not be written after the verdict.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from diag import errors
from diag.errors import exit_code, final, worst

ROOT = Path(__file__).resolve().parent.parent

# The documented meaning of each code, and the order a person reading the README expects.
DOCUMENTED = {"bad_node": 3, "crashed": 4, "failed": 1, "bad_file": 2}
WORST_FIRST = ["bad_node", "crashed", "failed", "bad_file"]


def test_each_finding_alone_is_its_documented_code_and_nothing_found_is_0():
    assert exit_code() == 0
    for finding, code in DOCUMENTED.items():
        assert exit_code(**{finding: True}) == code


def test_several_findings_exit_with_the_worst():
    for n in range(2, 5):
        for found in itertools.combinations(DOCUMENTED, n):
            expected = DOCUMENTED[min(found, key=WORST_FIRST.index)]
            assert exit_code(**dict.fromkeys(found, True)) == expected, found


def test_a_file_that_cannot_be_written_never_hides_a_finding():
    assert [worst(code, 2) for code in (0, 1, 3, 4)] == [2, 1, 3, 4]


def test_sigterm_outranks_whatever_the_command_found():
    assert [final(c, terminated=True) for c in (0, 1, 4)] == [128 + 15] * 3
    assert final(1, terminated=False) == 1


def test_exit_codes_are_named_only_in_the_policys_module():
    """No command decides a code with a number of its own: `EXIT_*` is assigned in
    diag/errors.py only, no result's `exit_code` returns a literal, and no
    `typer.Exit(...)`/`sys.exit(...)` in diag/cli or diag/preflight is given one."""
    found = []
    for path in sorted((ROOT / "diag").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT).as_posix()
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and where != "diag/errors.py":
                found += [f"{where}:{n.lineno}: {t.id}" for t in n.targets
                          if isinstance(t, ast.Name) and t.id.startswith("EXIT_")
                          and not isinstance(n.value, ast.Name)]  # an alias of the policy's
            if (isinstance(n, ast.FunctionDef) and n.name == "exit_code"
                    and where != "diag/errors.py"
                    and any(isinstance(c, ast.Constant) and type(c.value) is int
                            for r in ast.walk(n) if isinstance(r, ast.Return) and r.value
                            for c in ast.walk(r.value))):
                found.append(f"{where}:{n.lineno}: {n.name} returns a number of its own")
            if (where.startswith(("diag/cli/", "diag/preflight/")) and isinstance(n, ast.Call)
                    and ast.unparse(n.func) in ("typer.Exit", "sys.exit", "SystemExit")
                    and any(isinstance(c, ast.Constant) and type(c.value) is int
                            for a in n.args for c in ast.walk(a))):
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    assert not found, "exit codes decided outside diag/errors.py:\n" + "\n".join(found)
    assert errors.PRECEDENCE[:4] == tuple(DOCUMENTED[f] for f in WORST_FIRST)


def test_what_stopped_a_command_decides_the_code_it_ends_with():
    class Crashed(errors.DiagError):
        exit_code = 4

    class Terminated(KeyboardInterrupt):
        exit_code = 128 + 15

    assert errors.ended_by(Crashed("x")) == 4
    assert errors.ended_by(errors.UsageError("x")) == 2
    assert errors.ended_by(KeyboardInterrupt()) == 130
    assert errors.ended_by(Terminated()) == 143
    assert errors.ended_by(ValueError("a bug")) == 70
