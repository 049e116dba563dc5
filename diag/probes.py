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

import numpy as np

from diag.compare import gelu as _gelu
from diag.compare import greedy as _greedy, matmul as _matmul, softmax as _softmax
from diag.compare import topk as _topk, train as _train, train_run as _train_run
from diag.compare.outcome import Evaluation, MalformedOutput, Outcome
from diag.inputs import INPUT_MAKERS
from diag.train import case as _train_case

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


# What a backend returned and the verdict on it, and each op family's evaluate/agree, live in
# diag.compare; they are imported under the names the PROBES rows use.

_matmul_evaluate, _matmul_agree = _matmul.evaluate, _matmul.agree
_softmax_evaluate, _softmax_agree = _softmax.evaluate, _softmax.agree
_gelu_evaluate, _gelu_agree = _gelu.evaluate, _gelu.agree
_top_k_evaluate, _top_k_agree = _topk.evaluate, _topk.agree
_greedy_evaluate, _greedy_agree = _greedy.evaluate, _greedy.agree
_train_evaluate, _train_agree = _train.evaluate, _train.agree


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
# 4.0 and [64,65536,64] 2.7 input copies; [1024,4,1024] 3.2, [2048,4,2048] 2.3 and
# [4096,4,4096] 2.1 output copies since judging streams (12.7 before); softmax
# [4,65536] 22 and [8,131072] 18 copies. The estimates are 1.1-2.9x those peaks;
# `tests/test_suite.py` checks that the estimate stays above a measured peak.
MATMUL_INPUT_COPIES = 6
MATMUL_OUTPUT_COPIES = 6
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
      make_inputs: (rng, params, dtype) -> the case's input arrays, for ops whose inputs are
        not one maker per shape (a model's initial weights and batches); None: `inputs`.
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
    make_inputs: Optional[Callable[..., list]] = None

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
        # A bf16 elementwise chain (a transformer MLP's activation): where XLA may keep
        # intermediates in float32 or round each one (--xla_allow_excess_precision).
        Probe(
            op="gelu", dims=("rows", "n"), params={},
            op_args=(), dtypes=_FLOATS, inputs=("normal", "normal5", "uniform"),
            input_shapes=_rows_shapes, truth=_oracle("gelu"),
            evaluate=_gelu_evaluate, agree=_gelu_agree, label=_rows_label(),
            input_family="rows", claim="tanh-approximate GELU, float32 arithmetic",
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
        # N AdamW steps of a small transformer (diag.train): inputs are the initial weights
        # and batches (float32 whatever `compute` is: fp32 master weights), the truth the
        # float64 reference of the same steps, judged per step and tensor.
        Probe(
            op="train", dims=("layers", "width", "vocab", "seq", "batch", "steps"),
            params={"heads": (int, None, 4), "lr": (float, None, 3e-3),
                    "compute": (str, ("float32", "bfloat16"), ["float32", "bfloat16"])},
            op_args=("layers", "width", "vocab", "seq", "batch", "steps", "heads", "lr",
                     "compute"),
            dtypes=("float32",), inputs=("transformer",),
            input_shapes=_train_case.input_shapes, truth=_train_case.truth,
            truth_args=("heads", "lr"), evaluate=_train_run.evaluate,
            agree=_train_run.agree, label=_train_case.label, validate=_train_case.validate,
            claim="N AdamW steps matching the float64 reference per step and tensor",
            host_bytes=_train_case.host_bytes, make_inputs=_train_case.make_inputs,
            report_section="training",
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
