"""Report sections for the sampling probes and A/B experiments: the rows a person must see.

The verdict table says *that* a greedy token or a top-k went wrong; these sections show *which
rows* and with what logits (the incident where a sampler dropped its most probable token is
only believable with the logits in front of you), and what an A/B setting changed, down to
the compiled HLO.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from diag.report.fields import as_mapping, mapping_or_none
from diag.status import Status, severity

__all__ = ["sampling_context", "ab_context"]

_ROW_LIMIT = 12


def _section_records(
    records: Iterable[Mapping[str, Any]], sections: Mapping[str, Any], section: str
) -> list[Mapping[str, Any]]:
    """The probe records of the ops whose report section is `section` (run.json's
    `report_sections`, written from the probe table), in record order."""
    return [
        r
        for r in records
        if r.get("kind", "probe") == "probe"
        and sections.get(str(r.get("op"))) == section
        and isinstance(r.get("metrics"), Mapping)
    ]


def sampling_context(
    records: Iterable[Mapping[str, Any]], sections: Mapping[str, str]
) -> dict[str, Any] | None:
    """Greedy-token disagreements and wrong top-k rows, or None when the run has neither.

    Args:
      records: the run's records.
      sections: run.json's `report_sections` (op -> section, from the probe table): which
        ops' records belong to the `greedy` and `top-k` sections.

    Returns:
      {"greedy": [...], "top_k": [...]}: per record, its status, backend, case, reason and
      the example rows the check kept (row, expected and chosen token, top logits).
    """
    records = list(records)
    greedy = [_greedy_row(r) for r in _section_records(records, sections, "greedy")]
    top_k = [
        _top_k_row(r)
        for r in _section_records(records, sections, "top-k")
        if r.get("status") not in (Status.PASS, Status.SKIP) or r["metrics"].get("semantics")
    ]
    if not greedy and not top_k:
        return None
    greedy.sort(key=lambda g: -severity(str(g["status"])))
    top_k.sort(key=lambda t: -severity(str(t["status"])))
    return {"greedy": greedy, "top_k": top_k}


def _greedy_examples(paths: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows a greedy-token check kept, per path: expected and chosen token, why they differ
    and the top logits with their bits."""
    examples = []
    for path, info in paths.items():
        for ex in (info.get("examples") or [])[:_ROW_LIMIT]:
            examples.append(
                {
                    "path": path,
                    "row": ex.get("row"),
                    "expected": ex.get("expected"),
                    "chosen": ex.get("chosen"),
                    "why": (
                        "probabilities round to a tie"
                        if ex.get("rounding_tie")
                        else "tied maximum"
                        if ex.get("tied_max")
                        else "wrong token"
                    ),
                    "top": [
                        {
                            "value": t.get("logit"),
                            "bits": t.get("bits"),
                            "index": t.get("index"),
                        }
                        for t in ex.get("top3") or []
                    ],
                }
            )
    return examples


def _greedy_row(r: Mapping[str, Any]) -> dict[str, Any]:
    """One greedy-token record: per path how many rows disagree, which batch sizes changed rows,
    and its example rows."""
    m = r["metrics"]
    paths = as_mapping(m.get("paths"))
    batch = as_mapping(m.get("batch_dependence"))
    return {
        "status": r.get("status"),
        "backend": r.get("backend"),
        "case": r.get("case"),
        "reason": r.get("reason"),
        "rows": m.get("rows"),
        "tied_rows": m.get("tied_rows"),
        "paths": [
            {
                "path": p,
                "disagree": i.get("disagree", 0),
                "rounding_tie": i.get("rounding_tie", 0),
                "wrong_on_tie": i.get("wrong_on_tie", 0),
            }
            for p, i in paths.items()
        ],
        "batch_dependent": [
            k for k, v in batch.items() if isinstance(v, Mapping) and v.get("rows_differ")
        ],
        "examples": _greedy_examples(paths)[: _ROW_LIMIT * 2],
    }


def _top_k_row(r: Mapping[str, Any]) -> dict[str, Any]:
    """One top-k record: its recall against the target, wrong and invalid rows, semantics."""
    m = r["metrics"]
    return {
        "status": r.get("status"),
        "backend": r.get("backend"),
        "op": r.get("op"),
        "case": r.get("case"),
        "reason": r.get("reason"),
        "min_recall": m.get("recall_min"),
        "mean_recall": m.get("recall_mean"),
        "wrong_rows": m.get("wrong_rows"),
        "invalid_rows": m.get("invalid_rows"),
        "semantics": list(m.get("semantics") or []),
    }


def ab_context(
    records: Iterable[Mapping[str, Any]], ab: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """What an A/B setting changed, per case, with the HLO difference; None without one.

    Args:
      records: the run's records (`ab` records: diag.run.ab).
      ab: run.json's `ab` (the setting), None for a run without one.
    """
    rows = []
    for r in records:
        if r.get("kind") != "ab":
            continue
        m = as_mapping(r.get("metrics"))
        diff = as_mapping(m.get("difference"))
        hlo = mapping_or_none(m.get("hlo_diff"))
        rows.append(
            {
                "status": r.get("status"),
                "backends": r.get("backend"),
                "op": r.get("op"),
                "case": r.get("case"),
                "reason": r.get("reason"),
                "changed": ", ".join(m.get("changed_outputs") or []) or "nothing",
                "mismatched": diff.get("mismatched"),
                "elements": diff.get("elements"),
                "verdicts": " → ".join(map(str, m.get("status") or [])),
                "hlo": hlo,
            }
        )
    if not rows and not ab:
        return None
    rows.sort(key=lambda row: -severity(str(row["status"])))
    return {
        "setting": " ".join((ab or {}).get("B", [])) if isinstance(ab, Mapping) else "",
        "rows": rows,
        "changed": sum(1 for row in rows if row["status"] != Status.PASS),
    }
