"""Drift is said once per cause (`diag.gate.drift.causes`).

Claims under test: one setting changed to the same value under several names (the env var,
each worker's record of it) is one cause; a backend's fingerprint and feature drifts go under
a setting cause that names that backend, else under the first of them; each record's drifts
go under the cause that names its backend (an agreement record under either of its pair), or
are one cause of their own; a missing backend explains its missing records; the JUnit file
has one settings testcase per cause. The expected grouping is written out by hand here.
"""

from __future__ import annotations

import xmlschema

from conftest import REPO_ROOT
from diag.gate.drift import Check, Drift, causes
from diag.gate.junit import write

XSD = REPO_ROOT / "tests" / "data" / "junit-jenkins.xsd"
FLAGS = "--xla_allow_excess_precision=false"


def _setting(name, old, new):
    return Drift(f"setting {name}", "value", old, new, "a numerics setting changed")


def _rec(key, what="status", old="pass", new="fail"):
    return Drift(key, what, old, new, "the verdict changed")


def test_one_flags_change_under_three_names_is_one_cause():
    drifts = [_setting("env XLA_FLAGS", None, FLAGS), _setting("jax-cpu XLA_FLAGS", "", FLAGS),
              _setting("torch-cpu XLA_FLAGS", "", FLAGS),
              _setting("torch-cpu float32_matmul_precision", "highest", "medium")]
    found = causes(drifts)
    assert [c.head.where for c in found] == ["setting env XLA_FLAGS",
                                            "setting torch-cpu float32_matmul_precision"]
    assert [d.where for d in found[0].same] == ["setting jax-cpu XLA_FLAGS",
                                                "setting torch-cpu XLA_FLAGS"]
    # Workers' copies of an env var say nothing about who reads it: no backend's records
    # are claimed by it (torch never reads XLA_FLAGS); a framework's own setting is.
    assert found[0].backends == set() and found[1].backends == {"torch-cpu"}
    assert "the same change in setting jax-cpu XLA_FLAGS, setting torch-cpu XLA_FLAGS" \
        in found[0].text()


def test_a_backends_arithmetic_change_explains_its_records():
    """A torch matmul computing float32 in bf16: fingerprint, features, 10 records, one cause."""
    fp = [Drift("fingerprint torch-cpu precision=default via=none", f, "a", "b", "changed")
          for f in ("label", "input_bits", "passes")]
    feats = [Drift("features torch-cpu precision=default via=none dtype=float32", f, 1, 2, "x")
             for f in ("extra_bits", "rounding")]
    recs = [d for i in range(10) for d in (_rec(f"mm | d={i} | torch-cpu"),
                                           _rec(f"mm | d={i} | torch-cpu", "bound_ratio", 0.5,
                                                3.0))]
    other = _rec("sm | n=8 | jax-cpu")
    pair = _rec("mm | d=0 | jax-cpu|torch-cpu", "bound_ratio", 0.1, 2.0)
    found = causes([*recs, other, *fp, *feats, pair])
    assert [c.head.where for c in found] == ["fingerprint torch-cpu precision=default via=none",
                                            "sm | n=8 | jax-cpu"]
    head = found[0]
    assert head.head == fp[0] and head.arithmetic == fp[1:] + feats
    assert list(head.records) == [f"mm | d={i} | torch-cpu" for i in range(10)] + [
        "mm | d=0 | jax-cpu|torch-cpu"]
    assert all(len(v) == 2 for k, v in head.records.items() if "|" not in k.split(" | ")[2])
    assert "with it: 4 fingerprint/feature field(s), 21 drift(s) of 11 record(s)" in head.text()
    # The jax-cpu record nothing explains is a cause of its own.
    assert found[1].head == other and found[1].records == {}


def test_a_setting_naming_the_backend_takes_its_arithmetic_and_records():
    s = _setting("torch-cpu float32_matmul_precision", "highest", "medium")
    fp = Drift("fingerprint torch-cpu precision=default via=none", "label", "F32", "BF16", "x")
    r = _rec("mm | d=1 | torch-cpu")
    (cause,) = causes([r, fp, s])
    assert cause.head == s and cause.arithmetic == [fp] and cause.records == {r.where: [r]}


def test_a_record_alone_keeps_its_drifts_beside_the_first():
    a, b = _rec("mm | d=1 | jax-cpu"), _rec("mm | d=1 | jax-cpu", "bound_exceeded", 0, 5)
    (cause,) = causes([a, b])
    assert cause.head == a
    assert cause.text() == (f"{a.text()}; also bound_exceeded 0 -> 5")


def test_a_missing_backend_explains_its_missing_records():
    gone = Drift("backend torch-cpu", "backend", "ran", "did not run", "absent")
    missing = [Drift(f"mm | d={i} | torch-cpu", "record", "pass", None, "missing")
               for i in range(3)]
    (cause,) = causes([gone, *missing])
    assert cause.head == gone and len(cause.records) == 3


def test_junit_has_one_settings_testcase_per_cause(tmp_path):
    result = Check(drifts=[_setting("env XLA_FLAGS", None, FLAGS),
                           _setting("jax-cpu XLA_FLAGS", "", FLAGS),
                           _setting("torch-cpu XLA_FLAGS", "", FLAGS)])
    path = write(result, tmp_path / "j.xml")
    schema = xmlschema.XMLSchema(str(XSD))
    schema.validate(str(path))
    cases = schema.to_dict(str(path))["testsuite"][0]["testcase"]
    assert [c["@name"] for c in cases] == ["setting env XLA_FLAGS"]
    assert "the same change in setting jax-cpu XLA_FLAGS" in cases[0]["failure"]["@message"]
