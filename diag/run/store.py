"""Where a run's cases live on the host: inputs, truths, shared arrays, output files and
their digests (`CaseStore`), so that `diag.run.judge.Judge` only judges.

What the host holds between cases is bounded: inputs and outputs are .npy files (in the
run's work folder, or the cache's for large seeded inputs), memory-mapped while a case is
judged; ground truths and arrays shared by every backend (a matmul's error bound, computed
once per case) are kept within a byte budget, the costliest to recompute first
(`diag.plan.inputs.CostMemo`). A suite of 16.7M-element products is judged in a few hundred MB
however many cases and backends it has.

A shared array that was slow to compute for its size (a long-K matmul's bound: seconds for
half a MB) is also stored in the ground-truth cache, keyed by everything it depends on, and a
later run maps the verified file instead of computing it again (`CaseStore.shared`).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from diag import numerics, tolerance
from diag.oracle.cache import GroundTruthCache, default_cache_dir, source_digest
from diag.plan.inputs import MEMO_BYTES, CostMemo, InputStore, TruthStore
from diag.plan.suite import Case
from diag.worker.host import load_output
from diag.worker.protocol import Result

__all__ = ["STORE_MIN_SECONDS", "STORE_RATE", "CaseStore"]

#: A shared array goes to the on-disk cache only when computing it took at least this much
#: CPU time (a file per cheap array is clutter, not a saving) ...
STORE_MIN_SECONDS = 0.02
#: ... and more than 10 ms of CPU time per MB: mapping a stored array and checking its sha256
#: costs about 1 ms per MB here, so what is stored is at least 10x cheaper to get back. CPU
#: time, not wall time, so that other processes on the host sway the decision less; an
#: array near the line may be stored by one run and not by another (never both ways: once
#: stored it is read). Measured on the shipped suites (2-core host, CPU time): long-K matmul
#: bounds (64x16384x64, 256x65536x256) take seconds for under 1 MB and the 1024^3 products'
#: ~10-25 ms/MB: stored, ~27 MB for the matmul suite. K=4 products' bounds (a
#: [4096,4]x[4,4096] one: 134 MB for 0.06 s idle, 0.3 s on a busy host) and long softmax
#: rows' (5-20 ms/MB, ~16 MB each) mostly are not: storing all the matmul suite's bounds
#: would take ~570 MB.
STORE_RATE = 100e6


class CaseStore:
    """Inputs, truths, shared per-case arrays and output files of one run.

    Args:
      work: the run's work folder (deleted with the run).
      cache_dir: the ground-truth cache folder (None: the default).
      store_min_seconds, store_rate: which shared arrays are stored in that cache
        (`STORE_MIN_SECONDS`, `STORE_RATE`).
    """

    def __init__(
        self,
        work: Path,
        cache_dir: str | None,
        *,
        store_min_seconds: float = STORE_MIN_SECONDS,
        store_rate: float = STORE_RATE,
    ):
        self.work = work
        self.store_min_seconds, self.store_rate = store_min_seconds, store_rate
        self.cache = GroundTruthCache(cache_dir or default_cache_dir())
        self.inputs = InputStore(work, self.cache)
        # One budget for the truths and the shared arrays: the costliest to recompute stay.
        self._shared = CostMemo(MEMO_BYTES)
        self.truth = TruthStore(self.inputs, self.cache, memo=self._shared)
        #: What became of shared arrays the memo did not hold: read from the on-disk cache
        #: (`hit`), computed and stored (`stored`), computed only (`computed`).
        self.stored: dict[str, int] = {"hit": 0, "stored": 0, "computed": 0}
        #: (truth key, computation, output digests) -> what it gave (`recall`), and how many
        #: times a later output was judged by it (bit-identical to one judged before).
        self._recalled: dict[tuple, Any] = {}
        self.recalled = 0
        #: (device, inode) of an output file -> the sha256 of its array: a worker's hard link
        #: to an earlier bit-identical output (`diag.worker.main._Written`) is hashed
        #: once. Dropped when the last link goes (`release`): an inode is reused after that.
        self._file_digests: dict[tuple[int, int], str] = {}

    def shared(self, case: Case) -> Callable[[str, Callable[[], np.ndarray]], np.ndarray]:
        """A memo for arrays that depend on the case alone (its inputs and truth), not on the
        backend: `memo(name, compute)` computes once and hands every later backend (and every
        case with the same inputs) the same array, while `CostMemo`'s budget keeps it.

        `name` must say everything else the array depends on (the claimed arithmetic:
        ``bound-float32``), as it keys the on-disk copy too (`stored`).
        """
        base = self.truth.key(case)

        def memo(name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
            # A mapped array counts its full size: pages it touched stay resident while the
            # memo holds it, and it took only a map and a digest to get, so it goes first.
            return self._shared.get(
                json.dumps([base, name]),
                lambda: self._stored(case, name, compute),
                lambda a: a.nbytes,
            )

        return memo

    def write_inputs(self, cases: list[Case]) -> None:
        """Draw every case's inputs and write them where the workers read them (each input
        set once; `InputStore`)."""
        for case in cases:
            self.inputs.paths(case)

    def recall(self, case: Case) -> Callable[[tuple, Callable[[], Any]], Any]:
        """A memo for values computed from `case` and outputs' bits (`Outcome.remembered`):
        `memo(key, compute)`, where the key names the computation and the digests of the
        outputs it read. A deterministic comparison of the same bits against the same truth
        gives the same metrics, so a later output identical to an earlier one (a precision
        setting a CPU backend ignores, a backend that agrees bit for bit) is judged by the
        earlier numbers, not compared again; each caller gets its own copy."""
        base = self.truth.key(case)

        def memo(key: tuple, compute: Callable[[], Any]) -> Any:
            full = (base, *key)
            if full in self._recalled:
                self.recalled += 1
            else:
                self._recalled[full] = compute()
            return copy.deepcopy(self._recalled[full])

        return memo

    def shared_key(self, case: Case, name: str, compute: Callable) -> str:
        """The on-disk key of `case`'s shared array `name`: the truth's key (its oracle, the
        input recipe and the truth's parameters; `ORACLE_VERSION`), each input's dtype, shape
        and bit digest, the name (the claimed arithmetic), the source of the code that
        computes it (tolerance.py, numerics.py, the caller's module) and numpy's and
        ml_dtypes' versions (the float64 BLAS and the casts)."""
        inputs = [
            [numerics.dtype_name(a.dtype), list(a.shape), d]
            for a, d in zip(self.inputs.get(case), self.inputs.digests(case))
        ]
        return self.cache.derived_key(
            "shared",
            {
                "truth": self.truth.key(case),
                "inputs": inputs,
                "name": name,
                "code": source_digest(tolerance, numerics, compute),
                "numpy": np.__version__,
                "ml_dtypes": ml_dtypes.__version__,
            },
        )

    def _stored(self, case: Case, name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """`compute()`, or the same bytes mapped from the on-disk cache where an earlier run
        stored them; stores what was slow to compute (`store_min_seconds`, `store_rate`)."""
        key = self.shared_key(case, name, compute)
        hit = self.cache.get_mapped(key)
        if hit is not None:
            self.stored["hit"] += 1
            return hit.value
        t0 = time.process_time()
        value = compute()
        seconds = time.process_time() - t0
        if (
            seconds >= self.store_min_seconds
            and value.nbytes <= seconds * self.store_rate
            and self.cache.put_mapped(
                key,
                value,
                {"kind": "shared", "name": name, "case": case.label, "seconds": round(seconds, 4)},
            )
        ):
            self.stored["stored"] += 1
        else:
            # Too cheap for the cache on disk (a K=4 product's bound: 134 MB in ~0.06 s):
            # a later backend computes it again once the memo has let it go, which costs
            # less than writing it to a file and mapping it back (measured on the matmul
            # suite: the run took ~0.7 s less without that copy).
            self.stored["computed"] += 1
        return value

    def outputs(self, event: Result) -> tuple[list[np.ndarray], list[str]]:
        """A result event's outputs, memory-mapped from their files, and their names."""
        return [load_output(o) for o in event.outputs], [o["name"] for o in event.outputs]

    def output_digests(self, event: Result, outputs: list[np.ndarray]) -> list[str]:
        """sha256 of each output's bits (`output_digest`), in the event's order."""
        return [self.output_digest(meta["path"], o) for meta, o in zip(event.outputs, outputs)]

    def output_digest(self, path: str, array: np.ndarray) -> str:
        """sha256 of the bits of `array`, the output file at `path`, once per file."""
        stat = os.stat(path)
        key = (stat.st_dev, stat.st_ino)
        if key not in self._file_digests:
            self._file_digests[key] = numerics.bits_digest(array)
        return self._file_digests[key]

    def release(self, path: str) -> None:
        """Remove an output file the run is done with (its digest goes with its last link)."""
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return
        if stat.st_nlink <= 1:
            self._file_digests.pop((stat.st_dev, stat.st_ino), None)
        os.unlink(path)

    def oracle_info(self, case: Case) -> dict[str, Any]:
        """How the case's truth was had, for the record (empty for probes without one)."""
        truth = self.truth.get(case)
        if truth is None:
            return {}
        return {
            "method": truth.method,
            "fallbacks": truth.fallbacks,
            "cache_hit": truth.cache_hit,
            "seconds": round(truth.seconds, 4),
        }
