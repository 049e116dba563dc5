"""Cases of a user's function: `diag run FILE.py:FUNCTION` and suite entries naming one.

    [[probe]]
    name = "decoder"
    fn = "models/decoder.py:make"     # relative to the suite file's folder, or the cwd
    # or fn = "mypkg.models:make_decoder"

The function is loaded on the host when the case is made (`diag.userfn.host.prepare`: its
inputs taken, its float64 reference computed), so a function that cannot be loaded, raises,
returns no arrays or hangs past the timeout is a one-line error before any worker starts.
The case's op is the probe table's op that takes a user's function (`Probe.user_function`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from diag.errors import SuiteError
from diag.plan.cases import Case, Suite
from diag.plan.registry import PROBES

__all__ = [
    "check_entries",
    "code_named",
    "function_case",
    "function_entry",
    "function_suite",
    "with_functions",
    "FUNCTION_SUITE",
]

#: The suite name of a run of one function (`diag run FILE.py:FUNCTION`): records' `probe`
#: reads `function.model.py:forward`.
FUNCTION_SUITE = "function"


def _function_op() -> str:
    return next(p.op for p in PROBES.values() if p.user_function)


def absolute(spec: str, base: Path | None = None) -> str:
    """`spec` with its file made absolute (relative to `base`, when the file is there, else
    the cwd), so that workers started elsewhere load the same file; a module spec as it is."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target.endswith(".py") or Path(target).is_absolute():
        return spec
    beside = base / target if base is not None else None
    found = beside if beside is not None and beside.is_file() else Path(target)
    return f"{found.resolve()}:{name}"


def code_named(path: Path, entries: list) -> list[str]:
    """The code a suite's entries load, in the order they load it: `SPEC (probe[i].FIELD)`
    for each `fn` and `reference`, files made absolute as `function_entry` loads them.

    A suite entry naming a function imports its file and runs it on this host while the suite
    loads (to evaluate it in float64): a suite file is code. `diag run` prints this list
    before anything is imported, so a suite someone handed over cannot run code unannounced.
    """
    named = []
    for i, entry in enumerate(entries):
        for field in ("fn", "reference"):
            spec = entry.get(field) if isinstance(entry, dict) else None
            if isinstance(spec, str) and spec:
                named.append(f"{absolute(spec, path.parent)} (probe[{i}].{field})")
    return named


def function_case(
    spec: str,
    *,
    name: str | None = None,
    seed: int = 0,
    start: int = 0,
    where: str = "",
    timeout: float | None = None,
    reference: str = "",
    draw: str = "",
) -> Case:
    """The case of one user's function (judged against the reference function `reference`
    names, ``file.py:ref``, when given; else against itself in float64).

    Raises:
        UserFunctionError: the function could not be loaded, raised, returned no arrays or
            something else, or did not return within `timeout` seconds.
    """
    from diag.userfn.host import prepare

    spec = absolute(spec)
    reference = absolute(reference) if reference else ""
    prepared = prepare(spec, timeout, reference, draw)
    u = prepared.function
    op = _function_op()
    params = {
        "function": u.name,
        "fn": spec,
        "framework": u.framework,
        "source_hash": u.source_hash,
        "reference": reference,
        "draw": draw,
        "dtype": prepared.dtype,
        "inputs": "function",
        "input_bytes": sum(int(a.nbytes) for _, a in prepared.inputs),
    }
    key = hashlib.sha256(
        json.dumps([op, spec, u.source_hash, reference, draw]).encode()
    ).hexdigest()[:16]
    return Case(
        id=f"c{start:04d}",
        probe=name or u.name,
        op=op,
        label=u.name,
        params=params,
        op_args={"fn": spec, **({"draw": draw} if draw else {})},
        inputs="function",
        input_key=key,
        seed=int(key[:8], 16) ^ seed,
        dtype=prepared.dtype,
        host_bytes=PROBES[op].host_bytes(params),
        where=where,
    )


def function_suite(spec: str, timeout: float | None = None, reference: str = "") -> Suite:
    """A suite of one user's function (`diag run FILE.py:FUNCTION [--reference FILE.py:REF]`).

    Raises:
        UserFunctionError: as `function_case`.
    """
    case = function_case(spec, timeout=timeout, reference=reference)
    return Suite(
        name=FUNCTION_SUITE,
        path=case.params["fn"],
        description=f"the user's function {case.label}",
        seed=0,
        cases=(case,),
    )


_FN_FIELDS = {"name", "fn", "description", "reference", "inputs", "shape", "dtype", "seed"}


def _draw(path: Path, where: str, entry: dict, seed: int) -> str:
    """The entry's draw (`diag.userfn.drawn`), or "" when it names no ``inputs``.

    Raises:
        SuiteError: a bad maker, shape or dtype, or shape, dtype or seed without inputs.
    """
    from diag.userfn import UserFunctionError
    from diag.userfn.drawn import draw_spec

    if "inputs" not in entry:
        extra = sorted({"shape", "dtype", "seed"} & set(entry))
        if extra:
            raise SuiteError(str(path), f"{where}.{extra[0]}", "only with inputs = MAKER")
        return ""
    try:
        return draw_spec(
            entry["inputs"],
            entry.get("shape", []),
            entry.get("dtype", "float32"),
            entry.get("seed", seed),
        )
    except UserFunctionError as e:
        field, _, why = str(e).removeprefix("diag: ").partition(": ")
        raise SuiteError(str(path), f"{where}.{field}", why) from None


def _checked(path: Path, where: str, entry: dict, seed: int) -> tuple[str, str, str]:
    """(fn, reference, draw) of an entry naming a function, every field checked without
    importing anything.

    Raises:
        SuiteError: another field than name, fn and description; `fn` not a string; a bad
            reference, maker, shape or dtype.
    """
    unknown = set(entry) - _FN_FIELDS
    if unknown:
        raise SuiteError(
            str(path),
            f"{where}.{sorted(unknown)[0]}",
            f"only {', '.join(sorted(_FN_FIELDS))} in an entry naming a function",
        )
    ref = entry.get("reference", "")
    if not isinstance(ref, str) or (ref and ":" not in ref):
        raise SuiteError(str(path), f"{where}.reference", f"FILE.py:FUNCTION, got {ref!r}")
    spec = entry["fn"]
    if not isinstance(spec, str):
        raise SuiteError(
            str(path), f"{where}.fn", f"FILE.py:FUNCTION or package.module:function, got {spec!r}"
        )
    return spec, ref, _draw(path, where, entry, seed)


def check_entries(path: Path, entries: list, seed: int) -> None:
    """Check every field of the entries naming a function before any of their code is named
    or imported: a bad suite file is one `diag:` line, not a list of code it never loads.

    Raises:
        SuiteError: as `function_entry` would, for the first bad entry.
    """
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and "fn" in entry:
            _checked(path, f"probe[{i}]", entry, seed)


def function_entry(
    path: Path,
    where: str,
    entry: dict,
    pname: str,
    seed: int,
    start: int,
    timeout: float | None,
) -> Case:
    """The case of a suite entry naming a user's function (`fn = ...`).

    Raises:
        SuiteError: another field than name, fn and description; `fn` not a string; the
            function could not be prepared (the message says why).
    """
    from diag.userfn import UserFunctionError

    spec, ref, draw = _checked(path, where, entry, seed)
    try:
        return function_case(
            absolute(spec, path.parent),
            name=pname,
            seed=seed,
            start=start,
            where=where,
            timeout=timeout,
            reference=absolute(ref, path.parent) if ref else "",
            draw=draw,
        )
    except UserFunctionError as e:
        raise SuiteError(str(path), f"{where}.fn", str(e).removeprefix("diag: ")) from None


def with_functions(
    suite: Suite,
    specs: list[str],
    timeout: float | None = None,
    references: list[str] | None = None,
) -> Suite:
    """`suite` with a case per user's function appended (`diag preflight --probe`), each
    judged against the reference function of the same place in `references` (``--reference``)
    when given, else against itself in float64.

    Raises:
        UserFunctionError: as `function_case`.
    """
    refs = list(references or [""] * len(specs))
    cases = list(suite.cases)
    for spec, ref in zip(specs, refs):
        cases.append(function_case(spec, start=len(cases), timeout=timeout, reference=ref))
    return Suite(suite.name, suite.path, suite.description, suite.seed, tuple(cases))
