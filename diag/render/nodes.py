"""`diag nodes`'s tables and closing lines: per device, per host, detection, verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from rich.markup import escape
from rich.table import Table

from diag.numerics import NAN_ULP  # a NaN against a number

if TYPE_CHECKING:
    from rich.console import JustifyMethod

    from diag.nodes import NodeScan


_NODE_STYLE = {"ok": "green", "slow": "yellow", "suspect": "bold red"}


def nodes_tables(nodes: NodeScan) -> list:
    """`diag nodes`: a table per device (verdict and evidence), hosts, detection, notes.

    Args:
      nodes: what `diag.nodes.scan` returned.
    """
    kinds = sorted({str(d["kind"]) for d in nodes.devices})
    table = Table(title=escape(f"diag nodes: {len(nodes.devices)} device(s), {', '.join(kinds)}"))
    for col, justify in (
        ("proc", "right"),
        ("host", "left"),
        ("device", "right"),
        ("verdict", "left"),
        ("wrong", "right"),
        ("NaN+Inf", "right"),
        ("max ULP", "right"),
        ("median", "right"),
        ("x med", "right"),
        ("evidence", "left"),
    ):
        table.add_column(col, justify=cast("JustifyMethod", justify), overflow="fold")
    for d in nodes.devices:
        v = d["verdict"]
        table.add_row(
            str(d["process_index"]),
            escape(str(d["host"])),
            str(d["device_id"]),
            f"[{_NODE_STYLE.get(v, '')}]{v}[/]",
            f"{d['mismatched_calls']}/{d['calls']}",
            str(d["nan_count"] + d["inf_count"]),
            "—"
            if d["max_ulp"] is None
            else ("NaN" if d["max_ulp"] >= NAN_ULP else f"{d['max_ulp']:.3g}"),
            f"{d['time_median_s'] * 1e3:.3g} ms",
            f"{d['time_ratio']:.2f}",
            escape(", ".join(d["kinds"])) or "—",
        )
    tables = [table]
    if len(nodes.hosts) > 1:
        hosts = Table(title="diag nodes: hosts")
        for col in ("process", "host", "devices", "suspects", "slow", "verdict"):
            hosts.add_column(col)
        for h in nodes.hosts:
            v = h["verdict"]
            hosts.add_row(
                str(h["process_index"]),
                escape(str(h["host"])),
                str(h["devices"]),
                str(h["suspects"]),
                str(h["slow"]),
                f"[{_NODE_STYLE.get(v, '')}]{v}[/]",
            )
        tables.append(hosts)
    det = nodes.detection
    detect = Table(
        title=escape(
            f"diag nodes: detection, {det['formula']}, R={det['repeats']}, W={det['workloads']}"
        )
    )
    for col in ("fault rate per call", "P(detect) now", "R for 99%"):
        detect.add_column(col, justify="right")
    for row in det["rows"]:
        detect.add_row(
            f"{row['rate']:g}", f"{100 * row['p_detect']:.4g}%", str(row["repeats_for_99"])
        )
    tables.append(detect)
    return tables


def nodes_summary(nodes: NodeScan, run_dir: Any = None) -> list[str]:
    """The closing lines of `diag nodes`: injections, notes, verdict, where it was written."""
    lines = [
        f"diag: device {d['device_id']} (process {d['process_index']}, {d['host']}): "
        f"{d['verdict']}: {d['reason']}"
        for d in nodes.devices
        if d["verdict"] != "ok"
    ]
    lines += [f"diag: injected {i['text']}" for i in nodes.injections]
    lines += [f"diag: note: {n}" for n in nodes.notes]
    bad = nodes.suspects
    if bad:
        names = ", ".join(
            f"device {s['device_id']} (process {s['process_index']}, {s['host']})" for s in bad
        )
        lines.append(f"diag: {len(bad)} suspect(s): {names}")
    else:
        lines.append(f"diag: all {len(nodes.devices)} device(s) agree")
    if nodes.slow:
        lines.append(
            f"diag: {len(nodes.slow)} slow device(s): "
            + ", ".join(str(s["device_id"]) for s in nodes.slow)
        )
    if run_dir is not None:
        lines.append(f"diag: run folder: {run_dir}")
    return lines
