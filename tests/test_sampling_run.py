"""The sampling suite end to end on real backends: every op runs, is judged by its own check,
and a broken result is caught; an A/B setting's effect is attributed to it.

Claims: jax-cpu and torch-cpu produce records for softmax, top_k and greedy_token (and
jax-cpu for approx_max_k, which torch lacks); a fully masked row is reported as a hazard with
what the backend returns; top-k agrees across frameworks by value; a top-k whose output is
silently corrupted fails; turning `--xla_allow_excess_precision` off changes a bf16 softmax
on jax-cpu and the A/B record shows it, with the extra converts in the compiled HLO.
"""

from __future__ import annotations

import pytest

from diag import run
from tests.conftest import needs_jax, needs_torch

SMALL = """
[suite]
name = "small-sampling"
seed = 5

[[probe]]
name = "softmax"
op = "softmax"
inputs = ["normal", "fully_masked"]
dtypes = ["float32", "bfloat16"]
shapes = [[4, 2048]]

[[probe]]
name = "top_k"
op = "top_k"
inputs = ["normal", "ties"]
dtypes = ["bfloat16"]
shapes = [[4, 1024]]
k = 8

[[probe]]
name = "approx"
op = "approx_max_k"
inputs = "normal"
dtypes = ["float32"]
shapes = [[4, 1024]]
k = 8
recall_target = 0.95
aggregate_to_topk = [true, false]

[[probe]]
name = "greedy"
op = "greedy_token"
inputs = "near_ties"
dtypes = ["bfloat16"]
shapes = [[16, 1024]]
"""


def _by(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    path = root / "small.toml"
    path.write_text(SMALL)
    return run(str(path), ["jax-cpu", "torch-cpu"], out=root / "runs", repeats=1,
               cache_dir=str(root / "cache"))


@needs_jax
@needs_torch
def test_every_sampling_op_runs_on_each_backend_that_has_it(small_run):
    probes = _by(small_run.records, kind="probe")
    for backend in ("jax-cpu", "torch-cpu"):
        ops = {r["op"] for r in _by(probes, backend=backend)}
        assert {"softmax", "top_k", "greedy_token"} <= ops, (backend, ops)
    assert len(_by(probes, backend="jax-cpu", op="approx_max_k")) == 2
    assert not _by(probes, backend="torch-cpu", op="approx_max_k")  # torch has none
    assert all(r["status"] != "error" for r in probes), [r["reason"] for r in probes
                                                         if r["status"] == "error"]
    # Every record says what it was computed under.
    jax_rec = _by(probes, backend="jax-cpu", op="softmax")[0]
    assert "XLA_FLAGS" in jax_rec["settings"]
    assert "jax_default_matmul_precision" in jax_rec["settings"]
    torch_rec = _by(probes, backend="torch-cpu", op="softmax")[0]
    assert torch_rec["settings"]["float32_matmul_precision"] == "highest"


@needs_jax
@needs_torch
def test_fully_masked_rows_are_a_hazard_naming_what_comes_back(small_run):
    recs = [r for r in _by(small_run.records, kind="probe", op="softmax", dtype="float32")
            if "fully_masked" in r["case"]]
    assert len(recs) == 2
    for r in recs:
        assert r["status"] == "warn"
        assert "hazard: 2 rows fully masked" in r["reason"]
        assert "returns nan in 2" in r["reason"]


@needs_jax
@needs_torch
def test_exact_top_k_passes_and_agrees_by_value(small_run):
    for r in _by(small_run.records, kind="probe", op="top_k"):
        assert r["status"] == "pass", r["reason"]
        assert r["metrics"]["wrong_rows"] == 0 and r["metrics"]["recall_min"] == 1.0
    for r in _by(small_run.records, kind="agreement", op="top_k"):
        assert r["backend"] == "jax-cpu|torch-cpu"
        assert r["status"] == "pass" and r["metrics"]["value_differ_rows"] == 0
    approx = _by(small_run.records, kind="probe", op="approx_max_k")
    assert {r["metrics"]["returned"] > 8 for r in approx} == {False, True}  # aggregate off


@needs_jax
@needs_torch
def test_greedy_paths_argmax_of_logits_is_always_exact(small_run):
    for r in _by(small_run.records, kind="probe", op="greedy_token"):
        paths = r["metrics"]["paths"]
        logits_paths = [p for p in paths if "softmax" not in p]
        assert logits_paths and all(paths[p]["disagree"] == 0 for p in logits_paths)
        batched = [p for p in paths if "/batch8/" in p]
        assert batched, list(paths)
        # Each path's batches were compared (and agree here: no row is tied).
        assert r["metrics"]["batch_dependence"]
        assert all(v["rows_differ"] == 0 for v in r["metrics"]["batch_dependence"].values())
        assert r["metrics"]["unique_rows"] == 16  # the maker's top two are never equal
    jax_paths = _by(small_run.records, kind="probe", op="greedy_token", backend="jax-cpu")[0]
    assert {"jit/argmax", "eager/argmax_softmax", "jit/approx_max_k",
            "jit/batch1/top_k"} <= set(jax_paths["metrics"]["paths"])


@needs_jax
def test_silently_corrupted_top_k_fails(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text(SMALL)
    # c0004 is the first top_k case; `corrupt` doubles the first output (values[0, 0]).
    monkeypatch.setenv("DIAG_WORKER_FAULT", "corrupt@jax-cpu:c0004")
    result = run(str(path), ["jax-cpu"], out=tmp_path / "runs", repeats=1)
    bad = _by(result.records, kind="probe", op="top_k", status="fail")
    assert len(bad) == 1 and bad[0]["case"] == "4x1024 bfloat16 normal k=8"
    assert "not a valid top-k" in bad[0]["reason"]
    assert result.exit_code == 1


AB_SUITE = """
[suite]
name = "ab"

[[probe]]
name = "softmax"
op = "softmax"
inputs = "normal5"
dtypes = ["bfloat16"]
shapes = [[64, 2048]]
"""


@needs_jax
def test_excess_precision_flag_changes_bf16_softmax_and_ab_attributes_it(tmp_path):
    path = tmp_path / "ab.toml"
    path.write_text(AB_SUITE)
    result = run(str(path), ["jax-cpu"], out=tmp_path / "runs", repeats=1,
                 ab=["XLA_FLAGS=--xla_allow_excess_precision=false"])
    (ab,) = _by(result.records, kind="ab")
    assert ab["backend"] == "jax-cpu|jax-cpu+B"
    assert ab["status"] == "warn"
    diff = ab["metrics"]["difference"]
    assert 0 < diff["mismatched"] < diff["elements"] == 64 * 2048
    assert "XLA_FLAGS=--xla_allow_excess_precision=false changes jax-cpu's output (" in ab["reason"]
    hlo = ab["metrics"]["hlo_diff"]
    assert hlo["changed_lines"] > 0
    assert "convert" in hlo["ops"] and hlo["ops"]["convert"][1] > hlo["ops"]["convert"][0]
    assert (result.run_dir / hlo["path"]).is_file()
    b_side = _by(result.records, kind="probe", backend="jax-cpu+B")[0]
    assert "--xla_allow_excess_precision=false" in b_side["settings"]["XLA_FLAGS"]
    # The side is a field; the `+B` in the backend name is for people.
    assert b_side["variant"] == "B"
    assert {r["variant"] for r in _by(result.records, kind="probe", backend="jax-cpu")} == {""}
    # B is compared only with its own backend, never as a backend of its own.
    assert not _by(result.records, kind="agreement")


def test_ab_assignment_must_be_name_equals_value(tmp_path):
    from diag.errors import UsageError

    with pytest.raises(UsageError, match="--ab expects NAME=VALUE"):
        run("matmul", ["jax-cpu"], out=tmp_path, ab=["--xla_allow_excess_precision=false"])
    assert not list(tmp_path.iterdir())
