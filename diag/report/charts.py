"""Sweep charts for the HTML report, as inline SVG drawn by matplotlib.

A sweep (one parameter, e.g. the inner dimension ``d`` of a ``[d,4] x [4,d]`` matmul, varied
over a range) is how framework drift and silent low precision show up: the error of a backend
that accumulates in less precision than it claims grows with ``d``, while a correctly rounded
one stays flat. A table of numbers hides that shape; a log-log line per backend shows it.

The report must open offline and must not run anything a record contains, so the charts are
SVG (no images to fetch), drawn with a bare `matplotlib.figure.Figure` (no pyplot, so the
caller's global backend and figure registry are untouched), with ``svg.fonttype = "none"`` so
labels are ``<text>`` elements that matplotlib's SVG writer escapes. matplotlib is imported
only when a chart is drawn: ``import diag.report`` stays light.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diag import numerics

__all__ = [
    "Series",
    "Sweep",
    "figure_svg",
    "panels",
    "sweep_figure",
    "sweep_groups",
    "sweep_svg",
    "title_and_legend",
    "to_float",
    "zero_floor",
]

# The panels of a sweep figure: (metric key, panel title, a reference line or None).
# ULP and abs error show how error grows; the bound ratio is what decides the verdict:
# above 1, the backend used less precision than it claims.
PANELS = (
    ("max_ulp", "max ULP error", None),
    ("max_abs_err", "max |error|", None),
    ("bound_ratio", "error / bound (>1: less precise than claimed)", 1.0),
)


def to_float(value: Any) -> float | None:
    """A metric as a float, or None when it is missing or not a number.

    Records store NaN/Inf as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such
    numbers), so those strings map back to the floats; bools are not numbers here.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


@dataclass
class Series:
    """One line of a sweep chart: a (backend, dtype, precision) over the swept values.

    Attributes:
      backend: the backend name (``jax-cpu``, ...).
      dtype: the dtype name.
      precision: ``params["precision"]`` of the records, or None.
      points: swept value -> {metric key: value}; the worst value wins when two records of
        the series share a swept value (e.g. two shapes at the same ``d``).
    """

    backend: str
    dtype: str
    precision: str | None
    points: dict[float, dict[str, float]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        parts = [self.backend, self.dtype]
        if self.precision is not None:
            parts.append(f"precision={self.precision}")
        return " ".join(parts)

    def xy(self, metric: str) -> tuple[list[float], list[float]]:
        """Swept values and finite values of `metric`, sorted by swept value."""
        xs, ys = [], []
        for x in sorted(self.points):
            y = self.points[x].get(metric)
            if y is not None and math.isfinite(y):
                xs.append(x)
                ys.append(y)
        return xs, ys


@dataclass
class Sweep:
    """All sweep series of one probe.

    Attributes:
      probe: the probe name.
      op: the op name of its records.
      param: the name of the swept parameter (``params["sweep"]``).
      series: one `Series` per (backend, dtype, precision), in first-seen order.
      omitted: points dropped because a metric was NaN/Inf (they cannot be placed on a
        log axis; the verdict table still shows them).
    """

    probe: str
    op: str
    param: str
    series: list[Series] = field(default_factory=list)
    omitted: int = 0


def sweep_groups(records: Iterable[Mapping[str, Any]]) -> list[Sweep]:
    """Group sweep records by probe, then into series by (backend, dtype, precision).

    A record belongs to a sweep when it is a ``probe`` record whose ``params["sweep"]`` names
    a parameter whose value ``params[name]`` is a finite number, and at least one of the
    charted metrics is a number. Skips and errors carry no metrics and are left out.

    Args:
      records: record dicts as read from ``results.jsonl``.

    Returns:
      One `Sweep` per probe, in the order the probes first appear.
    """
    sweeps: dict[str, Sweep] = {}
    index: dict[tuple[str, str, str, str | None], Series] = {}
    for rec in records:
        if rec.get("kind", "probe") != "probe":
            continue
        params = rec.get("params") or {}
        name = params.get("sweep")
        if not isinstance(name, str):
            continue
        x = to_float(params.get(name))
        if x is None or not math.isfinite(x):
            continue
        metrics = rec.get("metrics") or {}
        values = {key: to_float(metrics.get(key)) for key, _, _ in PANELS}
        if all(v is None for v in values.values()):
            continue
        probe = str(rec.get("probe", ""))
        sweep = sweeps.get(probe)
        if sweep is None:
            sweep = sweeps[probe] = Sweep(probe=probe, op=str(rec.get("op", "")), param=name)
        precision = params.get("precision")
        precision = None if precision is None else str(precision)
        key = (probe, str(rec.get("backend", "")), str(rec.get("dtype", "")), precision)
        series = index.get(key)
        if series is None:
            series = index[key] = Series(backend=key[1], dtype=key[2], precision=precision)
            sweep.series.append(series)
        point = series.points.setdefault(x, {})
        for metric, v in values.items():
            if v is None:
                continue
            if not math.isfinite(v):
                sweep.omitted += 1
            old = point.get(metric)
            # NaN is the worst value a metric can take; keep it so the point is left out.
            if old is None or math.isnan(v) or (not math.isnan(old) and v > old):
                point[metric] = v
    return list(sweeps.values())


def import_matplotlib() -> None:
    """Import the matplotlib modules the charts use (`diag.report.preload` runs this in a
    thread); an import that fails is left for the drawing code to raise."""
    try:
        import matplotlib.backends.backend_svg  # noqa: F401
        import matplotlib.figure  # noqa: F401
        import matplotlib.textpath  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except Exception:  # noqa: BLE001 - raised again, with its traceback, where it is used
        pass


def _mpl_text(text: str) -> str:
    # matplotlib parses text between two `$` as mathtext: a backend or case name with two
    # dollars would be typeset (or raise). Escaped dollars are drawn literally.
    return text.replace("$", r"\$")


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def _plain_tick(label: str) -> str:
    r"""A log-axis tick label as plain text: ``$\mathdefault{2\times10^{-3}}$`` -> ``2×10⁻³``.

    matplotlib's log formatters write mathtext, and typesetting it (a pyparsing grammar run
    per label) took most of the time a report spent drawing its charts; Unicode superscripts
    say the same and are drawn as plain ``<text>``. Labels of another form are kept as they are.
    """
    m = re.fullmatch(
        r"\$\\mathdefault\{(-?)(?:([0-9.]+)\\times)?"
        r"(?:(\d+)\^\{(-?\d+)\}|([0-9.]+))\}\$",
        label,
    )
    if m is None:
        return label
    sign, coeff, base, exponent, number = m.groups()
    text = (
        number
        if number is not None
        else ((f"{coeff}×" if coeff else "") + base + exponent.translate(_SUPERSCRIPT))
    )
    return ("−" if sign else "") + text


def _plain_log_formatters(fig: Any) -> None:
    """Give every log axis of `fig` tick labels in plain text (`_plain_tick`) instead of
    mathtext, with the same choice of which ticks get a label."""
    from matplotlib.ticker import LogFormatterSciNotation

    class PlainLogFormatter(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return _plain_tick(super().__call__(x, pos))

    for axis in (a for ax in fig.axes for a in (ax.xaxis, ax.yaxis)):
        base = getattr(axis.get_transform(), "base", None)
        for fmt, setter in (
            (axis.get_major_formatter(), axis.set_major_formatter),
            (axis.get_minor_formatter(), axis.set_minor_formatter),
        ):
            if type(fmt) is LogFormatterSciNotation and base is not None:
                setter(
                    PlainLogFormatter(
                        base, labelOnlyBase=fmt.labelOnlyBase, minor_thresholds=fmt.minor_thresholds
                    )
                )


def _set_scale(ax, axis: str, values: list[float], base: float = 10) -> None:
    """Log scale where every value is > 0; symlog when zeros are present (0 ULP is the
    common, good case and must stay visible); linear when nothing is positive."""
    positive = [v for v in values if v > 0]
    setter = ax.set_xscale if axis == "x" else ax.set_yscale
    if positive and len(positive) == len(values):
        setter("log", base=base)
    elif positive:
        linthresh = min(positive)
        setter("symlog", linthresh=linthresh, linscale=0.5, base=base)
        if min(values) >= 0:
            # Errors are never negative: show zero just above the bottom edge, not a mirror
            # image of the positive decades.
            # (symlog autoscaling puts the largest value on the frame; pad it by hand.)
            (ax.set_xlim if axis == "x" else ax.set_ylim)(-0.25 * linthresh, 1.5 * max(values))


def zero_floor(values: list[float]) -> float | None:
    """Where a log axis draws an error of exactly 0: a decade below the smallest positive
    value, rounded down to a power of ten (None when no value is 0, or none is positive).

    A symlog axis drew 0 a quarter of a linear decade under its smallest tick, and the two
    labels ("10⁻⁶" and "0") overlapped; a floor on a plain log axis, stated in the panel's
    title, keeps zero visible (0 ULP is the common, good case) with every tick a decade apart.
    """
    positive = [v for v in values if v > 0]
    if not positive or len(positive) == len(values) or min(values) < 0:
        return None
    return 10.0 ** (math.floor(math.log10(min(positive))) - 1)


def _is_power_of_two(x: float) -> bool:
    return x > 0 and float(x).is_integer() and (int(x) & (int(x) - 1)) == 0


# The panel layout, in inches. Fixed margins instead of matplotlib's constrained layout: that
# draws the whole figure once more to measure it, which tripled the time a chart took. The
# margins hold the widest tick label a log axis writes ("2×10⁻¹²") and the axis label; the
# legend's columns and rows, and the room for a last x tick label that sticks out on the
# right, are measured from their text (FreeType metrics, without drawing).
PANEL_WIDTH, LEGEND_COLUMNS, TICK_SIZE, LEGEND_SIZE = 4.4, 4, 10, 8
_LEFT, _GAP, _RIGHT, _TOP, _BELOW_AXES, _LEGEND_ROW = 0.72, 0.72, 0.15, 0.62, 0.55, 0.2


def _text_width(text: str, size: float) -> float:
    """The width in inches matplotlib gives `text` at `size` points in the default font."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    width, _, _ = TextToPath().get_text_width_height_descent(
        text, FontProperties(size=size), ismath=False
    )
    return width / 72


def _legend_columns(labels: list[str], width: float) -> int:
    """As many legend columns (at most `LEGEND_COLUMNS`) as fit the figure's `width`."""
    # A column: the line sample, the gap to its text, the text, the gap to the next column
    # (2 + 0.8 + 2 font sizes: matplotlib's defaults).
    column = max((_text_width(label, LEGEND_SIZE) for label in labels), default=0)
    column += 4.8 * LEGEND_SIZE / 72
    fit = int((width - 0.2) // column) if column else LEGEND_COLUMNS
    return max(1, min(LEGEND_COLUMNS, len(labels), fit))


def panels(
    n_panels: int, axes_height: float, legend_labels: list[str], last_xtick: str = ""
) -> tuple[Any, list[Any]]:
    """A figure with `n_panels` axes side by side, room above them for a title and below
    them for the x axes and a legend of `legend_labels` (`title_and_legend`).

    Args:
      n_panels: how many axes, left to right.
      axes_height: their height in inches.
      legend_labels: the legend's entries, to size its rows.
      last_xtick: the label of the rightmost x tick when the caller sets labels itself (it
        is centred on the right edge of the last panel: half of it needs room there).

    Returns:
      The `matplotlib.figure.Figure` (no pyplot: the caller's backend and figure registry
      are untouched) and its axes, left to right.
    """
    from matplotlib.figure import Figure

    width = PANEL_WIDTH * n_panels
    right = max(_RIGHT, _text_width(last_xtick, TICK_SIZE) / 2 + 0.05)
    rows = max(1, math.ceil(len(legend_labels) / _legend_columns(legend_labels, width)))
    bottom = _BELOW_AXES + rows * _LEGEND_ROW + 0.1
    height = _TOP + axes_height + bottom
    axes_width = (width - _LEFT - right - (n_panels - 1) * _GAP) / n_panels
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=_LEFT / width,
        right=1 - right / width,
        top=1 - _TOP / height,
        bottom=bottom / height,
        wspace=_GAP / axes_width,
    )
    return fig, list(fig.subplots(1, n_panels, squeeze=False)[0])


def title_and_legend(fig: Any, title: str, handles: list[Any], labels: list[str]) -> None:
    """The figure's title on top and one legend for all its panels below them, in the
    columns `panels` made room for."""
    height = fig.get_figheight()
    fig.suptitle(_mpl_text(title), fontsize=11, y=1 - 0.08 / height, va="top")
    # Explicit labels: legend() would silently drop auto-collected labels starting with "_".
    fig.legend(
        handles,
        [_mpl_text(label) for label in labels],
        loc="lower center",
        bbox_to_anchor=(0.5, 0.05 / height),
        borderaxespad=0,
        frameon=False,
        ncol=_legend_columns(labels, fig.get_figwidth()),
        fontsize=LEGEND_SIZE,
    )


def sweep_svg(sweep: Sweep, fig_id: str) -> str:
    """Draw one probe's sweep as an inline-ready SVG string (one panel per metric, shared legend).

    Args:
      sweep: the probe's series, from `sweep_groups`.
      fig_id: a document-unique, id-safe prefix (e.g. ``sweep-0``). Every ``id`` inside the
        SVG is prefixed with it, so several SVGs can live in one HTML page; each drawn line
        gets the id ``{fig_id}-{metric}-s{i}`` for series ``i``.

    Returns:
      ``<svg ...>...</svg>`` without the XML prolog and doctype, sized by its viewBox.
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", fig_id):
        raise ValueError(f"fig_id must be id-safe, got {fig_id!r}")
    return figure_svg(sweep_figure(sweep), fig_id)


def sweep_figure(sweep: Sweep) -> Any:
    """The matplotlib figure `sweep_svg` writes: a panel per `PANELS` metric, a line per series
    (gid ``{metric}-s{i}``), log axes where the values allow."""
    import matplotlib
    from matplotlib.ticker import NullLocator

    colors = matplotlib.color_sequences["tab10"]
    markers = "osD^v<>ph*"
    xs_all = sorted({x for s in sweep.series for x in s.points})
    # Up to 12 swept values are each a labelled tick; more get a log axis's own ticks.
    xticks = [numerics.fmt(x, 6, compact=False) for x in xs_all] if len(xs_all) <= 12 else []
    fig, axes = panels(
        len(PANELS), 2.6, [s.label for s in sweep.series], last_xtick=xticks[-1] if xticks else ""
    )
    handles = []
    for ax, (metric, title, reference) in zip(axes, PANELS):
        ys_all: list[float] = []
        floor = zero_floor(
            [y for s in sweep.series for y in s.xy(metric)[1]]
            + ([reference] if reference is not None else [])
        )
        if floor is not None:  # the y axis's title says where an exact 0 sits
            ax.set_ylabel(f"0 drawn at {numerics.fmt(floor)}", fontsize=8, labelpad=1)
        for i, series in enumerate(sweep.series):
            xs, ys = series.xy(metric)
            if floor is not None:
                ys = [floor if y == 0 else y for y in ys]
            # Backends often agree exactly (CPU results are bit-identical across frameworks):
            # alternate solid/dashed lines and filled/hollow markers so a line drawn on top
            # of another one does not hide it.
            style = dict(
                color=colors[i % len(colors)],
                marker=markers[i % len(markers)],
                linestyle="--" if i % 2 else "-",
                markersize=5 if i % 2 else 4,
                markerfacecolor="none" if i % 2 else colors[i % len(colors)],
                linewidth=1.4,
            )
            (line,) = ax.plot(xs, ys, **style)
            line.set_gid(f"{metric}-s{i}")
            if ax is axes[0]:
                handles.append(line)
            ys_all.extend(ys)
        if reference is not None:
            ax.axhline(reference, color="#c0392b", linewidth=0.9, linestyle=":")
            ys_all.append(reference)
        # y given: the title sits above the frame; left to matplotlib, placing it measures
        # every tick label once more per draw (no ticks are on top here).
        ax.set_title(title, fontsize=10, y=1.0)
        ax.set_xlabel(_mpl_text(sweep.param))
        ax.grid(True, which="major", linewidth=0.5, alpha=0.5)
        if xs_all:
            _set_scale(ax, "x", xs_all, base=2 if all(map(_is_power_of_two, xs_all)) else 10)
            if xticks:
                ax.set_xticks(xs_all, xticks)
                ax.xaxis.set_minor_locator(NullLocator())
        if ys_all:
            _set_scale(ax, "y", ys_all)
        else:
            ax.text(
                0.5,
                0.5,
                "no finite values",
                transform=ax.transAxes,
                ha="center",
                va="center",
                color="#777",
            )
    title_and_legend(fig, f"{sweep.probe}  ({sweep.op})", handles, [s.label for s in sweep.series])
    return fig


def figure_svg(fig: Any, fig_id: str) -> str:
    """A matplotlib figure as SVG markup to inline in the report (text kept as text, log-axis
    tick labels in plain text, ids prefixed with `fig_id`)."""
    import matplotlib

    _plain_log_formatters(fig)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 9}):
        # No metadata: it would carry a creation date and a creator URL into the report.
        fig.savefig(
            buf,
            format="svg",
            metadata={"Date": None, "Creator": None, "Format": None, "Type": None},
        )
    return _inline_svg(buf.getvalue(), fig_id)


def _inline_svg(svg: str, prefix: str) -> str:
    """Make matplotlib's SVG document embeddable: drop the prolog and doctype, prefix every
    id (matplotlib numbers them `figure_1`, `axes_1`, ... in every file), drop the fixed
    width/height so CSS can size it by its viewBox."""
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("matplotlib produced no <svg> element")
    svg = svg[start:]
    # Defence in depth: matplotlib escapes text; an unescaped tag here would be a bug.
    if re.search(r"<\s*(script|foreignObject|iframe)", svg, re.IGNORECASE):
        raise ValueError("refusing to inline an SVG that contains active content")
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}-{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}-{m.group(1)})", svg)
    head_end = svg.index(">")
    head = re.sub(r'\s(width|height)="[^"]*"', "", svg[:head_end])
    return head + ' class="chart" role="img"' + svg[head_end:]
