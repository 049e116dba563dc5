"""Judge what a worker returned against the truth, holding as little as possible in memory.

The runner hands every result event here; this module builds the `Outcome` the probe table
judges (`diag.probes`), applies the run-level rules (inputs must arrive bit-identical, an
emulation promises nothing), and keeps the time each host-side phase took per backend.

What the host holds between cases is bounded: inputs and outputs are the .npy files in the
run's work folder, memory-mapped while a case is judged; ground truths and arrays shared by
every backend (a matmul's error bound, computed once per case) are kept within a byte budget,
the costliest to recompute first (`diag.inputs.CostMemo`). A suite of 16.7M-element products
is judged in a few hundred MB however many cases and backends it has.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diag.backends import BackendSpec, promises_full_precision
from diag.inputs import MEMO_BYTES, CostMemo, _Inputs, _Truth
from diag.probes import PROBES, Evaluation, Outcome, expected_outcome
from diag.suite import Case
from diag.workers import _load_output

__all__ = ["Judge", "as_emulation"]


def as_emulation(ev: Evaluation) -> Evaluation:
    """An emulated backend's verdict: `warn` at worst.

    An emulation is a model of an algorithm, not a device under test, and it promises
    nothing: a bound breach, or an overflow to Inf where the truth is finite, shows what that
    algorithm does to the case (worth a warning), never a broken machine or library.
    """
    if ev.status != "fail":
        return ev
    return dataclasses.replace(ev, status="warn", reason=(
        f"{ev.reason}; an emulation promises nothing, so this is what the emulated algorithm "
        f"does here, not a failure"))


class Judge:
    """Inputs, truths and shared per-case arrays of one run, and the host's phase clock.

    Args:
      work: the run's work folder (deleted with the run).
      cache_dir: the ground-truth cache folder (None: the default).
    """

    def __init__(self, work: Path, cache_dir: str | None):
        self.work = work
        self.inputs = _Inputs(work)
        # One budget for the truths and the shared arrays: the costliest to recompute stay.
        self._shared = CostMemo(MEMO_BYTES)
        self.truth = _Truth(self.inputs, cache_dir, memo=self._shared)
        #: backend label -> phase -> seconds spent on the host (truth, judge, write).
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def clock(self, label: str, phase: str, t0: float) -> float:
        """Add the time since `t0` to `label`'s `phase`; returns now (the next phase's t0)."""
        now = time.perf_counter()
        self.seconds[label][phase] += now - t0
        return now

    def shared(self, case: Case) -> Callable[[str, Callable[[], np.ndarray]], np.ndarray]:
        """A memo for arrays that depend on the case alone (its inputs and truth), not on the
        backend: `memo(name, compute)` computes once and hands every later backend (and every
        case with the same inputs) the same array, while `CostMemo`'s budget keeps it."""
        base = self.truth.key(case)

        def memo(name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
            return self._shared.get(json.dumps([base, name]), compute, lambda a: a.nbytes)

        return memo

    def outcome(self, case: Case, spec: BackendSpec, event: dict) -> Outcome:
        """What `spec` returned for `case` (its outputs memory-mapped), ready to be judged."""
        precision = case.params.get("precision", "default")
        return Outcome(
            inputs=self.inputs.get(case),
            outputs=[_load_output(o) for o in event["outputs"]],
            names=[o["name"] for o in event["outputs"]], truth=self.truth.get(case),
            params=case.params, promised=promises_full_precision(spec, case.dtype, precision),
            setting=f"precision={precision}", nan_report=event.get("nan_report"),
            shared=self.shared(case))

    def evaluate(self, case: Case, spec: BackendSpec, outcome: Outcome) -> Evaluation:
        """The verdict on one outcome, with the suite's planted outcome and emulation rules."""
        ev = expected_outcome(case.expect, PROBES[case.op].evaluate(outcome), outcome)
        return as_emulation(ev) if spec.emulated else ev

    def oracle_info(self, case: Case) -> dict[str, Any]:
        """How the case's truth was had, for the record (empty for probes without one)."""
        truth = self.truth.get(case)
        if truth is None:
            return {}
        return {"method": truth.method, "fallbacks": truth.fallbacks,
                "cache_hit": truth.cache_hit, "seconds": round(truth.seconds, 4)}
