"""Shared fixtures: a tiny suite, and backend availability for real-backend tests."""

from __future__ import annotations

import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest

from diag.numerics import bits_view

HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None

# The report tests drive Debian's headless Chromium through chromedriver (CI installs both).
CHROMIUM = os.environ.get("DIAG_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DIAG_CHROMEDRIVER", "/usr/bin/chromedriver")
HAS_CHROMIUM = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
NO_CHROMIUM = f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)"


def headless_chromium(profile_dir, window: str = "1500,1100"):
    """A headless Chromium session (selenium) with its own profile and the browser console
    log kept, so a test can assert the page logged no SEVERE entry. The caller quits it."""
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-quic",
                f"--window-size={window}", f"--user-data-dir={profile_dir}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER),
                           options=opts)
    drv.set_page_load_timeout(15)
    return drv

needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]
IDS = ["float32", "bfloat16", "float16"]


def marked_line(path, marker: str) -> int:
    """The line number in `path` ending with `# <marker>`: where a report must point."""
    from pathlib import Path

    hits = [i for i, text in enumerate(Path(path).read_text().splitlines(), 1)
            if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def assert_bits_equal(got, want, what=""):
    """Bit-for-bit equality (-0 != +0, NaN payloads kept), naming the first difference."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    bad = np.flatnonzero(bits_view(got).ravel() != bits_view(want).ravel())
    assert bad.size == 0, (
        f"{what}: {bad.size} / {got.size} elements differ; first at flat index {bad[0]}: "
        f"got {got.ravel()[bad[0]]!r}, want {want.ravel()[bad[0]]!r}")

TINY_SUITE = """
[suite]
name = "tiny"
seed = 7

[[probe]]
name = "sweep"
op = "matmul"
dtypes = ["float32", "bfloat16"]
shape = ["d", 4, "d"]
sweep = { d = [16, 64] }

[[probe]]
name = "prec"
op = "matmul"
dtypes = ["float32"]
shapes = [[32, 64, 32]]
precision = ["default", "highest", "medium"]
precision_via = ["argument", "config"]
"""


@pytest.fixture
def tiny_suite(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SUITE)
    return str(path)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Tests never touch the user's ground-truth cache."""
    monkeypatch.setenv("DIAG_CACHE_DIR", str(tmp_path / "gt-cache"))


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def diag_script() -> str:
    """The installed `diag` console script: what a user's shell runs.

    The one beside the interpreter running the tests comes first: a venv's python run without
    activating the venv must not start another installation's `diag` found on PATH.
    """
    import shutil
    import sys
    from pathlib import Path

    beside = Path(sys.executable).with_name("diag")
    found = str(beside) if beside.exists() else shutil.which("diag") or str(beside)
    assert Path(found).exists(), "the `diag` console script is not installed (pip install -e .)"
    return found


def run_diag(*args: str, env: dict | None = None, timeout: float = 300, cwd=None,
             input: str | None = None):
    """Run the real `diag` entry point in a subprocess, as a shell would.

    PYTHONPATH puts this checkout first, so the script runs the code under test even when
    the editable install points at another checkout.
    """
    import os
    import subprocess

    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + full["PYTHONPATH"]
                                           if full.get("PYTHONPATH") else "")
    return subprocess.run([diag_script(), *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=cwd, input=input)


def one_diag_line(out, code: int) -> str:
    """The process exited `code` with exactly one `diag:` line on stderr and no traceback."""
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("diag:")]
    assert len(lines) == 1, out.stderr
    return lines[0]
