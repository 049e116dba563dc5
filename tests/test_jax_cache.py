"""JAX workers keep compiled programs in diag's cache folder, and the NaN hunt's time is shown.

Claims: `worker_env` points JAX's persistent compilation cache at ``<diag cache>/jax`` with
every program kept (thresholds 0 and -1) without writing anything, leaves a user's own
JAX_COMPILATION_CACHE_DIR and thresholds alone, and sets nothing when the folder cannot be
created or XLA_FLAGS asks for dumps; a JAX process started
with that environment really writes its compiled programs there; `diag cache info` reports the
folder and `diag cache clear` empties it (through the real `diag` script); and `diag run`'s
`diag: time:` line and run.json's phases include the NaN hunt of the planted float16 overflow,
equal to the hunt seconds its record carries.
"""

from __future__ import annotations

import json
import subprocess
import sys

from diag.worker.host import worker_env
from tests.conftest import needs_jax, run_diag


def test_worker_env_points_jax_at_diags_cache_folder(tmp_path):
    env = worker_env(base={"DIAG_CACHE_DIR": str(tmp_path / "c"), "PATH": "/usr/bin"})
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "c" / "jax")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"
    assert not (tmp_path / "c").exists()  # nothing written before a worker compiles


def test_xla_dumps_turn_the_cache_off(tmp_path):
    # A cached program is not compiled, so XLA would dump nothing for it.
    env = worker_env(base={"DIAG_CACHE_DIR": str(tmp_path / "c"),
                           "XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}"})
    assert not any(k.startswith("JAX_") for k in env)


def test_worker_env_leaves_a_users_jax_cache_alone(tmp_path):
    env = worker_env(base={"DIAG_CACHE_DIR": str(tmp_path / "c"),
                           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine"),
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"})
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "mine")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "2"
    assert "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in env
    assert not (tmp_path / "c").exists()
    # Only the thresholds the user did not set are filled in when diag picks the folder.
    env = worker_env(base={"DIAG_CACHE_DIR": str(tmp_path / "c"),
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"})
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "2"
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"


def test_worker_env_sets_no_cache_where_the_folder_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = worker_env(base={"DIAG_CACHE_DIR": str(blocker / "c")})
    assert not any(k.startswith("JAX_") for k in env)


@needs_jax
def test_a_jax_process_with_the_workers_env_writes_its_programs_there_and_cache_clear_empties_it(
        tmp_path):
    cache = tmp_path / "c"
    env = worker_env(base={"DIAG_CACHE_DIR": str(cache), "PATH": "/usr/bin",
                           "HOME": str(tmp_path)})
    code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)))"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    written = [p for p in (cache / "jax").rglob("*") if p.is_file()]
    assert written, "JAX wrote nothing to its persistent cache"
    info = run_diag("cache", "info", "--json", "--cache-dir", str(cache))
    assert info.returncode == 0
    jc = json.loads(info.stdout)["jax_compilation_cache"]
    assert jc["path"] == str(cache / "jax") and jc["files"] == len(written) and jc["bytes"] > 0
    human = run_diag("cache", "info", "--cache-dir", str(cache))
    assert f"JAX compilation cache {cache / 'jax'}: {len(written)} file(s)" in human.stdout
    cleared = run_diag("cache", "clear", "--cache-dir", str(cache))
    assert cleared.returncode == 0
    assert f"removed {len(written)} cached file(s)" in cleared.stdout + cleared.stderr
    assert not [p for p in (cache / "jax").rglob("*") if p.is_file()]


OVERFLOW_SUITE = """
[suite]
name = "overflow"
seed = 20261123

[[probe]]
name = "train_overflow_fp16"
op = "train_step"
inputs = "mlp_huge"
dtypes = ["float16"]
shapes = [[16, 64, 8]]
lr = 0.1
expect = "nonfinite"
"""


@needs_jax
def test_the_nan_hunts_time_is_in_the_time_line_and_run_json(tmp_path):
    suite = tmp_path / "overflow.toml"
    suite.write_text(OVERFLOW_SUITE)
    out = run_diag("run", "--suite", str(suite), "--backend", "jax-cpu", "--no-report",
                   "--out", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    meta = json.loads((run_dir / "run.json").read_text())
    (rec,) = [json.loads(ln) for ln in (run_dir / "results.jsonl").read_text().splitlines()]
    assert rec["status"] == "pass" and rec["timings"]["hunt_s"] > 0
    hunt = meta["phases"]["jax-cpu"]["hunt"]
    assert abs(hunt - rec["timings"]["hunt_s"]) < 0.002
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("diag: time:")]
    assert f"hunt {hunt:.1f}" in line
