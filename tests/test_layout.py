"""diag's layout holds: knowledge of an op lives in the probe table, the report reads data.

Claims under test (issue 12): no module outside the probe table (`diag/probes.py`) tests an
op's name (`c.op == "matmul"`, `"softmax" in name`, `op in ("top_k", ...)`): a quirk of an
op is a field of its `Probe` row, so adding or changing an op touches one row, not the
runner, the worker and the report; and `diag.report` imports only the records' and run.json's
schema (`diag.results`), `diag.numerics`, `diag.errors` and its own modules, so a report can
be rendered from a run folder alone. Both are checked on the source with `ast`, not by eye.
And no module in diag/ is over 500 lines: past that a module holds more than one concern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from diag.probes import PROBES

DIAG = Path(__file__).resolve().parent.parent / "diag"
OPS = set(PROBES)
# The probe table is where op names are tested.
TABLE = DIAG / "probes.py"
REPORT_MAY_IMPORT = {"diag.results", "diag.numerics", "diag.errors"}


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if p != TABLE)


def _is_op_name(node: ast.AST) -> bool:
    """A string literal naming an op, or a tuple/list/set literal holding one."""
    if isinstance(node, ast.Constant):
        return node.value in OPS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_op_name(e) for e in node.elts)
    return False


def _is_op_field(node: ast.AST) -> bool:
    """`x.op`, `op`, or `x.get("op")` / `x["op"]`: an op's name read from a record or case."""
    if isinstance(node, ast.Attribute):
        return node.attr == "op"
    if isinstance(node, ast.Name):
        return node.id == "op"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr == "get" and bool(node.args)
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "op")
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "op"
    return False


def op_name_tests(path: Path, root: Path = DIAG.parent) -> list[str]:
    """`file:line: source` of each comparison that tests an op's name in one module."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literal = any(_is_op_name(o) for o in operands)
        field = any(_is_op_field(o) for o in operands) and any(
            isinstance(o, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for o in operands)
        if literal or field:
            found.append(f"{path.relative_to(root)}:{node.lineno}: "
                         f"{ast.get_source_segment(source, node)}")
    return found


# Op-name tests allowed outside the probe table while a module is being rewritten, as
# {file: code}: none today. The test fails when an entry no longer matches anything, so the
# list can only shrink.
PENDING: dict[str, str] = {}


# The pipeline and the report: here not even a call may name an op (`records_of(rs, "top_k")`
# selects by name as surely as `==` does); what they need to know comes from the probe row.
PIPELINE = ["runner.py", "judge.py", "workers.py", "ab.py", "backends/worker.py", "report"]


def op_names_passed(path: Path, root: Path = DIAG.parent) -> list[str]:
    """`file:line: call` of each call given an op's name as a literal argument."""
    source = path.read_text()
    return [f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)}"
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and any(_is_op_name(a) for a in [*node.args, *(k.value for k in node.keywords)])]


def test_the_checker_sees_each_way_of_testing_an_op_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('a = c.op == "matmul"\nb = "softmax" in name\nd = op in ("top_k", "x")\n'
                   'e = r.get("op") != "whatever"\nf = r["op"] == "greedy_token"\n'
                   'ok = spec.op_args == {} or name == "matmul_bound"\n')
    found = op_name_tests(bad, root=tmp_path)
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5"]
    passed = tmp_path / "passed.py"
    passed.write_text('a = records_of(rs, "greedy_token")\nb = f(op="top_k")\nc = f("k")\n')
    assert [h.split(":")[1] for h in op_names_passed(passed, root=tmp_path)] == ["1", "2"]


def test_the_pipeline_and_the_report_never_name_an_op():
    paths = [p for name in PIPELINE
             for p in ((DIAG / name).rglob("*.py") if (DIAG / name).is_dir() else [DIAG / name])]
    found = [hit for p in paths for hit in op_names_passed(p)]
    assert not found, "op names in the pipeline or the report:\n" + "\n".join(found)


def test_nothing_outside_the_probe_table_tests_an_op_name():
    found = [hit for path in _sources(DIAG) for hit in op_name_tests(path)]
    unexpected = [h for h in found
                  if not any(h.startswith(f + ":") and h.endswith(code)
                             for f, code in PENDING.items())]
    assert not unexpected, ("op names tested outside diag/probes.py (make the quirk a Probe "
                            "field):\n" + "\n".join(unexpected))
    stale = [f for f, code in PENDING.items()
             if not any(h.startswith(f + ":") and h.endswith(code) for h in found)]
    assert not stale, f"remove these fixed entries from PENDING: {stale}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "diag":  # `from diag import numerics`
                names |= {f"diag.{a.name}" for a in node.names if a.name != "__version__"}
    return {n for n in names if n == "diag" or n.startswith("diag.")} - {"diag"}


@pytest.mark.parametrize("path", _sources(DIAG / "report"), ids=lambda p: p.name)
def test_report_imports_only_records_run_json_numerics_and_errors(path):
    outside = {m for m in _imports(path)
               if m not in REPORT_MAY_IMPORT and not m.startswith("diag.report")}
    assert not outside, f"{path.name} imports {sorted(outside)}"


MAX_MODULE_LINES = 500


def test_no_module_in_diag_is_over_500_lines():
    """A module past ~500 lines holds more than one concern; split it along its seams."""
    counts = {p.relative_to(DIAG.parent).as_posix(): len(p.read_text().splitlines())
              for p in sorted(DIAG.rglob("*.py"))}
    assert len(counts) > 10 and "diag/nan/torch_hunt.py" in counts  # the walk found the package
    over = [f"{p}: {n} lines" for p, n in counts.items() if n > MAX_MODULE_LINES]
    assert not over, (f"modules over {MAX_MODULE_LINES} lines (split them):\n"
                      + "\n".join(over))
