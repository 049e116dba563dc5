"""The report read at a glance, checked on its HTML (the browser checks are in
test_report_layout_browser.py).

Claims under test: the matrix has one cell per (probe, dtype, setting, backend) that ran,
coloured by the worst status of its records (a cell's `skip` only when nothing was checked),
with the worst bound ratio written in, and each cell's id carried by exactly its records' rows;
an output that is Inf where the truth is Inf too is agreement, not an alarm (red only for
non-finite values where the truth is finite); a run folder whose results.jsonl was cut short
or deleted after the run is damaged: `diag report` exits 2 and the banner says how many
records run.json counted and how many are lost; long reasons are folded with the full text
kept.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict

import pytest

try:
    from test_report import _rec, make_run, sample_records
except ImportError:
    from tests.test_report import _rec, make_run, sample_records

from conftest import run_diag
from diag.report import write_report
from diag.records.results import CHECKED


def _html(run) -> str:
    return write_report(run.path).read_text("utf-8")


def _matrix_cells(html: str) -> dict[str, tuple[str, str]]:
    """cell id -> (status class, text) of each matrix cell."""
    table = re.search(r'<table class="matrix".*?</table>', html, re.DOTALL).group(0)
    return {m[1]: (m[0], re.sub(r"<[^>]+>", "", m[2]).strip())
            for m in re.findall(r'<td class="m-cell m-(\w+)"[^>]*><a href="#verdict-table" '
                                r'data-cell="(c\d+)"[^>]*>(.*?)</a>', table, re.DOTALL)}


def test_matrix_has_one_cell_per_row_and_backend_with_the_worst_status(tmp_path):
    records = [r.to_json() for r in sample_records()]
    records.append(_rec(probe="matmul.sweep_d4", case="extra", backend="jax-cpu",
                        dtype="float32", params={"sweep": "d", "d": 64, "precision": "default"},
                        status="fail", metrics={"bound_ratio": 7.5}).to_json())
    run = make_run(tmp_path, records=records)
    html = _html(run)
    cells = _matrix_cells(html)

    # Expected, computed here from the records: group by (probe, dtype, precision, backend).
    expected = defaultdict(list)
    for r in records:
        if r["kind"] == "probe":
            prec = r["params"].get("precision")
            expected[(r["probe"], r["dtype"], prec, r["backend"])].append(r)
    # A backend whose every record is a skip has no column (it is named under the matrix).
    ran = {r["backend"] for r in records if r["kind"] == "probe" and r["status"] != "skip"}
    absent = {r["backend"] for r in records if r["kind"] == "probe"} - ran
    expected = defaultdict(list, {k: v for k, v in expected.items() if k[3] in ran})
    assert len(cells) == len(expected)
    if absent:
        note = re.search(r'id="matrix-not-run">(.*?)</p>', html, re.DOTALL).group(1)
        assert all(f"<code>{b}</code>" in note for b in absent)

    rows = re.findall(r'<tr class="row-\w+" data-status="(\w+)" data-i="(\d+)" '
                      r'data-cell="(c\d+)"', html)
    by_cell = defaultdict(list)
    for status, i, cell in rows:
        if records[int(i)]["backend"] in ran:
            by_cell[cell].append(records[int(i)])
    assert set(by_cell) == set(cells)
    for cell, recs in by_cell.items():
        # Every row of a cell is one of the same (probe, dtype, setting, backend) group, and
        # the cell holds all of that group.
        keys = {(r["probe"], r["dtype"], r["params"].get("precision"), r["backend"])
                for r in recs}
        assert len(keys) == 1 and len(recs) == len(expected[keys.pop()])
        checked = [r["status"] for r in recs if r["status"] in CHECKED]
        worst = max(checked, key=CHECKED.index) if checked else "skip"
        status, text = cells[cell]
        assert status == worst, (cell, recs)
        ratios = [r["metrics"]["bound_ratio"] for r in recs if "bound_ratio" in r["metrics"]]
        if ratios:  # written to 3 significant digits
            assert float(text.split()[-1]) == pytest.approx(max(ratios), rel=5e-3), text
    # The cell with the added failing record reads fail and its ratio 7.5.
    assert ("fail", "fail 7.5") in cells.values()


def _nonfinite_cell(html: str, i: int) -> str:
    row = re.search(rf'<tr class="row-[^"]*"[^>]*data-i="{i}".*?</tr>', html, re.DOTALL).group(0)
    return re.search(r'<td class="num[^"]*"[^>]*title="NaN:[^"]*"[^>]*>[^<]*</td>', row).group(0)


def test_inf_where_the_truth_is_inf_is_agreement_not_an_alarm(tmp_path):
    """float16's wide-range matmul overflows in most elements, as the truth does: not red."""
    records = [
        _rec(probe="mm.wide", case="agree", dtype="float16",
             metrics={"elements": 16384, "nan_count": 0, "inf_count": 16306,
                      "unexpected_nonfinite": 0, "bound_ratio": 0.01}),
        _rec(probe="mm.wide", case="alarm", dtype="float16", status="fail",
             metrics={"elements": 16384, "nan_count": 2, "inf_count": 16306,
                      "unexpected_nonfinite": 2, "bound_ratio": 0.01}),
    ]
    run = make_run(tmp_path, records=records)
    r = run_diag("report", str(run.path))
    assert r.returncode == 0, r.stderr
    html = (run.path / "report.html").read_text("utf-8")
    agree, alarm = _nonfinite_cell(html, 0), _nonfinite_cell(html, 1)
    assert ">16306<" in agree and " bad" not in agree and " agree" in agree
    assert "16306 non-finite where the truth is too (agreement), 0 where the truth is finite" \
        in agree
    assert ">16308<" in alarm and " bad" in alarm


def _counted(run) -> dict[str, int]:
    counts = Counter(r["status"] for r in run.records())
    run.update_meta(counts={s: counts.get(s, 0) for s in ("pass", "warn", "fail", "error",
                                                          "skip")})
    return counts


@pytest.mark.parametrize("damage", ["cut in half", "deleted"])
def test_records_lost_from_a_finished_run_are_a_damaged_folder(tmp_path, damage):
    run = make_run(tmp_path)
    total = sum(_counted(run).values())
    path = run.path / "results.jsonl"
    lines = path.read_text("utf-8").splitlines(keepends=True)
    if damage == "deleted":
        path.unlink()
        held = 0
    else:
        half = "".join(lines).encode()[:len("".join(lines).encode()) // 2]
        path.write_bytes(half)
        # Whole lines only: a torn last line (reported on its own) is a record lost too.
        held = half.count(b"\n")
    r = run_diag("report", str(run.path))
    assert r.returncode == 2, r.stdout + r.stderr
    lost = total - held
    assert f"run.json counts {total}" in r.stderr and f"{lost} record(s) are lost" in r.stderr
    html = (run.path / "report.html").read_text("utf-8")
    banner = re.search(r'<ul class="damage" id="damage">(.*?)</ul>', html, re.DOTALL).group(1)
    assert f"{lost} record(s) are lost" in banner
    assert "readable records only" in html


def test_a_whole_folder_is_not_damaged(tmp_path):
    run = make_run(tmp_path)
    _counted(run)
    r = run_diag("report", str(run.path))
    assert r.returncode == 0, r.stderr
    assert 'id="damage"' not in (run.path / "report.html").read_text("utf-8")


def test_long_reasons_are_folded_with_the_full_text_kept(tmp_path):
    long = "the bound was exceeded " + " ".join(f"word{i}" for i in range(60))
    run = make_run(tmp_path, records=[_rec(probe="p", case="c", reason=long, status="fail",
                                           metrics={"bound_ratio": 2.0})])
    html = _html(run)
    row = re.search(r'<tr class="row-[^>]*data-i=.*?</tr>', html, re.DOTALL).group(0)
    fold = re.search(r'<details class="fold"><summary>(.*?)</summary>(.*?)</details>', row,
                     re.DOTALL)
    assert fold and fold.group(2) == long
    assert long.startswith(fold.group(1).removesuffix(" …")) and len(fold.group(1)) < len(long)


def test_drift_view_is_offline_and_escapes_what_it_shows(tmp_path):
    from diag.report import write_drift_view

    view = {"exit_code": 1, "summary": {"compared": 1, "drifts": 2, "missing": 0, "new": 0,
                                        "failed": 0},
            "causes": [{"text": "x", "explains": "with it: 1 drift(s) of 1 record(s)",
                        "head": {"where": "setting env XLA_FLAGS", "what": "value",
                                 "old": "null", "new": "<script>alert(1)</script>",
                                 "why": "a numerics setting changed"},
                        "same": [], "arithmetic": [],
                        "records": [{"key": "p | c | jax-cpu", "drifts": [
                            {"where": "p | c | jax-cpu", "what": "status", "old": "pass",
                             "new": "fail", "why": "the verdict changed"}]}]}],
            "key_mismatch": [], "notes": [], "failures": [], "known_failures": [],
            "bits_changed": []}
    html = write_drift_view(view, tmp_path / "sub" / "drift.html").read_text("utf-8")
    assert "<script" not in html.lower() and "script-src 'none'" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert not re.search(r'(?:src|href)\s*=\s*["\']?\s*(?:https?:|//)', html, re.IGNORECASE)
    assert "<link" not in html.lower()
    assert json.dumps(view)  # plain data: what Check.view() returns


def test_columns_that_give_way_on_narrow_windows_stay_in_the_max_ulp_tooltip(tmp_path):
    from diag.report.tables import fmt_num, fmt_pct

    run = make_run(tmp_path)
    html = _html(run)
    rec = run.records()[3]
    row = re.search(rf'<tr class="row-[^"]*"[^>]*data-i="3".*?</tr>', html, re.DOTALL).group(0)
    nums = re.findall(r'<td class="num[^"]*"[^>]*?(?:title="([^"]*)")?>', row)
    assert nums[1] == (f"p99 ULP: {fmt_num(rec['metrics']['p99_ulp'])}; not corr. rounded: "
                       f"{fmt_pct(rec['metrics']['frac_not_correctly_rounded'])}")
