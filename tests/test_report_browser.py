"""The report works in a real browser, offline: rows render, charts have a size, headers
sort, the filter box and status select hide rows, and the console stays clean (a wrong
script hash in the Content-Security-Policy, a blocked fetch or a script error would each
log a SEVERE entry).

Runs headless Debian chromium through chromedriver; skipped only where they are absent
(CI installs them).
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest

try:  # tests/ is on sys.path as a rootdir (no __init__.py) ...
    from test_report import make_run
except ImportError:  # ... or is a package
    from tests.test_report import make_run

from conftest import HAS_CHROMIUM, NO_CHROMIUM, headless_chromium
from diag.report import write_report

if not HAS_CHROMIUM:
    pytest.skip(NO_CHROMIUM, allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install "
                                "'diag[test]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402


@pytest.fixture(scope="module")
def run_and_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    run = make_run(root)
    return run, write_report(run.path)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    drv = headless_chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield drv
    drv.quit()


@pytest.fixture()
def page(driver, run_and_report):
    run, path = run_and_report
    driver.get(path.resolve().as_uri())
    return driver, run


def _visible_rows(driver, table_id="verdict-table") -> int:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr[data-i]'))"
        ".filter(r => r.offsetParent !== null).length;", f"#{table_id}")


def _column(driver, header: str, table_id="verdict-table") -> int:
    headers = driver.find_elements(By.CSS_SELECTOR, f"#{table_id} thead th")
    return [h.text.strip(" \u2195\u25b2\u25bc") for h in headers].index(header)


def _cell_keys(driver, col: int) -> list[str | None]:
    """data-v of one column, for the visible rows, in displayed order."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#verdict-table tbody tr[data-i]'))"
        ".filter(r => r.offsetParent !== null)"
        ".map(r => r.cells[arguments[0]].getAttribute('data-v'));", col)


def test_all_rows_visible_and_counted(page):
    driver, run = page
    records = run.records()
    n_probe = sum(r["kind"] != "agreement" for r in records)
    assert _visible_rows(driver) == n_probe
    assert _visible_rows(driver, "agreement-table") == 1
    assert driver.find_element(By.ID, "row-count").text == f"showing {n_probe} of {n_probe}"
    assert driver.find_element(By.ID, "verdict").is_displayed()


def test_charts_render_with_size(page):
    driver, _ = page
    svgs = driver.find_elements(By.CSS_SELECTOR, "figure.sweep svg")
    assert len(svgs) == 3
    for svg in svgs:
        size = svg.size
        assert size["width"] > 300 and size["height"] > 100, size
    # The series lines themselves have geometry (not clipped away or empty).
    box = driver.execute_script(
        "const b = document.getElementById('sweep-0-max_abs_err-s3').getBBox();"
        "return [b.width, b.height];")
    assert box[0] > 10 and box[1] > 1


def _group_keys(driver, col: int) -> dict[str, list[str | None]]:
    """data-v of one column per probe group (tbody), in displayed order."""
    return driver.execute_script(
        "const out = {}; document.querySelectorAll('#verdict-table tbody.group').forEach(tb =>"
        " out[tb.dataset.probe] = Array.from(tb.querySelectorAll('tr[data-i]'))"
        ".map(r => r.cells[arguments[0]].getAttribute('data-v'))); return out;", col)


def test_clicking_a_metric_header_sorts_numerically_within_each_probe(page):
    driver, run = page
    col = _column(driver, "max ULP")
    header = driver.find_elements(By.CSS_SELECTOR, "#verdict-table thead th")[col]
    records = [r for r in run.records() if r["kind"] != "agreement"]

    header.click()  # numbers: worst (largest) first
    assert header.get_attribute("aria-sort") == "descending"
    groups = _group_keys(driver, col)
    assert sorted(groups) == sorted({r["probe"] for r in records})
    for probe, keys in groups.items():
        assert len(keys) == sum(r["probe"] == probe for r in records)
        present = [float(k) for k in keys if k]
        assert present == sorted(present, reverse=True), probe
        assert all(not k for k in keys[len(present):])  # missing (error, skip) go last
    # The failing softmax has max_ulp "inf": first in its group.
    (inf_probe,) = {r["probe"] for r in records if r["metrics"].get("max_ulp") == "inf"}
    assert groups[inf_probe][0] == "Infinity"
    assert sum(not k for keys in groups.values() for k in keys) == 2

    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    for probe, keys in _group_keys(driver, col).items():
        present = [float(k) for k in keys if k]
        assert present == sorted(present), probe
        assert all(not k for k in keys[len(present):])
    keys = [k for k in _group_keys(driver, col)[inf_probe] if k]
    assert keys[-1] == "Infinity"


def test_text_sort_is_natural(page):
    driver, _ = page
    col = _column(driver, "case")
    driver.find_elements(By.CSS_SELECTOR, "#verdict-table thead th")[col].click()
    cases = driver.execute_script(
        "return Array.from(document.querySelectorAll('#verdict-table tbody tr[data-i]'))"
        ".map(r => r.cells[arguments[0]].textContent);", col)
    d_cases = [c for c in cases if c.startswith("d=") and c.endswith("precision=default")]
    assert d_cases == ["d=64 precision=default", "d=256 precision=default",
                       "d=1024 precision=default"]


def test_filter_box_and_status_select_hide_rows(page):
    driver, run = page
    records = [r for r in run.records() if r["kind"] != "agreement"]
    box = driver.find_element(By.ID, "filter")
    box.send_keys("bfloat16")
    want = sum("bfloat16" in r["dtype"] or "bfloat16" in r["case"] for r in records)
    assert _visible_rows(driver) == want
    assert driver.find_element(By.ID, "row-count").text == f"showing {want} of {len(records)}"

    box.clear()
    box.send_keys("torch-cpu")
    assert _visible_rows(driver) == sum(r["backend"] == "torch-cpu" for r in records)

    box.clear()
    box.send_keys("x")  # clear() fires no input event; typing and deleting does
    box.send_keys("\b")
    assert _visible_rows(driver) == len(records)

    status = Select(driver.find_element(By.ID, "status-filter"))
    counts = Counter(r["status"] for r in records)
    for value in ("fail", "error", "skip", "pass"):
        status.select_by_value(value)
        assert _visible_rows(driver) == counts[value], value
    status.select_by_value("problems")
    assert _visible_rows(driver) == counts["warn"] + counts["fail"] + counts["error"]

    status.select_by_value("pass")
    box.send_keys("jax-cpu")  # both filters apply together
    assert _visible_rows(driver) == sum(r["status"] == "pass" and r["backend"] == "jax-cpu"
                                        for r in records)


def test_status_badge_in_header_filters(page):
    driver, run = page
    driver.find_element(By.CSS_SELECTOR, '#status-counts button[data-status="fail"]').click()
    fails = sum(r["status"] == "fail" and r["kind"] != "agreement" for r in run.records())
    assert _visible_rows(driver) == fails


def test_console_has_no_errors(page):
    driver, _ = page
    driver.find_element(By.CSS_SELECTOR, "#verdict-table thead th").click()
    if os.environ.get("DIAG_REPORT_SCREENSHOT"):
        driver.save_screenshot(os.environ["DIAG_REPORT_SCREENSHOT"])
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    assert driver.execute_script("return window.__xss === undefined && !document.querySelector("
                                 "'main script, header script')")


@pytest.fixture(scope="module")
def features_page(driver, tmp_path_factory):
    """The report of a real run (jax-cpu, torch-cpu) in the browser, and its run.json."""
    try:
        from test_features_run import MATMUL_SUITE, _run
    except ImportError:
        from tests.test_features_run import MATMUL_SUITE, _run
    run_dir, meta = _run(tmp_path_factory.mktemp("browser-features"), MATMUL_SUITE,
                         "jax-cpu,torch-cpu")
    driver.get((run_dir / "report.html").resolve().as_uri())
    return driver, meta


def test_features_table_shows_real_values_and_opens_their_evidence(features_page):
    driver, meta = features_page
    from diag.gate.drift import FEATURE_FIELDS

    rows = driver.find_elements(By.CSS_SELECTOR, "#features-table tbody tr")
    # Evidence is collapsed until its section is opened.
    assert len(rows) == 2 and not any(r.is_displayed() for r in rows)
    driver.find_element(By.CSS_SELECTOR, "#features > details > summary").click()
    assert all(r.is_displayed() for r in rows)
    for row in rows:
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        (entry,) = meta["backends"][cells[0]]["features"]
        assert cells[4:4 + len(FEATURE_FIELDS)] == [str(entry[f]) for f in FEATURE_FIELDS]
        # Collapsed until opened; opened, the evidence shows the recorded outputs.
        rounding = row.find_element(By.CSS_SELECTOR, 'details[data-feature="rounding"]')
        output = rounding.find_element(By.CSS_SELECTOR, "code.feature-output")
        assert not output.is_displayed()
        rounding.find_element(By.TAG_NAME, "summary").click()
        assert output.is_displayed()
        (detail,) = [d for d in entry["details"] if d["name"] == "rounding"]
        assert output.text == f"{detail['evidence'][0]['output']:.9g}"
        assert rounding.find_element(By.CSS_SELECTOR, "li.feature-match").is_displayed()
