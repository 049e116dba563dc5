"""The report's charts say what matplotlib placed, in plain text, without typesetting math.

Claims under test: a log-axis tick label reads as the value matplotlib put the tick at
(``2×10⁻³`` for 0.002, in base 10 and base 2, zero and negatives included); the sweep charts
and the training curves draw no mathtext at all (typesetting it took most of a report's
drawing time) yet label their log axes with the decades their data spans.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diag import numerics
from diag.report import charts
from diag.report.training import curves_figure, curves_svg

try:  # tests/ is on sys.path as a rootdir (no __init__.py) ...
    from test_report import sample_records
except ImportError:  # ... or is a package
    from tests.test_report import sample_records

_DIGITS = {c: str(i) for i, c in enumerate("⁰¹²³⁴⁵⁶⁷⁸⁹")}


def _read(label: str) -> float:
    """The number a plain tick label shows: ``−1.5×10⁻⁷`` -> -1.5e-07."""
    m = re.fullmatch(r"(−?)(?:([0-9.]+)×)?(?:(\d+)([⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)|([0-9.]+))", label)
    assert m, f"not a plain number: {label!r}"
    sign, coeff, base, exponent, number = m.groups()
    if number is not None:
        value = float(number)
    else:
        power = int("".join("-" if c == "⁻" else _DIGITS[c] for c in exponent))
        value = float(coeff or 1) * float(base) ** power
    return -value if sign else value


@pytest.mark.parametrize("base, values", [
    (10, [0.0, 1e-12, 1e-3, 2e-3, 0.5, 1.0, 10.0, 3e5, 1.5e-7, -1e-3, -3e5, 1e-300]),
    (2, [1.0, 2.0, 4.0, 1024.0, 0.5, 2.0**-24, 3 * 2.0**10]),
])
def test_log_tick_labels_read_as_the_value_matplotlib_formatted(base, values):
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatterSciNotation

    ax = Figure().subplots()
    ax.set_yscale("symlog", base=base, linthresh=1e-300)
    fmt = LogFormatterSciNotation(base=base, labelOnlyBase=False)
    fmt.set_axis(ax.yaxis)
    for x in values:
        math_label = fmt(x)
        assert math_label.startswith("$"), math_label  # what matplotlib would typeset
        plain = charts._plain_tick(math_label)
        assert "$" not in plain and "\\" not in plain
        assert _read(plain) == pytest.approx(x, rel=1e-9, abs=0), (x, math_label, plain)


def test_labels_of_another_form_are_kept():
    for label in ("", "1024", r"$\mathdefault{2^{1.50}}$", "d=64"):
        assert charts._plain_tick(label) == label


@pytest.fixture()
def no_mathtext(monkeypatch):
    """Make any mathtext typesetting fail the test."""
    from matplotlib import mathtext

    def refuse(self, s, *args, **kwargs):
        raise AssertionError(f"mathtext typeset {s!r}")

    monkeypatch.setattr(mathtext.MathTextParser, "parse", refuse)


def _texts(svg: str) -> list[str]:
    return [re.sub(r"\s+", " ", t).strip()
            for t in re.findall(r"<text[^>]*>(.*?)</text>", svg, re.DOTALL)]


def test_sweep_chart_labels_log_axes_in_plain_text(no_mathtext):
    records = [r.to_json() for r in sample_records()]
    sweep = charts.sweep_groups(records)[0]
    svg = charts.sweep_svg(sweep, "sweep-0")
    texts = _texts(svg)
    assert not any("<tspan" in t or "$" in t for t in texts)
    decades = [_read(t) for t in texts if re.fullmatch(r"−?(?:[0-9.]+×)?10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+", t)]
    # Each panel's largest and smallest positive values sit within a decade of a label.
    for metric, _, _ in charts.PANELS:
        ys = [y for s in sweep.series for y in s.xy(metric)[1] if y > 0]
        for y in (min(ys), max(ys)):
            assert any(y / 10 <= d <= y * 10 for d in decades), (metric, y, decades)
    # The exact-zero points (jax-cpu float32 has 0 ULP) are drawn a decade below the
    # smallest positive value, on a plain log axis whose title says so (a symlog axis put
    # "0" under "10⁻⁶" and the two labels overlapped).
    ulps = [y for s in sweep.series for y in s.xy("max_ulp")[1]]
    assert 0 in ulps
    floor = 10.0 ** (math.floor(math.log10(min(y for y in ulps if y > 0))) - 1)
    assert f"0 drawn at {numerics.fmt(floor)}" in texts
    assert "0" not in texts


def test_zero_floor_is_a_decade_below_the_smallest_positive_value():
    assert charts.zero_floor([0.0, 3e-6, 2.0]) == pytest.approx(1e-7)
    assert charts.zero_floor([0.0, 1.0]) == pytest.approx(0.1)
    assert charts.zero_floor([3e-6, 2.0]) is None      # no zero: nothing to place
    assert charts.zero_floor([0.0, 0.0]) is None       # nothing positive: linear axis
    assert charts.zero_floor([-1.0, 0.0, 1.0]) is None  # signed values keep their scale


def test_training_curves_label_log_axes_in_plain_text(no_mathtext):
    metrics = {"curve": {"loss_err": [0.0, 1e-7, 3e-6, 2e-5],
                         "grad_err": [1e-6, 1e-5, 1e-4, 1e-3],
                         "update_err": [1e-4, 1e-3, 1e-2, 1e-1]}}
    svg = curves_svg([{"label": "jax-cpu vs float64", "metrics": metrics}],
                     {"loss": 1e-5, "grad": 1e-4, "update": 1e-2}, "train-0")
    texts = _texts(svg)
    values = {_read(t) for t in texts if "10" in t and re.fullmatch(r"[0-9⁻⁰¹²³⁴⁵⁶⁷⁸⁹×.−]+", t)}
    # The loss panel's zero is drawn at the 1e-12 floor: its axis spans 1e-12 .. 1e-5.
    for decade in (1e-12, 1e-6, 1e-3, 1e-1):
        assert any(math.isclose(v, decade) for v in values), (decade, sorted(values))
    assert "jax-cpu vs float64" in texts


def _crowded_sweep() -> charts.Sweep:
    """The widest labels a sweep chart writes: 8 long legend entries (two rows), a panel with
    zeros (symlog), one spanning under a decade (minor labels such as 2×10⁻³), one spanning
    twelve decades, and power-of-two swept values up to 2²⁰."""
    records = []
    xs = [2**k for k in range(8, 21, 2)]
    for i in range(8):
        for j, x in enumerate(xs):
            records.append({
                "kind": "probe", "probe": "matmul.a_rather_long_probe_name_for_a_sweep",
                "op": "matmul", "backend": f"torch-cpu-on-a-long-host-name-{i}",
                "dtype": "bfloat16", "params": {"sweep": "d", "d": x, "precision": "highest"},
                "metrics": {"max_ulp": 0.0 if i == 0 else 10.0**(j + i),
                            "max_abs_err": 2e-3 + 3e-4 * j + 1e-5 * i,
                            "bound_ratio": 10.0**(-12 + j + i / 4)}})
    (sweep,) = charts.sweep_groups(records)
    return sweep


def _boxes(fig) -> list[tuple[str, object]]:
    """(group, window extent) of every visible non-empty text of a drawn figure; texts of one
    group (one axis's tick labels) may touch each other, texts of two groups must not."""
    renderer = fig.canvas.get_renderer()  # an Agg canvas: its text metrics are FreeType's
    out = []
    for n, ax in enumerate(fig.axes):
        frame = ax.get_window_extent(renderer)
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            for t in axis.get_ticklabels(which="both"):
                box = t.get_window_extent(renderer)
                # Ticks outside the view limits keep a label that is not drawn.
                inside = (frame.x0 - 1 <= (box.x0 + box.x1) / 2 <= frame.x1 + 1 if name == "x"
                          else frame.y0 - 1 <= (box.y0 + box.y1) / 2 <= frame.y1 + 1)
                if t.get_visible() and t.get_text() and inside:
                    out.append((f"{n}{name}ticks", box))
            out.append((f"{n}{name}label", axis.label.get_window_extent(renderer)))
        out.append((f"{n}title", ax.title.get_window_extent(renderer)))
    for n, t in enumerate(fig.legends[0].get_texts()):
        out.append((f"legend{n}", t.get_window_extent(renderer)))
    out.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    return [(g, b) for g, b in out if b.width > 0]


@pytest.mark.parametrize("make", [
    lambda: charts.sweep_figure(_crowded_sweep()),
    lambda: curves_figure(
        [{"label": f"torch-cpu-on-a-long-host-name-{i}|jax-cpu vs each other",
          "metrics": {"curve": {"loss_err": [0.0, 1e-9 * (i + 1), 3e-3],
                                "grad_err": [2e-3, 3e-3, 4e-3], "update_err": [1e-1, 1e2, 1e4]}}}
         for i in range(6)], {"loss": 1e-5, "grad": 1e-4, "update": 1e-2}),
], ids=["sweep", "training"])
def test_chart_text_stays_inside_the_figure_and_apart(make):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = make()
    charts._plain_log_formatters(fig)  # what figure_svg does before it draws
    FigureCanvasAgg(fig).draw()
    frame = fig.bbox
    boxes = _boxes(fig)
    assert len({g for g, _ in boxes}) > 15
    for group, box in boxes:
        assert (box.x0 >= frame.x0 - 0.5 and box.x1 <= frame.x1 + 0.5
                and box.y0 >= frame.y0 - 0.5 and box.y1 <= frame.y1 + 0.5), (group, box, frame)
    for i, (g1, b1) in enumerate(boxes):
        for g2, b2 in boxes[i + 1:]:
            if g1 != g2:
                assert not b1.overlaps(b2), (g1, b1, g2, b2)
    # Tick labels keep off the neighbouring panel.
    for n, ax in enumerate(fig.axes):
        for group, box in boxes:
            if not group.startswith(str(n)):
                assert not box.overlaps(ax.get_window_extent()), (group, n)


def test_preload_imports_matplotlib_in_a_background_thread():
    # `diag run` calls preload() before its workers start; the import must happen off the
    # main thread (which returns at once) and leave the charts' modules loaded.
    code = ("import sys, threading, diag.report\n"
            "assert 'matplotlib' not in sys.modules\n"
            "diag.report.preload()\n"
            "(t,) = [t for t in threading.enumerate() if t.name == 'diag-report-preload']\n"
            "assert t.daemon\n"
            "t.join(120)\n"
            "print(sorted(m for m in ('matplotlib.figure', 'matplotlib.backends.backend_svg')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "['matplotlib.backends.backend_svg', 'matplotlib.figure']"
