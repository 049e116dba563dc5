"""The HTML report is one offline file that shows every record and runs nothing it reads.

Claims under test: every record gets exactly one table row; header counts equal the record
statuses; sweep records become one chart per probe with one line per (backend, dtype,
precision); no external resource is referenced; text from records and the environment is
escaped everywhere, including inside the matplotlib SVG; an interrupted run with no records
still renders and says it was interrupted.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from diag.report import render_report, write_report
from diag.report.charts import sweep_groups
from diag.report.tables import fmt_num, fmt_pct, fmt_seconds, sort_key
from diag.records.results import Record, RunDir

XSS = "<script>alert(1)</script>"
SWEEP_D = [64, 128, 256, 512, 1024, 2048, 4096]
SWEEP_BACKENDS = ["jax-cpu", "torch-cpu"]
SWEEP_DTYPES = ["float32", "bfloat16"]

ENV = {
    "host": "tpu-host-7",
    "python": "3.11.7",
    "devices": [{"platform": "cpu", "kind": "cpu", "id": 0}],
    "frameworks": {"jax": "0.4.35", "torch": "2.5.1"},
    "XLA_FLAGS": "--xla_allow_excess_precision=false --xla_cpu_enable_fast_math=false",
    "LIBTPU_INIT_ARGS": "",
    "numerics": {"jax": {"jax_default_matmul_precision": None, "jax_enable_x64": False},
                 "torch": {"allow_tf32": False, "float32_matmul_precision": "highest"}},
    "command": "diag run --suite matmul --backend jax-cpu",
    "note": XSS,
}


def _rec(**kw) -> Record:
    base = dict(op="matmul", probe="matmul.sweep_d4", case="", params={}, backend="jax-cpu",
                device={"platform": "cpu", "kind": "cpu", "id": 0}, dtype="float32",
                metrics={}, status="pass", reason="within tolerance")
    base.update(kw)
    return Record(**base)


def sample_records() -> list[Record]:
    """A realistic run: a 2x2 matmul sweep, a precision sweep, agreement, fail/error/skip."""
    recs = []
    for backend in SWEEP_BACKENDS:
        for dtype in SWEEP_DTYPES:
            for d in SWEEP_D:
                eps = 2.0**-23 if dtype == "float32" else 2.0**-8
                ulp = 0 if backend == "jax-cpu" and dtype == "float32" else math.sqrt(d) / 2
                recs.append(_rec(
                    case=f"m={d} k=4 n={d} {dtype} precision=default", dtype=dtype,
                    backend=backend, params={"sweep": "d", "d": d, "precision": "default"},
                    metrics={"max_ulp": ulp, "mean_ulp": ulp / 4, "p99_ulp": ulp / 2,
                             "frac_not_correctly_rounded": 0.0 if ulp == 0 else 0.125,
                             "max_rel_err": ulp * eps, "max_abs_err": ulp * eps * 3,
                             "bound_ratio": 0.01 * ulp, "nan_count": 0, "inf_count": 0,
                             "elements": d * d},
                    timings={"run_s_median": 1e-5 * d, "compile_s": 0.05}))
    for precision, ulp in (("default", 3.0), ("highest", 0.0)):
        for d in (64, 256, 1024):
            recs.append(_rec(
                probe="matmul.precision_sweep", backend="jax-cpu", dtype="float32",
                case=f"d={d} precision={precision}",
                params={"sweep": "d", "d": d, "precision": precision},
                metrics={"max_ulp": ulp * d / 64, "max_abs_err": ulp * 1e-7 * d}))
    recs.append(_rec(op="matmul", probe="matmul.drift", case="d=1024 bfloat16",
                     backend="jax-cpu|torch-cpu", kind="agreement", dtype="bfloat16",
                     device={}, metrics={"max_ulp_between": 4, "mismatched": 37,
                                         "elements": 1048576},
                     status="warn", reason="backends differ in 37 of 1048576 elements"))
    recs.append(_rec(op="softmax", probe="softmax.large_logits", case="n=4096 bfloat16",
                     dtype="bfloat16", status="fail",
                     metrics={"max_ulp": "inf", "p99_ulp": 12.0, "max_rel_err": "nan",
                              "nan_count": 3, "inf_count": 1, "bound_ratio": 41.5},
                     reason="3 NaN and 1 Inf outputs where the exact result is finite"))
    recs.append(_rec(op="top_k", probe="top_k.ties", case="k=8 n=1024", backend="torch-cpu",
                     status="error", device={},
                     reason="worker crashed: SIGSEGV in torch.topk; rerun with --debug"))
    recs.append(_rec(op="approx_max_k", probe="approx_max_k.recall", case="k=16",
                     backend="jax-tpu", device={}, status="skip",
                     reason="no TPU on this host"))
    recs.append(_rec(op="matmul", probe="xss" + XSS, case=XSS, backend=XSS,
                     params={"sweep": "d", "d": 64, "precision": XSS},
                     metrics={"max_ulp": 1.0, "max_abs_err": 1e-7}, status="warn",
                     reason="a reason with " + XSS + " & <b>markup</b>"))
    return recs


def make_run(root: Path, records=None, state="finished", env=ENV) -> RunDir:
    run = RunDir.create(root, "20250101-120000-abc123", env)
    for rec in sample_records() if records is None else records:
        run.append(rec)
    run.update_meta(state=state, suite={"name": "matmul-sweep", "path": "probes/x.toml"},
                    backends={"jax-cpu": {"device": {"platform": "cpu", "id": 0},
                                          "framework": {"name": "jax", "version": "0.4.35"},
                                          "settings": {"jax_default_matmul_precision": None}}},
                    backends_skipped={"jax-tpu": "no TPU visible to jax " + XSS})
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("report"))
    path = write_report(run.path)
    return run, path, path.read_text("utf-8")


def test_report_is_written_next_to_the_run_by_default(report):
    run, path, _ = report
    assert path == run.path / "report.html"
    assert path.is_file()


def test_report_references_no_external_resource(report):
    _, _, html = report
    # Attributes that make a browser fetch, and CSS that does; XML namespaces are not fetches.
    assert not re.search(r'(?:src|href|action|poster|data)\s*=\s*["\']?\s*(?:https?:|//)', html,
                         re.IGNORECASE)
    assert not re.search(r"url\(\s*['\"]?(?:https?:|//)", html, re.IGNORECASE)
    assert "@import" not in html
    assert "<link" not in html.lower()
    assert not re.search(r"<script[^>]*\ssrc=", html, re.IGNORECASE)
    assert "default-src 'none'" in html  # the browser itself refuses any fetch


def test_user_text_is_escaped_everywhere(report):
    _, _, html = report
    assert "<script>alert" not in html
    assert "<b>markup</b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.lower().count("<script") == 1  # only the report's own (hashed) script
    # The XSS record is also a sweep point: matplotlib must have escaped it in the SVG legend.
    svgs = re.findall(r"<svg.*?</svg>", html, re.DOTALL)
    assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in s for s in svgs)


def _tbody_rows(html: str, table_id: str) -> list[str]:
    table = re.search(rf'<table[^>]*id="{table_id}".*?</table>', html, re.DOTALL)
    assert table, table_id
    return re.findall(r"<tr\b[^>]*data-status=", table.group(0))


def test_one_table_row_per_record(report):
    run, _, html = report
    records = run.records()
    agreement = [r for r in records if r["kind"] == "agreement"]
    assert len(_tbody_rows(html, "verdict-table")) == len(records) - len(agreement)
    assert len(_tbody_rows(html, "agreement-table")) == len(agreement) == 1
    assert f"showing {len(records) - 1} of {len(records) - 1}" in html


def test_header_counts_match_records(report):
    run, _, html = report
    counts = Counter(r["status"] for r in run.records())
    for status in ("pass", "warn", "fail", "error", "skip"):
        shown = re.search(rf'data-count="{status}">(\d+)<', html)
        assert shown and int(shown.group(1)) == counts[status], status
    assert 'data-verdict="error"' in html  # the worst status wins
    assert re.search(r'id="run-state">finished<', html)


def test_environment_shows_host_and_backend_settings(report):
    _, _, html = report
    env = html[html.index('id="environment"'):]
    for text in ("tpu-host-7", "--xla_allow_excess_precision=false", "float32_matmul_precision",
                 "jax_default_matmul_precision", "no TPU visible to jax"):
        assert text in env, text
    assert env.index(">host<") < env.index(">python<") < env.index(">note<")
    assert "matmul-sweep" in html[:html.index('id="failures"')]


def test_failures_are_listed_first(report):
    _, _, html = report
    failures = html[html.index('id="failures"'):html.index('id="results"')]
    assert "worker crashed: SIGSEGV" in failures and "3 NaN and 1 Inf" in failures
    assert failures.index("worker crashed") < failures.index("3 NaN and 1 Inf")  # error first
    assert "no TPU on this host" not in failures


def test_sweep_charts_have_one_line_per_series(report):
    _, _, html = report
    figures = re.findall(r'<figure class="sweep" data-probe="([^"]*)" data-series="(\d+)">(.*?)'
                         r"</figure>", html, re.DOTALL)
    assert [(p, int(n)) for p, n, _ in figures] == [
        ("matmul.sweep_d4", len(SWEEP_BACKENDS) * len(SWEEP_DTYPES)),
        ("matmul.precision_sweep", 2),
        ("xss&lt;script&gt;alert(1)&lt;/script&gt;", 1),
    ]
    main_svg = figures[0][2]
    # Each series is one drawn line per panel, with a prefixed id that is unique in the page.
    for metric in ("max_ulp", "max_abs_err", "bound_ratio"):
        lines = re.findall(rf'id="sweep-0-{metric}-s(\d+)"', main_svg)
        assert sorted(map(int, lines)) == [0, 1, 2, 3]
        # 7 swept values -> 7 vertices in the line's path: one M and six L commands.
        for i in range(4):
            group = re.search(rf'id="sweep-0-{metric}-s{i}">\s*<path d="([^"]*)"', main_svg)
            assert group and group.group(1).count("L") == len(SWEEP_D) - 1
    legend = [label for label in re.findall(r"<text[^>]*>([^<]*)</text>", main_svg)
              if label.endswith("precision=default")]
    assert sorted(legend) == sorted(f"{b} {d} precision=default"
                                    for b in SWEEP_BACKENDS for d in SWEEP_DTYPES)
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), "element ids must be unique across inline SVGs"
    assert "<?xml" not in html and "<!DOCTYPE svg" not in html


def test_sweep_groups_skip_non_sweep_and_non_numeric_records():
    records = [r.to_json() for r in sample_records()]
    sweeps = sweep_groups(records)
    assert [s.probe for s in sweeps][:2] == ["matmul.sweep_d4", "matmul.precision_sweep"]
    main = sweeps[0]
    assert main.param == "d" and len(main.series) == 4
    assert all(sorted(s.points) == [float(d) for d in SWEEP_D] for s in main.series)
    assert {s.precision for s in sweeps[1].series} == {"default", "highest"}


def test_interrupted_empty_run_renders(tmp_path):
    run = make_run(tmp_path, records=[], state="interrupted", env={})
    html = write_report(run.path, out=tmp_path / "out" / "r.html").read_text("utf-8")
    assert re.search(r'id="run-state">interrupted<', html)
    assert "was interrupted" in html
    assert "No sweep records" in html and "No cross-backend agreement records" in html
    assert 'data-verdict="incomplete"' in html and "no records written" in html
    assert all(f'data-count="{s}">0<' in html for s in ("pass", "fail", "error"))


def test_running_run_says_results_are_partial(tmp_path):
    run = make_run(tmp_path, records=sample_records()[:3], state="running")
    html = write_report(run.path).read_text("utf-8")
    assert "still in progress" in html
    assert "PASS" in html and "so far: the run is running" in html


def test_missing_run_json_is_a_usage_error(tmp_path):
    from diag.errors import UsageError

    with pytest.raises(UsageError, match="not a run folder"):
        write_report(tmp_path)


def test_render_report_tolerates_sparse_metadata():
    html = render_report({}, [{"status": "pass"}])
    assert 'data-verdict="pass"' in html


@pytest.mark.parametrize("value, text", [
    (None, "—"), (3, "3"), (3.0, "3"), (0.123456, "0.123"), (1.5e-7, "1.5e-7"),
    (12345678.0, "1.23e7"), ("nan", "NaN"), ("inf", "inf"), ("-inf", "-inf"), (True, "true"),
])
def test_fmt_num(value, text):
    assert fmt_num(value) == text


def test_fmt_pct_seconds_and_sort_key():
    assert fmt_pct(0.125) == "12.5%" and fmt_pct(0) == "0%" and fmt_pct(None) == "—"
    assert fmt_seconds(0.00123) == "1.23 ms" and fmt_seconds(2.5) == "2.5 s"
    assert fmt_seconds(4e-6) == "4 µs" and fmt_seconds(5e-9) == "5 ns"
    assert sort_key("nan") == "NaN" and sort_key("inf") == "Infinity" and sort_key(None) == ""
    assert float(sort_key(0.1)) == 0.1


def test_import_diag_report_loads_no_framework_or_matplotlib():
    code = ("import sys, diag.report; "
            "print(sorted(m for m in ('jax', 'torch', 'torch_xla', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_read_results_counts_every_unreadable_line_and_a_torn_last_line_apart(tmp_path):
    from diag.records.results import read_results

    good = '{"status": "pass"}'
    path = tmp_path / "results.jsonl"
    # A line cut short, a JSON value that is not a record, a blank line, then a torn end.
    path.write_text("\n".join([good, '{"status": "fa', good, "[1, 2]", "", good, '{"st']))
    read = read_results(path)
    assert len(read.records) == 3
    assert read.unreadable == [2, 4] and read.torn_last_line == 7
    problems = read.problems("results.jsonl")
    assert len(problems) == 2 and "2 line(s)" in problems[0] and "line 7" in problems[1]
    path.write_text(good + "\n" + good + "\n")
    clean = read_results(path)
    assert len(clean.records) == 2 and clean.problems() == []


# ---------------------------------------------------------------------------------------------
# run.json's schema (diag.records.results.RunMeta): the report reads fields, never guesses keys


def test_report_shows_the_command_line_run_json_records(report):
    _, _, html = report
    assert '<code class="cmd">diag run --suite matmul --backend jax-cpu</code>' in html


def test_sampling_section_holds_the_ops_run_json_assigns_to_it():
    """The section a record lands in comes from run.json's `report_sections` (written from the
    probe table), not from its op's name: an op the report has never heard of is shown."""
    rec = _rec(op="new_top_k", probe="s.new", case="k=4 n=64", status="fail",
               metrics={"recall_min": 0.25, "recall_mean": 0.5, "wrong_rows": 3},
               reason="recall 0.25 below target " + XSS).to_json()
    meta = {"run_id": "r", "report_sections": {"new_top_k": "top-k"}}
    html = render_report(meta, [rec])
    section = html[html.index('<section id="sampling">'):]
    assert 'id="topk-table"' in section and "new_top_k" in section
    assert "recall 0.25 below target &lt;script&gt;" in section
    assert '<section id="sampling">' not in render_report({"run_id": "r"}, [rec])


def test_run_meta_reads_wrong_types_as_absent_and_keeps_unknown_keys():
    from diag.records.results import RunMeta

    meta = RunMeta.from_dict({"run_id": "r", "environment": ["not", "a", "dict"],
                              "started": "yesterday", "finished": 12.5, "verdict": "fail",
                              "exit_code": True, "written_by_a_newer_diag": {"x": 1}})
    assert meta.environment == {} and meta.started is None and meta.exit_code is None
    assert (meta.finished, meta.verdict) == (12.5, "fail")
    assert meta.to_dict()["written_by_a_newer_diag"] == {"x": 1}
    assert RunMeta.from_dict(meta.to_dict()) == meta


def test_update_meta_refuses_a_key_run_json_does_not_have(tmp_path):
    run = RunDir.create(tmp_path, "r1", {"host": "test"})
    with pytest.raises(TypeError, match="not run.json fields.*command_line"):
        run.update_meta(command_line="diag run")
    run.update_meta(verdict="pass")
    assert run.read_run().verdict == "pass"
