"""The probe table: one frozen record per op, as data.

A probe says which op a case runs (the same name in every backend module), which dtypes,
shape dimensions and parameters it takes, how its inputs are made, which parameters are
forwarded to the backend op, where its ground truth comes from and how a backend's output is
judged against it (and against another backend's). Quirks live in the record, never in
`if op == ...` in the runner or the tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np

from diag.inputs import INPUT_MAKERS

__all__ = ["Probe", "Outcome", "Evaluation", "MalformedOutput", "PROBES", "INPUT_MAKERS",
           "EXPECTATIONS", "FINGERPRINT_OP", "REPORT_SECTIONS", "SAMPLER_BATCHES", "get_probe",
           "expected_outcome"]


def _matmul_shapes(params: dict) -> list[tuple[int, ...]]:
    batch = tuple(params.get("batch", ()))
    m, k, n = params["m"], params["k"], params["n"]
    return [batch + (m, k), batch + (k, n)]


def _train_shapes(params: dict) -> list[tuple[int, ...]]:
    b, d, c = params["batch"], params["d"], params["c"]
    return [(b, d), (d, d), (d, c)]


def _rows_shapes(params: dict) -> list[tuple[int, ...]]:
    return [(params["rows"], params["n"])]


def matmul_bound(inputs: list[np.ndarray], truth: np.ndarray, params: dict) -> np.ndarray:
    """Largest |computed - truth| a backend may show if it computes as it claims.

    The claim: products of the given inputs summed in float32 (also for bf16/fp16 inputs,
    as every framework documents), then rounded once to the output dtype. With P = |A||B|,
    e the exact product and s the float32 sum (the textbook bound |s - e| <= gamma_K P, plus
    K * eta for float32 underflow in the partial sums):
      float32 output:   |s - e| <= gamma_K P
      narrower output:  |fl(s) - e| <= (1 + u) gamma_K P + u |e| + eta_out / 2
    and the truth itself is |truth - e| <= u |e| + eta_out / 2, with |e| <= t / (1 - u)
    for t = |truth| and u the output's unit roundoff, eta_out its least subnormal.
    """
    from diag import numerics

    a, b = (np.asarray(x, dtype=np.float64) for x in inputs)
    k = a.shape[-1]
    with np.errstate(invalid="ignore"):  # inf * 0: the truth is NaN there and not judged
        absprod = np.matmul(np.abs(a), np.abs(b))
    out = truth.dtype
    u = numerics.unit_roundoff(out)
    eta_out = float(ml_dtypes.finfo(out).smallest_subnormal)
    exact_mag = np.abs(truth.astype(np.float64)) / (1 - u)
    bound = numerics.gamma(k, np.float32) * absprod + k * float(
        np.finfo(np.float32).smallest_subnormal)
    if u > numerics.unit_roundoff(np.float32):  # a final rounding to a narrower output
        bound *= 1 + u
        bound += u * exact_mag + eta_out / 2
    bound += u * exact_mag + eta_out / 2  # the truth's own rounding
    return bound


@dataclass
class Outcome:
    """What one backend returned for one case, with everything needed to judge it.

    Attributes:
      inputs: the host's input arrays (what the backend received, bit for bit).
      outputs: the backend's outputs, in the op's order.
      names: a name per output (`values`, `indices`, or sampler paths like `jit/argmax`).
      truth: the oracle's result for this case (None for probes that need none).
      params: the case parameters.
      promised: whether the backend promises the claimed arithmetic under this setting.
      setting: the setting in words, for reasons (`precision=default`).
      nan_report: where a non-finite output was born (`diag.nan`), when the op asked the
        worker to hunt it.
    """

    inputs: list
    outputs: list
    names: list
    truth: Any
    params: dict
    promised: bool = True
    setting: str = ""
    nan_report: Optional[dict] = None

    @property
    def named(self) -> dict:
        """The outputs by name (`values`, `indices`, a sampler path, `loss`, ...)."""
        return dict(zip(self.names, self.outputs))


@dataclass
class Evaluation:
    """A verdict with its metrics; `context` is handed to the probe's agreement check."""

    status: str
    reason: str
    metrics: dict
    context: Any = None


class MalformedOutput(ValueError):
    """A backend returned outputs of the wrong shape, dtype or number: not a numerical result.

    The runner turns it (and any other exception while judging one output) into an `error`
    record with the reason, and the run goes on.
    """


def _only_output(o: "Outcome", expected: np.ndarray) -> np.ndarray:
    """The one output of a single-output op, checked against the truth's shape and dtype."""
    if len(o.outputs) != 1:
        raise MalformedOutput(f"returned {len(o.outputs)} outputs, expected 1")
    _shape_mismatch(o.outputs[0], expected)
    return o.outputs[0]


def _shape_mismatch(output: np.ndarray, expected: np.ndarray) -> None:
    """Raise `MalformedOutput` unless `output` has the truth's shape and dtype."""
    from diag import numerics

    if output.shape == expected.shape and output.dtype == expected.dtype:
        return
    raise MalformedOutput(f"returned {numerics.dtype_name(output.dtype)}{list(output.shape)}, "
                          f"expected {numerics.dtype_name(expected.dtype)}"
                          f"{list(expected.shape)}")


# ---------------------------------------------------------------------------------------------
# Ground truth per probe (diag.oracle, same op names)


def _oracle(op: str, *args_from_params: str) -> Callable:
    def truth(inputs: list, params: dict, cache) -> Any:
        from diag import oracle

        extra = [params[a] for a in args_from_params]
        return getattr(oracle, f"{op}_result")(*inputs, *extra, cache=cache)

    truth.__name__ = f"{op}_truth"
    return truth


# ---------------------------------------------------------------------------------------------
# Verdicts per probe (the policies live in diag.compare; these only route the arrays)


def _matmul_evaluate(o: Outcome) -> Evaluation:
    from diag.compare import compare, judge

    expected = o.truth.value
    output = _only_output(o, expected)
    bound = matmul_bound(o.inputs, expected, o.params)
    metrics = compare(output, expected, bound)
    status, reason = judge(metrics, claim="float32 accumulation", setting=o.setting,
                           promised=o.promised)
    return Evaluation(status, reason, metrics, context=bound)


def _matmul_agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    from diag.compare import agreement, judge_agreement

    metrics = agreement(a.outputs[0], b.outputs[0], context)
    status, reason = judge_agreement(metrics, *names, "float32 accumulation")
    return status, reason, metrics


def _softmax_evaluate(o: Outcome) -> Evaluation:
    from diag.compare import compare_softmax, judge_softmax

    expected = o.truth.value
    output = _only_output(o, expected)
    metrics = compare_softmax(output, expected, o.inputs[0])
    status, reason = judge_softmax(metrics, o.params["dtype"])
    return Evaluation(status, reason, metrics)


def _softmax_agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    from diag.compare import agree_values, softmax_ulp_tolerance

    # Two backends each within the tolerance of the truth may be twice it apart.
    allowed = 2 * softmax_ulp_tolerance(a.params["dtype"], a.params["n"])
    return agree_values(a.outputs[0], b.outputs[0], names, allowed_ulp=allowed)


def _top_k_outputs(o: Outcome) -> tuple[np.ndarray, np.ndarray]:
    """`values` and `indices`, checked for shape and dtype before they are judged.

    Raises:
      MalformedOutput: a missing output, or shapes that are not [rows..., k] (with
        `aggregate_to_topk=False` the candidate count is the implementation's, so only the
        leading dimensions are checked), or values of another dtype than the input.
    """
    from diag import numerics

    out = o.named
    missing = [n for n in ("values", "indices") if n not in out]
    if missing:
        raise MalformedOutput(f"no {' or '.join(missing)} output (got: "
                              f"{', '.join(o.names) or 'no outputs'})")
    values, indices = out["values"], out["indices"]
    x, k = o.inputs[0], o.params["k"]
    want = list(x.shape[:-1]) + [k]
    exact = o.params.get("aggregate_to_topk", True)
    if (values.shape != indices.shape or list(values.shape[:-1]) != want[:-1]
            or (exact and values.shape[-1] != k) or values.shape[-1] < 1):
        raise MalformedOutput(f"returned values{list(values.shape)} and indices"
                              f"{list(indices.shape)}, expected {want} each")
    if values.dtype != x.dtype:
        raise MalformedOutput(f"returned {numerics.dtype_name(values.dtype)} values for "
                              f"{numerics.dtype_name(x.dtype)} inputs")
    return values, indices


def _top_k_evaluate(o: Outcome) -> Evaluation:
    from diag.compare import check_top_k, judge_top_k

    values, indices = _top_k_outputs(o)
    target = o.params.get("recall_target")
    metrics = check_top_k(o.inputs[0], values, indices, o.params["k"], recall_target=target)
    status, reason = judge_top_k(metrics, approx=target is not None, recall_target=target)
    return Evaluation(status, reason, metrics)


def _top_k_agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    from diag.compare import agree_top_k

    return agree_top_k(a.inputs[0], _top_k_outputs(a), _top_k_outputs(b), a.params["k"],
                       names)


def _greedy_evaluate(o: Outcome) -> Evaluation:
    from diag.compare import check_greedy, judge_greedy

    tokens = o.named
    metrics = check_greedy(o.inputs[0], tokens, rounded_probs=o.truth.value)
    status, reason = judge_greedy(metrics)
    return Evaluation(status, reason, metrics)


def _greedy_agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    from diag.compare import agree_tokens

    return agree_tokens(a.named, b.named, names)


def _train_evaluate(o: Outcome) -> Evaluation:
    from diag.compare import compare_train_step, judge_train_step

    out = o.named
    truth = {"loss": o.truth.value, **o.truth.extra}
    metrics = compare_train_step(out, truth, o.inputs)
    status, reason = judge_train_step(metrics, nan_reason=(o.nan_report or {}).get("reason"))
    if o.nan_report:
        metrics["nan_report"] = o.nan_report
    return Evaluation(status, reason, metrics)


def _train_agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> tuple:
    from diag.compare import agree_train_step

    return agree_train_step(a.named, b.named, names)


# ---------------------------------------------------------------------------------------------
# Planted outcomes (a suite entry's `expect`)

# Outcomes a suite entry may declare it plants, so that the entry checks diag itself: the
# record passes when diag reports the planted outcome and fails when it does not.
EXPECTATIONS: dict[str, str] = {
    "nonfinite": "the inputs make the op overflow to NaN/Inf where the exact result is finite",
}


def _nonfinite_count(outputs: list) -> int:
    from diag import numerics

    return sum(int(np.count_nonzero(~np.isfinite(np.asarray(a).astype(np.float64))))
               for a in outputs if numerics.is_supported(np.asarray(a).dtype))


def expected_outcome(expect: Optional[str], ev: Evaluation, o: Outcome) -> Evaluation:
    """The verdict of a case whose suite entry plants an outcome (`expect`).

    A planted overflow is caught when the probe's own verdict is `fail` with NaN/Inf in the
    outputs: then the record passes, saying so. It fails when the outputs stay finite (the
    planted fault did not happen, so the case tested nothing) or when NaN/Inf went unflagged.

    Args:
      expect: the entry's `expect` (a key of `EXPECTATIONS`), or None for an ordinary case.
      ev: the probe's verdict as if nothing were planted.
      o: what the backend returned.
    """
    if expect is None:
        return ev
    nonfinite = _nonfinite_count(o.outputs)
    caught = ev.status == "fail" and nonfinite > 0
    metrics = {**ev.metrics, "expect": expect, "expect_caught": caught}
    if caught:
        return Evaluation("pass", f"planted NaN/Inf caught, as the suite expects "
                                  f"(expect = \"{expect}\"): {ev.reason}", metrics, ev.context)
    if nonfinite == 0:
        why = ("every output is finite: the planted overflow did not happen, so this case "
               "checked nothing")
    else:
        why = f"{nonfinite} output elements are NaN/Inf but the verdict did not flag them"
    return Evaluation("fail", f"the suite plants NaN/Inf here (expect = \"{expect}\") but "
                              f"{why}; verdict without the plant: {ev.status}: {ev.reason}",
                      metrics, ev.context)


# ---------------------------------------------------------------------------------------------
# Host memory per case (checked by the suite loader)

# Bytes per element the host holds at once while a case is drawn, its ground truth computed
# and an output judged, in float64-sized units (8 bytes): see `Probe.host_bytes`.
_F64 = 8


def _matmul_bytes(params: dict) -> int:
    # Inputs: float64 draws, the stored arrays and the oracle's/bound's float64 copies and
    # splits. Outputs: the truth, |A||B|, the bound, the loaded output and compare's arrays.
    batch = math.prod(params.get("batch", ()))
    m, k, n = params["m"], params["k"], params["n"]
    return _F64 * batch * (MATMUL_INPUT_COPIES * (m * k + k * n) + MATMUL_OUTPUT_COPIES * m * n)


def _rows_bytes(params: dict) -> int:
    # Rows ops hold the inputs, the float64 truth and its error terms, and the outputs.
    return _F64 * ROWS_COPIES * params["rows"] * params["n"]


def _train_bytes(params: dict) -> int:
    b, d, c = params["batch"], params["d"], params["c"]
    return _F64 * ROWS_COPIES * (b * d + d * d + d * c + b * c)


# Peak host memory over input + truth + verdict, in float64 copies of the inputs and of the
# output, rounded up from measured peaks (numpy 2, float32, VmHWM): matmul [16,32768,16]
# 4.0 and [64,65536,64] 2.7 input copies, [2048,4,2048] 12.7 output copies; softmax
# [4,65536] 22 and [8,131072] 18 copies. The estimates are 1.1-2.3x those peaks;
# `tests/test_suite.py` checks that the estimate stays above a measured peak.
MATMUL_INPUT_COPIES = 6
MATMUL_OUTPUT_COPIES = 16
ROWS_COPIES = 24


# ---------------------------------------------------------------------------------------------
# Parameter checks (run by the suite loader, before any worker starts)


def _check_k(params: dict) -> Optional[str]:
    k, n = params["k"], params["n"]
    if not 1 <= k <= n:
        return f"k must be in 1 ... n (n = {n}), got k = {k}"
    return None


def _check_approx(params: dict) -> Optional[str]:
    bad_k = _check_k(params)
    if bad_k:
        return bad_k
    target = params["recall_target"]
    if not math.isfinite(target) or not 0.0 < target <= 1.0:
        return f"recall_target must be a finite number in (0, 1], got {target}"
    override = params["reduction_input_size_override"]
    if override != -1 and override < params["n"]:
        return (f"reduction_input_size_override must be -1 (none) or >= n (n = {params['n']}), "
                f"got {override}")
    return None


def _no_check(params: dict) -> Optional[str]:
    return None


# ---------------------------------------------------------------------------------------------
# Case labels


def _matmul_label(params: dict) -> str:
    label = f"{params['m']}x{params['k']}x{params['n']} {params['dtype']}"
    if params.get("precision", "default") != "default":
        label += f" precision={params['precision']} via={params['precision_via']}"
    return label


def _rows_label(*extra: str, quiet: Optional[dict] = None) -> Callable[[dict], str]:
    """Labels like `16x32768 bfloat16 ties k=64`; parameters in `quiet` are left out while
    they hold the value given there (the op's own default)."""
    quiet = quiet or {}

    def label(params: dict) -> str:
        text = f"{params['rows']}x{params['n']} {params['dtype']} {params['inputs']}"
        for name in extra:
            value = params[name]
            if name in quiet and value == quiet[name]:
                continue
            text += f" {name}={json.dumps(value) if isinstance(value, bool) else value}"
        return text

    return label


def _train_label(params: dict) -> str:
    return (f"batch={params['batch']} d={params['d']} c={params['c']} {params['dtype']} "
            f"{params['inputs']} lr={params['lr']}")


def _matmul_normalize(params: dict) -> dict:
    # 'default' touches no setting, so how it would be passed does not matter: one case.
    if params["precision"] == "default":
        params["precision_via"] = "none"
    return params


def _same(params: dict) -> dict:
    return params


@dataclass(frozen=True)
class Probe:
    """One op as data.

    Attributes:
      op: the op name; `getattr(backend_module, op)` runs it on a backend.
      dims: the names of the suite's `shape` dimensions (matmul: m, k, n).
      params: grid parameters a suite entry may set: name -> (type, allowed values or None,
        default: one value, or a list of them for a grid). Each may be given as one value or a list (the grid is their product).
      op_args: the parameters forwarded to the backend op (the rest shape the inputs).
      dtypes: dtypes this probe supports.
      inputs: input makers (`INPUT_MAKERS`) that make sense for it.
      input_shapes: case params -> the shapes of the op's inputs.
      truth: (inputs, params, cache) -> the oracle's result for the case.
      truth_args: the parameters the ground truth depends on besides the inputs.
      evaluate: `Outcome` -> `Evaluation`: one backend's output against the truth.
      agree: (Outcome a, Outcome b, (name a, name b), context) -> (status, reason, metrics):
        two backends' outputs for the same case against each other.
      validate: params -> a message when the values are invalid together (k > n, ...).
      label: params -> the case label records carry.
      normalize: params -> params, merging grid points that mean the same case.
      input_family: cases of probes with the same family, inputs maker, dtype and shape
        share their input arrays (and so their ground truth).
      claim: what the verdict assumes, for the report.
      host_bytes: params -> an estimate of the host memory one case needs at its peak
        (inputs drawn, ground truth computed, an output judged); the suite loader refuses a
        case above the memory limit before anything runs.

    Quirks (so that the runner, the worker and the report never test an op's name):
      fingerprint: the worker measures this op's arithmetic (`diag.precision.fingerprint`)
        under each (`precision`, `precision_via`) setting its cases use, and `diag env`
        measures it under every setting a backend can express: what a verdict under a
        setting is checked against.
      fixed_args: op arguments the probe fixes for every case (not case parameters, not in
        records), e.g. the batch sizes a sampler's rows are also run in.
      hunt_nans: a non-finite output is hunted to the op that produced it (`diag.nan`) in
        the worker, and the record's reason names it.
      report_section: the report section that shows this op's rows (`diag.report.sections`;
        run.json's `report_sections`), '' for none.
    """

    op: str
    dims: tuple[str, ...]
    params: dict
    op_args: tuple[str, ...]
    dtypes: tuple[str, ...]
    inputs: tuple[str, ...]
    input_shapes: Callable[[dict], list[tuple[int, ...]]]
    truth: Callable[[list, dict, Any], Any]
    evaluate: Callable[[Outcome], Evaluation]
    agree: Callable[..., tuple]
    claim: str
    host_bytes: Callable[[dict], int]
    truth_args: tuple[str, ...] = ()
    validate: Callable[[dict], Optional[str]] = _no_check
    label: Callable[[dict], str] = field(default=_matmul_label)
    normalize: Callable[[dict], dict] = _same
    input_family: str = ""
    fingerprint: bool = False
    fixed_args: dict = field(default_factory=dict)
    hunt_nans: bool = False
    report_section: str = ""

    @property
    def family(self) -> str:
        return self.input_family or self.op


PRECISIONS = ("default", "high", "highest", "medium")
# The batch sizes a sampler's rows are also run in: a chosen token must not depend on them.
SAMPLER_BATCHES = (1, 8, 64)
PRECISION_VIA = ("argument", "config")
_FLOATS = ("float32", "bfloat16", "float16")
_LOGIT_MAKERS = ("normal", "normal5", "near_1e4", "masked_half", "fully_masked", "ties",
                 "special", "all_equal", "near_ties", "uniform", "wide")

PROBES: dict[str, Probe] = {
    p.op: p
    for p in (
        Probe(
            op="matmul", dims=("m", "k", "n"),
            params={"precision": (str, PRECISIONS, "default"),
                    # Unset: both ways (collapsed to one case for 'default').
                    "precision_via": (str, PRECISION_VIA + ("none",), list(PRECISION_VIA))},
            op_args=("precision", "precision_via"),
            dtypes=_FLOATS, inputs=("normal", "uniform", "positive", "wide"),
            input_shapes=_matmul_shapes, truth=_oracle("matmul"),
            evaluate=_matmul_evaluate, agree=_matmul_agree,
            normalize=_matmul_normalize, claim="float32 accumulation",
            host_bytes=_matmul_bytes, fingerprint=True,
        ),
        Probe(
            op="softmax", dims=("rows", "n"), params={},
            op_args=(), dtypes=_FLOATS, inputs=_LOGIT_MAKERS,
            input_shapes=_rows_shapes, truth=_oracle("softmax"),
            evaluate=_softmax_evaluate, agree=_softmax_agree, label=_rows_label(),
            input_family="rows", claim="softmax over the last axis, float32 arithmetic",
            host_bytes=_rows_bytes,
        ),
        Probe(
            op="top_k", dims=("rows", "n"), params={"k": (int, None, 1)},
            op_args=("k",), dtypes=_FLOATS, inputs=_LOGIT_MAKERS,
            input_shapes=_rows_shapes, truth=_oracle("top_k", "k"), truth_args=("k",),
            evaluate=_top_k_evaluate, agree=_top_k_agree, validate=_check_k,
            label=_rows_label("k"), input_family="rows", claim="exact top-k",
            host_bytes=_rows_bytes, report_section="top-k",
        ),
        Probe(
            op="approx_max_k", dims=("rows", "n"),
            params={"k": (int, None, 1), "recall_target": (float, None, 0.95),
                    "aggregate_to_topk": (bool, None, True),
                    "reduction_input_size_override": (int, None, -1)},
            op_args=("k", "recall_target", "aggregate_to_topk",
                     "reduction_input_size_override"),
            dtypes=_FLOATS, inputs=_LOGIT_MAKERS,
            input_shapes=_rows_shapes, truth=_oracle("top_k", "k"), truth_args=("k",),
            evaluate=_top_k_evaluate, agree=_top_k_agree, validate=_check_approx,
            label=_rows_label("k", "recall_target", "aggregate_to_topk",
                              "reduction_input_size_override",
                              quiet={"reduction_input_size_override": -1}),
            input_family="rows", claim="top-k at the promised recall",
            host_bytes=_rows_bytes, report_section="top-k",
        ),
        Probe(
            op="greedy_token", dims=("rows", "n"), params={},
            op_args=(), dtypes=_FLOATS, inputs=_LOGIT_MAKERS,
            # The truth is the correctly rounded softmax: what sampling from rounded
            # probabilities can and cannot resolve.
            input_shapes=_rows_shapes, truth=_oracle("softmax"),
            evaluate=_greedy_evaluate, agree=_greedy_agree, label=_rows_label(),
            input_family="rows", claim="the exact argmax token",
            host_bytes=_rows_bytes, fixed_args={"batches": SAMPLER_BATCHES},
            report_section="greedy",
        ),
        Probe(
            op="train_step", dims=("batch", "d", "c"), params={"lr": (float, None, 0.1)},
            op_args=("lr",), dtypes=_FLOATS, inputs=("mlp", "mlp_huge"),
            input_shapes=_train_shapes, truth=_oracle("train_step", "lr"), truth_args=("lr",),
            evaluate=_train_evaluate, agree=_train_agree, label=_train_label,
            claim="a finite step matching the float64 reference",
            host_bytes=_train_bytes, hunt_nans=True,
        ),
    )
}


# The op whose arithmetic diag fingerprints (`Probe.fingerprint`): `diag env` and each run's
# workers measure it.
FINGERPRINT_OP = next(p.op for p in PROBES.values() if p.fingerprint)
# The report section of each op that has one (run.json's `report_sections`).
REPORT_SECTIONS = {p.op: p.report_section for p in PROBES.values() if p.report_section}


def get_probe(op: str) -> Probe:
    return PROBES[op]
