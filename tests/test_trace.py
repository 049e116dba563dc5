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
    res = run_diag("run", "-s", str(suite), "-b", "jax-cpu", "--trace", "--no-report",
                   "-o", str(tmp_path / "runs"), env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert res.returncode == 0, res.stderr[-2000:]
    # The terminal says where the traces are and how to read them.
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("diag: traces: diag trace ")]
    run = Path(line.split("diag trace ", 1)[1].split(" (--serve")[0])
    assert run.parent == tmp_path / "runs"
    (s,) = read_summaries(run)
    assert s["summary_error"].startswith("trace captured, summary unavailable")
    assert "xprof removed for this test" in s["summary_error"]
    assert list((run / s["session"]).glob("*.xplane.pb"))
    assert (run / s["hlo"]).is_file()
    # `diag trace` shows the case with the reason its ops are missing.
    shown = run_diag("trace", str(run))
    assert shown.returncode == 0, shown.stderr
    assert "trace captured, summary unavailable" in " ".join(shown.stdout.split())


def test_untraced_run_writes_no_trace(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE)
    res = run_diag("run", "-s", str(suite), "-b", "torch-cpu", "--json", "--no-report",
                   "-o", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr[-2000:]
    run = _run_folder(res)
    assert not (run / "plugins").exists() and not read_summaries(run)


# ---------------------------------------------------------------------------------------------
# diag trace RUN_DIR


def test_diag_trace_prints_each_cases_top_ops(traced):
    run, _ = traced
    res = run_diag("trace", str(run), "--top", "2")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # rich may wrap long cells
    for s in read_summaries(run):
        assert s["case"] in text
        for o in s["ops"][:2]:
            assert o["name"] in text
    assert f"traced case(s) in {run}" in text


def test_diag_trace_refuses_a_folder_without_traces(tmp_path):
    res = run_diag("trace", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("diag:") and "no run.json" in res.stderr
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x"}))
    res = run_diag("trace", str(tmp_path))
    assert res.returncode == 2 and "diag run --trace" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on (Linux /proc)."""
    import os
    import socket
    import struct

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                           for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads Linux /proc")
def test_serve_binds_127_0_0_1_only_and_serves_the_sessions(traced):
    import os
    import signal
    import subprocess
    import urllib.request

    from conftest import REPO_ROOT, diag_script

    run, _ = traced
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([diag_script(), "trace", str(run), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.poll())
        url = line[line.index("http://"):].split()[0]
        port = int(url.rsplit(":", 1)[1].strip("/"))
        assert _listening(proc.pid) == {("127.0.0.1", port)}  # nothing on 0.0.0.0 or ::
        with urllib.request.urlopen(url + "data/plugin/profile/runs", timeout=60) as r:
            body = r.read()
            if r.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
        sessions = {p.name for p in (run / "plugins" / "profile").iterdir()}
        assert set(json.loads(body)) == sessions
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 143  # SIGTERM, as every diag command reports it


def test_serve_on_a_taken_port_is_a_usage_error(traced):
    import socket

    run, _ = traced
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = run_diag("trace", str(run), "--serve", "--port", str(s.getsockname()[1]))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("diag: cannot listen on 127.0.0.1:")


def test_serve_without_xprof_says_how_to_install_it(traced, tmp_path):
    run, _ = traced
    fake = tmp_path / "shadow" / "xprof"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('xprof removed for this test')\n")
    res = run_diag("trace", str(run), "--serve", "--port", "0",
                   env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "diag: --serve needs xprof (xprof removed for this test); install it with pip "
        "install 'diag[trace]'"]


@pytest.mark.parametrize("backend", ["jax-cpu", "torch-cpu"])
def test_each_traced_call_is_a_sample_and_diag_trace_says_when_highest_is_noise(traced,
                                                                               backend):
    run, _ = traced
    s = _summary(run, backend, "matmul")
    for side in (s, s["highest"]):
        samples = side["call_us_samples"]
        assert len(samples) == s["calls"] and all(x > 0 for x in samples)
    # jax: every op event belongs to one call, so the calls add up to the per-call figure
    if backend == "jax-cpu":
        assert abs(sum(s["call_us_samples"]) / s["calls"] - s["per_call_us"]) < 1e-2
    base, high = s["call_us_samples"], s["highest"]["call_us_samples"]
    overlap = min(base) <= max(high) and min(high) <= max(base)
    res = run_diag("trace", str(run))
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    from diag.numerics import fmt

    def n(x):
        return fmt(x, compact=False)

    spread = (f"calls {n(min(base))}-{n(max(base))} µs at default, "
              f"{n(min(high))}-{n(max(high))} µs at highest: ")
    said = "within the spread: no cost measured" if overlap else "beyond the spread"
    assert spread + said in text, (spread, text[-3000:])
