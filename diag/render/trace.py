"""`diag trace`: per traced case, its top ops beside its verdict and error figures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from rich.console import JustifyMethod

from diag.render.cells import badge, num


def trace_tables(context: dict[str, Any], top: int = 5) -> list:
    """`diag trace RUN`: per traced case, its top ops beside its verdict and error figures
    (`diag.report.trace.trace_context`), then where each A/B pair's programs first differ."""
    out: list = []
    for c in context["cases"]:
        title = (
            f"{badge(c['status'])} {escape(str(c['op']))} · {escape(str(c['case']))} · "
            f"{escape(str(c['backend']))}"
        )
        figures = [f"bound ratio {num(c['bound_ratio'])}", f"max ULP {num(c['max_ulp'])}"]
        if c["fingerprint"]:
            figures.append(f"fingerprint {escape(c['fingerprint'])}")
        if c["per_call_us"] is not None:
            figures.append(f"{num(c['per_call_us'])} µs per call")
        high = c["highest"]
        if high and high.get("per_call_us") is not None and high.get("ratio") is not None:
            figures.append(_highest_words(high))
        table = Table(title=title, caption=escape("; ".join(figures)), title_justify="left")
        for col, justify in (
            ("op", "left"),
            ("µs per call", "right"),
            ("count", "right"),
            ("dtype", "left"),
            ("shape", "left"),
        ):
            table.add_column(col, justify=cast("JustifyMethod", justify), overflow="fold")
        for o in c["ops"][:top]:
            table.add_row(
                escape(o["name"]),
                num(o["per_call_us"]),
                num(o["count"]),
                escape(o["dtype"]),
                escape(o["shape"]),
            )
        if c["error"]:
            table.add_row(f"[yellow]{escape(str(c['error']))}[/]", "", "", "", "")
        out.append(table)
    for p in context["passes"]:
        where = (
            escape(str(p["error"]))
            if p["error"]
            else f"first differs after pass [bold]{escape(str(p['pass']))}[/]"
            if p["pass"]
            else "per-pass programs identical"
        )
        lines = [
            f"{escape(str(p['pair']))} · {escape(str(p['case']))} · "
            f"{escape(str(p['setting']))}: {where}"
        ]
        lines += [f"  + {escape(line)}" for line in p["added"][:5]]
        lines += [f"  - {escape(line)}" for line in p["removed"][:5]]
        out.append("\n".join(lines))
    return out


def _highest_words(high: dict[str, Any]) -> str:
    """What `highest` costs, with each side's spread of calls: a ratio inside both spreads is
    timing noise and is said to be, not shown as a cost."""
    words = f"at highest {num(high['per_call_us'])} µs ({num(high['ratio'])}x"
    base, cost = high.get("base_range_us"), high.get("range_us")
    if base is None or cost is None:
        return words + ")"
    spread = (
        f"calls {num(base[0])}-{num(base[1])} µs at default, "
        f"{num(cost[0])}-{num(cost[1])} µs at highest"
    )
    verdict = (
        "within the spread: no cost measured" if high.get("within_spread") else "beyond the spread"
    )
    return f"{words}; {spread}: {verdict})"
