"""diag's layout holds: an op lives in its own module under probes/, the report reads data.

Claims under test: every op is one module under `probes/` (installed as
`diag.probes`), found by `diag.plan.registry`, and its name appears nowhere else in the package:
no module outside probes/ holds an op's name as a string (`c.op == "matmul"`, `"softmax" in
name`, a table keyed by it), except the rows of `diag/tolerance/` the op modules refer to;
so adding an op is one module and a suite entry. `diag.report` imports only the records' and
run.json's schema (`diag.records.results`), the status order (`diag.status`), `diag.numerics`,
`diag.errors` and its own modules, so a report can be rendered from a run folder alone. No
module is over 500 lines and no function over 80 (a shrinking list of functions not yet
split); the import graph of diag and probes (lazy imports in functions included, modules
named by strings and the registry's discovery of the op modules too, `if TYPE_CHECKING:`
blocks not) has no cycle, and no module takes another module's private (underscore) name,
imported or read as an attribute. The imports between packages follow a contract written as
data (`LAYERS`, `READERS`, as import-linter's layers and forbidden contracts), with the
imports against it that remain named and explained (`EXCEPTIONS`, a list that can only
shrink); the contract is tried on a planted upward import and a planted importlib cycle.
All checked on the source with `ast`.
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


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


#: The root's constants (`from diag import __version__`): set on the root's first lines, which
#: every `diag.*` import has already run; reading one runs no stage, so it is no edge.
ROOT_CONSTANTS = {"__version__"}
#: Calls that import a module named by their first argument.
IMPORTERS = {"import_module", "__import__"}


def _named_modules(name: str, tree: ast.AST, mods: dict[str, Path]) -> dict[str, int]:
    """Modules named by a string (`"diag.backends.jax_backend"` in a table the importer reads,
    `importlib.import_module("...")`): imported by name. Not a module run as a process
    (``python -m diag.worker.main``), nor a package of `name`'s own (the templates of
    ``jinja2.PackageLoader("diag.report", ...)``): Python imported that before `name`."""
    process = {id(b) for n in ast.walk(tree) if isinstance(n, (ast.List, ast.Tuple))
               for a, b in zip(n.elts, n.elts[1:])
               if isinstance(a, ast.Constant) and a.value == "-m"}
    return {n.value: n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in mods
            and n.value != "diag" and not name.startswith(n.value + ".")
            and id(n) not in process}


def _dynamic_imports(name: str, tree: ast.Module, mods: dict[str, Path]
                     ) -> tuple[dict[str, int], list[int]]:
    """(the modules an `import_module(f"{PACKAGE}.{name}")` may import: every module of that
    package, as `diag.plan.registry`'s discovery of the op modules and a package's loader of
    its submodules (`f"{__name__}.{name}"`) do; the lines of the `import_module` calls whose
    module is named by data, not by this file)."""
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    constants["__name__"] = name
    edges, by_data = {}, []
    for n in ast.walk(tree):
        func = getattr(n, "func", None)
        name = getattr(func, "attr", getattr(func, "id", None))
        if not isinstance(n, ast.Call) or name not in IMPORTERS or not n.args:
            continue
        arg = n.args[0]
        if isinstance(arg, ast.Name) and arg.id in constants:
            arg = ast.Constant(constants[arg.id])
        if isinstance(arg, ast.Constant):
            continue  # a module named by a string: `_named_modules`
        prefix = ""
        for part in arg.values if isinstance(arg, ast.JoinedStr) else []:
            if isinstance(part, ast.Constant):
                prefix += part.value
            elif isinstance(part.value, ast.Name) and part.value.id in constants:
                prefix += constants[part.value.id]
            else:
                break
        package = prefix[:-1] if prefix.endswith(".") else None
        if package in mods:
            edges |= {m: n.lineno for m in mods if m.rpartition(".")[0] == package}
        else:
            by_data.append(n.lineno)
    return edges, by_data


def _diag_imports(name: str, path: Path, mods: dict[str, Path]
                  ) -> tuple[dict[str, int], list[str], list[int]]:
    """Every diag module `name` makes Python import, with the line that does:
    `import`/`from` anywhere in its source (function bodies too, not `if TYPE_CHECKING:`
    blocks), a module named by a string, a package's modules imported in a loop by an
    f-string; the private names it takes from other modules (imported, or read as an
    attribute: `numerics._x`, `getattr(numerics, "_x")`); the lines of imports of modules
    named by data (`_dynamic_imports`)."""
    tree = ast.parse(path.read_text())
    skip = {id(m) for n in ast.walk(tree) if isinstance(n, ast.If)
            and "TYPE_CHECKING" in ast.unparse(n.test) for m in ast.walk(n)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges, by_data = _dynamic_imports(name, tree, mods)
    edges |= _named_modules(name, tree, mods)
    private, aliases = [], {}  # local name -> the diag module it is bound to
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name in mods:
                    edges.setdefault(a.name, n.lineno)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(n, ast.ImportFrom):
            base = package.rsplit(".", n.level - 1)[0] if n.level > 1 else package
            mod = (f"{base}.{n.module}" if n.module else base) if n.level else n.module or ""
            for a in n.names:
                if f"{mod}.{a.name}" in mods:  # a submodule: `from diag import numerics`
                    edges.setdefault(f"{mod}.{a.name}", n.lineno)
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
                    continue
                if mod == "diag" and a.name in ROOT_CONSTANTS:
                    continue
                if mod in mods:
                    edges.setdefault(mod, n.lineno)
                    if _is_private(a.name):
                        private.append(f"{_where(path, n.lineno)}: {a.name} from {mod}")
    for n in ast.walk(tree):
        owner, attr = None, None
        if isinstance(n, ast.Attribute) and _is_private(n.attr):
            owner, attr = n.value, n.attr
        elif (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
              and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
              and isinstance(n.args[1].value, str) and _is_private(n.args[1].value)):
            owner, attr = n.args[0], n.args[1].value
        if owner is None:
            continue
        target = aliases.get(owner.id) if isinstance(owner, ast.Name) else None
        if target is None and isinstance(owner, (ast.Name, ast.Attribute)):
            target = ast.unparse(owner) if ast.unparse(owner) in mods else None
        if target is not None and target != name:
            private.append(f"{_where(path, n.lineno)}: {attr} of {target}")
    edges.pop(name, None)
    return edges, private, by_data


def _graph(extra: dict[str, Path] | None = None
           ) -> tuple[dict[str, dict[str, int]], list[str], dict[str, list[int]]]:
    """(module -> {module it imports: line}, private names taken across modules, module ->
    lines of its imports of modules named by data), for diag and probes (and `extra`)."""
    mods = {**_modules(), **(extra or {})}
    graph, private, by_data = {}, [], {}
    for name, path in mods.items():
        graph[name], found, lines = _diag_imports(name, path, mods)
        private += found
        if lines:
            by_data[name] = lines
    return graph, private, by_data


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
    """Lazy imports, modules named by strings and the registry's discovery included."""
    assert _cycles(_graph()[0]) == []


def test_no_private_name_is_imported_from_another_module():
    assert _graph()[1] == []


# ---------------------------------------------------------------------------------------------
# The import contract between packages (as import-linter's layers and forbidden contracts)

#: Modules that are a unit of their own, on a layer below the rest of their package: the plan
#: spans the op table's row type (which every op module imports), the op registry (which
#: discovers the op modules) and the suites (which name backends and users' functions); the
#: XLA flag rules are read by the worker host, which the environment report drives.
OWN_UNITS = ("plan.makers", "plan.probe", "plan.registry", "settings.flags")

#: The layers, top to bottom: a unit imports only units on lower layers; units sharing a
#: layer are independent. Imports inside a unit are free (the module-level rules above hold).
LAYERS = [
    ("cli",),  # nothing imports the command line
    ("diag",),  # the root: the library's packages as attributes, loaded on first use
    ("render",),  # the terminal's rendering (only it imports rich)
    ("testing",),  # pytest helpers over the library
    ("preflight", "accuracy"),  # one command each over many workers: the quick version of
    # every check; the elementwise accuracy tables
    ("nodes", "report", "gate"),  # node scans; readers of run folders (`READERS`)
    ("run",),  # the runner: reads the plan, drives workers, judges, writes records
    ("settings",),  # the environment report (it starts workers to list devices)
    ("worker",),  # the worker and its host side: a leaf below the runner and preflight
    ("trace",),  # a worker's profiler hook and the A/B pass attribution
    ("plan", "settings.flags"),  # suites and cases; XLA flag rules
    ("backends",),  # one module per framework
    ("plan.registry",),  # the op table, discovered from the op modules
    ("probes",),  # the op modules
    ("train",),  # the training-step probe's models
    ("nan",),  # the NaN hunt (a worker hunts a non-finite output)
    ("userfn",),  # a user's function as an op
    ("diverge",),  # first divergence from the float64 shadow
    ("plan.probe",),  # the op table's row type
    ("compare",),  # streaming judging
    ("oracle", "tolerance", "interp", "arith", "plan.makers", "records"),
    ("numerics", "status"),
    ("errors",),
]

#: Readers of records: what each may import at all (gate and report read records only).
READERS = {
    "report": {"records", "status", "numerics", "errors"},
    "gate": {"records", "tolerance", "status", "numerics", "errors"},
}

#: Imports against the contract that remain, as {(importer, imported): why}. Each is checked
#: to be still needed, so the list can only shrink.
EXCEPTIONS = {
    # Release bisection (`diag bisect --package`) installs each release into a venv kept in
    # diag's cache folder and runs the suite's cases there with the runner: a driver above
    # `run`, not a reader of records, kept in gate/ beside the commit bisection and the
    # history it feeds. These go when it moves to a package of its own above `run`.
    ("diag.gate.releases", "diag.oracle.cache_folder"): "release bisection's venv cache",
    ("diag.gate.releases", "diag.plan.cases"): "release bisection runs a suite",
    ("diag.gate.releases", "diag.run.runner"): "release bisection runs a suite",
    ("diag.gate.releases", "diag.worker.interpreter"): "release bisection's workers' Python",
    # Not an import: the root's loader (`diag.<name>` on first use) imports
    # f"diag.{name}", counted as every package; its names (`_LAZY_MODULES`) leave out `cli`.
    ("diag", "diag.cli"): "the root's lazy loader, counted as every package",
}

#: Imports of a module named by data, not by the importing file, as {module: where the
#: names come from}: what they import is counted where the names are written.
NAMED_BY_DATA = {
    "diag": "`MOVED`: the old flat names' new modules (strings in the same file)",
    "diag.backends.arithmetic": "a backend's module, from `diag.backends.BACKENDS`",
    "diag.trace.passes": "a backend's module, from `diag.backends.BACKENDS`",
    "diag.worker.main": "a backend's module (`diag.backends.BACKENDS`); a job's hooks "
                        "(`diag.worker.protocol.Hook`, named by the host that asks)",
    "diag.nodes.workloads": "a user's workload module (`diag nodes --workload`)",
    "diag.userfn.load": "a user's module (`module:function`)",
    "diag.accuracy": "its public names' modules (`_WHERE`, strings in the same file)",
    "diag.accuracy.worker": "a framework's op (`jax.numpy.exp`), from `diag.accuracy.functions`",
}


def _unit(module: str) -> str:
    """The unit of the contract `module` belongs to: its own (`OWN_UNITS`), else its package
    under diag (`plan` for diag.plan.suite, `probes` for the op modules, `diag` the root)."""
    name = module.removeprefix("diag.") if module != "diag" else "diag"
    own = [u for u in OWN_UNITS if name == u or name.startswith(u + ".")]
    return max(own, key=len) if own else name.split(".")[0]


def _layer(unit: str) -> int:
    (index,) = [i for i, layer in enumerate(LAYERS) if unit in layer]
    return index


def contract_violations(graph: dict[str, dict[str, int]], mods: dict[str, Path]
                        ) -> dict[tuple[str, str], str]:
    """{(importer, imported): `file:line: why`} of every import across units that the
    layers or the readers' contract do not allow."""
    out = {}
    for a, imported in graph.items():
        for b, line in imported.items():
            ua, ub = _unit(a), _unit(b)
            if ua == ub:
                continue
            la, lb = _layer(ua), _layer(ub)
            if ua in READERS and ub not in READERS[ua]:
                why = f"{ua} reads records only ({', '.join(sorted(READERS[ua]))})"
            elif lb <= la:
                why = f"{ua} imports {ub}, a unit {'above' if lb < la else 'beside'} it"
            else:
                continue
            out[(a, b)] = f"{_where(mods[a], line)}: {a} -> {b}: {why}"
    return out


def test_every_unit_has_one_layer():
    units = {_unit(m) for m in _modules()}
    placed = [u for layer in LAYERS for u in layer]
    assert sorted(placed) == sorted(set(placed)), "a unit on two layers"
    assert units == set(placed), (f"place these in LAYERS: {sorted(units - set(placed))}; "
                                  f"remove these: {sorted(set(placed) - units)}")


def test_imports_between_packages_follow_the_contract():
    graph = _graph()[0]
    found = contract_violations(graph, _modules())
    unexpected = [why for edge, why in found.items() if edge not in EXCEPTIONS]
    assert not unexpected, "imports against the contract:\n" + "\n".join(unexpected)
    stale = [edge for edge in EXCEPTIONS if edge not in found]
    assert not stale, f"remove these exceptions, no longer needed: {stale}"


def test_modules_named_by_data_are_each_accounted_for():
    by_data = _graph()[2]
    assert set(by_data) == set(NAMED_BY_DATA), (
        f"say where these modules' names come from: {sorted(set(by_data) - set(NAMED_BY_DATA))}"
        f"; remove these: {sorted(set(NAMED_BY_DATA) - set(by_data))}")


def test_the_worker_does_not_import_preflight_and_reads_no_diag_environment_variable():
    """What preflight asks of a worker travels in its job (`Hook`, `features`), never in the
    workers' environment: the worker reads only its own fault injection from there."""
    graph = _graph()[0]
    worker = [m for m in graph if _unit(m) == "worker"]
    assert not [(m, b) for m in worker for b in graph[m] if _unit(b) == "preflight"]
    main = (DIAG / "worker" / "main.py").read_text()
    read = {n.value for n in ast.walk(ast.parse(main))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("DIAG_")}
    assert read == {"DIAG_WORKER_FAULT"}


def test_the_contract_fails_on_a_planted_upward_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from diag.run import runner\n    return runner\n")
    mods = {**_modules(), "diag.records.planted": planted}
    graph = _graph({"diag.records.planted": planted})[0]
    found = contract_violations(graph, mods)
    assert set(found) - set(EXCEPTIONS) == {("diag.records.planted", "diag.run.runner")}
    assert "records imports run, a unit above it" in found[("diag.records.planted",
                                                             "diag.run.runner")]


def test_the_contract_fails_on_a_planted_importlib_cycle(tmp_path):
    """An op module that imports the registry by name, in a function: a cycle only once the
    registry's discovery (every op module, by an f-string) and the string count."""
    planted = tmp_path / "planted.py"
    planted.write_text("import importlib\n\n\ndef f():\n"
                       "    return importlib.import_module('diag.plan.registry')\n")
    graph = _graph({"diag.probes.planted": planted})[0]
    assert graph["diag.plan.registry"]["diag.probes.planted"]  # the discovery, counted
    assert ["diag.plan.registry", "diag.probes.planted"] in _cycles(graph)
    assert ("diag.probes.planted", "diag.plan.registry") in contract_violations(
        graph, {**_modules(), "diag.probes.planted": planted})


def test_the_checker_sees_private_names_read_as_attributes(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import diag.plan.inputs as i\nfrom diag import numerics\n"
                       "import diag.trace.hlo\n\n\ndef f():\n"
                       "    return numerics._x, i._spill, getattr(numerics, '_y'), "
                       "diag.trace.hlo._DEF, numerics.__name__\n")
    private = _diag_imports("diag.planted", planted, _modules())[1]
    assert sorted(p.split(": ")[1] for p in private) == [
        "_DEF of diag.trace.hlo", "_spill of diag.plan.inputs", "_x of diag.numerics",
        "_y of diag.numerics"]


# ---------------------------------------------------------------------------------------------
# One status type

STATUS_WORDS = {"pass", "warn", "fail", "error", "skip"}
STATUS_MODULE = DIAG / "status.py"
#: A status word that is not a status, decided by its context, as {word: why}: used as a key
#: (`rec["error"]`, `event.get("error")`, `{"error": message}`, `"error" in box`), the word
#: names a field, not a status. A dict whose keys are all status words (two or more) is
#: keyed by status (a style per status), so its keys are statuses.
FIELD_NAMES = {
    "error": "the error message's field of a record, an event, a framework's entry",
    "pass": "the XLA compiler pass where an A/B run's programs first differ (diag.trace)",
}


def _is_key(node: ast.Constant, parent: dict[ast.AST, ast.AST]) -> bool:
    par = parent.get(node)
    if isinstance(par, ast.Subscript):
        return par.slice is node
    if isinstance(par, ast.Call) and isinstance(par.func, ast.Attribute):
        return par.func.attr in ("get", "pop", "setdefault") and par.args[:1] == [node]
    if isinstance(par, ast.Dict) and node in par.keys:
        return len(par.keys) < 2 or not all(
            isinstance(k, ast.Constant) and k.value in STATUS_WORDS for k in par.keys)
    if isinstance(par, ast.Compare):
        return par.left is node and isinstance(par.ops[0], (ast.In, ast.NotIn))
    return False


def status_literals(path: Path) -> list[str]:
    """`file:line: word` of each status word written as a bare string literal in `path`."""
    source = path.read_text()
    tree = ast.parse(source)
    parent = {child: n for n in ast.walk(tree) for child in ast.iter_child_nodes(n)}
    return [f"{_where(path, n.lineno)}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in STATUS_WORDS
            and not (n.value in FIELD_NAMES and _is_key(n, parent))]


def test_no_status_word_is_a_bare_string_outside_the_status_module():
    found = [hit for p in [*_sources(DIAG), *_sources(PROBES_DIR)] if p != STATUS_MODULE
             for hit in status_literals(p)]
    assert not found, "status words as strings (use diag.status.Status):\n" + "\n".join(found)


def test_the_status_checker_tells_a_status_from_a_field_named_error(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        'a = r["status"] == "fail"\nb = ("pass", "ok")\nc = {"error": "red", "warn": "y"}\n'
        'd = counts["skip"]\n'  # statuses: lines 1-4
        'e = r["error"]\nf = r.get("error")\ng = {"error": msg, "pass": p, "case": c}\nh = "error" in box\n'
        'i = p["pass"]\n')
    assert [h.split(":")[1] for h in status_literals(planted)] == ["1", "2", "3", "3", "4"]
