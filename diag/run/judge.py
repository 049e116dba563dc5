"""Judge what a worker returned against the truth: the verdict, and nothing else.

The runner hands every result event here; this module builds the `Outcome` the probe table
judges (each op's module, `diag.plan.registry`) from what the run's `diag.run.store.CaseStore` holds
(inputs, truth, the output files and their digests), applies the run-level rules (inputs
must arrive bit-identical, an emulation promises nothing), and keeps the time each host-side
phase took per backend.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from pathlib import Path

from diag.backends import BackendSpec, promises_full_precision
from diag.compare.outcome import Evaluation, Outcome
from diag.plan.probe import expected_outcome
from diag.plan.registry import PROBES
from diag.plan.suite import Case
from diag.run.store import STORE_MIN_SECONDS, STORE_RATE, CaseStore
from diag.status import Status
from diag.worker.protocol import Result

__all__ = ["STORE_MIN_SECONDS", "STORE_RATE", "Judge", "as_emulation"]


def as_emulation(ev: Evaluation) -> Evaluation:
    """An emulated backend's verdict: `warn` at worst.

    An emulation is a model of an algorithm, not a device under test, and it promises
    nothing: a bound breach, or an overflow to Inf where the truth is finite, shows what that
    algorithm does to the case (worth a warning), never a broken machine or library.
    """
    if ev.status != Status.FAIL:
        return ev
    return dataclasses.replace(
        ev,
        status=Status.WARN,
        reason=(
            f"{ev.reason}; an emulation promises nothing, so this is what the emulated algorithm "
            f"does here, not a failure"
        ),
    )


class Judge:
    """The verdicts of one run, judged from its `store`, and the host's phase clock.

    Args:
      work: the run's work folder (deleted with the run).
      cache_dir: the ground-truth cache folder (None: the default).
      store_min_seconds, store_rate: which shared arrays the store keeps in that cache
        (`diag.run.store.STORE_MIN_SECONDS`, `STORE_RATE`).
    """

    def __init__(
        self,
        work: Path,
        cache_dir: str | None,
        *,
        store_min_seconds: float = STORE_MIN_SECONDS,
        store_rate: float = STORE_RATE,
    ):
        #: The run's inputs, truths, shared arrays, output files and digests.
        self.store = CaseStore(
            work, cache_dir, store_min_seconds=store_min_seconds, store_rate=store_rate
        )
        #: backend label -> phase -> seconds spent on the host (truth, judge, write).
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def clock(self, label: str, phase: str, t0: float) -> float:
        """Add the time since `t0` to `label`'s `phase`; returns now (the next phase's t0)."""
        now = time.perf_counter()
        self.seconds[label][phase] += now - t0
        return now

    def outcome(
        self, case: Case, spec: BackendSpec, event: Result, digests: list[str] | None = None
    ) -> Outcome:
        """What `spec` returned for `case` (its outputs memory-mapped), ready to be judged.

        `digests`: the outputs' sha256 (`numerics.bits_digest`) where an earlier call computed
        them (they are the record's `output_digests`); computed here otherwise."""
        store = self.store
        precision = case.params.get("precision", "default")
        outputs, names = store.outputs(event)
        return Outcome(
            inputs=store.inputs.get(case),
            outputs=outputs,
            names=names,
            truth=store.truth.get(case),
            params=case.params,
            promised=promises_full_precision(spec, case.dtype, precision),
            setting=f"precision={precision}",
            nan_report=event.nan_report,
            shared=store.shared(case),
            recall=store.recall(case),
            digests=digests or store.output_digests(event, outputs),
        )

    def evaluate(self, case: Case, spec: BackendSpec, outcome: Outcome) -> Evaluation:
        """The verdict on one outcome, with the suite's planted outcome and emulation rules."""
        ev = expected_outcome(case.expect, PROBES[case.op].evaluate(outcome), outcome)
        return as_emulation(ev) if spec.emulated else ev
