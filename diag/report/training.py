"""The report's training-run section: divergence curves over steps, worst tensors, first
divergence and first NaN/Inf, per case of the `train` probe.

"The port scores differently" is a question about time: whether two runs part at step 0 (a
bug: they compute different functions) or slowly (drift). A table of worst values cannot show
that; one curve per backend (and per pair of backends) of the loss error, the worst gradient
error and the worst update error against the step can, with the tolerance drawn in. Reads
records only (their `metrics`: `diag.train.compare.summarize`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from diag.report.charts import figure_svg, panels, title_and_legend, to_float
from diag.report.fields import mapping_or_none
from diag.status import severity

__all__ = ["train_context", "curves_figure", "curves_svg"]

# Panels: (curve key, title, tolerance key in `allowed`).
PANELS = (
    ("loss_err", "loss: relative error", "loss"),
    ("grad_err", "worst gradient tensor: relative error", "grad"),
    ("update_err", "worst parameter update: relative error", "update"),
)
# Exact agreement (error 0) cannot sit on a log axis: drawn at this floor, said in the title.
_FLOOR = 1e-12


def _curve(metrics: Mapping[str, Any], key: str) -> list[float]:
    values = (metrics.get("curve") or {}).get(key) or []
    out = []
    for v in values:
        f = to_float(v)
        out.append(max(f, _FLOOR) if f is not None and f == f else float("nan"))
    return out


def curves_svg(series: list[dict], allowed: Mapping[str, Any], fig_id: str) -> str:
    """One figure as inline SVG: a panel per `PANELS` entry, a line per series (`label`,
    `metrics`), the tolerances of `allowed` drawn in."""
    return figure_svg(curves_figure(series, allowed), fig_id)


def curves_figure(series: list[dict], allowed: Mapping[str, Any]) -> Any:
    """The matplotlib figure `curves_svg` writes."""
    import matplotlib

    fig, axes = panels(len(PANELS), 2.6, [s["label"] for s in series])
    colors = matplotlib.color_sequences["tab10"]
    handles = []
    for ax, (key, title, tol_key) in zip(axes, PANELS):
        for i, s in enumerate(series):
            ys = _curve(s["metrics"], key)
            (line,) = ax.plot(
                range(len(ys)),
                ys,
                color=colors[i % len(colors)],
                marker="o" if i % 2 == 0 else "s",
                markersize=3,
                linestyle="-" if i % 2 == 0 else "--",
                linewidth=1.3,
            )
            if ax is axes[0]:
                handles.append(line)
        tol = to_float((allowed or {}).get(tol_key))
        if tol:
            ax.axhline(tol, color="#c0392b", linewidth=0.9, linestyle=":")
        ax.set_yscale("log")
        # y given: the title sits above the frame; left to matplotlib, placing it measures
        # every tick label once more per draw (no ticks are on top here).
        ax.set_title(title, fontsize=10, y=1.0)
        ax.set_xlabel("step")
        ax.grid(True, linewidth=0.5, alpha=0.5)
    title_and_legend(
        fig,
        "divergence over steps (dotted: the tolerance; 0 drawn at 1e-12)",
        handles,
        [s["label"] for s in series],
    )
    return fig


def train_context(
    records: Iterable[Mapping[str, Any]], sections: Mapping[str, str]
) -> dict[str, Any] | None:
    """Per `train` case: the curves (SVG), and per backend and pair its verdict, first
    divergence, first NaN/Inf and worst tensors; None when the run has no such records.

    Args:
      records: the run's records.
      sections: run.json's `report_sections` (op -> section): records of ops whose section
        is `training` are shown.
    """
    cases: dict[str, dict[str, Any]] = {}
    for r in records:
        if sections.get(str(r.get("op"))) != "training" or r.get("kind", "probe") not in (
            "probe",
            "agreement",
        ):
            continue
        m = r.get("metrics")
        if not isinstance(m, Mapping) or "curve" not in m:
            continue
        case = cases.setdefault(
            str(r.get("case")),
            {"case": r.get("case"), "rows": [], "allowed": m.get("allowed") or {}},
        )
        fd = mapping_or_none(m.get("first_divergence"))
        nf = mapping_or_none(m.get("nonfinite"))
        against = "float64" if r.get("kind", "probe") == "probe" else "each other"
        case["rows"].append(
            {
                "status": r.get("status"),
                "backend": r.get("backend"),
                "kind": r.get("kind", "probe"),
                "reason": r.get("reason"),
                "metrics": m,
                "label": f"{r.get('backend')} vs {against}",
                "first_divergence": fd,
                "nonfinite": nf,
                "worst": [w for w in (m.get("worst") or []) if isinstance(w, Mapping)][:5],
            }
        )
    if not cases:
        return None
    out = []
    for n, c in enumerate(cases.values()):
        probe_rows = [row for row in c["rows"] if row["kind"] == "probe"]
        c["svg"] = curves_svg(
            c["rows"],
            (probe_rows[0]["metrics"].get("allowed") if probe_rows else c["allowed"]),
            f"train-{n}",
        )
        c["rows"].sort(key=lambda row: -severity(str(row["status"])))
        c["status"] = c["rows"][0]["status"]
        out.append(c)
    return {"cases": out}
