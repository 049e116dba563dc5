"""Moving every op into its own module under probes/ changed where the code lives, not one
verdict: a recorded run of every shipped suite (tests/judge_reference.py) is judged again by
today's code, and every record (each backend's verdict and each pair's agreement: status,
reason and metrics) must be the one recorded before the move.

The record holds the workers' outputs, bit for bit, so nothing compared depends on this CPU;
the inputs are drawn again from the suites' seeds, the ground truth computed again (both
independent of the CPU: seeded numpy draws, correctly rounded oracles). Floats in metrics are
compared at `DIGITS` significant digits (a bound's float64 BLAS may differ in its last bits
from one CPU to another); statuses and reasons exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from diag.worker.protocol import Result
from tests import judge_reference as ref

RECORD = json.loads((ref.DATA / "judge_reference.json").read_text())


def _judge(work, suites, change=None) -> list[dict]:
    """Every record of the stored outputs of `suites` judged by today's code; `change`
    (key, array -> array) alters a stored output first."""
    from diag.backends import get_spec
    from diag.run.judge import Judge
    from diag.plan.registry import PROBES

    judge = Judge(work, str(work / "cache"))
    specs = [get_spec(n) for n in RECORD["backends"]]
    arrays = np.load(ref.DATA / "judge_reference.npz")
    records = []
    for path in suites:
        suite = ref.name(path)
        events = {s.name: {} for s in specs}
        for key, meta in RECORD["events"].items():
            where, backend, cid = key.split("/")
            if where != suite:
                continue
            outputs = []
            for i, o in enumerate(meta["outputs"]):
                file = work / f"{suite}-{backend}-{cid}-{i}.npy"
                array = arrays[f"{key}/{i}"]
                np.save(file, change(f"{key}/{i}", array) if change else array)
                outputs.append({**o, "path": str(file)})
            events[backend][cid] = Result(case=cid, outputs=outputs, timings={}, input_digests=[],
                                          nan_report=meta["nan_report"])
        kept = [c for c in ref.cases(path) if any(c.id in e for e in events.values())]
        records += ref.judge_all(suite, kept, events, judge, specs, PROBES)
    return records


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> list[dict]:
    return _judge(tmp_path_factory.mktemp("judge-reference"), ref.SUITES)


def test_the_record_covers_every_shipped_suite_and_op():
    from diag.plan.registry import PROBES
    from diag.plan.suite import suite_names

    suites = {r["suite"] for r in RECORD["records"]}
    assert suites == {ref.name(s) for s in ref.SUITES}
    assert set(suite_names()) - suites == {"train"}  # recorded as train_small
    recorded = {k.split("/")[0] + "/" + k.split("/")[2] for k in RECORD["events"]}
    ops = {c.op for s in ref.SUITES for c in ref.cases(s)
           if f"{ref.name(s)}/{c.id}" in recorded}
    # logsumexp came after the record; a user's function is in no shipped suite
    assert ops == set(PROBES) - {"logsumexp", "user_function"}
    statuses = {r["status"] for r in RECORD["records"]}
    assert {"pass", "warn"} <= statuses  # emu-bf16x1 warns where float32 is claimed
    assert any("|" in r["backend"] for r in RECORD["records"])


def test_every_recorded_verdict_and_metric_is_unchanged(judged):
    want = RECORD["records"]
    assert len(judged) == len(want)
    for got, exp in zip(judged, want):
        where = f"{exp['suite']}: {exp['case']} on {exp['backend']}"
        assert (got["case"], got["backend"]) == (exp["case"], exp["backend"]), where
        assert (got["status"], got["reason"]) == (exp["status"], exp["reason"]), where
        assert got["metrics"] == exp["metrics"], where


def test_a_changed_output_changes_its_record(tmp_path):
    # The comparison is not vacuous: one element of one stored output off by 1000 ulps
    # changes that backend's record and its agreements, and nothing else.
    key = next(k for k in sorted(RECORD["events"]) if k.startswith("preflight/jax-cpu/"))

    def change(name, array):
        if name != key + "/0":
            return array
        array = array.copy()
        array.flat[0] += 1000  # the bits of a float: 1000 ulps away
        return array

    got = _judge(tmp_path, ["preflight"], change)
    want = [r for r in RECORD["records"] if r["suite"] == "preflight"]
    differ = [(w["case"], w["backend"]) for g, w in zip(got, want) if g != w]
    assert len(got) == len(want) and differ
    assert {case for case, _ in differ} == {differ[0][0]}
    assert all("jax-cpu" in backend for _, backend in differ)
