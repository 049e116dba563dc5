"""`diag nodes` names the device or host that computes wrong bits, and nothing else.

Claims: the vote names exactly the device that differs (majority), refuses to guess with two
devices unless a golden digest or a repeat disagreement decides; a single device's repeats of
the same input are compared (intermittent faults); stragglers are `slow`, not suspects; the
detection probability is the stated formula. End to end on CPU host devices: a clean scan of
8 devices exits 0 over many repeats; a 1% injected fault on one device is named with every
injected fault caught; with 3 jax.distributed processes, process 0 names the process whose
workload corrupts its output, and names the process started with another XLA flag as
misconfigured (with the flag) whether or not its bits differ. Subprocesses run this interpreter's
own `diag` script, and the pod example the interpreter it is given (never a `python` on PATH).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diag import nodes

from diag.worker import faults
from diag.errors import UsageError
from diag.nodes import store
from tests.conftest import REPO_ROOT, needs_jax

DIAG = [str(Path(sys.executable).parent / "diag")]  # this interpreter's console script


def run_diag(*args: str, env: dict | None = None, timeout: float = 300):
    """The real `diag` script of the interpreter running the tests, in a subprocess."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(DIAG + list(args), capture_output=True, text=True, timeout=timeout,
                          env=full)


def _obs(digests, times=None, nan=None):
    """Synthetic observations: digests[d][w][r] as short strings."""
    dig = np.array(digests, dtype=object)
    D, W, R = dig.shape
    devices = [{"device_id": d, "process_index": 0, "host": "h", "kind": "cpu",
                "platform": "cpu"} for d in range(D)]
    zeros = np.zeros((D, W, R), np.int64)
    return nodes.Observations(
        devices, [f"w{w}" for w in range(W)], dig,
        zeros.copy() if nan is None else np.array(nan), zeros.copy(),
        np.full((D, W, R), 1e-3) if times is None else np.array(times, float),
        np.zeros((D, W, R), bool))


def _suspect_ids(result):
    return sorted(s["device_id"] for s in result.suspects)


# --- the vote (no jax) -----------------------------------------------------------------------

def test_majority_names_only_the_device_that_differs():
    good = [["a0", "a1", "a0", "a1"]]
    bad = [["a0", "XX", "a0", "a1"]]
    result = nodes.analyze(_obs([good, good, bad, good]))
    assert _suspect_ids(result) == [2]
    dev = result.devices[2]
    assert dev["mismatched_calls"] == 1 and dev["kinds"] == ["mismatch", "intermittent"]
    assert "w0 repeats 1" in dev["reason"]
    assert result.exit_code == 3


def test_clean_observations_exit_0():
    good = [["a0", "a1", "a0", "a1"], ["b0", "b1", "b0", "b1"]]
    result = nodes.analyze(_obs([good] * 5))
    assert result.suspects == [] and result.exit_code == 0
    assert all(d["verdict"] == "ok" for d in result.devices)


def test_two_devices_that_disagree_are_both_named_and_the_tie_is_said():
    result = nodes.analyze(_obs([[["a0", "a1"]], [["a0", "ZZ"]]]))
    assert _suspect_ids(result) == [0, 1]
    assert all("no-majority" in s["kinds"] for s in result.suspects)
    assert any("two devices" in n for n in result.notes)


def test_a_golden_digest_breaks_a_two_device_tie():
    result = nodes.analyze(_obs([[["a0", "a1"]], [["a0", "ZZ"]]]),
                           golden={"w0": ["a0", "a1"]})
    assert _suspect_ids(result) == [1]
    assert result.references["golden"] == 1


def test_repeat_disagreement_breaks_a_two_device_tie():
    # Device 1 answers input 1 two ways; device 0 is consistent: device 1 is the one to blame.
    result = nodes.analyze(_obs([[["a0", "a1", "a0", "a1"]], [["a0", "ZZ", "a0", "a1"]]]))
    assert _suspect_ids(result) == [1]


def test_single_device_repeats_of_the_same_input_are_compared():
    result = nodes.analyze(_obs([[["a0", "a1", "a0", "a1", "a0", "QQ"]]]))
    assert _suspect_ids(result) == [0]
    assert result.suspects[0]["kinds"] == ["intermittent"]
    assert any("one device" in n for n in result.notes)


def test_nan_in_a_wrong_output_is_counted_but_a_nan_everyone_gets_is_the_workload():
    dig = [[["n0", "a1"]], [["n0", "a1"]], [["n0", "NN"]]]
    nan = [[[3, 0]], [[3, 0]], [[3, 5]]]
    result = nodes.analyze(_obs(dig, nan=nan))
    assert _suspect_ids(result) == [2]
    assert "nan" in result.suspects[0]["kinds"]
    assert result.devices[0]["nan_count"] == 3 and result.devices[0]["verdict"] == "ok"
    assert any("w0 returns NaN/Inf in the reference" in n for n in result.notes)


def test_straggler_is_slow_not_a_suspect_unless_asked():
    dig = [[["a0", "a1", "a0"]]] * 4
    times = [[[1e-3, 1e-3, 1e-3]]] * 3 + [[[5e-3, 4e-3, 6e-3]]]
    result = nodes.analyze(_obs(dig, times=times))
    assert result.suspects == [] and result.exit_code == 0
    assert [s["device_id"] for s in result.slow] == [3]
    assert result.devices[3]["verdict"] == "slow"
    strict = nodes.analyze(_obs(dig, times=times), fail_on_slow=True)
    assert _suspect_ids(strict) == [3] and strict.exit_code == 3


def test_one_slow_repeat_is_noise_not_a_straggler():
    dig = [[["a0", "a1", "a0"]]] * 4
    times = [[[1e-3, 1e-3, 1e-3]]] * 3 + [[[1e-3, 50e-3, 1e-3]]]
    assert nodes.analyze(_obs(dig, times=times)).slow == []


def test_scan_result_is_typed_and_nodes_json_keeps_its_keys_in_order():
    vote = nodes.analyze(_obs([[["a0", "a1"]], [["a0", "a1"]], [["a0", "XX"]]]))
    result = nodes.NodeScan(
        **vote.to_dict(), process_index=0, num_processes=1, platform="cpu", device_kind="cpu",
        versions={"jax": "0"}, repeats=2, seed=0, inputs_per_workload=2, workloads=[],
        golden={}, injections=[], detection={}, selftest=None, local_devices=3,
        compile_seconds=0.0, scan_seconds=0.0, seconds_per_device=0.0, total_seconds=0.0)
    data = result.to_dict()
    # The keys nodes.json (schema diag.nodes/1) has had since it was a dict, in that order.
    assert list(data) == [
        "schema", "process_index", "num_processes", "platform", "device_kind", "versions",
        "repeats", "seed", "inputs_per_workload", "workloads", "golden", "injections",
        "detection", "selftest", "local_devices", "compile_seconds", "scan_seconds",
        "seconds_per_device", "total_seconds", "verdict", "exit_code", "devices", "suspects",
        "slow", "hosts", "references", "fleet_median_repeat_s", "notes",
        # Added after them (the schema stays diag.nodes/1: readers of the old keys still work).
        "framework", "misconfigured", "config"]
    assert data["schema"] == nodes.NODES_SCHEMA == "diag.nodes/1"
    assert data["suspects"] == vote.suspects and [s["device_id"] for s in vote.suspects] == [2]
    assert json.loads(json.dumps(data)) == data


# --- detection probability and injection ---------------------------------------------------

@pytest.mark.parametrize("rate,workloads", [(0.01, 4), (0.001, 1), (0.3, 2)])
def test_repeats_for_99_is_the_smallest_r_reaching_99_percent(rate, workloads):
    r = nodes.repeats_for(rate, workloads, 0.99)
    assert nodes.detection_probability(rate, r, workloads) >= 0.99
    assert r == 1 or nodes.detection_probability(rate, r - 1, workloads) < 0.99
    assert nodes.detection_probability(rate, r, workloads) == pytest.approx(
        1 - (1 - rate) ** (r * workloads))


def test_detection_probability_matches_a_simulation():
    rng = np.random.default_rng(1)
    rate, calls = 0.01, 40
    caught = (rng.random((20000, calls)) < rate).any(axis=1).mean()
    assert caught == pytest.approx(nodes.detection_probability(rate, 10, 4), abs=0.01)


@pytest.mark.parametrize("text,message", [
    ("device=3,kind=melt", "kind must be one of nan, bitflip, stuck, slow"),
    ("device=3,kind=nan,rate=0", "rate must be in (0, 1]"),
    ("kind=nan,rate=0.1", "name the faulty device=ID and/or process=INDEX"),
    ("device=x,kind=nan", "invalid literal for int()"),
    ("device=1,kind=nan,color=red", "unknown key(s) color"),
])
def test_bad_injection_is_a_usage_error(text, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nodes.parse_injection(text)


def test_each_fault_kind_changes_the_output_as_described():
    out = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    stale = out + 1
    rng = np.random.default_rng(0)
    flipped = faults.corrupt(out, "bitflip", rng=rng, stale=stale)
    diff = np.bitwise_xor(flipped.view(np.uint32), out.view(np.uint32))
    assert [bin(int(x)).count("1") for x in diff.ravel() if x] == [1]
    with_nan = faults.corrupt(out, "nan", rng=rng, stale=stale)
    assert np.isnan(with_nan).sum() == 1 and np.isnan(out).sum() == 0
    assert np.array_equal(faults.corrupt(out, "stuck", rng=rng, stale=stale), stale)


def test_worker_fault_kinds_corrupt_a_copy_as_described():
    out = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    doubled = faults.corrupt(out, "double")
    assert doubled[0, 0] == 2 * out[0, 0] and out[0, 0] == 1  # a copy: the truth is kept
    assert np.array_equal(doubled.ravel()[1:], out.ravel()[1:])
    truncated = faults.corrupt(out, "truncate")
    assert truncated.shape == (3, 3) and np.array_equal(truncated, out[:, :3])
    # One vocabulary: the worker's output faults and --inject's are kinds of faults.corrupt.
    assert set(faults.WORKER_OUTPUT_FAULTS.values()) <= set(faults.OUTPUT_FAULTS)
    assert set(nodes.FAULT_KINDS) - {"slow"} <= set(faults.OUTPUT_FAULTS)
    with pytest.raises(ValueError, match="unknown fault kind 'melt'"):
        faults.corrupt(out, "melt")


def test_golden_store_is_outside_what_cache_clear_removes(tmp_path, monkeypatch):
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    monkeypatch.setenv("DIAG_CACHE_DIR", str(tmp_path / "cache"))
    path = store.golden_path(store.default_golden_dir(), "cpu", "cpu",
                             {"jax": "1", "jaxlib": "1"})
    keys = {"w0": "w0/v1"}
    store.mark_cache_folder(store.default_golden_dir())  # what scan(save_golden=True) does
    store.save_golden(path, keys, np.array([[["a0", "a1"]]] * 3, dtype=object), {})
    GroundTruthCache(default_cache_dir()).clear()
    assert store.load_golden(path, keys) == {"w0": ["a0", "a1"]}


def test_bad_injection_on_the_command_line_exits_2_with_one_line():
    out = run_diag("nodes", "--inject", "device=1,kind=melt", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "diag: --inject 'device=1,kind=melt': kind must be one of nan, bitflip, stuck, slow"]


# --- end to end on CPU host devices ----------------------------------------------------------

def _scan(*args, tmp_path, timeout=120, env=None):
    out = run_diag("nodes", "--json", "--out", str(tmp_path / "runs"), *args, timeout=timeout,
                   env={"DIAG_CACHE_DIR": str(tmp_path / "cache"), **(env or {})})
    data = json.loads(out.stdout) if out.stdout.strip().startswith("{") else None
    return out, data


@needs_jax
def test_clean_scan_of_8_host_devices_over_many_repeats_exits_0(tmp_path):
    out, data = _scan("--host-devices", "8", "--repeats", "40", "-w", "matmul_bf16,softmax",
                      tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(data["devices"]) == 8 and data["suspects"] == []
    assert all(d["mismatched_calls"] == 0 and d["calls"] == 80 for d in data["devices"])
    assert data["references"] == {"majority": 80, "golden": 0, "undecided": 0}


@needs_jax
def test_injected_1_percent_fault_on_one_device_is_named(tmp_path):
    workloads = 2
    repeats = nodes.repeats_for(0.01, workloads, 0.99)
    out, data = _scan("--host-devices", "8", "--repeats", str(repeats),
                      "-w", "matmul_f32,softmax", "--inject", "device=5,kind=bitflip,rate=0.01",
                      tmp_path=tmp_path)
    assert out.returncode == 3, out.stderr
    assert [(s["device_id"], s["process_index"], s["host"]) for s in data["suspects"]] == [
        (5, 0, socket.gethostname())]
    dev5 = data["devices"][5]
    assert dev5["injected_calls"] > 0 and dev5["injected_caught"] == dev5["injected_calls"]
    assert dev5["mismatched_calls"] == dev5["injected_calls"]
    row = next(r for r in data["detection"]["rows"] if r["rate"] == 0.01)
    assert row["p_detect"] >= 0.99
    assert data["selftest"]["verdict"] == "found"
    assert [o["found"] for o in data["selftest"]["injections"]] == [True]
    run = tmp_path / "runs" / os.path.basename(data["run_dir"])
    saved = json.loads((run / "nodes.json").read_text())
    assert saved["suspects"] == data["suspects"]
    html = (run / "report.html").read_text()
    section = html[html.index('<section id="nodes"'):html.index('<section id="failures"')]
    assert "device 5" in section and "suspect" in section


@needs_jax
def test_golden_digest_names_the_bad_one_of_two_devices(tmp_path):
    base = ["--host-devices", "2", "--repeats", "4", "-w", "matmul_f32"]
    out, data = _scan(*base, "--save-golden", tmp_path=tmp_path)
    assert out.returncode == 0 and data["golden"]["saved"] == 1, out.stderr
    cleared = run_diag("cache", "clear", env={"DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert cleared.returncode == 0, cleared.stderr  # diag's folder, and the golden stays
    out, data = _scan(*base, "--inject", "device=1,kind=stuck,rate=1", tmp_path=tmp_path)
    assert out.returncode == 3, out.stderr
    assert data["golden"]["compared"] == ["matmul_f32"]
    assert [s["device_id"] for s in data["suspects"]] == [1]


@needs_jax
def test_golden_digests_are_numerics_bits_digest_of_each_builtin_output(tmp_path):
    # One digest for host, worker and nodes: what --save-golden stores is what
    # numerics.bits_digest gives for the builtin's output, computed here in-process.
    import jax

    from diag.numerics import bits_digest

    names = ["matmul_bf16", "softmax", "train_step"]
    out, data = _scan("--host-devices", "1", "--repeats", "2", "-w", ",".join(names),
                      "--save-golden", tmp_path=tmp_path)
    assert out.returncode == 0 and data["golden"]["saved"] == len(names), out.stderr
    stored = json.loads(open(data["golden"]["path"]).read())
    assert stored["schema"] == store.GOLDEN_SCHEMA
    for name in names:
        w = nodes.builtin_workload(name)
        fn = w.build()
        expected = [bits_digest(np.asarray(fn(jax.device_put(w.make_input(0, k),
                                                             jax.devices("cpu")[0]))))
                    for k in range(nodes.INPUTS_PER_WORKLOAD)]
        assert stored["workloads"][w.key(0)] == expected, name


@needs_jax
def test_injected_fault_that_never_fires_is_a_failed_self_test_with_the_repeats_needed(
        tmp_path):
    # 8 devices, 2 repeats x 1 workload at rate 0.001: P(fire) = 0.2%; the seeded draw does
    # not fire, so the scan sees 8 agreeing devices, which must not read as a passed self-test.
    out, data = _scan("--host-devices", "8", "--repeats", "2", "-w", "matmul_f32",
                      "--inject", "device=5,kind=bitflip,rate=0.001", tmp_path=tmp_path)
    assert data is not None, out.stderr
    assert data["devices"][5]["injected_calls"] == 0 and data["suspects"] == []
    assert out.returncode == 1 == data["exit_code"] == nodes.EXIT_SELFTEST_MISSED
    (outcome,) = data["selftest"]["injections"]
    need = nodes.repeats_for(0.001, 1, 0.99)
    assert (outcome["found"], outcome["fired"], outcome["repeats_for_99"]) == (False, 0, need)
    assert data["selftest"]["verdict"] == "missed"
    assert "never fired in 2 repeat(s) x 1 workload(s)" in outcome["text"]
    assert outcome["text"].endswith(f"use --repeats {need}")
    run = tmp_path / "runs" / os.path.basename(data["run_dir"])
    meta = json.loads((run / "run.json").read_text())
    assert meta["exit_code"] == 1 and meta["nodes"]["selftest"] == "missed"
    html = (run / "report.html").read_text()
    section = html[html.index('<section id="nodes"'):html.index('<section id="failures"')]
    assert "self-test FAILED" in section and f"--repeats {need}" in section


@needs_jax
def test_terminal_says_the_self_test_failed(tmp_path):
    out = run_diag("nodes", "--no-report", "--out", str(tmp_path / "runs"), "--host-devices",
                   "4", "--repeats", "2", "-w", "matmul_f32", "--inject",
                   "device=2,kind=nan,rate=0.001", env={"COLUMNS": "400"}, timeout=120)
    assert out.returncode == 1, out.stderr
    need = nodes.repeats_for(0.001, 1, 0.99)
    lines = (out.stdout + out.stderr).splitlines()
    failed = [line for line in lines if line.startswith("diag: self-test FAILED: ")]
    assert len(failed) == 1 and failed[0].endswith(f"use --repeats {need}"), lines


@needs_jax
def test_injected_fault_that_fires_but_cannot_be_seen_is_a_failed_self_test(tmp_path):
    # One device, one repeat: no majority, no golden digest, no input seen twice.
    out, data = _scan("--host-devices", "1", "--repeats", "1", "-w", "matmul_f32",
                      "--inject", "device=0,kind=bitflip,rate=1", tmp_path=tmp_path)
    assert out.returncode == 1, out.stderr
    (outcome,) = data["selftest"]["injections"]
    assert outcome["fired"] == data["devices"][0]["injected_calls"] == 1
    assert outcome["caught"] == 0 and not outcome["found"]
    assert "no reference to compare with" in outcome["text"]


def test_injection_outcomes_tell_never_fired_from_unseen_and_found():
    # The verdict of a synthetic scan: device 1 had 3 faulty calls; what it was judged decides.
    def verdict(kinds, caught):
        devs = [{"device_id": d, "process_index": 0, "verdict": "ok", "kinds": [],
                 "injected_calls": 0, "injected_caught": 0} for d in range(3)]
        devs[1].update(kinds=kinds, injected_calls=3, injected_caught=caught,
                       verdict="suspect" if caught else ("slow" if kinds else "ok"))
        return {"devices": devs, "repeats": 4, "workloads": ["w0"],
                "references": {"majority": 4, "golden": 0}}

    slow = nodes.Injection("slow", rate=0.5, device=1)
    flip = nodes.Injection("bitflip", rate=0.5, device=1)
    (o,) = nodes.injection_outcomes(verdict([], 0), [slow])
    assert not o["found"] and "needs rate=1" in o["text"] and o["repeats_for_99"] is None
    (o,) = nodes.injection_outcomes(verdict(["slow"], 0), [slow])
    assert o["found"] and o["text"].startswith("self-test passed")
    (o,) = nodes.injection_outcomes(verdict(["mismatch"], 3), [flip])
    assert o["found"] and (o["fired"], o["caught"]) == (3, 3)
    (o,) = nodes.injection_outcomes(verdict([], 0), [flip])
    assert not o["found"] and "bits equal the reference" in o["text"]
    other = nodes.Injection("nan", rate=0.01, device=2)  # device 2 got no faulty call
    (o,) = nodes.injection_outcomes(verdict([], 0), [other])
    assert not o["found"] and o["fired"] == 0
    assert o["text"].endswith(f"use --repeats {nodes.repeats_for(0.01, 1, 0.99)}")


@needs_jax
@pytest.mark.parametrize("spec, message", [
    ("device=99,kind=nan", "--inject 'device=99,kind=nan,rate=1': no device 99 in this scan "
                           "(device ids 0-3); name one of the scanned devices"),
    ("process=1,kind=bitflip,rate=0.5", "--inject 'process=1,kind=bitflip,rate=0.5': no "
                                        "process 1 in this scan (device ids 0-3 on process(es) "
                                        "0); name one of the scanned devices"),
])
def test_injection_that_cannot_apply_exits_2_with_one_line(tmp_path, spec, message):
    out, data = _scan("--host-devices", "4", "--repeats", "1", "-w", "matmul_f32",
                      "--inject", spec, tmp_path=tmp_path)
    assert out.returncode == 2 and data is None
    assert out.stderr.strip().splitlines() == [f"diag: {message}"]
    assert not (tmp_path / "runs").exists()


@needs_jax
def test_unknown_xla_flag_exits_2_naming_it_before_jax_starts(tmp_path):
    out, data = _scan("--host-devices", "2", "--repeats", "1", "-w", "matmul_f32",
                      tmp_path=tmp_path, env={"XLA_FLAGS": "--xla_nonexistent_flag=1"})
    assert out.returncode == 2 and data is None, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag: XLA_FLAGS: bad flag "
                                                   "'--xla_nonexistent_flag=1'"), lines
    assert not (tmp_path / "runs").exists()


@needs_jax
def test_library_scan_refuses_an_unknown_xla_flag_instead_of_dying():
    code = ("from diag import nodes\n"
            "from diag.settings.flags import BadFlag\n"
            "try:\n    nodes.scan(host_devices=2, repeats=1)\n"
            "except BadFlag as e:\n    print('refused:', e.flag)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                                           "XLA_FLAGS": "--xla_nonexistent_flag=1"})
    assert out.returncode == 0 and out.stdout == "refused: --xla_nonexistent_flag=1\n", \
        out.stderr[-2000:]


@needs_jax
def test_host_devices_after_jax_started_with_another_count_is_refused():
    code = ("import jax; jax.devices()\n"
            "from diag import nodes\n"
            "try:\n    nodes.scan(host_devices=3, repeats=1)\n"
            "except nodes.UsageError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in os.environ.items()
                                          if k != "XLA_FLAGS"})
    assert out.stdout.startswith("diag: --host-devices 3: jax was already started in this "
                                 "process with 1 CPU device(s)"), out.stdout + out.stderr


CORRUPTING_WORKLOAD = '''
import jax
import jax.numpy as jnp

_f = jax.jit(lambda x: jnp.tanh(x @ x.T))


def work(x):
    y = _f(x)
    if jax.process_index() == 1:  # this host's devices compute a wrong finite value
        y = y.at[0, 0].add(1e-3)
    return y
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST_MATH = "--xla_cpu_enable_fast_math=true"


@needs_jax
def test_three_processes_name_the_corrupting_one_and_the_misconfigured_one(tmp_path):
    # Process 1's workload corrupts its output; process 2 runs with XLA's CPU fast math, which
    # computes the builtin matmul bit-identically on jax 0.10.2 CPU: misconfigured all the same.
    workload = tmp_path / "corrupting.py"
    workload.write_text(CORRUPTING_WORKLOAD)
    port = _free_port()
    flags = os.environ.get("XLA_FLAGS", "")
    procs = [subprocess.Popen(
        DIAG + ["nodes", "--json", "--out", str(tmp_path / "runs"), "--distributed",
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "3",
                "--process-id", str(i), "--host-devices", "2", "--repeats", "4",
                "--workload", f"{workload}:work", "--input-shape", "32,16",
                "-w", "matmul_f32", "--init-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DIAG_CACHE_DIR": str(tmp_path / "cache"),
             "XLA_FLAGS": f"{flags} {FAST_MATH}" if i == 2 else flags,
             "PYTHONPATH": str(REPO_ROOT)}) for i in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [3, 3, 3], [r[1][-2000:] for r in results]
    data = json.loads(results[0][0])
    assert len(data["devices"]) == 6 and data["num_processes"] == 3
    host = socket.gethostname()
    hw = sorted((s["process_index"], s["host"]) for s in data["suspects"])
    # Process 1 corrupts; process 2 is a hardware suspect only if fast math changed its bits.
    assert hw[:2] == [(1, host)] * 2 and set(hw[2:]) <= {(2, host)}, hw
    # The other hosts are never suspects for process 1's fault; whether one of them is also
    # reported `slow` is timing (a straggler, reported apart), which a loaded CI machine
    # decides, not the vote.
    verdicts = [h["verdict"] for h in data["hosts"]]
    assert verdicts[1] == "suspect" and verdicts[0] in {"ok", "slow"}, verdicts
    # Wrong on every call, the same way each time: not intermittent (it may also be slower).
    assert all(s["kinds"][0] == "mismatch" and "intermittent" not in s["kinds"]
               for s in data["suspects"] if s["process_index"] == 1), data["suspects"]
    # Configuration: process 2 alone, with the flag, its value and the majority's (unset).
    (m,) = data["misconfigured"]
    assert (m["process_index"], m["host"]) == (2, host)
    assert {"key": "XLA_FLAGS --xla_cpu_enable_fast_math", "value": "true",
            "majority": "(unset)"} in m["differs"]
    assert m["hardware_suspect"] == any(p == 2 for p, _ in hw)
    if not m["hardware_suspect"]:  # its bits agree (measured here): named for its flag alone
        assert all(d["mismatched_calls"] == 0 for d in data["devices"]
                   if d["process_index"] == 2)
    assert results[1][0] == "" and results[2][0] == ""  # only process 0 writes the verdict
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.slow
@needs_jax
def test_a_debug_xla_flag_that_changes_the_bits_is_both_misconfigured_and_a_suspect(tmp_path):
    # --xla_backend_optimization_level=0 changes the builtin train step's bits on jax 0.10.2
    # CPU (measured); wherever it does, the host is named for both, and says so.
    port = _free_port()
    flags = os.environ.get("XLA_FLAGS", "")
    procs = [subprocess.Popen(
        DIAG + ["nodes", "--json", "--out", str(tmp_path / "runs"), "--distributed",
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "3",
                "--process-id", str(i), "--repeats", "3", "-w", "train_step",
                "--init-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DIAG_CACHE_DIR": str(tmp_path / "cache"),
             "XLA_FLAGS": f"{flags} --xla_backend_optimization_level=0" if i == 1 else flags,
             "PYTHONPATH": str(REPO_ROOT)}) for i in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [3, 3, 3], [r[1][-2000:] for r in results]
    data = json.loads(results[0][0])
    (m,) = data["misconfigured"]
    assert m["process_index"] == 1 and {"key": "XLA_FLAGS --xla_backend_optimization_level",
                                        "value": "0", "majority": "(unset)"} in m["differs"]
    hw = [s["process_index"] for s in data["suspects"]]
    assert set(hw) <= {1} and m["hardware_suspect"] == (hw == [1])
    if hw:
        assert data["verdict"] == "suspect" and data["suspects"][0]["misconfigured"]
        assert "misconfigured and a hardware suspect" in m["reason"]
    else:
        assert data["verdict"] == "misconfigured"


@needs_jax
def test_pod_scan_example_self_test_names_the_faulty_process(tmp_path):
    # `python` and `python3` on PATH are not this interpreter (they fail): the example must run
    # the interpreter it is given, as it must on a machine where the venv is not activated.
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text("#!/bin/sh\necho 'wrong python' >&2\nexit 97\n")
        (fake / name).chmod(0o755)
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "pod_scan.sh")
    out = subprocess.run(["bash", script], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env={**os.environ, "SELFTEST": "1", "REPEATS": "10",
                                            "OUT": str(tmp_path / "r"),
                                            "PYTHON": sys.executable,
                                            "PYTHONPATH": str(REPO_ROOT),
                                            "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
                                            "DIAG_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 3, out.stderr
    host = socket.gethostname()
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"exclude: [('{host}', 1, "), lines
    # Process 2 runs with --xla_cpu_enable_fast_math=true: misconfigured, named for the flag.
    assert lines[1].startswith(f"misconfigured: [('{host}', 2, ['"), lines
    assert "'XLA_FLAGS --xla_cpu_enable_fast_math'" in lines[1] and "', 0, " not in lines[1]
    assert f"('{host}', 0, " not in out.stdout
