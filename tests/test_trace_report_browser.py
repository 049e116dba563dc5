"""The report of a traced run shows each case's top ops joined with its error figures, in a
real browser.

A real `diag run --trace` on jax-cpu and torch-cpu (a default-precision matmul and a bf16
softmax); its report opened in headless
Chromium. Per (case, backend) the Profile section must show the ops of that case's summary
(names, dtypes, shapes as the converters gave them) beside that case's own record figures
and the backend's recorded fingerprint; the matmul shows what `highest` costs; problem cases
come first; the console is clean. (The A/B pass attribution's place in the report is checked
in test_trace_passes.py, whose run has one.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HAS_CHROMIUM, HAS_JAX, HAS_TORCH, NO_CHROMIUM, headless_chromium, run_diag
from diag.report.tables import fmt_num
from diag.records.results import RunDir
from diag.trace import read_summaries

if not HAS_CHROMIUM:
    pytest.skip(NO_CHROMIUM, allow_module_level=True)
if not (HAS_JAX and HAS_TORCH):
    pytest.skip("needs jax and torch", allow_module_level=True)
pytest.importorskip("xprof", reason="needs xprof (pip install 'diag[trace]')")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium")
from selenium.webdriver.common.by import By  # noqa: E402

SUITE = """
[suite]
name = "joined"
seed = 3

[[probe]]
name = "mm"
op = "matmul"
dtypes = ["float32"]
shapes = [[48, 96, 40]]
precision = ["default"]

[[probe]]
name = "sm"
op = "softmax"
inputs = "normal5"
dtypes = ["bfloat16"]
shapes = [[16, 2048]]
"""


@pytest.fixture(scope="module")
def traced_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("joined")
    suite = root / "joined.toml"
    suite.write_text(SUITE)
    res = run_diag("run", "-s", str(suite), "-b", "jax-cpu,torch-cpu", "--trace", "--json",
                   "-o", str(root / "runs"))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    return Path(data["run_dir"]), Path(data["report"])


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    drv = headless_chromium(tmp_path_factory.mktemp("chromium-profile"), window="1400,1000")
    yield drv
    drv.quit()


@pytest.fixture()
def page(driver, traced_report):
    run, report = traced_report
    driver.get(report.resolve().as_uri())
    return driver, run


def _cases(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#trace .trace-case")


def _open_trace_tables(driver) -> None:
    """The ops tables are evidence, collapsed by default: open them all."""
    for summary in driver.find_elements(By.CSS_SELECTOR, "#trace details.trace-fold > summary"):
        summary.click()


def test_each_case_shows_its_ops_next_to_its_error_figures(page):
    driver, run = page
    folded = driver.find_elements(By.CSS_SELECTOR, "#trace details.trace-fold")
    assert folded and not any(d.get_attribute("open") for d in folded)
    _open_trace_tables(driver)
    records = {(r["case"], r["backend"]): r for r in RunDir(run).records()
               if r.get("kind", "probe") == "probe"}
    summaries = {(s["case"], s["backend"]): s for s in read_summaries(run)}
    shown = _cases(driver)
    assert len(shown) == len(summaries) == len(records)
    meta = json.loads((run / "run.json").read_text())
    for div in shown:
        key = (div.get_attribute("data-case"), div.get_attribute("data-backend"))
        s, rec = summaries[key], records[key]
        assert div.is_displayed()
        assert div.get_attribute("data-status") == rec["status"]
        ops = div.find_elements(By.CSS_SELECTOR, ".trace-ops tbody tr")
        cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in ops]
        assert [c[0] for c in cells] == [o["name"] for o in s["ops"][:len(cells)]]
        assert cells and len(cells) == min(len(s["ops"]), 6)
        for c, o in zip(cells, s["ops"]):
            assert c[3] == (o["dtype"] or "—") and c[4] == (o["shape"] or "—")
        ratio = div.find_element(By.CSS_SELECTOR, ".bound-ratio").text
        assert ratio == fmt_num(rec["metrics"].get("bound_ratio"))
        fp = div.find_element(By.CSS_SELECTOR, ".fingerprint").text
        if rec["op"] == "matmul":  # the backend's measured arithmetic at this setting
            label = next(f["label"] for f in meta["backends"][key[1]]["fingerprints"]
                         if f["precision"] == "default")
            assert fp.startswith(label)
            high = div.find_element(By.CSS_SELECTOR, ".highest")
            assert float(high.get_attribute("data-us")) == s["highest"]["per_call_us"]
            assert "× the default's" in high.text
        else:
            assert fp == "—"
            assert not div.find_elements(By.CSS_SELECTOR, ".highest")
    # A jax softmax in bf16 runs ops in bf16: the dtype column says so.
    jax_sm = next(d for d in shown if d.get_attribute("data-backend") == "jax-cpu"
                  and "bfloat16" in d.get_attribute("data-case"))
    assert "bf16" in jax_sm.find_element(By.CSS_SELECTOR, ".trace-ops").text


def test_problem_cases_come_first(page):
    driver, _ = page
    order = [d.get_attribute("data-status") for d in _cases(driver)]
    rank = {"fail": 0, "error": 1, "warn": 2, "pass": 3}
    assert [rank.get(s, 5) for s in order] == sorted(rank.get(s, 5) for s in order)


def test_console_has_no_errors(page):
    driver, _ = page
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_traced_report_fits_every_width(page):
    """The layout claims of test_report_layout_browser.py hold for a traced run too."""
    try:
        from test_report_layout_browser import check_layout, expected_cells
    except ImportError:
        from tests.test_report_layout_browser import check_layout, expected_cells
    driver, run = page
    check_layout(driver, run / "report.html", expected_cells(run))
