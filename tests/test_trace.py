"""`diag run --trace` captures a profiler session per (case, backend) that the converters read.

The claims, through the real `diag` script on jax-cpu and torch-cpu with a float32 matmul and
a bf16 softmax:
  - the run folder is an XProf logdir: `plugins/profile/<case>.<backend>/` holds the XSpace
    (JAX) or the Kineto trace (PyTorch), and xprof converts the XSpace again here to the same
    per-op figures the summary holds (the test reads the converted data);
  - each summarised op is an instruction of the saved optimised HLO, with its dtype and shape;
  - the matmul at the default precision is also profiled at `highest`;
  - a converter that cannot load degrades to "trace captured, summary unavailable" and the
    run still exits 0.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import HAS_JAX, HAS_TORCH, run_diag
from diag.trace import hlo, read_summaries
from diag.trace.summarise import xla_events

pytestmark = pytest.mark.skipif(not (HAS_JAX and HAS_TORCH), reason="needs jax and torch")
xprof = pytest.importorskip("xprof", reason="needs xprof (pip install 'diag[trace]')")

SUITE = """
[suite]
name = "traced"
seed = 11

[[probe]]
name = "mm"
op = "matmul"
dtypes = ["float32"]
shapes = [[32, 128, 48]]
precision = ["default"]

[[probe]]
name = "sm"
op = "softmax"
inputs = "normal5"
dtypes = ["bfloat16"]
shapes = [[8, 1024]]
"""


def _run_folder(result) -> Path:
    data = json.loads(result.stdout)
    return Path(data["run_dir"])


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("traced")
    suite = root / "traced.toml"
    suite.write_text(SUITE)
    res = run_diag("run", "-s", str(suite), "-b", "jax-cpu,torch-cpu", "--trace", "--json",
                   "--no-report", "-o", str(root / "runs"))
    assert res.returncode == 0, res.stderr[-2000:]
    return _run_folder(res), json.loads(res.stdout)["records"]


def _summary(run: Path, backend: str, op: str) -> dict:
    (s,) = [s for s in read_summaries(run) if s["backend"] == backend and s["op"] == op]
    return s


def test_every_case_and_backend_has_a_session_and_a_summary(traced):
    run, records = traced
    probe = [r for r in records if r.get("kind", "probe") == "probe"]
    summaries = read_summaries(run)
    assert {(s["case"], s["backend"]) for s in summaries} == {
        (r["case"], r["backend"]) for r in probe}
    for s in summaries:
        assert "summary_error" not in s, s.get("summary_error")
        session = run / s["session"]
        assert session.parent == run / "plugins" / "profile"  # XProf's logdir layout
        pattern = "*.xplane.pb" if s["framework"] == "jax" else "*.pt.trace.json.gz"
        assert list(session.glob(pattern)), f"no {pattern} in {session}"


@pytest.mark.parametrize("op", ["matmul", "softmax"])
def test_xprof_conversion_gives_the_summarised_jax_ops(traced, op):
    run, _ = traced
    s = _summary(run, "jax-cpu", op)
    events = [e for e in xla_events(run / s["session"])
              if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    assert events, "xprof's trace_viewer has no HLO op events for the case"
    per_op = defaultdict(float)
    for e in events:
        per_op[e["args"]["hlo_op"]] += e["dur"]
    # The summary is what the converted events say: same ops, same times.
    assert {o["name"] for o in s["ops"]} <= set(per_op)
    for o in s["ops"]:
        assert o["total_us"] == pytest.approx(per_op[o["name"]], rel=1e-6, abs=1e-3)
    assert s["calls"] == 3  # diag's default repeats, one execution each
    # Every op is an instruction of the saved optimised HLO, with its dtype and shape.
    text = (run / s["hlo"]).read_text()
    defined = hlo.instructions(text)
    for o in s["ops"]:
        assert o["name"] in defined
        assert (o["dtype"], o["shape"]) == (defined[o["name"]]["dtype"],
                                            defined[o["name"]]["shape"])
    dtypes = {o["dtype"] for o in s["ops"]}
    assert ("bf16" in dtypes) if op == "softmax" else (dtypes == {"f32"})


def test_kineto_trace_gives_the_summarised_torch_ops(traced):
    run, _ = traced
    s = _summary(run, "torch-cpu", "matmul")
    (path,) = (run / s["session"]).glob("*.pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == f"diag:{s['case_id']}.torch-cpu" for e in events)
    mm = [e for e in events if e.get("cat") == "cpu_op" and e.get("name") == "aten::mm"]
    assert len(mm) == 3
    assert mm[0]["args"]["Input Dims"][:2] == [[32, 128], [128, 48]]
    row = next(o for o in s["ops"] if o["name"] == "aten::mm")
    assert row["shape"] == "[32, 128], [128, 48]" and row["dtype"] == "float"
    assert row["count"] == 3
    assert 0 < row["total_us"] <= sum(e["dur"] for e in mm) + 1e-6  # self time <= duration


@pytest.mark.parametrize("backend", ["jax-cpu", "torch-cpu"])
def test_default_precision_matmul_is_also_profiled_at_highest(traced, backend):
    run, _ = traced
    s = _summary(run, backend, "matmul")
    high = s["highest"]
    assert high.get("summary_error") is None
    assert high["op_args"]["precision"] == "highest"
    assert (run / high["session"]).is_dir()
    assert high["per_call_us"] > 0 and s["per_call_us"] > 0
    # Its per-call time is the sum over all its ops; the summary keeps the top three.
    assert high["per_call_us"] >= sum(o["per_call_us"] for o in high["ops"]) - 1e-3
    assert high["ops"] and all(o["count"] >= 3 for o in high["ops"][:1])


def test_softmax_has_no_highest_comparison(traced):
    run, _ = traced
    assert "highest" not in _summary(run, "jax-cpu", "softmax")


def test_converter_failure_is_summary_unavailable_not_a_failed_run(tmp_path):
    """xprof shadowed by a package that fails to import: the run passes, the trace is there,
    and the summary says why it is missing."""
    fake = tmp_path / "shadow" / "xprof"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('xprof removed for this test')\n")
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE.split("[[probe]]\nname = \"sm\"")[0])
    res = run_diag("run", "-s", str(suite), "-b", "jax-cpu", "--trace", "--json", "--no-report",
                   "-o", str(tmp_path / "runs"), env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert res.returncode == 0, res.stderr[-2000:]
    run = _run_folder(res)
    (s,) = read_summaries(run)
    assert s["summary_error"].startswith("trace captured, summary unavailable")
    assert "xprof removed for this test" in s["summary_error"]
    assert list((run / s["session"]).glob("*.xplane.pb"))
    assert (run / s["hlo"]).is_file()


def test_untraced_run_writes_no_trace(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE)
    res = run_diag("run", "-s", str(suite), "-b", "torch-cpu", "--json", "--no-report",
                   "-o", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr[-2000:]
    run = _run_folder(res)
    assert not (run / "plugins").exists() and not read_summaries(run)
