"""`diag nodes` on torch.distributed, and why a host differs: hardware or configuration.

Claims: the configuration comparison names exactly the process whose value of a key differs
from the majority's (with the key, its value and the majority's), names both of two processes
that differ, and marks a process that is both misconfigured and a hardware suspect; the
framework is detected from torchrun's variables; the torch builtins compute what their float64
definitions say (within float32 / bfloat16 rounding); the nodes package has no import cycle and
imports no private name from another module. End to end through the real `diag` script under
`torchrun` (the interpreter's own, 3 ranks over gloo, loopback, a free port): rank 1's workload
corrupts its outputs (from outside diag) and is the hardware suspect; rank 2 runs with another
float32 matmul precision and is misconfigured with the keys that differ, whether or not its bits
differ; a clean job exits 0 on every rank.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diag import nodes
from diag.nodes import config
from tests.conftest import REPO_ROOT, needs_torch

DIAG = str(Path(sys.executable).parent / "diag")  # the console script of this interpreter
EXAMPLES = REPO_ROOT / "examples"


def _torchrun() -> list[str]:
    """The torchrun of the interpreter running the tests (its script, else its module)."""
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith((
        "TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), DIAG_CACHE_DIR=str(tmp_path / "cache"), **extra)
    return env


# --- the configuration comparison (no framework) ---------------------------------------------

def _fp(**kw):
    return {"python": "3.11", "XLA_FLAGS --xla_foo": "1", **kw}


PROCS = [{"process_index": p, "host": f"h{p}"} for p in range(4)]


def test_the_process_off_the_majority_is_named_with_key_value_and_majority():
    fps = [_fp(), _fp(), _fp(**{"torch float32_matmul_precision": "medium"}), _fp()]
    for fp in fps[:2] + fps[3:]:
        fp["torch float32_matmul_precision"] = "highest"
    bad, summary = config.compare(fps, PROCS)
    assert [(m["process_index"], m["host"]) for m in bad] == [(2, "h2")]
    assert bad[0]["differs"] == [{"key": "torch float32_matmul_precision", "value": "medium",
                                  "majority": "highest"}]
    assert bad[0]["reason"] == ("configuration differs: torch float32_matmul_precision = "
                                "medium (majority: highest)")
    assert summary["reference"]["torch float32_matmul_precision"] == "highest"
    assert summary["no_majority"] == [] and summary["processes"] == 4


def test_a_key_only_one_process_has_reads_unset_for_the_others():
    fps = [_fp(), _fp(), _fp(**{"XLA_FLAGS --xla_cpu_enable_fast_math": "true"})]
    bad, _ = config.compare(fps, PROCS[:3])
    assert [m["differs"] for m in bad] == [[{"key": "XLA_FLAGS --xla_cpu_enable_fast_math",
                                             "value": "true", "majority": config.UNSET}]]


def test_two_processes_that_differ_are_both_named_without_a_majority():
    bad, summary = config.compare([_fp(), _fp(python="3.12")], PROCS[:2])
    assert [m["process_index"] for m in bad] == [0, 1]
    assert [m["differs"][0]["majority"] for m in bad] == [None, None]
    assert summary["no_majority"] == ["python"]
    assert config.compare([_fp(), _fp()], PROCS[:2])[0] == []
    assert config.compare([_fp()], PROCS[:1])[0] == []


def test_a_process_that_is_both_says_so_and_one_that_is_only_misconfigured_does_not():
    # Process 1's bits differ on every call and its configuration differs; process 2 only
    # its configuration: both are named, each as what it is.
    dig = np.array([[["a0", "a1"]], [["XX", "YY"]], [["a0", "a1"]], [["a0", "a1"]]], object)
    devices = [{"device_id": d, "process_index": d, "host": f"h{d}", "kind": "cpu",
                "platform": "cpu"} for d in range(4)]
    zeros = np.zeros(dig.shape, np.int64)
    vote = nodes.analyze(nodes.Observations(devices, ["w0"], dig, zeros, zeros.copy(),
                                            np.full(dig.shape, 1e-3), np.zeros(dig.shape, bool)))
    fps = [_fp(), _fp(python="3.12"), _fp(**{"env ATEN_CPU_CAPABILITY": "default"}), _fp()]
    bad, _, notes = config.judge(vote, fps)
    assert [(m["process_index"], m["hardware_suspect"]) for m in bad] == [(1, True), (2, False)]
    assert bad[0]["reason"].endswith("misconfigured and a hardware suspect")
    assert "hardware suspect" not in bad[1]["reason"]
    assert [(s["process_index"], s["misconfigured"]) for s in vote.suspects] == [(1, True)]
    assert [h["misconfigured"] for h in vote.hosts] == [False, True, True, False]
    assert notes == []


@pytest.mark.parametrize("env, framework", [
    ({}, "jax"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "jax"),  # jax.distributed reads SLURM itself
    ({"TORCHELASTIC_RUN_ID": "x"}, "torch"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "torch"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "jax"),
])
def test_framework_is_detected_from_torchruns_variables(env, framework):
    assert nodes.detect_framework(env) == framework


def test_terminal_lines_name_each_misconfigured_process_then_count_them():
    data = {"misconfigured": [{"process_index": 2, "host": "h2", "reason": "configuration "
                               "differs: python = 3.12 (majority: 3.11)"}],
            "config": {"processes": 3, "keys": 40}}
    assert config.misconfigured_lines(data) == [
        "diag: process 2 (h2): misconfigured: configuration differs: python = 3.12 (majority: "
        "3.11)",
        "diag: 1 misconfigured process(es): process 2 (h2); configuration apart from hardware: "
        "see `misconfigured` in --json"]
    assert config.misconfigured_lines({"misconfigured": [], "config": {
        "processes": 3, "keys": 40}}) == [
        "diag: all 3 processes have the same configuration (40 keys compared)"]
    assert config.misconfigured_lines({"misconfigured": [], "config": {"processes": 1}}) == []


def test_fingerprint_has_one_key_per_xla_flag_and_no_per_process_variables():
    fp = config.fingerprint({"jax jax": "0.1"}, environ={
        "XLA_FLAGS": "--xla_cpu_enable_fast_math=true --xla_foo", "CUDA_VISIBLE_DEVICES": "3",
        "ATEN_CPU_CAPABILITY": "default"})
    assert fp["XLA_FLAGS --xla_cpu_enable_fast_math"] == "true"
    assert fp["XLA_FLAGS --xla_foo"] == "true"
    assert fp["env ATEN_CPU_CAPABILITY"] == "default" and fp["env JAX_ENABLE_X64"] == "(unset)"
    assert fp["jax jax"] == "0.1"
    assert not any("CUDA_VISIBLE_DEVICES" in k or "RANK" in k for k in fp)


def test_nodes_package_has_no_import_cycle_and_imports_no_private_name():
    """Module-level and in-function imports alike."""
    root = REPO_ROOT / "diag" / "nodes"
    graph, private = {}, []
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if node.module.startswith("diag") and alias.name.startswith("_"):
                        private.append(f"{path.name}: {node.module}.{alias.name}")
                    sub = root / f"{alias.name}.py"
                    if node.module == "diag.nodes" and sub.exists():
                        deps.add(alias.name)
                    elif node.module.startswith("diag.nodes."):
                        deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names
                         if a.name.startswith("diag.nodes.")}
        graph[path.stem] = deps - {path.stem}

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            for d in graph.get(todo.pop(), ()):
                if d == b:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False

    mods = [m for m in graph if m != "__init__"]
    assert [(a, b) for a in mods for b in mods if a < b and reaches(a, b) and reaches(b, a)] == []
    assert private == []


# --- torch builtins against float64 ----------------------------------------------------------

def _tanh_chain(x, ws):
    for w in ws:
        x = np.tanh(x @ w)
    return x


def _sgd_step(x, w1, w2, lr=0.1):
    """One SGD step of softmax cross-entropy on tanh(x w1) w2, labels argmax(x[:, :10])."""
    n = x.shape[0]
    labels = np.argmax(x[:, :w2.shape[1]], axis=1)
    h = np.tanh(x @ w1)
    z = h @ w2
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(n), labels]))
    dz = p.copy()
    dz[np.arange(n), labels] -= 1
    dz /= n
    g2 = h.T @ dz
    g1 = x.T @ ((dz @ w2.T) * (1 - h ** 2))
    return np.concatenate([(w1 - lr * g1).ravel(), (w2 - lr * g2).ravel(), [loss]])


@needs_torch
@pytest.mark.parametrize("name, atol", [("matmul_f32", 1e-5), ("matmul_bf16", 0.06),
                                        ("softmax", 1e-6), ("train_step", 1e-5)])
def test_torch_builtins_compute_their_float64_definition(name, atol):
    import torch  # noqa: F401  (the builtins' framework)

    from diag.nodes.seeded import weights

    w = nodes.builtin_workload(name)
    fn = w.build_for("torch")
    from diag.nodes.torch_workloads import from_numpy, to_numpy

    x = w.make_input(0, 0)
    got = to_numpy(fn(from_numpy(x)))
    assert got.dtype == x.dtype or name == "train_step"
    x64 = x.astype(np.float64)
    want = {
        "matmul_f32": lambda: _tanh_chain(x64, [a.astype(np.float64) for a in
                                                weights(1, [(128, 128)] * 4, "float32")]),
        "matmul_bf16": lambda: _tanh_chain(x64, [a.astype(np.float64) for a in
                                                 weights(1, [(128, 128)] * 4, "bfloat16")]),
        "softmax": lambda: np.exp(4 * x64 - (4 * x64).max(-1, keepdims=True))
        / np.exp(4 * x64 - (4 * x64).max(-1, keepdims=True)).sum(-1, keepdims=True),
        "train_step": lambda: _sgd_step(x64, *[a.astype(np.float64) for a in
                                               weights(2, [(32, 64), (64, 10)], "float32")]),
    }[name]()
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=atol)


# --- through the diag script -----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--framework", "tensorflow"], "diag: --framework tensorflow: expected jax or torch"),
    (["--framework", "torch", "--host-devices", "2"],
     "diag: --host-devices forces jax CPU devices; with --framework torch start one rank per "
     "device (torchrun --nproc-per-node N)"),
    pytest.param(["--distributed", "--framework", "torch"],
                 "diag: --distributed --framework torch: RANK is not set; start diag with "
                 "torchrun (or srun with MASTER_ADDR and MASTER_PORT exported), or pass "
                 "--coordinator HOST:PORT --num-processes N --process-id I", marks=needs_torch),
])
def test_bad_framework_use_exits_2_with_one_line(tmp_path, args, message):
    out = subprocess.run([DIAG, "nodes", "--out", str(tmp_path / "runs"), *args],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "runs").exists()


def _torchrun_scan(tmp_path, *args, nproc=3, timeout=240):
    """torchrun --no-python DIAG nodes --distributed ... on loopback; process 0's JSON and
    every rank's exit code (torchrun reports each failed rank's; the others exited 0)."""
    cmd = _torchrun() + ["--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr",
                         "127.0.0.1", "--master-port", str(_free_port()), "--no-python", DIAG,
                         "nodes", "--distributed", "--json", "--out", str(tmp_path / "runs"),
                         "--init-timeout", "120", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=_env(tmp_path), cwd=tmp_path)
    codes = [0] * nproc
    for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*"
                                 r"(-?\d+)", out.stderr):
        codes[int(rank)] = int(code)
    data = json.loads(out.stdout) if out.stdout.strip().startswith("{") else None
    return out, data, codes


@needs_torch
def test_torchrun_names_the_corrupting_rank_and_the_misconfigured_one(tmp_path):
    workload = f"{EXAMPLES / 'nodes_selftest_torch.py'}:work"
    out, data, codes = _torchrun_scan(tmp_path, "--repeats", "4", "-w", "matmul_f32",
                                      "-w", workload, "--input-shape", "32,16")
    assert data is not None, out.stderr[-3000:]
    # Every rank exits 3. torchrun stops the ranks still running as soon as one exits
    # non-zero: a rank may be stopped (SIGTERM, -15) while it exits, never before process 0
    # wrote the verdict (every rank waits for it: the JSON, nodes.json and the report are
    # complete); the first to finish exits 3 on its own.
    assert set(codes) <= {3, -15} and 3 in codes, out.stderr[-3000:]
    assert out.returncode != 0 and data["exit_code"] == 3
    assert data["framework"] == "torch" and data["num_processes"] == 3  # detected, not told
    assert data["versions"]["torch"] and len(data["devices"]) == 3
    host = socket.gethostname()
    # Hardware: rank 1 differs from the majority on its own workload, every call, the same way.
    hw = {s["process_index"]: s for s in data["suspects"]}
    assert 1 in hw and (hw[1]["device_id"], hw[1]["host"]) == (1, host)
    assert hw[1]["kinds"][0] == "mismatch" and not hw[1]["misconfigured"]
    assert set(hw) <= {1, 2}
    # Configuration: rank 2 alone, with the precision key, its value and the majority's.
    (m,) = data["misconfigured"]
    assert (m["process_index"], m["host"]) == (2, host)
    keys = {d["key"]: (d["value"], d["majority"]) for d in m["differs"]}
    assert keys["torch float32_matmul_precision"] == ("medium", "highest")
    # Whether "medium" changed rank 2's bits is the CPU's matter (bf16 matmul units); the
    # verdict must say what was measured: a hardware suspect too exactly when its bits differ.
    assert m["hardware_suspect"] == (2 in hw)
    if 2 in hw:
        assert hw[2]["misconfigured"] and m["reason"].endswith("hardware suspect")
    assert [h["misconfigured"] for h in data["hosts"]] == [False, False, True]
    run = tmp_path / "runs" / os.path.basename(data["run_dir"])
    saved = json.loads((run / "nodes.json").read_text())
    assert saved["misconfigured"] == data["misconfigured"]
    meta = json.loads((run / "run.json").read_text())
    assert (meta["state"], meta["exit_code"], meta["nodes"]["misconfigured"]) == ("finished", 3, 1)
    html = (run / "report.html").read_text()
    assert "process 2 (" in html and "misconfigured" in html
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in records} == {"torch-cpu"}


@pytest.mark.slow
@needs_torch
def test_torchrun_clean_job_exits_0_on_every_rank(tmp_path):
    out, data, codes = _torchrun_scan(tmp_path, "--repeats", "4")
    assert data is not None, out.stderr[-3000:]
    assert out.returncode == 0 and codes == [0, 0, 0], out.stderr[-3000:]
    assert data["verdict"] == "ok" and data["suspects"] == [] and data["misconfigured"] == []
    assert [w["name"] for w in data["workloads"]] == list(nodes.BUILTIN_WORKLOADS)
    assert all(d["mismatched_calls"] == 0 and d["calls"] == 16 for d in data["devices"])
    assert data["config"]["processes"] == 3 and data["config"]["keys"] > 10


@pytest.mark.slow
@needs_torch
def test_torch_single_process_scan_finds_an_injected_bf16_fault(tmp_path):
    out = subprocess.run([DIAG, "nodes", "--framework", "torch", "--json", "--out",
                          str(tmp_path / "runs"), "--repeats", "3", "-w", "matmul_bf16",
                          "--inject", "device=0,kind=bitflip,rate=1"],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    data = json.loads(out.stdout)
    assert out.returncode == 3 and data["framework"] == "torch", out.stderr
    assert data["selftest"]["verdict"] == "found"
    assert data["suspects"][0]["kinds"] == ["intermittent"]


def _wrong_pythons(tmp_path) -> str:
    """A PATH whose python/python3 are not this interpreter (they fail): the examples must
    use the interpreter they are given."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text("#!/bin/sh\necho 'wrong python' >&2\nexit 97\n")
        (fake / name).chmod(0o755)
    return f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.mark.slow
@needs_torch
def test_slurm_torchrun_example_self_test(tmp_path):
    out = subprocess.run(["bash", str(EXAMPLES / "slurm_torchrun.sh")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path,
                         env=_env(tmp_path, SELFTEST="1", REPEATS="6", OUT=str(tmp_path / "r"),
                                  PYTHON=sys.executable, PATH=_wrong_pythons(tmp_path)))
    assert out.returncode == 3, out.stderr[-3000:]
    host = socket.gethostname()
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"exclude: [('{host}', 1, 1)"), lines
    assert lines[1].startswith(f"misconfigured: [('{host}', 2, [")
    assert "'torch float32_matmul_precision'" in lines[1]


@pytest.mark.slow
@needs_torch
def test_srun_without_torchrun_reads_the_rank_from_slurm(tmp_path):
    # What `srun --ntasks=3 diag nodes --distributed --framework torch` gives each task.
    port = str(_free_port())
    procs = [subprocess.Popen(
        [DIAG, "nodes", "--distributed", "--framework", "torch", "--json", "--out",
         str(tmp_path / "runs"), "--repeats", "3", "-w", "softmax", "--init-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(tmp_path, SLURM_PROCID=str(i), SLURM_NTASKS="3", SLURM_LOCALID=str(i),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for i in range(3)]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [r[1][-2000:] for r in results]
    data = json.loads(results[0][0])
    assert (data["framework"], data["num_processes"], data["verdict"]) == ("torch", 3, "ok")
    assert [d["device_id"] for d in data["devices"]] == [0, 1, 2]
    assert results[1][0] == "" and results[2][0] == ""


@pytest.mark.slow
@needs_torch
def test_torch_golden_digest_names_a_stuck_cpu_device(tmp_path):
    # One torch CPU device: no vote across devices; the golden digest saved by a clean scan
    # (under torch's version, apart from jax's) names the device stuck on its previous output.
    base = [DIAG, "nodes", "--framework", "torch", "--json", "--out", str(tmp_path / "runs"),
            "--repeats", "2", "-w", "softmax", "--golden-dir", str(tmp_path / "golden")]
    saved = subprocess.run(base + ["--save-golden"], capture_output=True, text=True,
                           timeout=120, env=_env(tmp_path))
    data = json.loads(saved.stdout)
    assert saved.returncode == 0 and data["golden"]["saved"] == 1, saved.stderr
    assert "torch" in Path(data["golden"]["path"]).name
    out = subprocess.run(base + ["--inject", "device=0,kind=stuck,rate=1"], capture_output=True,
                         text=True, timeout=120, env=_env(tmp_path))
    data = json.loads(out.stdout)
    assert out.returncode == 3 and data["golden"]["compared"] == ["softmax"], out.stderr
    assert "golden" in data["suspects"][0]["kinds"]  # the golden digest is the reference
