"""The report and the drift view read at a glance, in a real browser, on a laptop and a wide
screen.

At 1000, 1400 and 1920 px wide: no horizontal page overflow (the document's scrollWidth is
its clientWidth), the verdict table's reason column at least 30 characters wide (its width
over the width of "0" in its own font, measured by the browser), the matrix present with one
cell per (probe, dtype, setting, backend) that ran and each cell's records reachable with a
click, the page height bounded with evidence collapsed, no console error. The expected cells
are computed here from results.jsonl.

The fast tests use a synthetic run folder and drift view; real runs (matmul, sampling, ci and
its drift view) are `slow`: each is generated once per session with one backend (ci: two) and
the smallest shipped suite that shows the feature. The traced run is checked in test_trace_report_browser.py with
`check_layout` from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

try:
    from test_report import make_run
except ImportError:
    from tests.test_report import make_run

from conftest import HAS_CHROMIUM, HAS_JAX, HAS_TORCH, NO_CHROMIUM, headless_chromium, run_diag
from diag.report import write_report
from diag.report.matrix import row_key
from diag.records.results import RunDir

if not HAS_CHROMIUM:
    pytest.skip(NO_CHROMIUM, allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium")
from selenium.webdriver.common.by import By  # noqa: E402

WIDTHS = (1000, 1400, 1920)
#: Height of a report with everything collapsed (evidence by default, probe groups with one
#: click): the matmul report was 64,053 px with its evidence open as raw nested tables.
MAX_HEIGHT = 15000

MEASURE = """
const d = document.documentElement;
const rc = document.querySelector('#verdict-table tr[data-i]:not([hidden]) td.reason');
let chars = null;
if (rc) {
  const c = document.createElement('canvas').getContext('2d');
  c.font = getComputedStyle(rc).font;
  chars = rc.getBoundingClientRect().width / c.measureText('0').width;
}
return {scroll: d.scrollWidth, client: d.clientWidth, height: d.scrollHeight, chars: chars};
"""


def expected_cells(run_dir: Path) -> set[tuple]:
    """(probe, dtype, setting, backend) of every probe record of a backend that ran (one
    whose every record is a skip has no column): the matrix's cells."""
    probes = [r for r in RunDir(run_dir).records() if r.get("kind", "probe") == "probe"]
    ran = {r["backend"] for r in probes if r["status"] != "skip"}
    return {(*row_key(r), r["backend"]) for r in probes if r["backend"] in ran}


def check_layout(driver, report: Path, cells: set[tuple], shots: Path | None = None) -> dict:
    """Open `report` at each width and check what the module docstring claims; returns the
    measures per width (for the record)."""
    driver.get(report.resolve().as_uri())
    out = {}
    shots = shots or (Path(os.environ["DIAG_REPORT_SHOTS"]) if os.environ.get(
        "DIAG_REPORT_SHOTS") else None)
    for width in WIDTHS:
        driver.set_window_size(width, 1000)
        m = driver.execute_script(MEASURE)
        out[width] = m
        assert m["scroll"] <= m["client"], (width, m)
        if m["chars"] is not None:
            assert m["chars"] >= 30, (width, m)
        if shots is not None:
            driver.save_screenshot(str(shots / f"{report.parent.name}-{width}.png"))
    # Everything collapsed (evidence is, by default; the probes with one click): bounded.
    toggle = driver.find_elements(By.ID, "groups-toggle")
    if toggle:
        toggle[0].click()
    for width in WIDTHS:
        driver.set_window_size(width, 1000)
        m = driver.execute_script(MEASURE)
        out[width]["collapsed_height"] = m["height"]
        assert m["height"] <= MAX_HEIGHT, (width, m)
        assert m["scroll"] <= m["client"], (width, m)
    if toggle:
        toggle[0].click()
    print(report.parent.name, json.dumps(out))
    shown = driver.find_elements(By.CSS_SELECTOR, "#matrix a[data-cell]")
    assert len(shown) == len(cells)
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return out


def click_cell_shows_its_records(driver, run_dir: Path) -> None:
    """The first matrix cell, clicked, leaves exactly its records visible in the table."""
    link = driver.find_element(By.CSS_SELECTOR, "#matrix a[data-cell]")
    cell = link.get_attribute("data-cell")
    link.click()
    visible = driver.execute_script(
        "return Array.from(document.querySelectorAll('#verdict-table tr[data-i]'))"
        ".filter(r => r.offsetParent !== null).map(r => +r.dataset.i);")
    records = RunDir(run_dir).records()
    keys = {(*row_key(records[i]), records[i]["backend"]) for i in visible}
    assert len(keys) == 1
    (key,) = keys
    assert sorted(visible) == [i for i, r in enumerate(records)
                               if r.get("kind", "probe") == "probe"
                               and (*row_key(r), r["backend"]) == key]
    assert driver.find_element(By.ID, "cell-filter").is_displayed()
    assert cell


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    drv = headless_chromium(tmp_path_factory.mktemp("chromium-layout"), window="1400,1000")
    yield drv
    drv.quit()


def test_synthetic_report_fits_every_width_and_its_matrix_links_records(driver, tmp_path):
    run = make_run(tmp_path)
    report = write_report(run.path)
    check_layout(driver, report, expected_cells(run.path))
    click_cell_shows_its_records(driver, run.path)
    # Collapsing a probe hides its records; the group header stays.
    toggle = driver.find_element(By.CSS_SELECTOR, "#verdict-table tbody.group button.group-toggle")
    driver.find_element(By.ID, "cell-filter-clear").click()
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "false"
    group = toggle.find_element(By.XPATH, "ancestor::tbody")
    assert not any(r.is_displayed() for r in group.find_elements(By.CSS_SELECTOR, "tr[data-i]"))


def test_synthetic_drift_view_fits_every_width_with_causes_folded(driver, tmp_path):
    from diag.gate.drift import Check, Drift
    from diag.report import write_drift_view

    flags = "--xla_allow_excess_precision=false " * 8  # a long value must wrap, not overflow
    drifts = [Drift(f"setting {n} XLA_FLAGS", "value", "", flags, "a numerics setting changed")
              for n in ("env", "jax-cpu", "torch-cpu")]
    drifts += [Drift("fingerprint torch-cpu precision=default via=none", "label", "F32_F32_F32",
                     "BF16_BF16_F32", "the matmul arithmetic at this setting changed")]
    drifts += [Drift(f"mm | d={d} | torch-cpu", "bound_ratio", 0.5, 3.0, "crossed")
               for d in range(12)]
    result = Check(drifts=drifts, known_failures=["k | c | jax-cpu: fail: x"],
                   failures=["k | c | jax-cpu: fail: x", "k2 | c | jax-cpu: fail: y"])
    view = write_drift_view(result.view(), tmp_path / "drift.html")
    driver.get(view.resolve().as_uri())
    causes = driver.find_elements(By.CSS_SELECTOR, "#causes li.cause")
    assert [c.get_attribute("data-where") for c in causes] == [
        "setting env XLA_FLAGS", "fingerprint torch-cpu precision=default via=none"]
    rows = causes[1].find_elements(By.CSS_SELECTOR, "tr.record-drift")
    assert len(rows) == 12 and not any(r.is_displayed() for r in rows)
    causes[1].find_element(By.TAG_NAME, "summary").click()
    assert all(r.is_displayed() for r in rows)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#failures li.known")) == 1
    assert len(driver.find_elements(By.CSS_SELECTOR, "#failures li.new-failure")) == 1
    for width in WIDTHS:
        driver.set_window_size(width, 1000)
        m = driver.execute_script(MEASURE)
        assert m["scroll"] <= m["client"], (width, m)
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# --- real runs, generated once per session -------------------------------------------------


def _run(root: Path, *args: str) -> Path:
    r = run_diag("run", *args, "--json", "-o", str(root), timeout=600)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    return Path(json.loads(r.stdout)["run_dir"])


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """matmul on torch-cpu, sampling on jax-cpu (approx_max_k is JAX's), ci on both."""
    if not (HAS_JAX and HAS_TORCH):
        pytest.skip("needs jax and torch")
    root = tmp_path_factory.mktemp("glance-runs")
    return {"matmul": _run(root / "matmul", "--suite", "matmul", "-b", "torch-cpu"),
            "sampling": _run(root / "sampling", "--suite", "sampling", "-b", "jax-cpu"),
            "ci": _run(root / "ci", "--suite", "ci", "-b", "jax-cpu,torch-cpu")}


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["matmul", "sampling", "ci"])
def test_real_report_fits_every_width(driver, real_runs, suite):
    run_dir = real_runs[suite]
    check_layout(driver, run_dir / "report.html", expected_cells(run_dir))
    click_cell_shows_its_records(driver, run_dir)
    # Evidence starts collapsed.
    for sec in ("fingerprints", "features", "environment"):
        for d in driver.find_elements(By.CSS_SELECTOR, f"#{sec} > details"):
            assert d.get_attribute("open") is None, sec


@pytest.mark.slow
def test_drift_view_of_a_changed_setting_says_it_once(driver, real_runs, tmp_path):
    """A baseline of the ci run whose XLA_FLAGS differ (as the env var and in each worker's
    settings) and whose torch-cpu matmul fingerprint differs: `diag check --html` writes a view
    with one cause per change, the fingerprint's records folded under it."""
    run_dir = real_runs["ci"]
    base = tmp_path / "b.json"
    assert run_diag("baseline", str(run_dir), "-o", str(base)).returncode == 0
    data = json.loads(base.read_text())
    settings = data["key"]["settings"]
    flag_keys = [k for k in settings if k.endswith("XLA_FLAGS")]
    assert len(flag_keys) >= 2
    for k in flag_keys:
        settings[k] = "--xla_cpu_enable_fast_math=true"
    fp = data["fingerprints"]["torch-cpu"][0]
    fp["label"] = "BF16_BF16_F32"
    base.write_text(json.dumps(data))
    view = tmp_path / "drift.html"
    r = run_diag("check", str(run_dir), "--baseline", str(base), "--html", str(view))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("diag: drift:")]
    assert len(lines) == 2, r.stdout
    assert sum("XLA_FLAGS" in x for x in lines) == 1
    driver.get(view.resolve().as_uri())
    causes = driver.find_elements(By.CSS_SELECTOR, "#causes li.cause")
    assert [c.get_attribute("data-where") for c in causes] == [
        "setting " + flag_keys[0],
        f"fingerprint torch-cpu precision={fp['precision']} via={fp['via']}"]
    same = causes[0].find_elements(By.CSS_SELECTOR, "li.same")
    assert not any(s.is_displayed() for s in same)  # folded until opened
    causes[0].find_element(By.TAG_NAME, "summary").click()
    assert [s.text.split(":")[0] for s in same] == ["setting " + k for k in flag_keys[1:]]
    for width in WIDTHS:
        driver.set_window_size(width, 1000)
        m = driver.execute_script(MEASURE)
        assert m["scroll"] <= m["client"], (width, m)
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
