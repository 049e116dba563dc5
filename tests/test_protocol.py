"""The worker protocol is typed at both ends (diag.worker.protocol): a job survives its JSON trip,
every line a real worker writes parses into its event type, and an unknown event is refused.
What a caller asks of a worker beyond its cases travels in the job (`Hook`, `features`): a
hook runs in a worker of its framework only, and one that fails does not fail the job.
"""

from __future__ import annotations

import io
import json

import pytest

from diag.worker.protocol import (
    EVENTS,
    CaseError,
    CaseJob,
    Done,
    Event,
    Hook,
    Job,
    Ready,
    Result,
    parse_event,
)
from tests.conftest import needs_jax


def test_a_job_survives_its_json_round_trip():
    job = Job(backend="jax-cpu", label="jax-cpu+B", out_dir="/tmp/x", repeats=2,
              repeat_budget_s=0.25, hlo=True, fingerprint=[("default", "none"), ("high", "config")],
              cases=[CaseJob(id="c0001", op="matmul", op_args={"precision": "high"},
                             inputs=["a.npy", "b.npy"], input_dtypes=["float32", "float32"])],
              features=False, hooks=[Hook("m.n", "f", {"path": "/tmp/y"}, framework="jax")])
    wire = json.loads(json.dumps(job.to_json()))
    assert wire["fingerprint"] == [["default", "none"], ["high", "config"]]
    assert Job.from_json(wire) == job


def test_a_job_without_a_label_is_labelled_by_its_backend():
    job = Job.from_json({"backend": "torch-cpu", "out_dir": "/o", "cases": []})
    assert job.label == "torch-cpu" and job.fingerprint == [] and job.repeats == 3
    assert job.features and job.hooks == []


def test_every_event_kind_parses_back_to_its_type_and_an_unknown_one_is_refused():
    for event in (Ready(device={"id": 0}, framework={"name": "jax"}, settings={}),
                  Result(case="c0000", outputs=[], timings={}, input_digests=["ab"]),
                  CaseError(case="c0002", error="ValueError: x"), Done()):
        assert parse_event(json.loads(json.dumps(event.to_json()))) == event
    assert set(EVENTS) == {"ready", "result", "case_error", "arithmetic", "platforms",
                           "backend", "done"}
    with pytest.raises(ValueError, match="unknown worker event 'exploded'"):
        parse_event({"event": "exploded"})


@needs_jax
def test_a_real_workers_stream_is_typed_events(tmp_path):
    import numpy as np

    from diag.worker.main import run_job

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "a.npy", a.view(np.uint32))  # inputs travel as raw bits
    np.save(tmp_path / "b.npy", a.T.copy().view(np.uint32))
    job = Job(backend="jax-cpu", label="jax-cpu", out_dir=str(tmp_path), repeats=1,
              cases=[CaseJob(id="c0000", op="matmul", op_args={},
                             inputs=[str(tmp_path / "a.npy"), str(tmp_path / "b.npy")],
                             input_dtypes=["float32", "float32"])])
    stream = io.StringIO()
    run_job(job.to_json(), stream)
    events = [parse_event(json.loads(line)) for line in stream.getvalue().splitlines()]
    assert [type(e) for e in events] == [Ready, Result, Done]
    (result,) = [e for e in events if isinstance(e, Result)]
    out = np.load(result.outputs[0]["path"]).view(np.float32)
    assert (out == a @ a.T).all()  # small integers: exact in float32


@needs_jax
def test_a_jobs_hooks_run_in_a_worker_of_their_framework_and_a_failing_one_is_harmless(
        tmp_path):
    from diag.worker.main import run_job

    src = tmp_path / "src.txt"
    src.write_text("scanned")
    job = Job(backend="jax-cpu", label="jax-cpu", out_dir=str(tmp_path), cases=[], hooks=[
        Hook("shutil", "copyfile", {"src": str(tmp_path / "absent"), "dst": "x"}),  # raises
        Hook("shutil", "copyfile", {"src": str(src), "dst": str(tmp_path / "jax.txt")},
             framework="jax"),
        Hook("shutil", "copyfile", {"src": str(src), "dst": str(tmp_path / "torch.txt")},
             framework="torch"),
    ])
    stream = io.StringIO()
    run_job(job.to_json(), stream)
    events = [parse_event(json.loads(line)) for line in stream.getvalue().splitlines()]
    assert [type(e) for e in events] == [Ready, Done]
    assert (tmp_path / "jax.txt").read_text() == "scanned"
    assert not (tmp_path / "torch.txt").exists()


def test_the_host_types_each_line_and_skips_what_is_not_an_event():
    from diag.worker.host import _event

    line = json.dumps(CaseError(case="c0001", error="ValueError: x").to_json())
    assert _event(line) == CaseError(case="c0001", error="ValueError: x")
    for not_an_event in ("a framework's log line", '{"event": "exploded"}', "[1, 2]",
                         '{"event": "result", "case": "c0"}'):  # the last lacks fields
        assert _event(not_an_event) is None


def test_an_event_read_as_one_kind_refuses_another():
    line = Done(platforms=["cpu"]).to_json()
    assert Event.from_json(line) == Done(platforms=["cpu"]) == Done.from_json(line)
    with pytest.raises(ValueError, match="expected a result event, got 'done'"):
        Result.from_json(line)
