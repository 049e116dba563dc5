"""The report's Settings, Precision fingerprints and Arithmetic features sections, from
run.json alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from diag.records.results import RunMeta
from diag.report.fields import as_mapping

__all__ = ["report_context"]

#: The measured features of a matmul unit, in the order the report's table shows them
#: (`diag.arith.precision.features`; the CI gate compares the same fields, `diag.gate.drift`).
FEATURE_COLUMNS = (
    "product_exact",
    "extra_bits",
    "rounding",
    "block_fma_width",
    "order",
    "subnormals",
)


def _num(v: Any) -> str:
    """A float32 value as the evidence shows it: round-trip exact (9 significant digits)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:.9g}"


def _same(a: Any, b: Any) -> bool:
    """Equal as the features test decides it: bit for bit, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def _evidence(ev: Mapping[str, Any]) -> dict[str, Any]:
    """One crafted input: the products summed (value@k), the output, and the hypotheses
    grouped by what they predicted, the group that matched the output marked."""
    products = " + ".join(
        f"{_num(p[1])}@{p[0]}" if len(p) == 2 else f"{_num(p[1])}*{_num(p[2])}@{p[0]}"
        for p in ev.get("products") or []
        if isinstance(p, list) and p
    )
    groups: dict[str, dict[str, Any]] = {}
    for hyp, value in (ev.get("predicted") or {}).items():
        g = groups.setdefault(
            _num(value),
            {"value": _num(value), "hypotheses": [], "match": _same(value, ev.get("output"))},
        )
        g["hypotheses"].append(str(hyp))
    return {
        "input": str(ev.get("input", "")),
        "products": products,
        "output": _num(ev.get("output")),
        "predicted": list(groups.values()),
    }


def _feature_row(backend: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    details = [
        {
            "name": str(d.get("name", "")),
            "value": str(d.get("value", "")),
            "note": str(d.get("note") or ""),
            "evidence": [_evidence(e) for e in d.get("evidence") or [] if isinstance(e, Mapping)],
        }
        for d in entry.get("details") or []
        if isinstance(d, Mapping)
    ]
    return {
        "backend": backend,
        "precision": str(entry.get("precision", "")),
        "via": str(entry.get("via", "")),
        "dtype": str(entry.get("dtype", "")),
        "cells": [str(entry.get(c, "")) for c in FEATURE_COLUMNS],
        "error": str(entry["error"]) if entry.get("error") else None,
        "seconds": entry.get("seconds"),
        "details": details,
    }


def report_context(meta: RunMeta | Mapping[str, Any]) -> dict[str, Any]:
    """What the report's Settings and Precision fingerprints sections show, from run.json.

    Findings come from `environment.findings` (host side, every run); fingerprints from
    `backends[name]["fingerprints"]` and the matmul unit's arithmetic features (each with its
    evidence) from `backends[name]["features"]` when a worker recorded them.
    """
    run = meta if isinstance(meta, RunMeta) else RunMeta.from_dict(meta)
    env = run.environment
    found = env.get("findings")
    flags = as_mapping(env.get("flags"))
    rows = []
    for name, info in run.backends.items():
        for fp in (info or {}).get("fingerprints") or []:
            if isinstance(fp, Mapping):
                rows.append(
                    {
                        "backend": str(name),
                        "precision": str(fp.get("precision", "")),
                        "via": str(fp.get("via", "")),
                        "label": str(fp.get("label", "")),
                        "input_bits": ", ".join(map(str, fp.get("input_bits") or [])),
                        "accumulator": str(fp.get("accumulator", "")),
                        "evidence": [str(e) for e in fp.get("evidence") or []],
                    }
                )
    feature_rows = [
        _feature_row(str(name), entry)
        for name, info in run.backends.items()
        for entry in (info or {}).get("features") or []
        if isinstance(entry, Mapping)
    ]
    return {
        "settings_recorded": "findings" in env,
        "settings_findings": [f for f in found if isinstance(f, Mapping)]
        if isinstance(found, list)
        else [],
        "settings_flags": [
            (var, entry.get("raw"), entry.get("error"))
            for var, entry in flags.items()
            if isinstance(entry, Mapping)
        ],
        "fingerprint_rows": rows,
        "feature_columns": FEATURE_COLUMNS,
        "feature_rows": feature_rows,
    }
