"""`diag env`'s tables: backends, settings and flags, fingerprints, arithmetic features,
findings."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def env_tables(report: dict[str, Any]) -> list:
    """`diag env`: backends, settings and flags, fingerprints, findings (diag.settings.flags)."""

    def cell(v: Any) -> str:
        return "—" if v is None else escape(str(v))

    backends = Table(title="diag env: backends")
    for col in ("backend", "device", "framework", "settings"):
        backends.add_column(col, overflow="fold")
    fps = Table(title="diag env: matmul fingerprints (measured with crafted inputs)")
    for col in ("backend", "precision", "via", "algorithm", "input bits", "accumulator"):
        fps.add_column(col, overflow="fold")
    for fw, data in report["frameworks"].items():
        if data.get("error"):
            backends.add_row(cell(fw), "—", "—", f"[yellow]{cell(data['error'])}[/]")
        for name, info in data.get("backends", {}).items():
            dev, framework = info.get("device") or {}, info.get("framework") or {}
            backends.add_row(
                cell(name),
                cell(f"{dev.get('kind')} x{dev.get('count')}"),
                cell(f"{framework.get('name')} {framework.get('version')}"),
                cell("\n".join(f"{k}={v}" for k, v in (info.get("settings") or {}).items())),
            )
            for fp in info.get("fingerprints") or []:
                label = fp.get("label", "")
                style = "green" if label == "F32_F32_F32" else "yellow"
                fps.add_row(
                    cell(name),
                    cell(fp.get("precision")),
                    cell(fp.get("via")),
                    f"[{style}]{cell(label)}[/]",
                    cell(", ".join(map(str, fp.get("input_bits") or []))),
                    cell(fp.get("accumulator")),
                )
    settings = Table(title="diag env: environment and flags")
    settings.add_column("setting")
    settings.add_column("value", overflow="fold")
    for k, v in sorted(report.get("env", {}).items()):
        settings.add_row(cell(k), cell(v))
    for var, entry in report.get("flags", {}).items():
        for name, value in entry.get("flags", {}).items():
            settings.add_row(cell(f"{var} --{name}"), cell(value))
    settings.add_row("XLA_FLAGS check", cell(report.get("xla_flags_check")))
    found = Table(
        title=f"diag env: {len(report['findings'])} setting(s) to look at", show_lines=True
    )
    for col in ("severity", "setting", "value", "why", "instead"):
        found.add_column(col, overflow="fold")
    for f in report["findings"]:
        style = "bold red" if f["severity"] == "risk" else "yellow"
        found.add_row(
            f"[{style}]{cell(f['severity'])}[/]",
            cell(f["setting"]),
            cell(f["value"]),
            cell(f["why"]),
            cell(f["instead"]),
        )
    tables = [backends, settings]
    if fps.row_count:
        tables.append(fps)
    feats = _features_table(report, cell)
    if feats.row_count:
        tables.append(feats)
    return tables + ([found] if report["findings"] else [])


def _features_table(report: dict[str, Any], cell) -> Table:
    """`diag env --deep`: each matmul's arithmetic features (diag.arith.features)."""
    cols = ("product_exact", "extra_bits", "rounding", "block_fma_width", "order", "subnormals")
    table = Table(title="diag env --deep: matmul arithmetic features (crafted inputs)")
    # `via` tells apart two rows of one precision set two ways (an argument, a config)
    for col in ("backend", "precision", "via", "inputs", "output") + cols:
        table.add_column(col, overflow="fold")
    for data in report["frameworks"].values():
        for name, info in data.get("backends", {}).items():
            for f in info.get("features") or []:
                vals = [
                    f"[yellow]{cell(f.get(c))}[/]" if f.get(c) == "unknown" else cell(f.get(c))
                    for c in cols
                ]
                if f.get("error"):
                    vals = [f"[red]{cell(f['error'])}[/]"] + [""] * (len(cols) - 1)
                table.add_row(
                    cell(name),
                    cell(f.get("precision")),
                    cell(f.get("via")),
                    cell(f.get("dtype")),
                    cell(f.get("output_dtype")),
                    *vals,
                )
    return table
