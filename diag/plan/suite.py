"""Load and validate suite files (TOML) into cases.

A suite is a list of probe entries; each entry names an op from the probe table
(`diag.plan.registry.PROBES`: one module per op under probes/) and a grid of parameters.
Every field is checked before any worker starts: a bad file raises `SuiteError` naming the
file, the field and what was expected.

    [suite]
    name = "matmul"
    seed = 0

    [[probe]]
    name = "sweep_d4"          # unique within the suite
    op = "matmul"
    inputs = "normal"          # an input maker: normal, uniform, positive, wide
    dtypes = ["float32", "bfloat16"]
    shape = ["d", 4, "d"]      # [M, K, N]; a string names a swept parameter
    sweep = { d = [64, 128, 256] }
    precision = ["default"]    # default | high | highest | medium
    precision_via = ["argument", "config"]   # per op (JAX only) or process-wide config

`shapes = [[M, K, N], ...]` lists fixed shapes instead of `shape` + `sweep`.
`expect = "nonfinite"` declares that the entry plants an overflow on purpose: its records pass
when diag reports the NaN/Inf and fail when it does not (`diag.plan.probe.expected_outcome`).

Each case's peak host memory is estimated (`Probe.host_bytes`) and a case above the limit is
refused here, naming the figure, instead of dying in numpy mid-run: the limit is half of this
machine's physical memory (the host's inputs and ground truth share the machine with a CPU
worker's own copies of the same arrays and the OS), 8 GiB where that is unknown, or what
`max_memory` (`diag run --max-memory GIB`) says.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from diag.errors import SuiteError
from diag.plan.cases import Case, Suite
from diag.plan.probe import EXPECTATIONS
from diag.plan.registry import PROBES, SUITE_DIR

__all__ = [
    "Case",
    "Suite",
    "load_suite",
    "suite_names",
    "check_memory",
    "memory_limit",
    "SUITE_DIR",
]

GIB = 2**30
FALLBACK_MEMORY_LIMIT = 8 * GIB  # where the physical memory cannot be read


# Fields every entry may have; each probe adds its own grid parameters (`Probe.params`).
_ENTRY_FIELDS = {
    "name",
    "op",
    "description",
    "inputs",
    "dtypes",
    "shape",
    "shapes",
    "sweep",
    "expect",
}


def suite_names() -> list[str]:
    """Names of the suites shipped with diag."""
    return sorted(p.stem for p in SUITE_DIR.glob("*.toml"))


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise SuiteError(str(p), "path", "an existing suite file (.toml)")
        return p
    shipped = SUITE_DIR / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise SuiteError(
            name_or_path,
            "suite",
            f"a suite name ({', '.join(suite_names())}) or a path to a .toml file",
        )
    return shipped


def _expect(path: Path, where: str, value: Any, typ, what: str) -> Any:
    # bool is an int in Python; a suite saying `k = true` is a mistake, not a 1.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        got = type(value).__name__
        raise SuiteError(str(path), where, f"expected {what}, got {got} {value!r}")
    return value


def _str_list(path: Path, where: str, value: Any, allowed=None) -> list[str]:
    _expect(path, where, value, list, "a list of strings")
    if not value:
        raise SuiteError(str(path), where, "expected a non-empty list")
    for i, v in enumerate(value):
        _expect(path, f"{where}[{i}]", v, str, "a string")
        if allowed is not None and v not in allowed:
            raise SuiteError(
                str(path), f"{where}[{i}]", f"expected one of {', '.join(allowed)}, got {v!r}"
            )
    return value


def _shape_dims(
    path: Path, where: str, shape: Any, sweep: dict | None, dims: tuple[str, ...]
) -> list:
    """Check a shape of the probe's dims; with `sweep` a string may name a swept param."""
    names = "[" + ", ".join(d.upper() if len(d) == 1 else d for d in dims) + "]"
    _expect(path, where, shape, list, f"a list {names}")
    if len(shape) != len(dims):
        raise SuiteError(
            str(path), where, f"expected {len(dims)} dimensions {names}, got {len(shape)}"
        )
    for i, dim in enumerate(shape):
        if isinstance(dim, str) and sweep is not None:
            if dim not in sweep:
                raise SuiteError(
                    str(path),
                    f"{where}[{i}]",
                    f"'{dim}' is not a swept parameter (sweep has: "
                    f"{', '.join(sweep) or 'nothing'})",
                )
        else:
            _expect(
                path,
                f"{where}[{i}]",
                dim,
                int,
                "a positive integer or a sweep name" if sweep is not None else "a positive integer",
            )
            if dim < 1:
                raise SuiteError(
                    str(path),
                    f"{where}[{i}]",
                    f"expected >= 1 ({dims[i]} may not be empty), got {dim}",
                )
    return shape


def _grid_values(path: Path, where: str, value: Any, typ, allowed) -> list:
    """One value or a list of values of a grid parameter, type- and range-checked."""
    values = list(value) if isinstance(value, list) else [value]  # never the probe's default
    if not values:
        raise SuiteError(str(path), where, "expected a value or a non-empty list")
    what = {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        list: "a list",
    }[typ]
    for j, v in enumerate(values):
        at = f"{where}[{j}]" if isinstance(value, list) else where
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            values[j] = v = float(v)
        _expect(path, at, v, typ, what)
        if allowed is not None and v not in allowed:
            raise SuiteError(
                str(path), at, f"expected one of {', '.join(map(str, allowed))}, got {v!r}"
            )
    return values


def memory_limit(max_memory: float | None = None) -> tuple[int, str]:
    """The host memory a case may need, in bytes, and where the figure comes from.

    Args:
      max_memory: the limit in GiB; None for half of the physical memory.
    """
    if max_memory is not None:
        return int(max_memory * GIB), "--max-memory"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_MEMORY_LIMIT, "the default when physical memory is unknown"
    return total // 2, f"half of this machine's {total / GIB:.1f} GiB"


def _gib(n: float) -> str:
    gib = n / GIB
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib:.2g} GiB"


def check_memory(suite: Suite, max_memory: float | None = None) -> None:
    """Refuse a suite with a case whose estimated host memory is above the limit.

    Args:
      suite: a loaded suite.
      max_memory: the limit in GiB; None for half of the physical memory.

    Raises:
      SuiteError: naming the case, its estimate and the limit, and how to raise it.
    """
    limit, source = memory_limit(max_memory)
    for case in suite.cases:
        if case.host_bytes > limit:
            raise SuiteError(
                suite.path,
                f"{case.where}.shape" if case.where else "shape",
                f"case '{case.label}' needs about {_gib(case.host_bytes)} of host "
                f"memory (inputs, ground truth, verdict), more than the limit of "
                f"{_gib(limit)} ({source}); use smaller shapes, "
                f"or raise the limit with --max-memory GIB (library: max_memory=)",
            )


def load_suite(
    name_or_path: str,
    max_memory: float | None = None,
    timeout: float | None = None,
    announce: Callable[[list[str]], None] | None = None,
) -> Suite:
    """Load a shipped suite by name, or a suite file by path, and expand it into cases.

    Args:
      name_or_path: a shipped suite name or a path to a .toml file.
      max_memory: host memory one case may need, in GiB (None: half of physical memory).
      timeout: seconds an entry naming a user's function may take to load and to be
        evaluated in float64 on the host (`diag.plan.suite_fn`); None: no limit.
      announce: called, before any of it is imported, with the code the suite's entries
        load (`diag.plan.suite_fn.code_named`), when they name any.

    Raises:
      SuiteError: unknown suite, unreadable or malformed TOML, a field of the wrong type
        or value, or a case needing more host memory than the limit; the message names the
        file, the field and what was expected.
    """
    path = _resolve(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(str(path), "toml", f"valid TOML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SuiteError(str(path), "file", f"a readable UTF-8 file ({e})") from None

    head = _expect(path, "suite", data.get("suite", {}), dict, "a [suite] table")
    name = _expect(path, "suite.name", head.get("name", path.stem), str, "a string")
    description = _expect(path, "suite.description", head.get("description", ""), str, "a string")
    seed = _expect(path, "suite.seed", head.get("seed", 0), int, "an integer")
    unknown = set(data) - {"suite", "probe"}
    if unknown:
        raise SuiteError(str(path), sorted(unknown)[0], "only [suite] and [[probe]] tables")
    entries = _expect(path, "probe", data.get("probe"), list, "one or more [[probe]] tables")
    if not entries:
        raise SuiteError(str(path), "probe", "one or more [[probe]] tables")
    if announce is not None and any(isinstance(e, dict) and "fn" in e for e in entries):
        from diag.plan.suite_fn import check_entries, code_named

        check_entries(path, entries, seed)  # a bad field is one line, before any code is named
        announce(code_named(path, entries))

    cases: list[Case] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        cases.extend(_expand(path, f"probe[{i}]", entry, seed, seen, len(cases), timeout))
    suite = Suite(name=name, path=str(path), description=description, seed=seed, cases=tuple(cases))
    check_memory(suite, max_memory)
    return suite


def _expand(
    path: Path,
    where: str,
    entry: Any,
    seed: int,
    seen: set,
    start: int,
    timeout: float | None = None,
) -> list[Case]:
    _expect(path, where, entry, dict, "a table")
    if "name" not in entry:
        raise SuiteError(str(path), f"{where}.name", "a probe name (string)")
    pname = _expect(path, f"{where}.name", entry["name"], str, "a string")
    if pname in seen:
        raise SuiteError(str(path), f"{where}.name", f"a unique name; '{pname}' is repeated")
    seen.add(pname)
    if "fn" in entry:
        from diag.plan.suite_fn import function_entry

        return [function_entry(path, where, entry, pname, seed, start, timeout)]
    op = _expect(path, f"{where}.op", entry.get("op"), str, "an op name (or fn, a function)")
    if op not in PROBES:
        raise SuiteError(str(path), f"{where}.op", f"one of {', '.join(PROBES)}, got {op!r}")
    probe = PROBES[op]
    if probe.user_function:
        raise SuiteError(str(path), f"{where}.fn", "FILE.py:FUNCTION or package.module:function")
    known = _ENTRY_FIELDS | set(probe.params)
    unknown = set(entry) - known
    if unknown:
        raise SuiteError(
            str(path),
            f"{where}.{sorted(unknown)[0]}",
            f"a known field for op '{op}' ({', '.join(sorted(known))})",
        )
    inputs = _grid_values(path, f"{where}.inputs", entry.get("inputs", "normal"), str, probe.inputs)
    dtypes = _str_list(path, f"{where}.dtypes", entry.get("dtypes"), probe.dtypes)
    expect = entry.get("expect")
    if expect is not None:
        _expect(path, f"{where}.expect", expect, str, "a string")
        if expect not in EXPECTATIONS:
            raise SuiteError(
                str(path),
                f"{where}.expect",
                f"expected one of {', '.join(EXPECTATIONS)}, got {expect!r}",
            )
    grid = {
        name: _grid_values(path, f"{where}.{name}", entry.get(name, default), typ, allowed)
        for name, (typ, allowed, default) in probe.params.items()
    }
    shapes = _entry_shapes(path, where, entry, probe)
    return _entry_cases(
        path, where, probe, pname, shapes, inputs, dtypes, grid, seed, expect, start
    )


def _entry_shapes(path: Path, where: str, entry: dict, probe) -> list[tuple[list, dict]]:
    """The entry's shapes (`shape` with its `sweep`, or `shapes`), each with the swept
    parameter's value."""
    sweep = _expect(path, f"{where}.sweep", entry.get("sweep", {}), dict, "a table of lists")
    for key, values in sweep.items():
        _expect(path, f"{where}.sweep.{key}", values, list, "a list of positive integers")
        if not values:
            raise SuiteError(str(path), f"{where}.sweep.{key}", "a non-empty list")
        for j, v in enumerate(values):
            _expect(path, f"{where}.sweep.{key}[{j}]", v, int, "a positive integer")
            if v < 1:
                raise SuiteError(str(path), f"{where}.sweep.{key}[{j}]", f"expected >= 1, got {v}")
    if ("shape" in entry) == ("shapes" in entry):
        raise SuiteError(
            str(path), f"{where}.shape", "exactly one of 'shape' (with 'sweep') or 'shapes'"
        )
    if "shape" in entry:
        template = _shape_dims(path, f"{where}.shape", entry["shape"], sweep, probe.dims)
        if len(sweep) > 1:
            raise SuiteError(str(path), f"{where}.sweep", "at most one swept parameter")
        if not sweep:
            return [(template, {})]
        ((key, values),) = sweep.items()
        return [([v if d == key else d for d in template], {"sweep": key, key: v}) for v in values]
    if sweep:
        raise SuiteError(str(path), f"{where}.sweep", "'sweep' only together with 'shape'")
    listed = _expect(path, f"{where}.shapes", entry["shapes"], list, "a list of shapes")
    if not listed:
        raise SuiteError(str(path), f"{where}.shapes", "a non-empty list")
    return [
        (_shape_dims(path, f"{where}.shapes[{j}]", s, None, probe.dims), {})
        for j, s in enumerate(listed)
    ]


def _entry_cases(
    path: Path,
    where: str,
    probe,
    pname: str,
    shapes: list,
    inputs: list,
    dtypes: list,
    grid: dict,
    seed: int,
    expect: str | None,
    start: int,
) -> list[Case]:
    """One case per point of the entry's grid (points that mean the same case merged)."""
    cases: list[Case] = []
    labels: set[str] = set()
    names = list(grid)
    for (dims, sweep_params), maker, dtype, values in itertools.product(
        shapes, inputs, dtypes, itertools.product(*grid.values())
    ):
        params = {
            **dict(zip(probe.dims, dims)),
            "dtype": dtype,
            "inputs": maker,
            **dict(zip(names, values)),
            **sweep_params,
        }
        params = probe.normalize(params)
        problem = probe.validate(params)
        if problem:
            raise SuiteError(str(path), where, problem)
        label = probe.label(params)
        if label in labels:  # grid points that mean the same case (normalize merged them)
            continue
        labels.add(label)
        op_args = {a: params[a] for a in probe.op_args}
        key_data = json.dumps([probe.family, maker, dtype, dims, seed])
        input_key = hashlib.sha256(key_data.encode()).hexdigest()[:16]
        cases.append(
            Case(
                id=f"c{start + len(cases):04d}",
                probe=pname,
                op=probe.op,
                label=label,
                params=params,
                op_args=op_args,
                inputs=maker,
                input_key=input_key,
                seed=int(input_key[:8], 16) ^ seed,
                dtype=dtype,
                expect=expect,
                host_bytes=probe.host_bytes(params),
                where=where,
            )
        )
    return cases
