"""Suite files are validated before anything runs: a bad file names the file, field, expectation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diag.errors import SuiteError
from diag.plan.suite import load_suite, suite_names
from tests.conftest import REPO_ROOT


def _write(tmp_path, text: str):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return str(p)


GOOD = """
[suite]
name = "t"
seed = 3

[[probe]]
name = "sweep"
op = "matmul"
dtypes = ["float32", "bfloat16"]
shape = ["d", 4, "d"]
sweep = { d = [8, 16] }
"""


def test_matmul_suite_covers_the_d4_sweep_dtypes_and_precisions():
    suite = load_suite("matmul")
    assert "matmul" in suite_names()
    sweep = [c for c in suite.cases if c.probe == "sweep_d4"]
    ds = sorted({c.params["d"] for c in sweep})
    assert ds == [64, 128, 256, 512, 1024, 2048, 4096]
    assert {c.dtype for c in sweep} == {"float32", "bfloat16", "float16"}
    assert all(c.params["k"] == 4 and c.params["m"] == c.params["n"] == c.params["d"]
               for c in sweep)
    settings = {(c.params["precision"], c.params["precision_via"]) for c in suite.cases}
    assert ("default", "none") in settings
    for level in ("high", "highest", "medium"):
        assert (level, "argument") in settings and (level, "config") in settings
    assert len({c.id for c in suite.cases}) == len(suite.cases)


def test_cases_with_same_inputs_share_an_input_key():
    suite = load_suite("matmul")
    prec = [c for c in suite.cases if c.probe == "precision" and c.params["m"] == 512]
    assert len(prec) == 7 and len({c.input_key for c in prec}) == 1
    sweep_4096 = [c for c in suite.cases if c.probe == "sweep_d4" and c.params["d"] == 4096
                  and c.dtype == "float32"][0]
    prec_4096 = [c for c in suite.cases if c.probe == "precision" and c.params["m"] == 4096][0]
    assert sweep_4096.input_key == prec_4096.input_key  # ground truth computed once


def test_good_suite_expands_grid(tmp_path):
    suite = load_suite(_write(tmp_path, GOOD))
    assert suite.name == "t"
    assert [(c.params["d"], c.dtype) for c in suite.cases] == [
        (8, "float32"), (8, "bfloat16"), (16, "float32"), (16, "bfloat16")]
    assert suite.cases[0].label == "8x4x8 float32"


@pytest.mark.parametrize("text, field, expected", [
    (GOOD.replace('dtypes = ["float32", "bfloat16"]', 'dtypes = "float32"'),
     "probe[0].dtypes", "expected a list of strings, got str"),
    (GOOD.replace('"bfloat16"]', '"float99"]'), "probe[0].dtypes[1]", "float99"),
    (GOOD.replace('op = "matmul"', 'op = "matmull"'), "probe[0].op", "matmull"),
    (GOOD.replace("[8, 16]", "[8, 0]"), "probe[0].sweep.d[1]", "expected >= 1"),
    (GOOD.replace("[8, 16]", "[8, true]"), "probe[0].sweep.d[1]", "positive integer, got bool"),
    (GOOD.replace('["d", 4, "d"]', '["e", 4, "d"]'), "probe[0].shape[0]", "not a swept"),
    (GOOD.replace('["d", 4, "d"]', '["d", 4]'), "probe[0].shape", "3 dimensions"),
    (GOOD.replace("seed = 3", 'seed = "3"'), "suite.seed", "an integer"),
    (GOOD + "\n[[probe]]\nname = \"sweep\"\nop = \"matmul\"\ndtypes=[\"float32\"]\n"
            "shapes=[[1,2,3]]\n", "probe[1].name", "repeated"),
    (GOOD.replace('name = "sweep"', 'name = "sweep"\nprecison = ["high"]'),
     "probe[0].precison", "known field"),
    (GOOD.replace('name = "sweep"', 'name = "sweep"\nprecision = ["ultra"]'),
     "probe[0].precision[0]", "ultra"),
    ("[suite\nname=1", "toml", "valid TOML"),
    ("[suite]\nname = \"x\"\n", "probe", "[[probe]]"),
])
def test_bad_suite_names_file_field_and_expectation(tmp_path, text, field, expected):
    path = _write(tmp_path, text)
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    msg = str(info.value)
    assert msg.startswith(f"diag: {path}: field '{field}'"), msg
    assert expected in msg
    assert info.value.field == field


def test_unknown_suite_name_lists_shipped_suites():
    with pytest.raises(SuiteError) as info:
        load_suite("no-such-suite")
    assert "matmul" in str(info.value) and "no-such-suite" in str(info.value)


TOPK = """
[suite]
name = "t"

[[probe]]
name = "tk"
op = "approx_max_k"
inputs = ["normal", "ties"]
dtypes = ["bfloat16"]
shapes = [[4, 1024]]
k = 8
recall_target = [0.9, 0.99]
aggregate_to_topk = [true, false]
"""


def test_sampling_suite_has_every_op_and_input_class():
    suite = load_suite("sampling")
    assert "sampling" in suite_names()
    ops = {c.op for c in suite.cases}
    assert ops == {"softmax", "top_k", "approx_max_k", "greedy_token", "logsumexp"}
    inputs = {c.inputs for c in suite.cases}
    for maker in ("normal", "normal5", "near_1e4", "masked_half", "fully_masked", "ties",
                  "special", "all_equal", "near_ties"):
        assert maker in inputs
    vocab = {c.params["n"] for c in suite.cases if c.probe == "softmax_vocab"}
    assert vocab == {32768, 131072, 262144}
    approx = [c for c in suite.cases if c.op == "approx_max_k"]
    assert {c.params["recall_target"] for c in approx} == {0.9, 0.95, 0.99}
    assert {c.params["aggregate_to_topk"] for c in approx} == {True, False}
    assert {c.params["reduction_input_size_override"] for c in approx} == {-1, 65536}
    # top_k and approx_max_k cases on the same rows share inputs (and so ground truth).
    keys = {c.op: c.input_key for c in suite.cases
            if c.inputs == "normal" and c.dtype == "float32" and c.params.get("k") == 64}
    assert keys["top_k"] == keys["approx_max_k"]


def test_grid_parameters_expand_as_a_product(tmp_path):
    suite = load_suite(_write(tmp_path, TOPK))
    assert len(suite.cases) == 2 * 2 * 2
    assert suite.cases[0].op_args == {"k": 8, "recall_target": 0.9, "aggregate_to_topk": True,
                                      "reduction_input_size_override": -1}
    assert suite.cases[0].label == "4x1024 bfloat16 normal k=8 recall_target=0.9 aggregate_to_topk=true"


@pytest.mark.parametrize("change, field, expected", [
    (("k = 8", "k = 0"), "probe[0]", "k must be in 1 ... n (n = 1024), got k = 0"),
    (("k = 8", "k = 1025"), "probe[0]", "got k = 1025"),
    (("[0.9, 0.99]", "[0.9, nan]"), "probe[0]", "recall_target must be a finite number"),
    (("[0.9, 0.99]", "inf"), "probe[0]", "got inf"),
    (("[0.9, 0.99]", "1.5"), "probe[0]", "in (0, 1]"),
    (("[[4, 1024]]", "[[4, 0]]"), "probe[0].shapes[0][1]", "n may not be empty"),
    (("[[4, 1024]]", "[[4, 16, 16]]"), "probe[0].shapes[0]", "2 dimensions [rows, N]"),
    (("k = 8", 'k = "8"'), "probe[0].k", "an integer, got str"),
    (("k = 8", "k = 8\nprecision = \"high\""), "probe[0].precision", "known field for op"),
    (("recall_target", "reduction_input_size_override = 100\nrecall_target"), "probe[0]",
     "reduction_input_size_override must be -1 (none) or >= n"),
])
def test_bad_sampling_parameters_exit_before_any_worker(tmp_path, change, field, expected):
    path = _write(tmp_path, TOPK.replace(*change, 1))
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    assert info.value.field == field, str(info.value)
    assert expected in str(info.value)



_PEAK = r"""
import json, re, sys, tempfile
from pathlib import Path
import numpy as np
from diag.compare.outcome import Outcome
from diag.plan.registry import PROBES
from diag.plan.inputs import InputStore, TruthStore
from diag.plan.suite import load_suite

def hwm():
    # This process's peak RSS (VmHWM, KiB). Not ru_maxrss: Linux carries that over from the
    # parent across exec, so under a big pytest process it would read the parent's peak.
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


case = load_suite(sys.argv[1]).cases[0]
before = hwm()
inputs = InputStore(Path(tempfile.mkdtemp()))
truth = TruthStore(inputs, tempfile.mkdtemp()).get(case)
outcome = Outcome(inputs=inputs.get(case), outputs=[np.array(truth.value)], names=["output"],
                  truth=truth, params=case.params)
assert PROBES[case.op].evaluate(outcome).status == "pass"
peak = hwm() - before
print(json.dumps({"peak": peak, "estimate": case.host_bytes}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads VmHWM from /proc/self/status")
@pytest.mark.parametrize("op, shape", [
    ("matmul", [1024, 4, 1024]),   # output-dominated
    ("matmul", [16, 32768, 16]),   # input-dominated (long K: Ozaki splitting)
    ("softmax", [4, 65536]),
])
def test_host_memory_estimate_is_above_the_measured_peak(tmp_path, op, shape):
    """The estimate the loader refuses oversized cases by must not undercount: the host's
    peak memory for one case (inputs drawn, ground truth, verdict) stays below it."""
    path = _write(tmp_path, f'[suite]\nname = "m"\n[[probe]]\nname = "p"\nop = "{op}"\n'
                            f'dtypes = ["float32"]\nshapes = [{shape}]\n')
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DIAG_CACHE_DIR": str(tmp_path / "c")}
    out = subprocess.run([sys.executable, "-c", _PEAK, path], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["peak"] > 0
    assert m["peak"] <= m["estimate"] <= 4 * m["peak"], m
