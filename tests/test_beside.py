"""CPU backends' workers run side by side (`diag.worker.host.start_beside`), the host reads them in turn.

Claims: which backends start beside the first follows from what their frameworks listed (only
the CPU) or from being diag's numpy emulation; a run whose second backend ran beside the first
writes its records in the planned order (every record of the first backend, then each record
of the second followed by its agreement record), judged as one by one; a worker that crashes
while it runs beside another still gives its error record, is restarted for the rest, and the
other backend runs in full.
"""

from __future__ import annotations

import json

from conftest import needs_jax, needs_torch

from diag import run
from diag.backends import get_spec
from diag.records.results import read_records
from diag.plan.suite import load_suite
from diag.worker.host import MAX_BESIDE, resolve_backends, start_beside, worker_env

pytestmark = [needs_jax, needs_torch]


def _by(records, **match):
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def test_which_backends_start_beside_follows_what_the_frameworks_listed():
    specs, _, parked = resolve_backends(["jax-cpu", "torch-cpu"], worker_env())
    try:
        assert [s.name for s in specs] == ["jax-cpu", "torch-cpu"]
        beside = start_beside(specs, parked)
        # torch-cpu starts beside jax-cpu exactly when torch listed the CPU alone.
        expected = ["torch-cpu"] if parked["torch"].platforms == ["cpu"] else []
        assert [s.name for s in beside] == expected
    finally:
        for worker in parked.values():
            worker.kill()
    # diag's numpy emulation holds no device: it always may; never more than MAX_BESIDE.
    emus = [get_spec(n) for n in ("emu-bf16x1", "emu-bf16x3", "emu-tf32", "emu-f16",
                                  "emu-tf32x3", "emu-bf16x6")]
    assert start_beside([get_spec("jax-gpu"), *emus], {}) == emus[:MAX_BESIDE - 1]
    # A GPU backend never starts beside: it waits for its turn.
    assert start_beside([get_spec("jax-cpu"), get_spec("torch-cuda")], parked) == []


def test_records_come_in_the_planned_order(tmp_path, tiny_suite):
    result = run(tiny_suite, ["jax-cpu", "torch-cpu"], out=tmp_path, repeats=1)
    labels = [c.label for c in load_suite(tiny_suite).cases]
    probes = [r for r in result.records if r["kind"] == "probe"]
    jax = [r["case"] for r in probes if r["backend"] == "jax-cpu"]
    torch = [r["case"] for r in probes if r["backend"] == "torch-cpu"]
    # Each backend's cases in the suite's order; every jax-cpu record before torch-cpu's.
    assert jax == [c for c in labels if c in jax] and torch == [c for c in labels if c in torch]
    first_torch = next(i for i, r in enumerate(result.records) if r["backend"] == "torch-cpu")
    assert all(r["backend"] == "jax-cpu" for r in result.records[:first_torch])
    # After each torch-cpu record, its agreement with jax-cpu on the same case.
    for i, r in enumerate(result.records):
        if r["backend"] == "torch-cpu" and r["case"] in jax:
            after = result.records[i + 1]
            assert after["kind"] == "agreement" and after["case"] == r["case"]
    assert [json.loads(line) for line in (result.run_dir / "results.jsonl").open()] == \
        result.records
    phases = json.loads((result.run_dir / "run.json").read_text())["phases"]
    assert all(phases[b]["start"] > 0 and phases[b]["wall"] >= phases[b]["start"]
               for b in ("jax-cpu", "torch-cpu"))


def test_a_worker_crashing_beside_another_gives_its_error_record(tmp_path, tiny_suite,
                                                                 monkeypatch):
    monkeypatch.setenv("DIAG_WORKER_FAULT", "kill@torch-cpu:c0001")
    result = run(tiny_suite, ["jax-cpu", "torch-cpu"], out=tmp_path, repeats=1)
    torch = _by(result.records, kind="probe", backend="torch-cpu")
    (error,) = _by(torch, status="error")
    assert error["case"] == "16x4x16 bfloat16"  # c0001
    assert "killed by SIGKILL" in error["reason"]
    # The worker was restarted for the rest: every other case ran and was judged (its verdict
    # is the CPU's business: torch's `medium` float32 matmul precision is bf16 on some CPUs
    # and float32 on others); jax-cpu, which ran beside it, ran in full.
    rest = [r for r in torch if r is not error]
    assert len(rest) == len(torch) - 1 >= 5
    assert all(r["status"] in ("pass", "warn", "fail") and r["metrics"] for r in rest)
    jax = _by(result.records, kind="probe", backend="jax-cpu")
    assert jax and not _by(jax, status="error")
    assert result.exit_code == 4
    assert len(list(read_records(result.run_dir))) == len(result.records)
