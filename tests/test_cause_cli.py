"""The cause through the real `diag` script: `diag run FILE.py:FUNCTION` (reason, results.jsonl),
`diag diverge` (its line and `--json`), and `diag.testing.assert_numerics`'s message, for one
PyTorch and one JAX planted bug of tests/data/cause/, with their twins exiting 0.

Each expected line is the one marked ``# planted: <case>`` in the data file; that changing it
repairs the output is checked against float64 in tests/test_cause_models.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import marked_line, run_diag

pytest.importorskip("jax")
pytest.importorskip("torch")

DATA = Path(__file__).parent / "data" / "cause"
ENV = {"HF_HUB_OFFLINE": "1", "COLUMNS": "400"}


def _records(out: Path) -> list[dict]:
    (run,) = [p for p in out.iterdir() if (p / "results.jsonl").exists()]
    lines = (run / "results.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


@pytest.mark.parametrize(
    ("name", "case", "backend", "op"),
    [
        # two `diag run`s, each importing transformers in its worker: ~45 s here
        pytest.param("hf_torch", "attnpool", "torch-cpu", "aten.exp", marks=pytest.mark.slow),
        ("flax_jax", "eps", "jax-cpu", "add"),
    ],
)
def test_diag_run_names_the_planted_line_as_the_cause(tmp_path, name, case, backend, op):
    line = marked_line(DATA / f"{name}.py", f"planted: {case}")
    spec = f"{DATA / name}.py:{case}_planted"
    r = run_diag("run", spec, "-b", backend, "--no-report", "--out", str(tmp_path), env=ENV)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cause:" in r.stdout  # in the table's reason cell
    (rec,) = _records(tmp_path)
    assert f"cause: {op} at {name}.py:{line} (" in rec["reason"]
    m = rec["metrics"]
    assert m["cause"].startswith(f"{name}.py:{line} (")
    assert m["cause_ops"][0].startswith(f"{op} at {name}.py:{line} (")
    assert m["cause_confirmed"] is True and 1 <= m["cause_reruns"] <= 10
    allowed = min(o["allowed"] for o in m["outputs"] if o["status"] == "fail")
    assert m["error_after"] <= allowed
    assert m["error_before"] == "inf" or m["error_before"] > allowed
    assert "repair" in m and "measured: error" in m["repair"]
    assert m["time_before_s"] > 0 and m["repair_time_s"] > 0  # what the repair costs

    twin = run_diag(
        "run",
        f"{DATA / name}.py:{case}_twin",
        "-b",
        backend,
        "--no-report",
        "--out",
        str(tmp_path / "twin"),
        env=ENV,
    )
    assert twin.returncode == 0, twin.stdout + twin.stderr
    assert "cause:" not in twin.stdout


def test_diag_diverge_json_carries_the_cause():
    line = marked_line(DATA / "hf_torch.py", "planted: attnpool")
    r = run_diag("diverge", f"{DATA / 'hf_torch.py'}:attnpool_planted", "--json", env=ENV)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    cause = doc["cause"]
    assert cause["cause"].startswith(f"hf_torch.py:{line} (")
    assert cause["text"].startswith(f"cause: aten.exp at hf_torch.py:{line} (")
    assert doc["report"]["first"]["cause"] == cause["cause"]  # the finding carries it
    assert cause["error_before"] == "inf" and math.isfinite(cause["error_after"])
    assert cause["time_before_s"] > 0 and cause["repair_time_s"] > 0
    assert doc["report"]["first"]["repair_time_s"] == cause["repair_time_s"]

    text = run_diag("diverge", f"{DATA / 'hf_torch.py'}:attnpool_planted", env=ENV)
    assert text.returncode == 1
    assert f"diag diverge: cause: aten.exp at hf_torch.py:{line} (" in text.stdout
    assert "repaired (" in text.stdout  # and what the repair costs in time


def test_assert_numerics_message_names_the_cause():
    from diag.testing import assert_numerics
    from tests.test_cause_models import _module

    mod = _module("hf_torch")
    line = marked_line(DATA / "hf_torch.py", "planted: rmsnorm")
    fn, args = mod.rmsnorm_planted()
    with pytest.raises(AssertionError) as err:
        assert_numerics(fn, *args)
    msg = str(err.value)
    assert f"cause: aten.mul at hf_torch.py:{line} (" in msg
    assert "repair: its result overflows float16" in msg
    fn, args = mod.rmsnorm_twin()
    assert all(v.status == "pass" for v in assert_numerics(fn, *args))


def test_the_rope_example_names_the_product_not_the_cosine():
    """examples/cause_rope.py (docs/diverge.md): the shadow's symptom is `cos`, the cause the
    bf16 product one line above it; computing the angles in float32 (`fixed`) exits 0."""
    example = Path(__file__).parent.parent / "examples" / "cause_rope.py"
    lines = example.read_text().splitlines()
    mul = 1 + next(i for i, t in enumerate(lines) if "angles = positions[:, None]" in t)
    cos = 1 + next(i for i, t in enumerate(lines) if "jnp.cos(angles)" in t)
    r = run_diag("diverge", f"{example}:planted", env=ENV)
    assert r.returncode == 1, r.stderr
    assert f"cos at cause_rope.py:{cos} (rotate)" in r.stdout  # where it shows
    assert f"diag diverge: cause: mul at cause_rope.py:{mul} (attention_logits)" in r.stdout
    fixed = run_diag("diverge", f"{example}:fixed", env=ENV)
    assert fixed.returncode == 0, fixed.stdout
    assert "cause:" not in fixed.stdout


def test_diag_nan_names_the_cause_of_a_birth_the_float64_shadow_does_not_make(tmp_path):
    """The NaN hunt's birth is the rsqrt of a zero variance; its cause is the eps that float16
    rounded to 0 one op earlier. A NaN the math makes itself (a log of a negative number, NaN
    in float64 too) gets no cause."""
    line = marked_line(DATA / "flax_jax.py", "planted: eps")
    r = run_diag("nan", f"{DATA / 'flax_jax.py'}:eps_planted", env=ENV)
    assert r.returncode == 1, r.stderr
    assert f"Inf born in rsqrt at flax_jax.py:{line} (__call__)" in r.stdout
    assert f"diag nan: cause: add at flax_jax.py:{line} (__call__)" in r.stdout

    (tmp_path / "true_nan.py").write_text(
        "import jax.numpy as jnp\nimport numpy as np\n\n\n"
        "def make():\n"
        "    return jnp.log, (np.linspace(-1, 1, 16, dtype=np.float32),)\n"
    )
    r = run_diag("nan", f"{tmp_path / 'true_nan.py'}:make", "--json", env=ENV)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["found"] and "cause" not in doc
