"""The report's Settings and Precision fingerprints sections, from run.json alone."""

from __future__ import annotations

from typing import Any, Mapping

from diag.results import RunMeta

__all__ = ["report_context"]


def report_context(meta: RunMeta | Mapping[str, Any]) -> dict[str, Any]:
    """What the report's Settings and Precision fingerprints sections show, from run.json.

    Findings come from `environment.findings` (host side, every run); fingerprints from
    `backends[name]["fingerprints"]` when a worker recorded them.
    """
    run = meta if isinstance(meta, RunMeta) else RunMeta.from_dict(meta)
    env = run.environment
    found = env.get("findings")
    flags = env.get("flags") if isinstance(env.get("flags"), Mapping) else {}
    rows = []
    for name, info in run.backends.items():
        for fp in (info or {}).get("fingerprints") or []:
            if isinstance(fp, Mapping):
                rows.append({"backend": str(name), "precision": str(fp.get("precision", "")),
                             "via": str(fp.get("via", "")), "label": str(fp.get("label", "")),
                             "input_bits": ", ".join(map(str, fp.get("input_bits") or [])),
                             "accumulator": str(fp.get("accumulator", "")),
                             "evidence": [str(e) for e in fp.get("evidence") or []]})
    return {
        "settings_recorded": "findings" in env,
        "settings_findings": [f for f in found if isinstance(f, Mapping)]
        if isinstance(found, list) else [],
        "settings_flags": [(var, entry.get("raw"), entry.get("error"))
                           for var, entry in flags.items() if isinstance(entry, Mapping)],
        "fingerprint_rows": rows,
    }
