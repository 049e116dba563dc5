"""Pass attribution: the first XLA pass where the A and B sides of an `--ab` case differ.

Through the real `diag` script: a bf16 softmax on jax-cpu under
`--xla_allow_excess_precision=false` (field notes: with the default, XLA keeps the bf16 `exp`
in f32 where it feeds the row sum; without it, a `convert` rounds it to bf16 first). The
attribution must name a pass and the `convert` instruction that pass adds on the B side, in
agreement with the final HLO diff diag records for the pair. The comparison of per-pass dump
folders is also checked on folders XLA wrote for one side twice (no difference).
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_JAX, REPO_ROOT, run_diag
from diag.trace import passes, read_passes

pytestmark = pytest.mark.skipif(not HAS_JAX, reason="needs jax")

SUITE = """
[suite]
name = "excess"
seed = 5

[[probe]]
name = "sm"
op = "softmax"
inputs = "normal5"
dtypes = ["bfloat16"]
shapes = [[64, 2048]]
"""
SETTING = "XLA_FLAGS=--xla_allow_excess_precision=false"


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("passes")
    suite = root / "excess.toml"
    suite.write_text(SUITE)
    res = run_diag("run", "-s", str(suite), "-b", "jax-cpu", "--trace", "--ab", SETTING,
                   "--json", "-o", str(root / "runs"))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    return Path(data["run_dir"]), data["records"]


def test_excess_precision_is_attributed_to_a_pass_that_inserts_a_convert(ab_run):
    run, records = ab_run
    (ab,) = [r for r in records if r.get("kind") == "ab"]
    attributions = read_passes(run)
    if not ab["metrics"]["changed_outputs"]:  # the setting changed nothing: nothing to name
        assert attributions == []
        pytest.skip("the setting did not change the outputs on this machine")
    (att,) = attributions
    assert att["pair"] == ab["backend"] and att["case"] == ab["case"]
    assert att["setting"] == SETTING
    first = att["first_difference"]
    assert first is not None and first["pass"], att
    assert first["module"].startswith("jit")
    # The pass left B with more converts than A, and the new instruction is one of them.
    a_count, b_count = first["opcodes"]["convert"]
    assert b_count > a_count
    assert any(" convert(" in line for line in first["added"])
    # The final HLO diff diag recorded for the pair agrees: B compiled more converts.
    final = ab["metrics"]["hlo_diff"]["ops"]["convert"]
    assert final[1] > final[0]


def test_report_names_the_pass_beside_the_pair(ab_run):
    """The report's Profile section lists the attribution: the pair, the pass, what it added."""
    run, _ = ab_run
    attributions = read_passes(run)
    if not attributions:
        pytest.skip("the setting did not change the outputs on this machine")
    (att,) = attributions
    page = (run / "report.html").read_text()
    section = page[page.index('<section id="trace">'):]
    section = section[:section.index("</section>")]
    item = section[section.index(f'data-pair="{att["pair"]}"'):]
    first = att["first_difference"]
    assert f'<b class="pass-name">{html.escape(first["pass"])}</b>' in item
    assert html.escape(f"+ {first['added'][0]}") in item


def _dump(folder: Path, env_extra: str) -> None:
    code = ("import jax, jax.numpy as jnp, ml_dtypes, numpy as np\n"
            "x = jnp.asarray(np.linspace(-3, 3, 512).reshape(4, 128).astype(ml_dtypes.bfloat16))\n"
            "jax.jit(lambda a: jax.nn.softmax(a, axis=-1)).lower(x).compile()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT),
           "XLA_FLAGS": f"{env_extra} " + passes.DUMP_FLAGS.format(dir=folder)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                   timeout=300)


def test_first_difference_of_dump_folders(tmp_path):
    a, a2, b = tmp_path / "a", tmp_path / "a2", tmp_path / "b"
    _dump(a, "")
    _dump(a2, "")
    _dump(b, "--xla_allow_excess_precision=false")
    mods = passes.dumps(a)
    assert any(m.startswith("jit__lambda#") for m in mods)
    assert passes.first_difference(a, a2) is None  # the same program, compiled twice
    diff = passes.first_difference(a, b)
    assert diff is not None and diff["pass"]
    # The dumps before the named one are the same programs on both sides.
    steps_a, steps_b = mods[f"{diff['module']}#0"], passes.dumps(b)[f"{diff['module']}#0"]
    for (sa, pa), (sb, pb) in zip(steps_a[:diff["index"]], steps_b[:diff["index"]]):
        assert sa == sb and passes._program(pa) == passes._program(pb)
