"""The cells every terminal table shares: a status badge and a number, one formatter each."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from diag import numerics
from diag.status import Status

__all__ = ["STYLE", "badge", "num"]

STYLE: dict[str, str] = {
    Status.PASS: "green",
    Status.WARN: "yellow",
    Status.FAIL: "bold red",
    Status.ERROR: "bold magenta",
    Status.SKIP: "dim",
}


def badge(status: str) -> str:
    return f"[{STYLE.get(status, '')}]{escape(str(status))}[/]"


def num(x: Any) -> str:
    # A bool is a flag, not a measure: shown as missing, as the table always did.
    return "—" if isinstance(x, bool) else numerics.fmt(x, compact=False)
