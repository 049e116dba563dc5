"""The CI gate proves it can fail and does not cry wolf.

Claims under test, all through the real `diag` script: a baseline saved from one run checks
clean against reruns (no false alarm, also bit for bit on this machine); a changed numerics
setting, a tampered baseline and a tampered run each exit 1 naming the probe, case, backend and
the old and new values; a move inside the error bound is not drift (two correct
implementations may differ that much) unless --bitwise; unusable baseline files exit 2 with one
line; the JUnit file validates against the Jenkins JUnit schema.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import xmlschema

from conftest import REPO_ROOT, TINY_SUITE, needs_jax, needs_torch, run_diag
from diag.gate.drift import FEATURE_FIELDS

XSD = REPO_ROOT / "tests" / "data" / "junit-jenkins.xsd"

pytestmark = [needs_jax, needs_torch]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four clean runs of a tiny suite (baseline + three reruns) and the baseline of the first."""
    root = tmp_path_factory.mktemp("gate")
    suite = root / "tiny.toml"
    suite.write_text(TINY_SUITE)
    env = {"DIAG_CACHE_DIR": str(root / "gt-cache")}
    dirs = []
    for i in range(4):
        out = root / f"runs{i}"
        r = run_diag("run", "--suite", str(suite), "--out", str(out), "--no-report",
                     "-b", "jax-cpu,torch-cpu", env=env)
        assert r.returncode == 0, r.stderr
        dirs.append(next(out.iterdir()))
    baseline = root / "baseline.json"
    r = run_diag("baseline", str(dirs[0]), "-o", str(baseline), env=env)
    assert r.returncode == 0, r.stderr
    return {"root": root, "suite": suite, "env": env, "dirs": dirs, "baseline": baseline}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def _tampered(runs, tmp_path, change):
    data = json.loads(runs["baseline"].read_text())
    change(data)
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(data))
    return path


def _first(data, **match):
    return next(r for r in data["records"]
                if all(r.get(k) == v for k, v in match.items()) and "bound_ratio" in r["metrics"])


def test_clean_reruns_check_clean_no_false_alarm(runs):
    false_alarms = 0
    for rerun in runs["dirs"][1:]:
        for extra in ([], ["--bitwise"]):
            r = run_diag("check", str(rerun), "--baseline", str(runs["baseline"]), *extra)
            false_alarms += r.returncode != 0
            assert r.returncode == 0, r.stdout + r.stderr
            assert "no drift" in r.stdout and "0 drift(s)" in r.stdout
    assert false_alarms == 0


def test_baseline_holds_metrics_fingerprints_key_and_digests(runs):
    data = json.loads(runs["baseline"].read_text())
    records = _records(runs["dirs"][0])
    assert len(data["records"]) == len(records)
    assert data["suite"] == "tiny" and data["backends"] == ["jax-cpu", "torch-cpu"]
    assert {"jax-cpu", "torch-cpu"} <= set(data["fingerprints"])
    assert data["key"]["hardware"]["machine"]
    assert "jax-cpu jax_default_matmul_precision" in data["key"]["settings"]
    probe = next(r for r in data["records"] if r["backend"] == "jax-cpu" and r["op"] == "matmul")
    source = next(r for r in records if r["backend"] == "jax-cpu" and r["case"] == probe["case"]
                  and r["probe"] == probe["probe"])
    assert probe["metrics"]["bound_ratio"] == source["metrics"]["bound_ratio"]
    assert probe["digests"] == source["metrics"]["output_digests"]


def test_baseline_keys_each_backends_matmul_features(runs):
    data = json.loads(runs["baseline"].read_text())
    meta = json.loads((runs["dirs"][0] / "run.json").read_text())
    for name in ("jax-cpu", "torch-cpu"):
        (kept,) = data["features"][name]
        (measured,) = meta["backends"][name]["features"]
        assert kept == {k: measured[k] for k in kept}  # the values, not the evidence
        assert set(FEATURE_FIELDS) < set(kept) and "details" not in kept


def test_changed_feature_drifts_and_names_it(runs, tmp_path):
    """A driver or library that changes how the unit adds is drift, even if records pass."""
    (now,) = json.loads((runs["dirs"][1] / "run.json").read_text())["backends"]["torch-cpu"][
        "features"]
    old = "toward_zero" if now["rounding"] != "toward_zero" else "nearest"

    def change(data):
        data["features"]["torch-cpu"][0]["rounding"] = old

    path = _tampered(runs, tmp_path, change)
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("drift: features torch-cpu precision=default via=none dtype=float32: rounding "
            f"{old} -> {now['rounding']} (the matmul unit's arithmetic changed)") in r.stdout
    # Everything else still matches: the feature is the only drift.
    assert r.stdout.count("diag: drift:") == 1, r.stdout
    # The untampered baseline passes the same run.
    assert run_diag("check", str(runs["dirs"][1]), "--baseline",
                    str(runs["baseline"])).returncode == 0


def test_baseline_saved_before_features_checks_clean_and_says_so(runs, tmp_path):
    path = _tampered(runs, tmp_path, lambda data: data.pop("features"))
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "records no matmul features" in r.stdout + r.stderr


def test_changed_setting_drifts_and_names_it(runs, tmp_path):
    r = run_diag("run", "--suite", str(runs["suite"]), "--out", str(tmp_path), "--no-report",
                 "-b", "jax-cpu,torch-cpu",
                 env={**runs["env"], "JAX_DEFAULT_MATMUL_PRECISION": "bfloat16"})
    assert r.returncode == 0, r.stderr
    r = run_diag("check", str(next(tmp_path.iterdir())), "--baseline", str(runs["baseline"]))
    assert r.returncode == 1, r.stdout + r.stderr
    # One change, said once: the env var and the jax-cpu worker's record of it are one cause.
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("diag: drift: setting")]
    assert line.startswith("diag: drift: setting env JAX_DEFAULT_MATMUL_PRECISION: value null "
                           "-> bfloat16 (a numerics setting changed)"), r.stdout
    assert "the same change in setting jax-cpu jax_default_matmul_precision" in line


def test_one_xla_flags_change_is_one_drift_in_the_terminal_and_junit(runs, tmp_path):
    """XLA_FLAGS is the env var and each worker's copy of it: one change, said once."""
    flags = "--xla_allow_excess_precision=false"
    r = run_diag("run", "--suite", str(runs["suite"]), "--out", str(tmp_path / "r"),
                 "--no-report", "-b", "jax-cpu,torch-cpu", env={**runs["env"], "XLA_FLAGS": flags})
    assert r.returncode == 0, r.stderr
    junit = tmp_path / "j.xml"
    r = run_diag("check", str(next((tmp_path / "r").iterdir())), "--baseline",
                 str(runs["baseline"]), "--junit", str(junit))
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines()
               if x.startswith("diag: drift:") and "XLA_FLAGS" in x]
    assert line.startswith(f"diag: drift: setting env XLA_FLAGS: value null -> {flags}"), line
    copies = re.findall(r"setting ([\w-]+) XLA_FLAGS", line)
    assert copies == ["env", "jax-cpu", "torch-cpu"], line
    doc = xmlschema.XMLSchema(str(XSD)).to_dict(str(junit))
    names = [c["@name"] for c in doc["testsuite"][0]["testcase"] if "XLA_FLAGS" in c["@name"]]
    assert names == ["setting env XLA_FLAGS"]


def test_missing_backend_and_records_drift(runs, tmp_path):
    r = run_diag("run", "--suite", str(runs["suite"]), "--out", str(tmp_path), "--no-report",
                 "-b", "jax-cpu", env=runs["env"])
    assert r.returncode == 0, r.stderr
    r = run_diag("check", str(next(tmp_path.iterdir())), "--baseline", str(runs["baseline"]))
    assert r.returncode == 1
    assert "drift: backend torch-cpu: backend ran -> did not run" in r.stdout
    # The backend's missing records are said under it, once, not as drifts of their own.
    assert "| torch-cpu: record pass -> null" in r.stdout
    assert r.stdout.count("diag: drift:") == 1, r.stdout


def _set_ratio(value):
    def change(data):
        _first(data, backend="jax-cpu")["metrics"]["bound_ratio"] = value
    return change


def _set_status(data):
    _first(data, backend="torch-cpu")["status"] = "fail"


def _set_nan(data):
    _first(data, backend="jax-cpu")["metrics"]["nan_count"] = 3


def _drop_record(data):
    data["records"].remove(_first(data, backend="torch-cpu"))


def _set_fingerprint(data):
    fp = data["fingerprints"]["jax-cpu"][0]
    fp.update(label="BF16_BF16_F32", passes=1, input_bits=[7, 7])


TAMPERINGS = {
    # name: (change, bitwise, expected text in the drift line(s), record whose name appears)
    "bound_ratio_over_1": (_set_ratio(1.5), False, "bound_ratio 1.5 -> "),
    "status": (_set_status, False, "status fail -> pass"),
    "nan_count": (_set_nan, False, "nan_count 3 -> 0"),
    "removed_record": (_drop_record, False, "record null -> pass (not in the baseline"),
    "fingerprint": (_set_fingerprint, False, "label BF16_BF16_F32 -> F32_F32_F32"),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_tampered_baseline_is_caught(runs, tmp_path, name):
    change, bitwise, text = TAMPERINGS[name]
    path = _tampered(runs, tmp_path, change)
    rerun = runs["dirs"][1]
    r = run_diag("check", str(rerun), "--baseline", str(path), *(["--bitwise"] if bitwise else []))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert text in out
    if name != "fingerprint":
        rec = next(x for x in json.loads(runs["baseline"].read_text())["records"]
                   if x not in json.loads(path.read_text())["records"])
        assert f"{rec['probe']} | {rec['case']} | {rec['backend']}:" in r.stdout


def test_removed_record_from_run_is_missing(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["dirs"][1], run)
    lines = (run / "results.jsonl").read_text().splitlines()
    gone = json.loads(lines[-1])
    (run / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    r = run_diag("check", str(run), "--baseline", str(runs["baseline"]))
    assert r.returncode == 1
    assert (f"{gone['probe']} | {gone['case']} | {gone['backend']}: record {gone['status']} -> "
            "null (in the baseline, missing from this run)") in r.stdout


def test_tampered_run_is_caught(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["dirs"][1], run)
    records = _records(run)
    victim = next(r for r in records if r["backend"] == "torch-cpu" and r["op"] == "matmul")
    victim["metrics"]["bound_ratio"] = 3.0
    victim["metrics"]["bound_exceeded"] = 5
    victim["status"] = "fail"
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run_diag("check", str(run), "--baseline", str(runs["baseline"]), "--junit",
                 str(tmp_path / "junit.xml"))
    assert r.returncode == 1
    # Every line on stdout (`diag check > out.txt` keeps what drifted), said once: one cause.
    assert r.stderr == ""
    assert r.stdout.count("diag: drift:") == 1, r.stdout
    where = f"{victim['probe']} | {victim['case']} | torch-cpu"
    assert f"{where}: status pass -> fail" in r.stdout
    assert f"{where}: bound_ratio " in r.stdout and "-> 3 (crossed its allowance 1" in r.stdout
    assert f"{where}: bound_exceeded 0 -> 5" in r.stdout
    junit = xmlschema.XMLSchema(str(XSD))
    junit.validate(str(tmp_path / "junit.xml"))
    doc = junit.to_dict(str(tmp_path / "junit.xml"))
    cases = doc["testsuite"][0]["testcase"]
    assert len(cases) == len(records)
    failed = [c for c in cases if "failure" in c]
    assert [c["@name"] for c in failed] == [f"{victim['case']} [torch-cpu]"]
    assert "status pass -> fail" in failed[0]["failure"]["@message"] \
        or "fail:" in failed[0]["failure"]["@message"]


def test_move_inside_the_bound_is_not_drift_unless_bitwise(runs, tmp_path):
    """Two correct implementations may land anywhere inside the bound: 0.999 is no drift."""
    path = _tampered(runs, tmp_path, _set_ratio(0.999))
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path), "--bitwise")
    assert r.returncode == 1
    assert "bound_ratio 0.999 -> " in r.stdout and "bitwise: the metric changed" in r.stdout


def test_changed_digest_is_drift_only_bitwise(runs, tmp_path):
    def change(data):
        rec = _first(data, backend="jax-cpu")
        rec["digests"] = ["0" * 64 for _ in rec["digests"]]
    path = _tampered(runs, tmp_path, change)
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path), "--bitwise")
    assert r.returncode == 1
    assert "output 0 sha256 000000000000 -> " in r.stdout


def test_key_mismatch_is_reported_and_bitwise_names_it_as_the_likely_cause(runs, tmp_path):
    def change(data):
        data["key"]["hardware"]["cpu_model"] = "Some Other CPU"
        data["key"]["versions"]["package numpy"] = "0.0.1"
        rec = _first(data, backend="jax-cpu")
        rec["digests"] = ["0" * 64 for _ in rec["digests"]]
    path = _tampered(runs, tmp_path, change)
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 0, r.stdout + r.stderr  # the tolerance rule holds across versions
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path), "--bitwise")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "key mismatch: hardware: cpu_model Some Other CPU -> " in r.stdout
    assert "key mismatch: versions: package numpy 0.0.1 -> " in r.stdout
    assert "--bitwise still compares the bits" in r.stdout
    # The bits are compared: the one record whose digests were changed is the one drift,
    # with the key difference named as its likely cause.
    rec = _first(json.loads(path.read_text()), backend="jax-cpu")
    drift = [ln for ln in r.stdout.splitlines() if ln.startswith("diag: drift:")]
    assert len(drift) == 1 and f"{rec['probe']} | {rec['case']} | jax-cpu" in drift[0]
    assert "output(s) differ in their bits; likely cause: versions: package numpy 0.0.1 -> " \
        in drift[0]


@pytest.mark.parametrize("content, words", [
    ('{"schema": "diag.baseline/1", "key": {', "not valid JSON"),
    ("[1, 2]", "schema is 'list'"),
    ('{"schema": "diag.baseline/0"}', "schema is 'diag.baseline/0'"),
    ('{"schema": "diag.baseline/1", "key": {"hardware": {}, "versions": {}, "settings": {}}, '
     '"fingerprints": {}, "backends": [], "records": [{"probe": 1}]}', "record 0 lacks"),
    ('{"schema": "diag.baseline/1", "key": {"hardware": {}, "versions": {}, "settings": {}}, '
     '"fingerprints": {}, "features": {"jax-cpu": "nearest"}, "backends": [], "records": []}',
     "field 'features' must map backends to lists of objects"),
    (None, "no such baseline file"),
])
def test_unusable_baseline_exits_2_with_one_line(runs, tmp_path, content, words):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: ") and words in lines[0], r.stderr


def test_baseline_of_another_suite_exits_2(runs, tmp_path):
    path = _tampered(runs, tmp_path, lambda d: d.update(suite="ci"))
    r = run_diag("check", str(runs["dirs"][1]), "--baseline", str(path))
    assert r.returncode == 2
    assert "the baseline is for suite 'ci', the run is of suite 'tiny'" in r.stderr


def test_not_a_run_folder_exits_2(runs, tmp_path):
    for args in (("baseline", str(tmp_path), "-o", str(tmp_path / "b.json")),
                 ("check", str(tmp_path), "--baseline", str(runs["baseline"]))):
        r = run_diag(*args)
        assert r.returncode == 2
        assert r.stderr.strip().startswith("diag: ") and "no run.json" in r.stderr


def test_baseline_of_unfinished_run_exits_2(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["dirs"][1], run)
    meta = json.loads((run / "run.json").read_text())
    meta["state"] = "interrupted"
    (run / "run.json").write_text(json.dumps(meta))
    r = run_diag("baseline", str(run), "-o", str(tmp_path / "b.json"))
    assert r.returncode == 2 and "the run is 'interrupted', not finished" in r.stderr


def test_run_with_damaged_records_exits_2(runs, tmp_path):
    """A verdict without an unreadable line may hide a failure: no gate on a damaged run."""
    run = tmp_path / "run"
    shutil.copytree(runs["dirs"][1], run)
    lines = (run / "results.jsonl").read_text().splitlines()
    lines[1] = "{not json"
    (run / "results.jsonl").write_text("\n".join(lines) + "\n")
    r = run_diag("check", str(run), "--baseline", str(runs["baseline"]))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "1 line(s) of" in r.stderr and "(line 2)" in r.stderr


def test_unwritable_baseline_path_exits_2(runs, tmp_path):
    (tmp_path / "afile").write_text("")  # missing folders are created; a file is in the way
    r = run_diag("baseline", str(runs["dirs"][0]), "-o", str(tmp_path / "afile" / "b.json"))
    assert r.returncode == 2
    assert r.stderr.startswith("diag: ") and "cannot write the baseline" in r.stderr
