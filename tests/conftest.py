"""Shared fixtures: a tiny suite, and backend availability for real-backend tests."""

from __future__ import annotations

import importlib.util

import pytest

HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None

needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

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
