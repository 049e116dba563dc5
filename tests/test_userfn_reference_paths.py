"""A reference function the user names reaches every path that runs a user's function:
`diag preflight --probe FILE.py:FUNCTION --reference FILE.py:REF` and `diag.testing`'s worker
path (``assert_numerics("f.py:make", reference=...)``), as `diag run --reference` does.

The expected verdicts are decided here: the function's float32 output against each reference,
both computed in numpy, normwise, against sqrt(u) of float32.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from tests.conftest import run_diag

torch = pytest.importorskip("torch")

SQRT_U32 = 2.0**-12

F = '''
import numpy as np
import torch


def softplus(x):
    return torch.nn.functional.softplus(x)


def ref_good(x):
    return np.log1p(np.exp(x.double().numpy()))


def ref_bad(x):  # a reference that is 1% off
    return np.log1p(np.exp(x.double().numpy())) * 1.01


def make():
    return softplus, (torch.linspace(-3, 3, 64),)
'''


@pytest.fixture()
def f(tmp_path):
    path = tmp_path / "f.py"
    path.write_text(F)
    return path


def _expected(path, ref: str) -> str:
    spec = importlib.util.spec_from_file_location(f"f_{ref}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn, (x,) = mod.make()
    y = fn(x).double().numpy()
    r = getattr(mod, ref)(x)
    return "pass" if np.abs(y - r).max() / np.abs(r).max() <= SQRT_U32 else "fail"


def test_testing_worker_path_takes_a_reference_spec_or_a_top_level_function(f, monkeypatch):
    from diag.testing import assert_numerics

    assert _expected(f, "ref_bad") == "fail" and _expected(f, "ref_good") == "pass"
    with pytest.raises(AssertionError) as info:
        assert_numerics(f"{f}:make", backends=["torch-cpu"], reference=f"{f}:ref_bad")
    # the function agrees with itself in float64: the difference is with the reference
    assert "torch-cpu: output (float32): normwise error 0.0099 beyond 0.000244 allowed" in (
        str(info.value)
    )
    assert "no single op leaves the float64 shadow" in str(info.value)
    monkeypatch.syspath_prepend(str(f.parent))
    spec = importlib.util.spec_from_file_location("f", f)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "f", mod)
    spec.loader.exec_module(mod)
    (v,) = assert_numerics(f"{f}:make", backends=["torch-cpu"], reference=mod.ref_good)
    assert v.status == "pass"


def test_testing_refuses_a_reference_the_workers_host_cannot_load(f):
    from diag.errors import UsageError
    from diag.testing import assert_numerics

    with pytest.raises(UsageError, match="not a function at the top level of a file"):
        assert_numerics(f"{f}:make", reference=lambda x: x)


def test_preflight_reference_count_must_match_its_probes(f):
    proc = run_diag("preflight", "--probe", f"{f}:make", "--reference", f"{f}:ref_bad",
                    "--reference", f"{f}:ref_good")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "diag: --reference given 2 time(s) for 1 --probe: give one --reference per --probe, "
        "in the same order"
    ]


@pytest.mark.slow
def test_preflight_judges_a_probe_against_its_reference(f):
    assert _expected(f, "ref_bad") == "fail"
    proc = run_diag("preflight", "--probe", f"{f}:make", "--reference", f"{f}:ref_bad",
                    "--json", timeout=600)
    findings = json.loads(proc.stdout)["findings"]
    mine = [x for x in findings if "f.py:make" in x["check"]]
    assert mine and all(x["status"] == "fail" for x in mine), mine
    assert "beyond 0.000244 allowed" in mine[0]["what"] and proc.returncode == 1
