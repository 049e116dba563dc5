"""`diag accuracy`: one table per dtype, backends as columns, functions as rows.

A cell is `max_ulp / not-correctly-rounded %`: green when every output is the correctly
rounded value, yellow when every error is within one ulp (faithful), red beyond, magenta
when some output is NaN/Inf where the truth is finite (or the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from diag import numerics

__all__ = ["accuracy_cell", "accuracy_tables"]


def accuracy_cell(row: Mapping[str, Any]) -> str:
    """`max_ulp / %` of one row, coloured by how far from correctly rounded it is."""
    share = 100.0 * row["not_correctly_rounded"] / row["inputs"] if row["inputs"] else 0.0
    text = f"{numerics.fmt(row['max_ulp'])} / {share:.3g}%"
    if row["nonfinite_wrong"]:
        style = "bold magenta"
    elif not row["not_correctly_rounded"]:
        style = "green"
    elif row["max_ulp"] <= 1.0:
        style = "yellow"
    else:
        style = "bold red"
    return f"[{style}]{escape(text)}[/]"


def accuracy_tables(
    rows: Sequence[Mapping[str, Any]], errors: Mapping[str, str] | None = None
) -> list[Table]:
    """One rich table per dtype of `rows` (`diag.accuracy.Row.to_json()`), in their order.

    Args:
      rows: the measured rows.
      errors: row name -> why the call gave no row; shown as `error` in its cell.
    """
    tables = []
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for dtype in dtypes:
        mine = [r for r in rows if r["dtype"] == dtype]
        inputs = sorted({r["inputs"] for r in mine})
        caption = "every finite input in the domain" if dtype != "float32" else "samples"
        table = Table(
            title=f"{dtype}: max ULP / not correctly rounded ({caption}; "
            f"{inputs[0]}-{inputs[-1]} inputs per function)",
            title_justify="left",
        )
        table.add_column("function")
        for b in backends:
            table.add_column(escape(b), justify="right")
        labels = list(dict.fromkeys((r["function"], r["setting"]) for r in mine))
        for function, setting in labels:
            cells = []
            for b in backends:
                hit = [
                    r
                    for r in mine
                    if (r["backend"], r["function"], r["setting"]) == (b, function, setting)
                ]
                if hit:
                    cells.append(accuracy_cell(hit[0]))
                else:
                    key = f"{b} {function}{f' [{setting}]' if setting else ''} {dtype}"
                    cells.append("[bold magenta]error[/]" if key in (errors or {}) else "—")
            label = f"{function} [{setting}]" if setting else function
            table.add_row(escape(label), *cells)
        tables.append(table)
    return tables
