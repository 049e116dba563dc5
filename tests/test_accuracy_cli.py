"""`diag accuracy` measures what the backend computes, and says it in rows and exit codes.

Claims under test: a row's counts and max ULP equal what this test finds on its own: it
runs the same op in-process (torch eager; JAX under jit) on every bfloat16 input of the
function's domain, and decides each correctly rounded value and error with mpmath (exact
rationals, written here, not diag's code). Through the installed `diag` script: exit 0 with
the rows as JSON, 2 for an unknown function or dtype (one `diag:` line), 1 for a check
against a baseline in which a row changed (the row is named), 0 for a check against the
baseline the same run wrote.
"""

from __future__ import annotations

import json

import ml_dtypes
import mpmath
import numpy as np
import pytest

from tests.conftest import needs_jax, needs_torch, run_diag


def diag(args: list[str], **kw):
    return run_diag(*args, **kw)

MP = mpmath.mp.clone()
MP.prec = 160
BF16 = np.dtype(ml_dtypes.bfloat16)


def every_bf16(domain=lambda x: np.ones(x.shape, bool)) -> np.ndarray:
    x = np.arange(1 << 16, dtype=np.uint16).view(BF16)
    x = x[np.isfinite(x.astype(np.float32))]
    return x[domain(x.astype(np.float64))]


def bf16_nearest(v) -> float:
    """v rounded to bfloat16 by mpmath: 8 bits to nearest-even in the normal range, a
    multiple of 2^-133 below 2^-126, Inf from max + half an ulp = 2^128 - 2^119."""
    if abs(v) >= MP.mpf(2) ** 128 - MP.mpf(2) ** 119:
        return float("inf") if v > 0 else float("-inf")
    if abs(v) < MP.mpf(2) ** -126:
        return float(MP.nint(v * MP.mpf(2) ** 133) * MP.mpf(2) ** -133) or (-0.0 if v < 0 else 0.0)
    ctx = MP.clone()
    ctx.prec = 8
    return float(ctx.mpf(v))  # mpmath rounds to nearest, ties to even


def expected(xs: np.ndarray, ys: np.ndarray, exact) -> tuple[int, float]:
    """(not correctly rounded, max ULP at the exact value) of bf16 outputs `ys`, by mpmath."""
    wrong, worst = 0, 0.0
    for x, y in zip(xs.astype(np.float64).tolist(), ys.astype(np.float64).tolist()):
        v = exact(MP.mpf(x))
        best = bf16_nearest(v)
        if not (y == best or (np.isnan(y) and np.isnan(best))):
            wrong += 1
        if np.isfinite(y) and np.isfinite(best):
            e = max(int(MP.frexp(v)[1]) - 1, -126) if v else -126
            worst = max(worst, float(abs(MP.mpf(y) - v) / MP.mpf(2) ** (e - 7)))
    return wrong, worst


def _row(rows, backend, function):
    [row] = [r for r in rows if r["backend"] == backend and r["function"] == function
             and not r["setting"]]
    return row


@needs_torch
def test_torch_exp_row_counts_what_mpmath_decides(tmp_path):
    import torch

    x = every_bf16()
    bits = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    y = torch.exp(bits).view(torch.int16).numpy().view(BF16)
    want_wrong, want_max = expected(x, y, MP.exp)
    done = diag(["accuracy", "-f", "exp", "-d", "bf16", "-b", "torch-cpu", "--json"],
                    env={"DIAG_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert done.returncode == 0, done.stderr
    row = _row(json.loads(done.stdout), "torch-cpu", "exp")
    assert row["inputs"] == x.size == 65280
    assert row["not_correctly_rounded"] == want_wrong
    assert row["max_ulp"] == pytest.approx(want_max, rel=1e-9)


@needs_jax
def test_jax_sqrt_row_counts_what_mpmath_decides(tmp_path):
    import jax
    import jax.numpy as jnp

    x = every_bf16(lambda v: v >= 0)
    y = np.asarray(jax.jit(jnp.sqrt)(jnp.asarray(x)))
    want_wrong, want_max = expected(x, y, MP.sqrt)
    done = diag(["accuracy", "-f", "sqrt", "-d", "bfloat16", "-b", "jax-cpu", "--json",
                     "--no-settings"], env={"DIAG_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["setting"] for r in rows} == {""}
    row = _row(rows, "jax-cpu", "sqrt")
    assert row["inputs"] == x.size
    assert row["not_correctly_rounded"] == want_wrong
    assert row["max_ulp"] == pytest.approx(want_max, rel=1e-9)
    assert row["flushed"] == int(((y.astype(np.float64) == 0) & (x.astype(np.float64) > 0)).sum())


@pytest.mark.parametrize("args, word", [
    (["-f", "nope"], "unknown function 'nope'"),
    (["-d", "float64"], "unknown dtype 'float64'"),
    (["-b", "nowhere"], "unknown backend 'nowhere'"),
])
def test_a_bad_name_is_one_line_and_exit_2(args, word, tmp_path):
    done = diag(["accuracy", *args], env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag:") and word in lines[0]


def test_a_check_against_a_file_that_is_not_a_baseline_exits_2(tmp_path):
    bad = tmp_path / "b.json"
    bad.write_text("{}")
    done = diag(["accuracy", "-f", "exp", "--check", str(bad)],
                    env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 2 and "not an accuracy baseline" in done.stderr


@needs_torch
def test_check_exits_1_naming_a_changed_row_and_0_when_nothing_changed(tmp_path):
    base = tmp_path / "base.json"
    args = ["accuracy", "-f", "sigmoid", "-d", "float16", "-b", "torch-cpu"]
    env = {"DIAG_CACHE_DIR": str(tmp_path / "cache")}
    done = diag([*args, "--baseline", str(base)], env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    same = diag([*args, "--check", str(base)], env=env, timeout=300)
    assert same.returncode == 0 and "0 changed" in same.stdout
    data = json.loads(base.read_text())
    key = "torch-cpu sigmoid float16"
    data["rows"][key]["not_correctly_rounded"] += 1
    base.write_text(json.dumps(data))
    changed = diag([*args, "--check", str(base)], env=env, timeout=300)
    assert changed.returncode == 1
    assert f"diag: changed: {key}: not_correctly_rounded" in changed.stdout


@needs_torch
def test_out_writes_the_rows_and_a_page_with_a_cell_per_row(tmp_path):
    env = {"DIAG_CACHE_DIR": str(tmp_path / "cache")}
    done = diag(["accuracy", "-f", "tanh,silu", "-d", "float16", "-b", "torch-cpu",
                     "--out", str(tmp_path / "o")], env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "o" / "accuracy.json").read_text())
    page = (tmp_path / "o" / "accuracy.html").read_text()
    assert len(rows) == 2 and page.count("<details>") == 2
    for field in ("not_correctly_rounded", "max_ulp", "worst_input", "nonfinite_wrong",
                  "flushed", "histogram"):
        assert all(field in r for r in rows)
    assert all(sum(c for _, c in r["histogram"]) <= r["inputs"] for r in rows)


def test_a_worker_that_dies_is_one_line_and_exit_4(tmp_path):
    # /bin/true stands for a broken torch_xla Python: it exits at once, answering nothing
    done = diag(["accuracy", "-f", "exp", "-d", "bf16", "-b", "torch-xla-cpu",
                 "--python", "torch-xla=/bin/true"], env={"DIAG_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 4
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("diag:")]
    assert len(lines) == 1 and "torch-xla-cpu" in lines[0] and "worker" in lines[0]
