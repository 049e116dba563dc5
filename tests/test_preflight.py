"""`diag preflight`: one verdict for "is this machine fit to run a job", under a time budget.

Claims, each through the real `diag` script: a healthy machine is fit (exit 0) and every step
ran; the verdict and exit code agree with the findings diag measured; a bad XLA flag is bad
usage (exit 2) before any step; a budget skips the steps whose measured cost does not fit and
names them; a corrupted probe output is a numerical problem (1), a crashed worker a crash (4),
an injected device fault a bad device (3); the JUnit file validates against the Jenkins XSD
with one testcase per finding.
"""

from __future__ import annotations

import json

import pytest
import xmlschema

from conftest import REPO_ROOT, needs_jax, needs_torch, run_diag

XSD = REPO_ROOT / "tests" / "data" / "junit-jenkins.xsd"
STEP_NAMES = ["settings", "fingerprints", "probes", "nodes"]

pytestmark = [needs_jax, needs_torch]


def _timings(cache, **seconds):
    """Pretend earlier preflights measured these step costs here (what the budget plans by)."""
    path = cache / "preflight" / "timings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(seconds))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preflight")
    proc = run_diag("preflight", "--json", "--junit", str(tmp / "junit.xml"),
                    env={"DIAG_CACHE_DIR": str(tmp / "cache")})
    return proc, tmp


def test_healthy_machine_is_fit_and_every_step_ran(healthy):
    proc, tmp = healthy
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["verdict"] == "fit" and data["exit_code"] == 0
    assert [s["name"] for s in data["steps"]] == STEP_NAMES
    # With the default budget the probe workers measure the fingerprints too (one start).
    assert [s["state"] for s in data["steps"]] == ["ran", "with probes", "ran", "ran"]
    # The node scan ran in the probes' JAX worker (jax imported once), not in this process.
    assert "JAX worker" in data["steps"][3]["note"]
    assert data["skipped"] == []
    statuses = {f["status"] for f in data["findings"]}
    assert not statuses & {"fail", "error"}
    assert {f["step"] for f in data["findings"]} == set(STEP_NAMES)
    # Every finding that asks for attention says what to do.
    assert all(f["todo"] for f in data["findings"] if f["status"] in ("warn", "fail"))
    # Fingerprints were measured for the CPU backends, and the verdict agrees with them.
    assert {"jax-cpu", "torch-cpu"} <= set(data["fingerprints"])
    for backend, fps in data["fingerprints"].items():
        low = [fp for fp in fps if fp["label"] != "F32_F32_F32"]
        mine = [f for f in data["findings"]
                if f["step"] == "fingerprints" and f["check"].startswith(backend)]
        assert mine and all(f["status"] == ("warn" if low else "pass") for f in mine)
    # Each step's measured cost is kept for the next budget.
    kept = json.loads((tmp / "cache" / "preflight" / "timings.json").read_text())
    assert set(kept) == {"settings", "probes", "nodes"} and all(v >= 0 for v in kept.values())


def test_progress_is_one_stderr_line_per_step(healthy):
    proc, _ = healthy
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("diag preflight: [")]
    assert [ln.split("] ")[1].split(":")[0] for ln in lines] == STEP_NAMES
    assert all(f"[{i}/4]" in ln for i, ln in enumerate(lines, 1))


def test_junit_validates_with_one_testcase_per_finding(healthy):
    proc, tmp = healthy
    data = json.loads(proc.stdout)
    schema = xmlschema.XMLSchema(str(XSD))
    schema.validate(str(tmp / "junit.xml"))
    cases = schema.to_dict(str(tmp / "junit.xml"))["testsuite"][0]["testcase"]
    assert len(cases) == len(data["findings"])
    assert [c["@name"] for c in cases] == [f["check"] for f in data["findings"]]
    failing = sum(f["status"] in ("fail", "error") for f in data["findings"])
    assert sum("failure" in c or "error" in c for c in cases) == failing


def test_bad_xla_flag_is_bad_usage_before_any_step(tmp_path):
    proc = run_diag("preflight", env={"XLA_FLAGS": "--xla_no_such_flag_diag=1",
                                      "DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("diag:")]
    assert len(errors) == 1 and "xla_no_such_flag_diag" in errors[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert "[2/4]" not in proc.stderr


def test_bad_budget_is_bad_usage():
    proc = run_diag("preflight", "--budget", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("diag:") and "--budget" in proc.stderr


def test_tiny_budget_skips_steps_and_says_which(tmp_path):
    proc = run_diag("preflight", "--budget", "0.5", env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "skipped: fingerprints, probes, nodes" in proc.stdout
    assert "fit (3 step(s) skipped)" in proc.stdout
    for step in STEP_NAMES[1:]:
        assert f"{step}: skipped, needs ~" in proc.stderr


def test_budget_plans_by_measured_costs(tmp_path):
    """Steps measured as too slow here are skipped; a cheap later step still runs."""
    _timings(tmp_path, fingerprints=1000.0, probes=1000.0, nodes=0.1)
    proc = run_diag("preflight", "--json", "--budget", "30",
                    env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["skipped"] == ["fingerprints", "probes"]
    assert [s["state"] for s in data["steps"]] == ["ran", "skipped", "skipped", "ran"]
    skips = [f for f in data["findings"] if f["status"] == "skip"]
    assert [f["step"] for f in skips] == ["fingerprints", "probes"]
    assert all("needs ~1000 s" in f["what"] and "--budget" in f["todo"] for f in skips)


def test_fingerprints_alone_when_the_probes_do_not_fit(tmp_path):
    """The cheaper half: `diag env`'s workers measure settings and fingerprints."""
    _timings(tmp_path, fingerprints=1.0, probes=1000.0, nodes=1000.0)
    proc = run_diag("preflight", "--json", "--budget", "60",
                    env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [s["state"] for s in data["steps"]] == ["ran", "ran", "skipped", "skipped"]
    assert {"jax-cpu", "torch-cpu"} <= set(data["fingerprints"])
    precisions = {fp["precision"] for fp in data["fingerprints"]["jax-cpu"]}
    assert {"default", "highest"} <= precisions


@pytest.mark.parametrize("fault,code,status", [
    ("corrupt@torch-cpu:c0000", 1, "fail"),   # silent wrong data: a numerical problem
    ("kill@torch-cpu:c0000", 4, "error"),     # the worker died: the check is incomplete
])
def test_probe_fault_sets_the_exit_code(tmp_path, fault, code, status):
    _timings(tmp_path, fingerprints=1000.0, nodes=1000.0)  # only settings and probes run
    proc = run_diag("preflight", "--json", "--budget", "60",
                    env={"DIAG_CACHE_DIR": str(tmp_path), "DIAG_WORKER_FAULT": fault})
    assert proc.returncode == code, proc.stderr
    data = json.loads(proc.stdout)
    assert data["exit_code"] == code
    bad = [f for f in data["findings"] if f["status"] == status]
    # torch-cpu's own record, and (a dead worker) the agreement pair it left uncompared, which
    # is an error record of its own naming both backends (`jax-cpu|torch-cpu`).
    assert bad and all(f["step"] == "probes" and "torch-cpu" in f["check"].split()[0].split("|")
                       and f["what"] and f["todo"] for f in bad)
    assert any(f["check"].startswith("torch-cpu ") for f in bad)


def test_injected_fault_is_found_by_the_probe_workers_scan(tmp_path):
    """With the probes, the JAX probe worker scans the devices: its scan finds the fault too."""
    _timings(tmp_path, fingerprints=1000.0, probes=1.0, nodes=1.0)
    proc = run_diag("preflight", "--json", "--budget", "60", "--inject",
                    "device=0,kind=nan,rate=1", env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 3, proc.stderr
    data = json.loads(proc.stdout)
    nodes = data["steps"][3]
    assert nodes["state"] == "ran" and "JAX worker" in nodes["note"]
    bad = [f for f in data["findings"] if f["status"] == "fail"]
    assert bad and all(f["step"] == "nodes" and "exclude this device" in f["todo"] for f in bad)


def test_injected_device_fault_is_a_bad_device(tmp_path):
    _timings(tmp_path, fingerprints=1000.0, probes=1000.0)  # only settings and nodes run
    proc = run_diag("preflight", "--budget", "60", "--inject", "device=0,kind=nan,rate=1",
                    env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 3, proc.stderr
    assert "bad device" in proc.stdout and "exclude this device" in proc.stdout


def test_library_call_mirrors_the_command(tmp_path, monkeypatch):
    """`diag.preflight(...)` after a bare `import diag`, and its result type."""
    import diag

    monkeypatch.setenv("DIAG_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    result = diag.preflight(0.001)  # only `settings` fits: no framework is imported
    assert result.skipped == STEP_NAMES[1:]
    assert result.exit_code == 0 and result.verdict == "fit (3 step(s) skipped)"
    assert diag.preflight.preflight is not None and diag.preflight.STEPS[0].name == "settings"
    with pytest.raises(diag.UsageError, match="budget"):
        diag.preflight(-1)
