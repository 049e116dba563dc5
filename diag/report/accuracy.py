"""The accuracy tables as one self-contained HTML page (`diag accuracy --out DIR`).

Read from the rows' JSON alone (`diag.accuracy.Row.to_json()`), like every page of the
report: a cell opens (an HTML `<details>`, no script) on its histogram of ULP errors and its
ten worst inputs, each with the output and the correctly rounded value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from diag.errors import UsageError
from diag.numerics import fmt

__all__ = ["render_accuracy", "write_accuracy"]

_BAR_PX = 160


def _klass(row: Mapping[str, Any]) -> str:
    if row["nonfinite_wrong"]:
        return "nonfinite"
    if not row["not_correctly_rounded"]:
        return "ok"
    return "faithful" if row["max_ulp"] <= 1.0 else "bad"


def _cell(row: Mapping[str, Any]) -> dict[str, Any]:
    share = 100.0 * row["not_correctly_rounded"] / row["inputs"] if row["inputs"] else 0.0
    top = max((c for _, c in row["histogram"]), default=0) or 1
    return {
        "text": f"{fmt(row['max_ulp'])} / {share:.3g}%",
        "klass": _klass(row),
        "inputs": row["inputs"],
        "wrong": row["not_correctly_rounded"],
        "nonfinite": row["nonfinite_wrong"],
        "flushed": row["flushed"],
        "histogram": [
            {
                "edge": e if e == "inf" else fmt(e),
                "count": c,
                # a bar per bin, logarithmic so that one wrong output among 65,000 shows
                "width": round(_BAR_PX * math.log1p(c) / math.log1p(top)),
            }
            for e, c in row["histogram"]
        ],
        "worst": [
            {
                "input": repr(w["input"]),
                "output": repr(w["output"]),
                "correct": repr(w["correct"]),
                "ulp": fmt(w["ulp"]),
            }
            for w in row.get("worst_inputs") or []
        ],
    }


def _tables(rows: Sequence[Mapping[str, Any]], errors: Mapping[str, str]) -> list[dict]:
    out = []
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = {(r["backend"], r["function"], r["setting"]): r for r in rows if r["dtype"] == dtype}
        lines = []
        for function, setting in dict.fromkeys((f, s) for _, f, s in mine):
            cells: list[dict[str, Any] | None] = []
            for b in backends:
                row = mine.get((b, function, setting))
                key = f"{b} {function}{f' [{setting}]' if setting else ''} {dtype}"
                cells.append(
                    _cell(row) if row else {"error": errors[key]} if key in errors else None
                )
            lines.append(
                {"label": f"{function} [{setting}]" if setting else function, "cells": cells}
            )
        out.append({"dtype": dtype, "backends": backends, "lines": lines})
    return out


def render_accuracy(
    rows: Sequence[Mapping[str, Any]],
    errors: Mapping[str, str] | None = None,
    meta: Mapping[str, str] | None = None,
) -> str:
    """The page's HTML: one table per dtype (backends as columns, functions as rows)."""
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(
            lambda name: resources.files("diag.report").joinpath("templates", name).read_text()
        ),
        autoescape=True,
    )
    page = env.get_template("accuracy.html.j2")
    return page.render(tables=_tables(rows, errors or {}), meta=dict(meta or {}))


def write_accuracy(
    rows: Sequence[Mapping[str, Any]],
    path: Path,
    errors: Mapping[str, str] | None = None,
    meta: Mapping[str, str] | None = None,
) -> Path:
    """Write the page to `path`; UsageError (exit 2) when it cannot be written."""
    try:
        path.write_text(render_accuracy(rows, errors, meta))
    except OSError as e:
        raise UsageError(f"{path}: cannot write the accuracy page ({e.strerror})") from None
    return path
