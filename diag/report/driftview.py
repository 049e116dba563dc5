"""The drift view: what `diag check` found, as one self-contained HTML file.

When the CI gate fails, the artifact a person downloads must say what drifted (not only the
job log): each cause once (a setting, a backend's arithmetic, a record), old -> new, with
what it explains folded under it; the key mismatches; the known failures; and, with
`diag check --history`, each drifted record's series over the history's runs. Like the
report it fetches nothing and runs no script (`script-src 'none'`), and every value is data,
autoescaped.

It reads plain data (`diag.gate.drift.Check.view`), so this package still imports only the
records' schema.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from markupsafe import Markup

from diag.errors import UsageError

__all__ = ["render_drift_view", "write_drift_view"]


def render_drift_view(view: Mapping[str, Any], *, run_dir: str = "", baseline: str = "") -> str:
    """The drift view's HTML.

    Args:
      view: `Check.view()`: causes, key mismatches, notes, failures, bits changed, summary.
      run_dir: the run folder checked (shown in the header).
      baseline: the baseline file it was checked against.

    Returns:
      The complete HTML document.
    """
    from diag import __version__
    from diag.report.html import asset, environment
    from diag.report.seriesplot import series_charts

    return (
        environment()
        .get_template("drift.html.j2")
        .render(
            view=view,
            history_series=series_charts(view.get("series") or []),
            run_dir=run_dir,
            baseline=baseline,
            version=__version__,
            style=Markup(asset("report.css")),
            generated=_dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %z"),
        )
    )


def write_drift_view(
    view: Mapping[str, Any], path: str | os.PathLike, *, run_dir: str = "", baseline: str = ""
) -> Path:
    """Write the drift view atomically (temp file + rename) and return its path.

    Raises:
      UsageError: the file cannot be written (one line naming it).
    """
    path = Path(path)
    html = render_drift_view(view, run_dir=run_dir, baseline=baseline)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise UsageError(
            f"cannot write the drift view to '{path}': {e.strerror or e}; pass "
            "--html with a writable path"
        ) from None
    return path
