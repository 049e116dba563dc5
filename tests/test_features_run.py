"""Every run that fingerprints a backend's matmul also records its unit's arithmetic features,
and the report shows them with their evidence.

Claims, through the real `diag` script on jax-cpu and torch-cpu: run.json's
`backends[name]["features"]` holds one entry, float32 at the default setting, whose values
are what `diag.arith.precision.features` measures on the same framework's matmul in this process;
a run with no fingerprinted probe measures none; the report's features table shows exactly
the recorded values, and each feature's evidence the recorded products, output and the
prediction that matched it.
"""

from __future__ import annotations

import html as _html
import json
import re

import numpy as np
import pytest

from diag.gate.drift import FEATURE_FIELDS
from diag.arith.features import features
from tests.conftest import needs_jax, needs_torch, run_diag

pytestmark = [needs_jax, needs_torch]

MATMUL_SUITE = """
[suite]
name = "one-matmul"
seed = 3

[[probe]]
name = "mm"
op = "matmul"
dtypes = ["float32"]
shapes = [[16, 32, 16]]
"""

SOFTMAX_SUITE = """
[suite]
name = "one-softmax"
seed = 3

[[probe]]
name = "sm"
op = "softmax"
dtypes = ["float32"]
shapes = [[2, 64]]
"""


def _run(root, suite_text: str, backends: str):
    suite = root / "suite.toml"
    suite.write_text(suite_text)
    r = run_diag("run", "--suite", str(suite), "--out", str(root / "runs"), "-b", backends,
                 env={"DIAG_CACHE_DIR": str(root / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = next((root / "runs").iterdir())
    return run_dir, json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real run of one float32 matmul case on jax-cpu and torch-cpu, with its report."""
    return _run(tmp_path_factory.mktemp("features-run"), MATMUL_SUITE, "jax-cpu,torch-cpu")


def _jax(a, b):
    import jax.numpy as jnp

    return np.asarray(jnp.matmul(a, b))


def _torch(a, b):
    import torch

    return (torch.from_numpy(np.asarray(a)) @ torch.from_numpy(np.asarray(b))).numpy()


@pytest.mark.parametrize("backend, matmul", [("jax-cpu", _jax), ("torch-cpu", _torch)])
def test_run_records_the_float32_default_features_the_backend_shows(real_run, backend, matmul):
    _, meta = real_run
    info = meta["backends"][backend]
    assert info["fingerprints"], "features are recorded next to the fingerprints"
    (entry,) = info["features"]  # one features() call per backend per run
    assert (entry["precision"], entry["via"], entry["dtype"]) == ("default", "none", "float32")
    assert "error" not in entry, entry
    assert entry["seconds"] > 0
    direct = features(matmul, "float32").to_json()
    assert {f: entry[f] for f in FEATURE_FIELDS} == {f: direct[f] for f in FEATURE_FIELDS}
    for d in entry["details"]:
        assert d["value"] == entry[d["name"]]


def test_run_without_a_fingerprinted_probe_measures_no_features(tmp_path):
    _, meta = _run(tmp_path, SOFTMAX_SUITE, "jax-cpu")
    info = meta["backends"]["jax-cpu"]
    assert "features" not in info and not info.get("fingerprints")


def _table_rows(page: str, table_id: str) -> list[str]:
    table = re.search(rf'<table[^>]*id="{table_id}".*?</table>', page, re.S)
    assert table, f"no #{table_id} in the report"
    return re.findall(r"<tr>(.*?)</tr>\s*(?=<tr>|</tbody>)", table.group(0).split("<tbody>")[1],
                      re.S)


def test_report_shows_the_recorded_features_and_their_evidence(real_run):
    run_dir, meta = real_run
    page = (run_dir / "report.html").read_text("utf-8")
    rows = _table_rows(page, "features-table")
    assert len(rows) == sum(len(i.get("features", [])) for i in meta["backends"].values()) == 2
    for row in rows:
        backend = re.match(r"\s*<td>([^<]+)</td>", row).group(1)
        (entry,) = meta["backends"][backend]["features"]
        cells = [_html.unescape(c) for c in re.findall(r"<td><code>([^<]*)</code></td>", row)]
        assert cells == [str(entry[f]) for f in FEATURE_FIELDS]
        for d in entry["details"]:
            block = re.search(rf'<details class="feature-evidence" data-feature="{d["name"]}">'
                              r"(.*?)</details>", row, re.S)
            assert block, (backend, d["name"])
            outputs = re.findall(r'<code class="feature-output">([^<]*)</code>', block.group(1))
            assert outputs == [f"{e['output']:.9g}" for e in d["evidence"]]
            # Every input's list of predictions marks the output's value as the match when a
            # hypothesis predicted it (a decided feature: the decided hypothesis always did).
            matched = re.findall(r'<li class="feature-match"><strong>matches</strong> '
                                 r"<code>([^<]*)</code>", block.group(1))
            if d["value"] != "unknown":
                assert matched == outputs
