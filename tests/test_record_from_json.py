"""A record survives its trip through results.jsonl (`Record.to_json` -> `Record.from_json`):
every field comes back, the status as the one `Status` type (equal to its word, so readers
that compare strings keep working), a newer diag's extra keys are left out, an older
record's missing optional fields take their defaults, and a status diag does not know is
refused."""

from __future__ import annotations

import json

import pytest

from diag.records.results import Record
from diag.status import Status


def _record(**changes) -> Record:
    fields = dict(op="matmul", probe="matmul.small", case="m=4 k=4 n=4 float32",
                  params={"m": 4}, backend="jax-cpu", device={"platform": "cpu"},
                  dtype="float32", metrics={"max_ulp": 0.5, "bound_ratio": float("nan")},
                  status="warn", reason="within what two backends may differ",
                  timings={"run_s": 1e-3}, run_id="r1")
    return Record(**{**fields, **changes})


def test_a_record_comes_back_from_its_json_line_field_for_field():
    written = _record()
    line = json.loads(json.dumps(written.to_json()))
    read = Record.from_json(line)
    assert read.to_json() == written.to_json()
    assert read.status is Status.WARN and read.status == "warn"
    assert read.metrics["bound_ratio"] == "nan"  # as written: JSON has no NaN


def test_unknown_keys_are_left_out_and_missing_optional_fields_take_defaults():
    line = _record().to_json()
    line["written_by_a_newer_diag"] = 1
    for optional in ("timings", "framework", "oracle", "settings", "variant"):
        line.pop(optional)
    read = Record.from_json(line)
    assert read.timings == {} and read.variant == "" and read.kind == "probe"


def test_a_status_diag_does_not_know_is_refused():
    line = _record().to_json()
    line["status"] = "flaky"
    with pytest.raises(ValueError, match="status must be one of"):
        Record.from_json(line)
