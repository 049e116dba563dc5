"""One mismatch formatter for every op family: each family's failing verdict carries a
`Mismatch` that agrees with its metrics, and the reason's count/worst part is exactly
`format_mismatch` of it (torch.testing's "k / n (x%) ... at index (i, j) ... allowed" habit).

Each case is a should-fail (or, for greedy's pinned fail text, should-warn) output judged
through the probe table's own `evaluate`, as the runner judges it.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from diag import numerics, oracle
from diag.compare import format_index
from diag.compare.verdict import Mismatch, Verdict, format_mismatch
from diag.compare.outcome import Evaluation, Outcome
from diag.plan.registry import PROBES

BF16 = np.dtype(ml_dtypes.bfloat16)


def _judge(op: str, inputs: list, outputs: list, names: list, truth, **params) -> Verdict:
    params.setdefault("dtype", numerics.dtype_name(inputs[0].dtype))
    o = Outcome(inputs=inputs, outputs=outputs, names=names, truth=truth, params=params)
    return PROBES[op].evaluate(o)


def _assert_formatted(ev: Verdict) -> str:
    assert ev.mismatch is not None, ev.reason
    text = format_mismatch(ev.mismatch)
    assert text in ev.reason, (text, ev.reason)
    return text


def test_the_formatter_writes_count_share_and_worst():
    m = Mismatch(3, 400, where="(1, 2)", ratio=12.5, got=1.25, expected=1.0, allowed=0.001)
    assert format_mismatch(m) == ("3 / 400 elements (0.75%); worst 12.5x the bound at (1, 2): "
                                  "got 1.25, correctly rounded 1, allowed ±0.001")
    assert format_mismatch(Mismatch(2, 9, "rows", share=False)) == "2 / 9 rows"
    assert format_mismatch(Mismatch(5, 10, where="(0, 3)", ulp=7)) == (
        "5 / 10 elements (50.00%), up to 7 ULP at (0, 3)")
    assert Mismatch(2, 9, "rows", share=False).to_dict() == {
        "count": 2, "total": 9, "unit": "rows", "share": False}
    assert Evaluation is Verdict  # the probe table's name is the one verdict type


def test_matmul_bound_breach_reason_is_the_formatter():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 64)).astype(np.float32)
    truth = oracle.matmul_result(a, b)
    one_pass = np.matmul(a.astype(BF16).astype(np.float32), b.astype(BF16).astype(np.float32))
    ev = _judge("matmul", [a, b], [one_pass], ["output"], truth)
    assert ev.status == "fail"
    text = _assert_formatted(ev)
    assert ev.reason == f"error exceeds the float32 accumulation bound in {text}"
    m, w = ev.metrics, ev.metrics["worst"]
    assert (ev.mismatch.count, ev.mismatch.total) == (m["bound_exceeded"], truth.value.size)
    assert ev.mismatch.where == w["index"] and ev.mismatch.ratio == m["bound_ratio"]
    # The worst element is where the formatter says, with the values it prints.
    i, j = (int(v) for v in w["index"].strip("()").split(","))
    assert float(one_pass[i, j]) == ev.mismatch.got == w["got"]
    assert float(truth.value[i, j]) == ev.mismatch.expected
    assert re.fullmatch(r"\d+ / \d+ elements \(\d+\.\d\d%\); worst \S+x the bound at "
                        r"\(\d+, \d+\): got \S+, correctly rounded \S+, allowed ±\S+", text)


def test_matmul_nonfinite_and_agreement_reasons_are_the_formatter():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 32)).astype(np.float32)
    b = rng.standard_normal((32, 8)).astype(np.float32)
    truth = oracle.matmul_result(a, b)
    out = np.matmul(a, b)
    out[1, 2] = np.nan
    ev = _judge("matmul", [a, b], [out], ["output"], truth)
    assert ev.status == "fail" and _assert_formatted(ev) == "1 / 64 elements"
    assert ev.reason.startswith("1 / 64 elements are NaN/Inf")
    good = _judge("matmul", [a, b], [np.matmul(a, b)], ["output"], truth)
    assert good.status == "pass" and good.mismatch is None
    x = Outcome([a, b], [np.matmul(a, b)], ["output"], truth, {})
    y_out = np.matmul(a, b)
    y_out[3, 4] = np.nextafter(y_out[3, 4], np.float32(np.inf))
    y = Outcome([a, b], [y_out], ["output"], truth, {})
    v = PROBES["matmul"].agree(x, y, ("p", "q"), good.context)
    reason, metrics = v.reason, v.metrics
    assert metrics["worst"]["index"] == format_index(3 * 8 + 4, (8, 8))
    assert reason.startswith("p and q differ in "
                             + format_mismatch(Mismatch(1, 64, where="(3, 4)", ulp=1)))


def test_softmax_reasons_are_the_formatter():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    truth = oracle.softmax_result(x)
    out = truth.value.copy()
    out[2, 7] = np.inf
    ev = _judge("softmax", [x], [out], ["output"], truth, n=256)
    assert ev.status == "fail" and ev.mismatch.unit == "elements of defined rows"
    assert ev.reason.startswith(f"float32 softmax: {_assert_formatted(ev)} are NaN/Inf")
    wrong = truth.value.copy()
    wrong[1] *= 1.01  # a wrong normaliser: 1% off in a whole row
    ev = _judge("softmax", [x], [wrong], ["output"], truth, n=256)
    assert ev.status == "fail"
    assert ev.mismatch.count == ev.metrics["bound_exceeded"] > 0
    assert ev.reason.startswith("float32 softmax error exceeds the float32 arithmetic bound in "
                                + _assert_formatted(ev))


@pytest.mark.parametrize("op,params", [("top_k", {}),
                                       ("approx_max_k", {"recall_target": 0.95})])
def test_top_k_reasons_are_the_formatter(op, params):
    x = np.random.default_rng(3).standard_normal((5, 300)).astype(np.float32)
    truth = oracle.top_k_result(x, 8)
    v, i = truth.value.copy(), truth.extra["indices"].copy()
    i[:, 1], v[:, 1] = i[:, 0], v[:, 0]  # the same index twice in every row
    ev = _judge(op, [x], [v, i], ["values", "indices"], truth, k=8, **params)
    assert ev.status == "fail"
    text = _assert_formatted(ev)
    assert text == f"{ev.metrics['invalid_rows']} / 5 rows" == "5 / 5 rows"
    assert ev.mismatch.where == f"row {ev.metrics['invalid_examples'][0]['row']}"
    assert f"{text} are not a valid top-k" in ev.reason


def test_greedy_reasons_carry_the_mismatch():
    """greedy's fail text keeps its pinned per-path form ("path k of n rows"), built from the
    same Mismatch; its warn on rounding ties is the formatter."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 64)).astype(BF16)
    truth = oracle.softmax_result(x)
    exact = x.astype(np.float32).argmax(axis=-1)
    off = (exact + 1) % 64
    ev = _judge("greedy_token", [x], [exact, off], ["jit/argmax", "jit/broken"], truth)
    assert ev.status == "fail" and ev.mismatch.count == 6 == ev.mismatch.total
    assert f"jit/broken {ev.mismatch.count} of {ev.mismatch.total} rows" in ev.reason
    assert f"jit/broken {ev.mismatch.where} chose {ev.mismatch.got}, exact " \
           f"{ev.mismatch.expected}" in ev.reason
    # Two logits one bf16 ulp apart whose probabilities round to the same bf16 value: a
    # softmax path that takes the lower index is a rounding tie (warn), counted by the formatter.
    xt = np.full((1, 64), -30.0, np.float32).astype(BF16)
    xt[0, 10] = 0.25
    xt[0, 3] = numerics.from_bits(numerics.bits_view(xt[0, 10:11]) - 1, "bfloat16")[0]
    t = oracle.softmax_result(xt)
    assert t.value[0, 10] == t.value[0, 3]
    ev = _judge("greedy_token", [xt], [np.array([3])], ["jit/softmax/argmax"], t)
    assert ev.status == "warn"
    assert f"drops the most probable token in {_assert_formatted(ev)} " in ev.reason


def test_train_step_nonfinite_reason_is_the_formatter():
    rng = np.random.default_rng(5)
    x, w1, w2 = ((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
                 for s in ((8, 16), (16, 16), (16, 4)))
    truth = oracle.train_step_result(x, w1, w2, 0.1)
    loss, n1, n2 = truth.value, truth.extra["w1"].copy(), truth.extra["w2"]
    n1[0, :3] = np.nan
    ev = _judge("train_step", [x, w1, w2], [np.asarray(loss), n1, n2], ["loss", "w1", "w2"],
                truth, lr=0.1)
    assert ev.status == "fail"
    text = _assert_formatted(ev)
    assert text == f"3 / {1 + 16 * 16 + 16 * 4} output elements"
    assert ev.metrics["elements"] == 1 + 16 * 16 + 16 * 4
    assert ev.reason.startswith(f"the step went non-finite: {text} are NaN/Inf")


def _train_case():
    """A tiny `train` case (diag.train): the float64 reference judged as a float32 run."""
    from diag.probes.train import make_inputs, truth

    params = {"layers": 1, "width": 8, "vocab": 16, "seq": 4, "batch": 2, "steps": 2,
              "heads": 2, "lr": 3e-3, "compute": "float32"}
    inputs = make_inputs(np.random.default_rng(0), params, np.float32)
    tr = truth(inputs, params, None)
    traj = tr.extra["trajectory"]
    names = list(traj)
    return ("train", inputs, [traj[n].astype(np.float32) for n in names], names, tr, params)


def _family_metric_keys() -> set[str]:
    """Every top-level metric key the op families write, from real verdicts and agreements."""
    rng = np.random.default_rng(6)
    keys: set[str] = set()
    a = rng.standard_normal((8, 16)).astype(BF16)
    b = rng.standard_normal((16, 8)).astype(BF16)
    mt = oracle.matmul_result(a, b)
    out = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(BF16)
    out[0, 0] = np.nan
    x = rng.standard_normal((4, 64)).astype(BF16)
    x[0] = -np.inf  # an undefined row: the hazard keys
    sm = oracle.softmax_result(x)
    tk = oracle.top_k_result(x, 4)
    w = [(rng.standard_normal(s) / 4).astype(np.float32) for s in ((4, 8), (8, 8), (8, 2))]
    tr = oracle.train_step_result(*w, 0.1)
    cases = [
        ("matmul", [a, b], [out], ["output"], mt, {}),
        ("softmax", [x], [sm.value], ["output"], sm, {"n": 64}),
        ("top_k", [x], [tk.value, tk.extra["indices"]], ["values", "indices"], tk, {"k": 4}),
        ("approx_max_k", [x], [tk.value, tk.extra["indices"]], ["values", "indices"], tk,
         {"k": 4, "recall_target": 0.9}),
        ("greedy_token", [x], [x.astype(np.float32).argmax(-1)], ["jit/argmax"], sm, {}),
        ("train_step", w, [np.asarray(tr.value), tr.extra["w1"], tr.extra["w2"]],
         ["loss", "w1", "w2"], tr, {"lr": 0.1}),
    ]
    cases.append(_train_case())
    for op, inputs, outputs, names, truth, params in cases:
        params = {"dtype": numerics.dtype_name(inputs[0].dtype), **params}
        o = Outcome(inputs=inputs, outputs=outputs, names=names, truth=truth, params=params)
        ev = PROBES[op].evaluate(o)
        agreed = PROBES[op].agree(o, o, ("p", "q"), ev.context)
        assert isinstance(ev, Verdict) and isinstance(agreed, Verdict), op
        keys |= set(ev.metrics) | set(agreed.metrics)
    return keys


def test_every_op_agrees_in_a_verdict_as_it_evaluates_in_one():
    """`agree` is typed as `evaluate` is: a `Verdict` whose fields a record copies, never a
    bare (status, reason, metrics) tuple read by position."""
    import inspect

    for op, probe in PROBES.items():
        returns = inspect.signature(probe.agree).return_annotation
        assert returns in (Verdict, "Verdict"), f"{op}.agree returns {returns}"


def test_every_metric_the_terminal_and_report_read_is_one_a_family_writes():
    """A renamed metric key must not blank a report column silently: every key the terminal
    summary and the report read from a record's metrics is written by some op family (A/B
    records' own keys, documented in docs/records.md, aside)."""
    import pathlib

    from diag import render
    from diag.report import charts, html

    root = pathlib.Path(__file__).resolve().parents[1] / "diag"
    read = {key for _, key, _ in html.METRIC_COLUMNS} | {key for key, _, _ in charts.PANELS}
    read |= set(render._ULP_KEYS)
    pattern = re.compile(r"""\b(?:metrics|m|r\["metrics"\])(?:\.get\(|\[)\s*["'](\w+)["']""")
    for path in [*sorted((root / "render").glob("*.py")), *sorted((root / "report").glob("*.py"))]:
        read |= set(pattern.findall(path.read_text()))
    ab_record_keys = {"changed_outputs", "difference", "hlo_diff", "status"}
    missing = read - ab_record_keys - _family_metric_keys()
    assert not missing, f"read by the terminal/report but written by no op family: {missing}"
    assert {"bound_ratio", "max_ulp", "recall_min", "loss_ulp"} <= read  # the scan sees them
