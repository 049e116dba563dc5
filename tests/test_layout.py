"""diag's layout holds: an op lives in its own module under probes/, the report reads data.

Claims under test: every op is one module under `probes/` (installed as
`diag.probes`), found by `diag.plan.registry`, and its name appears nowhere else in the package:
no module outside probes/ holds an op's name as a string (`c.op == "matmul"`, `"softmax" in
name`, a table keyed by it), except the rows of `diag/tolerance/` the op modules refer to;
so adding an op is one module and a suite entry. `diag.report` imports only the records' and
run.json's schema (`diag.records.results`), the status order (`diag.status`), `diag.numerics`,
`diag.errors` and its own modules, so a report can be rendered from a run folder alone. No
module is over 500 lines and no function over 80 (a shrinking list of functions not yet
split); the import graph of diag and probes (lazy imports in functions included,
`if TYPE_CHECKING:` blocks not) has no cycle, and no module imports
another module's private (underscore) name. All checked on the source with `ast`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from diag.plan.registry import PROBES

ROOT = Path(__file__).resolve().parent.parent
DIAG = ROOT / "diag"
PROBES_DIR = ROOT / "probes"
OPS = set(PROBES)
# The tolerance table: one row per op, which the op modules refer to by name.
TOLERANCE_ROWS = DIAG / "tolerance" / "__init__.py"
REPORT_MAY_IMPORT = {"diag.records.results", "diag.status", "diag.numerics", "diag.errors"}


def _sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


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


def op_name_tests(path: Path, root: Path = ROOT) -> list[str]:
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


# Op-name tests allowed outside probes/ while a module is being rewritten, as
# {file: code}: none today. The test fails when an entry no longer matches anything, so the
# list can only shrink.
PENDING: dict[str, str] = {}


# The pipeline and the report: here not even a call may name an op (`records_of(rs, "top_k")`
# selects by name as surely as `==` does); what they need to know comes from the probe row.
PIPELINE = ["run", "worker", "report"]


def op_names_passed(path: Path, root: Path = ROOT) -> list[str]:
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


def test_nothing_outside_the_op_modules_tests_an_op_name():
    found = [hit for path in _sources(DIAG) for hit in op_name_tests(path)]
    unexpected = [h for h in found
                  if not any(h.startswith(f + ":") and h.endswith(code)
                             for f, code in PENDING.items())]
    assert not unexpected, ("op names tested outside probes/ (make the quirk a Probe "
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


def test_no_module_in_diag_or_probes_is_over_500_lines():
    """A module past ~500 lines holds more than one concern; split it along its seams."""
    counts = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
              for p in [*_sources(DIAG), *_sources(PROBES_DIR)]}
    assert len(counts) > 10 and "diag/nan/torch_hunt.py" in counts  # the walk found the package
    assert "probes/matmul.py" in counts
    over = [f"{p}: {n} lines" for p, n in counts.items() if n > MAX_MODULE_LINES]
    assert not over, (f"modules over {MAX_MODULE_LINES} lines (split them):\n"
                      + "\n".join(over))


# ---------------------------------------------------------------------------------------------
# One op, one module


def _string_constants(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_every_op_is_one_module_under_probes_and_nothing_else_is():
    modules = {p.stem for p in PROBES_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert modules == OPS and len(OPS) >= 8
    for op, row in PROBES.items():
        assert row.truth.__module__.startswith("diag.probes.")
        assert row.implementations, f"{op} has no implementation for any framework"


# Strings that spell an op's name outside probes/ without naming the op, as {file: why}:
# each is checked to still hold one (the list can only shrink).
SAME_SPELLING = {
    "diag/__init__.py": "'train' is the diag.train subpackage (lazy attribute)",
    "diag/cli/run.py": "'matmul' is the default suite's name",
    "diag/run/runner.py": "'matmul' is the default suite's name",
    "diag/nodes/workloads.py": "node-scan workloads named after what they run",
    "diag/nodes/torch_workloads.py": "node-scan workloads named after what they run",
    "diag/report/sections.py": "the report's own key for its top-k table",
    "diag/accuracy/functions.py": "the accuracy tables' elementwise functions (gelu's row)",
    # The ground truth's API and cache keys carry the op names, as the backends did (STYLE's
    # "same names everywhere"): `diag.oracle.matmul_result`.
    "diag/oracle/__init__.py": "the ground-truth API and its cache keys",
    "diag/oracle/mp.py": "the mpmath reference's API",
    # JAX's `top_k` primitive, and the decision kind named after it (DecisionRecord.kind).
    "diag/diverge/decisions.py": "the decision kind named after the primitive it judges",
    "diag/diverge/jax_decide.py": "JAX's top_k primitive, read from the jaxpr",
    "diag/diverge/torch_decide.py": "the decision kind named after JAX's top_k (aten.topk's)",
}


def test_an_op_name_appears_as_a_string_only_in_probes_and_the_tolerance_rows():
    found = [(p.relative_to(ROOT).as_posix(), line, value) for p in _sources(DIAG)
             if p != TOLERANCE_ROWS for line, value in _string_constants(p) if value in OPS]
    unexpected = [f"{p}:{line}: {value!r}" for p, line, value in found if p not in SAME_SPELLING]
    assert not unexpected, "op names outside probes/:\n" + "\n".join(unexpected)
    assert {p for p, _, _ in found} == set(SAME_SPELLING), "remove fixed SAME_SPELLING entries"


def test_the_checker_sees_an_op_name_in_any_string(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('TABLE = {"matmul": 1}\nf("top_k")\nok = "matmul_bound"\n')
    assert [line for line, v in _string_constants(bad) if v in OPS] == [1, 2]


def test_pyproject_installs_every_package_and_maps_probes_into_diag():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in DIAG.rglob("__init__.py")}
    assert set(config["packages"]) == on_disk | {"diag.probes"}
    assert config["package-dir"] == {"diag.probes": "probes"}
    assert config["package-data"]["diag.probes"] == ["suites/*.toml"]


MAX_FUNCTION_LINES = 80
def _long_functions(paths) -> list[str]:
    out = []
    for p in paths:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = n.end_lineno - n.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    name = p.relative_to(ROOT) if p.is_relative_to(ROOT) else p
                    out.append(f"{name}:{n.lineno}: {n.name} ({length} lines)")
    return out


def test_no_function_over_80_lines_in_diag_and_probes():
    long = _long_functions([*_sources(DIAG), *_sources(PROBES_DIR)])
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_length_checker_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    return 1\n")
    found = _long_functions([tmp_path / "m.py"])
    assert len(found) == 1 and ": f (81 lines)" in found[0]


# ---------------------------------------------------------------------------------------------
# The import graph of diag and probes


def _modules() -> dict[str, Path]:
    mods = {}
    for base, package in ((DIAG, "diag"), (PROBES_DIR, "diag.probes")):
        for p in _sources(base):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = p
    return mods


def _diag_imports(name: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The diag modules `name` imports anywhere in its source (function bodies too, not
    `if TYPE_CHECKING:` blocks), and the private names it imports from other modules."""
    tree = ast.parse(path.read_text())
    skip = {id(m) for n in ast.walk(tree) if isinstance(n, ast.If)
            and "TYPE_CHECKING" in ast.unparse(n.test) for m in ast.walk(n)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges, private = set(), []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            edges |= {a.name for a in n.names if a.name in mods}
        elif isinstance(n, ast.ImportFrom):
            base = package.rsplit(".", n.level - 1)[0] if n.level > 1 else package
            mod = (f"{base}.{n.module}" if n.module else base) if n.level else n.module or ""
            for a in n.names:
                if f"{mod}.{a.name}" in mods:  # a submodule: `from diag import numerics`
                    edges.add(f"{mod}.{a.name}")
                    continue
                if mod in mods:
                    edges.add(mod)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{path.relative_to(ROOT)}:{n.lineno}: {a.name} "
                                       f"from {mod}")
    edges.discard(name)
    return edges, private


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    graph, private = {}, []
    for name, path in mods.items():
        graph[name], found = _diag_imports(name, path, mods)
        private += found
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), iteratively."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_diag_and_probes():
    assert _cycles(_graph()[0]) == []


def test_no_private_name_is_imported_from_another_module():
    assert _graph()[1] == []
