"""Cause and cure: the op whose narrow dtype a failure comes from, proven by changing it.

The shadow names where an error *shows* (the first op past its threshold: the `cos` after a
bf16 angle, a LayerNorm after an fp16 sum that overflowed). What a user needs is the line to
change, and evidence that changing it fixes the result. So the cause is found by recomputing:

1. Candidates come from what the shadow already measured, walking back from the function's
   outputs along the ops' inputs (`Ledger` entries keep their producers): births of Inf/NaN,
   casts to a narrower float dtype, literals the tracer rounded, values that crossed their
   threshold, accumulations in bfloat16/float16, ops inside a loop whose error grew, an op
   whose own rounding a consumer amplified (own error x amplification). One candidate is a
   *site*: an op at one line (every layer's `mul` at ``rope.py:20``, every iteration of a
   scan), forward and backward apart.
2. The function is run again with the candidate's ops computed in a wider dtype (float32 for
   bf16/fp16 code, float64 for float32 code) and everything else as written: a promoted
   value keeps its width into the `MAX_HOPS` ops that compute with it, as type promotion
   would carry it, then is rounded to the dtype the code gives it; a promoted narrowing cast
   is one the user would drop, and its wider value stays (`diag.diverge.jax_cause`,
   `diag.diverge.torch_cause`). A JAX re-run starts downstream, at the first equation that
   holds a promoted op, from the values the run as written kept (`diag.diverge.jax_restart`).
3. The failing outputs of that run are measured against the reference. The cause is the
   first candidate (then the smallest set of the best ones) whose promotion brings every
   failing output within its allowance, in at most `MAX_RERUNS` runs. A claim is made only
   when its run confirms it; otherwise the report says no small set repairs it and shows the
   best candidate's effect.

The runs are the function's own: a promoted op is not a guess from the shadow's figures.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from diag import numerics
from diag.diverge import repair_cost
from diag.diverge.rules import carried_error

#: Re-runs of the function with candidates promoted, per failing record (the baseline run,
#: as written, is not counted).
MAX_RERUNS = 10
#: Times the function as written and as repaired each run again, timed, once a cause is
#: confirmed (not counted in `MAX_RERUNS`); the search's baseline and confirming runs, timed
#: as they ran, are the first sample of each (`diag.diverge.repair_cost`).
TIMINGS = 1
#: Single candidates tried before sets of the best ones are.
SINGLES = 7
#: How many ops computing with a promoted op's result see it at the wider width before it
#: is rounded to the dtype the code gives it (ops that only move values do not count): an
#: angle reaches its cosine, an exp its sum and division; promoting one op of a float32
#: model does not compute the rest of the model in float64.
MAX_HOPS = 3
_WIDER = {"bfloat16": "float32", "float16": "float32", "float32": "float64"}
_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z0-9_]+)")


def wider(dtype: str) -> str:
    """The dtype a candidate op is computed in: float32 for bf16/fp16, float64 for float32."""
    return _WIDER.get(dtype, dtype)


def package_of(path: str) -> str:
    """``transformers`` for a file under a site-packages folder, else ``""``."""
    m = _PACKAGE.search(path)
    return m[1] if m else ""


@dataclasses.dataclass(frozen=True)
class Site:
    """One candidate: an op at one line, in one phase.

    Attributes:
        primitive: the jaxpr primitive or aten op (``mul``, ``aten.exp``).
        source: the user's line, ``file.py:LINE (function)``.
        library: the library line that wrote the op, when the user's line only called it.
        phase: ``forward`` or ``backward``.
        dtype: the dtype the op computes in (of its output).
        tags: what the shadow knew about it (``narrowing``, ``literal``, ``birth``: an
            Inf or NaN was born here).
        path: where it sits (``jit[f]/scan[3]``).
    """

    primitive: str
    source: str
    library: str
    phase: str
    dtype: str
    tags: frozenset[str] = frozenset()
    path: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What the re-running evaluators match an op by."""
        return (self.primitive, self.source, self.library, self.phase)

    def line(self, where: tuple[str, ...] = ("", "")) -> str:
        """The line to change: the user's line first, then a library op's package and line
        (``rope.py:20 (rope)``; ``train.py:30 (loss_fn), in flax dtypes.py:79 (promote_dtype)``).

        Args:
            where: (package, the user's line) the re-runner saw for this site: the package
                that wrote the op, and the user's line when the site's source is a library's
                (JAX counts Flax's files as the user's).
        """
        package, user = where[0], where[1]
        source, library = self.source, self.library
        if user and user != source:
            source, library = user, source
        line = source or "an unknown line"
        if library and package not in ("jax", "torch"):
            line += f", in {package + ' ' if package else ''}{library}"
        return line

    def label(self, where: tuple[str, ...] = ("", "")) -> str:
        """``mul at rope.py:20 (rope)``; a library op also names its package and line."""
        back = " (backward)" if self.phase == "backward" else ""
        return f"{self.primitive} at {self.line(where)}{back}"


@dataclasses.dataclass(frozen=True)
class Failing:
    """A failing output: its name, the reference it is measured against, its allowance.

    A float output is measured normwise against `allowance`. An integer output (token ids,
    indices: the result of decisions) has allowance 0: it is repaired when every value equals
    the reference's, except where `forced` is set (a choice one rounding of the inputs already
    moves: `diag.userfn.judge`'s warn); its error is the share of the other values that
    differ.
    """

    path: str
    reference: np.ndarray
    allowance: float
    forced: np.ndarray | None = None

    @property
    def exact(self) -> bool:
        return self.reference.dtype.kind in "biu"


@dataclasses.dataclass(frozen=True)
class Cause:
    """The cause of a failure, and its proof.

    Attributes:
        cause: the line to change, ``file.py:LINE (function)`` (the user's line; a library
            op's package and line after it), or ``""`` when no candidate repaired it.
        cause_ops: the promoted ops, ``mul at rope.py:20 (rope)``.
        repair: what to change, in the user's terms, with the measured effect.
        error_before: the failing output's error as written (re-run op by op).
        error_after: the same with `cause_ops` computed in the wider dtype.
        allowance: what that output may carry.
        output: the failing output's name.
        confirmed: whether the re-run brought every failing output within its allowance.
        reruns: how many re-runs the search took.
        text: one line: ``cause: ...`` (or why there is none).
        time_before_s: the fastest time of the function as written, run op by op as the
            search re-runs it (CPU, eager: not a compiled kernel's time), over the search's
            baseline run and `TIMINGS` more; None without a confirmed cause.
        repair_time_s: the same with `cause_ops` promoted, over the run that confirmed the
            cause and `TIMINGS` more: what the repair costs in time.
        time_before_spread_s, repair_time_spread_s: the largest minus the smallest of those
            runs' times.
        decided: the integer outputs (a flipped decision's tokens, indices) the search held
            to equality with the float64 reference's.
    """

    cause: str
    cause_ops: tuple[str, ...]
    repair: str
    error_before: float
    error_after: float
    allowance: float
    output: str
    confirmed: bool
    reruns: int
    text: str
    time_before_s: float | None = None
    repair_time_s: float | None = None
    time_before_spread_s: float | None = None
    repair_time_spread_s: float | None = None
    decided: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The record's and ``--json``'s fields (an infinite error as the string ``inf``)."""
        return {
            "cause": self.cause,
            "cause_ops": list(self.cause_ops),
            "repair": self.repair,
            "error_before": _json(self.error_before),
            "error_after": _json(self.error_after),
            "cause_confirmed": self.confirmed,
            "cause_reruns": self.reruns,
            "time_before_s": self.time_before_s,
            "repair_time_s": self.repair_time_s,
            "time_before_spread_s": self.time_before_spread_s,
            "repair_time_spread_s": self.repair_time_spread_s,
        }


def _json(x: float) -> float | str | None:
    if math.isnan(x):
        return None
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


class Rerun(Protocol):
    """A framework's re-runner: the function's output leaves, with `sites` promoted. One
    that re-runs only the part downstream of the promoted sites (JAX) may say, as
    ``skipped_s``, how long the part it skipped took in the baseline run."""

    def __call__(self, sites: frozenset[tuple[str, str, str, str]]) -> list[tuple[str, Any]]: ...

    #: per promoted site: (its package, the user's line where the source is a library's,
    #: the code of the user's line)
    packages: dict[tuple[str, str, str, str], tuple[str, str, str]]


def errors(
    got: list[tuple[str, Any]], failing: Sequence[Failing], dtypes: dict | None = None
) -> list[float]:
    """Each failing output's normwise error in a run (inf where it is missing or misshaped).

    Args:
        got: the run's output leaves.
        failing: the outputs to measure.
        dtypes: per path, the dtype the function as written returns: a promoted run's wider
            output is rounded to it first, as the repaired function would return it.
    """
    have = dict(got)
    out = []
    for f in failing:
        y = have.get(f.path)
        if y is None or np.shape(y) != np.shape(f.reference):
            out.append(math.inf)
            continue
        if f.exact:
            differ = np.asarray(y).astype(np.int64) != f.reference.astype(np.int64)
            if f.forced is not None:
                differ &= ~f.forced
            out.append(float(differ.sum()) / max(differ.size, 1))
            continue
        want = (dtypes or {}).get(f.path)
        if want is not None and np.asarray(y).dtype != want:
            with np.errstate(over="ignore"):
                y = np.asarray(y, dtype=np.float64).astype(want)
        y64 = np.atleast_1d(np.asarray(y, dtype=np.float64))
        r64 = np.atleast_1d(np.asarray(f.reference, dtype=np.float64))
        err, _ = carried_error(y64, r64, "float64")
        if np.isnan(y64).any() and not np.isnan(r64).any():
            err = math.inf
        out.append(err)
    return out


def _worst(errs: list[float], failing: Sequence[Failing]) -> tuple[float, int]:
    """(largest error / allowance, which output); an integer output's ratio is 0 when no
    value differs, else 1 plus the share that does (more differing values rank worse)."""
    ratios = [
        (0.0 if e == 0 else 1.0 + e)
        if f.exact
        else e / f.allowance
        if f.allowance > 0
        else math.inf
        for e, f in zip(errs, failing)
    ]
    k = max(range(len(ratios)), key=lambda i: (ratios[i], -i))
    return ratios[k], k


def search(
    rerun: Rerun,
    candidates: list[Site],
    failing: Sequence[Failing],
    consumers: dict[tuple, set[str]] | None = None,
    max_reruns: int = MAX_RERUNS,
    timings: int = 0,
    first: tuple[list[tuple[str, Any]], float] | None = None,
) -> Cause:
    """Re-run with candidates promoted until every failing output is within its allowance.

    Args:
        rerun: the framework's re-runner.
        candidates: `diag.diverge.ranking.candidates`'s sites, most likely first.
        failing: the failing outputs.
        consumers: per site key, the primitives of the ops that read it (for the repair's
            wording: a sigmoid whose result a log reads).
        max_reruns: the budget.
        timings: how many more times the function as written and as repaired run, timed,
            once a cause is confirmed (not counted in the budget; 0: not timed).
        first: the baseline run (every op as written) and its seconds, when the caller
            already ran it (`repair_cost.timed`).
    """
    got, took = first if first is not None else repair_cost.timed(rerun, frozenset())
    dtypes = {p: np.asarray(y).dtype for p, y in got}
    base = errors(got, failing)
    before, k0 = _worst(base, failing)
    if before <= 1.0:
        return _none(
            "the failure does not reproduce when the function runs op by op (a compiler's "
            "fusion or excess precision changes it): no cause is claimed",
            failing[k0],
            base[k0],
            base[k0],
            0,
        )
    tried: list[tuple[float, Site, list[float]]] = []
    runs = 0
    for group in _plan(candidates[: min(SINGLES, max_reruns)]):
        errs, secs = _attempt(rerun, frozenset(s.key for s in group), failing, dtypes)
        runs += 1
        ratio, _ = _worst(errs, failing)
        if len(group) == 1:
            tried.append((ratio, group[0], errs))
        if ratio <= 1.0:
            cause = _found(group, base, errs, failing, rerun, runs, consumers or {})
            return _timed(cause, rerun, group, timings, (took, secs))
    tried.sort(key=lambda t: t[0])
    for n in range(2, len(tried) + 1):
        if runs >= max_reruns:
            break
        group = tuple(t[1] for t in tried[:n])
        errs, secs = _attempt(rerun, frozenset(s.key for s in group), failing, dtypes)
        runs += 1
        if _worst(errs, failing)[0] <= 1.0:
            cause = _found(group, base, errs, failing, rerun, runs, consumers or {})
            return _timed(cause, rerun, group, timings, (took, secs))
    if not tried:
        return _none(
            "no candidate op computes in a dtype narrower than float64",
            failing[k0],
            base[k0],
            base[k0],
            runs,
        )
    best = tried[0]
    k = _worst(best[2], failing)[1]
    label = best[1].label(rerun.packages.get(best[1].key, ("", "")))
    return _none(
        f"no cause: none of the {len(tried)} likeliest ops, alone or with the best others, "
        f"repairs it computed in a wider dtype; the best, "
        f"{label} in {wider(best[1].dtype)}: {_change(failing[k], base[k], best[2][k])}",
        failing[k],
        base[k],
        best[2][k],
        runs,
    )


def _plan(singles: list[Site]) -> list[tuple[Site, ...]]:
    """The runs to try first: each single candidate, most likely first; after the second,
    every narrowing cast among them together when there are several to one dtype (a
    module's ``dtype=`` casts each layer's inputs on its own line: one change, many lines)."""
    plan: list[tuple[Site, ...]] = [(s,) for s in singles]
    casts: dict[str, list[Site]] = {}
    for s in singles:
        if "narrowing" in s.tags:
            casts.setdefault(s.dtype, []).append(s)
    group = max(casts.values(), key=len, default=[])
    if len(group) > 1:
        plan.insert(min(2, len(plan)), tuple(group))
    return plan


def _attempt(
    rerun: Rerun, sites: frozenset, failing: Sequence[Failing], dtypes: dict
) -> tuple[list, float]:
    """The failing outputs' errors with `sites` promoted, and the run's seconds; inf where
    the promoted run raised (an autograd node refusing a wider gradient: that candidate
    repairs nothing)."""
    try:
        got, secs = repair_cost.timed(rerun, sites)
    except Exception:  # noqa: BLE001 - the user's function, changed, may raise anything
        return [math.inf for _ in failing], math.nan
    return errors(got, failing, dtypes), secs


def _timed(
    cause: Cause, rerun: Rerun, group: tuple[Site, ...], timings: int, took: tuple[float, float]
) -> Cause:
    """`cause` with what its repair costs in time (`diag.diverge.repair_cost`), `took` the
    seconds of the search's baseline run and of the run that confirmed the cause."""
    keys = frozenset(s.key for s in group)
    cost = repair_cost.measure(rerun, keys, timings, [took[0]], [took[1]])
    if cost is None:
        return cause
    return dataclasses.replace(
        cause,
        text=f"{cause.text}; {cost.text()}",
        time_before_s=cost.before_s,
        repair_time_s=cost.after_s,
        time_before_spread_s=cost.before_spread_s,
        repair_time_spread_s=cost.after_spread_s,
    )


def _change(f: Failing, before: float, after: float) -> str:
    """``the error of output['logits'] falls from 0.776 to 0.0042 (allowance 0.0625)``."""
    if f.exact:
        return (
            f"the share of {_name(f.path)}'s values that differ from the reference goes "
            f"from {_fmt(before)} to {_fmt(after)}"
        )
    verb = "falls" if after < before else "goes"
    return (
        f"the error of {_name(f.path)} {verb} from {_fmt(before)} to {_fmt(after)} "
        f"(allowance {_fmt(f.allowance)})"
    )


def _name(path: str) -> str:
    return f"output{path}" if path else "the output"


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else numerics.fmt(x)


def _none(text: str, f: Failing, before: float, after: float, runs: int) -> Cause:
    return Cause("", (), "", before, after, f.allowance, f.path, False, runs, text)


def _found(
    group: tuple[Site, ...],
    base: list[float],
    errs: list[float],
    failing: Sequence[Failing],
    rerun: Rerun,
    runs: int,
    consumers: dict[tuple, set[str]],
) -> Cause:
    _, k = _worst(base, failing)
    f = failing[k]
    head = group[0]
    line = head.line(rerun.packages.get(head.key, ("", "")))
    ops = tuple(s.label(rerun.packages.get(s.key, ("", ""))) for s in group)
    wide = wider(head.dtype)
    effect = f"computed in {wide}, {_change(f, base[k], errs[k])}"
    code = rerun.packages.get(head.key, ("", "", ""))[2:]
    said = f"`{code[0]}` in {head.dtype}" if code and code[0] else head.dtype
    what = ", ".join(ops) if len(group) > 1 else f"{ops[0]} ({said})"
    repair = repair_for(head, consumers.get(head.key, set()))
    return Cause(
        cause=line,
        cause_ops=ops,
        repair=f"{repair}; measured: error {_fmt(base[k])} -> {_fmt(errs[k])}",
        error_before=base[k],
        error_after=errs[k],
        allowance=f.allowance,
        output=f.path,
        confirmed=True,
        reruns=runs,
        text=f"cause: {what}; {effect}; repair: {repair}",
    )


_LOGS = {"log", "aten.log", "log1p", "aten.log1p"}
_SIGMOID = {"logistic", "aten.sigmoid"}
_EXP = {"exp", "aten.exp", "exp2"}
_SUMS = {"reduce_sum", "cumsum", "aten.sum", "aten.cumsum", "aten.mean", "add", "aten.add"}


def repair_for(site: Site, consumers: set[str]) -> str:
    """The repair in the user's terms: the usual fix of that kind of op, else the promotion."""
    wide = wider(site.dtype)
    if site.primitive in _SIGMOID and consumers & _LOGS:  # log(sigmoid), log(1 - sigmoid)
        return (
            "compute log(sigmoid) with log_sigmoid (jax.nn.log_sigmoid, "
            "torch.nn.functional.logsigmoid; log(1 - sigmoid(z)) = log_sigmoid(-z))"
        )
    if site.primitive in _EXP:
        return (
            f"subtract the row max before exp (as jax.nn.softmax and torch.softmax do), or "
            f"compute it in {wide}"
        )
    if "narrowing" in site.tags:
        return (
            f"keep this value in {wide}: drop the cast to {site.dtype} (a module's dtype= or an "
            f"explicit astype/.to)"
        )
    narrow = site.dtype in ("bfloat16", "float16")
    if narrow and ("scan[" in site.path or "while[" in site.path):
        return f"keep the loop's carry in {wide} (cast to {site.dtype} after the loop)"
    if "literal" in site.tags:
        return (
            f"compute this op in {wide}: a constant on this line rounds in {site.dtype} (an "
            f"eps below its smallest numbers becomes 0)"
        )
    if narrow and site.primitive in _SUMS:
        return f"accumulate in {wide}: upcast before the sum (cast the total back after it)"
    if "birth" in site.tags:
        return f"its result overflows {site.dtype}: upcast its inputs to {wide} before it"
    return f"compute this op in {wide} (upcast its inputs before it)"
