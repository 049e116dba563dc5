"""What a cause's repair costs in time: the function as written and as repaired, timed as the
cause search runs them.

The search already ran both: the baseline (every op as written) and the run that confirmed
the cause (its ops promoted). Once it has, each runs a few more times, alternately, timed,
and the medians and spreads (largest minus smallest) are said; the search's own runs are
warm-ups (a wider dtype's first run compiles its ops). These are the re-runner's times (JAX:
the jaxpr evaluated equation by equation; PyTorch: eager, under a dispatch mode, on a fresh
copy of the arguments), on the CPU: they say what computing those ops in the wider dtype
costs beside the rest of the function run the same way, not what a compiled kernel of either
would take.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Cost:
    """Median seconds as written and repaired, and each one's spread (largest minus
    smallest), over `runs` runs of each."""

    before_s: float
    after_s: float
    before_spread_s: float
    after_spread_s: float
    runs: int

    def text(self) -> str:
        """``time op by op on the CPU (median of 3): 12.1 ms (spread 0.4 ms) as written,
        12.9 ms (spread 0.3 ms) repaired (+7%)``."""
        change = f"{(self.after_s / self.before_s - 1) * 100:+.0f}%" if self.before_s else "n/a"
        return (
            f"time op by op on the CPU (median of {self.runs}): {_secs(self.before_s)} "
            f"(spread {_secs(self.before_spread_s)}) as written, {_secs(self.after_s)} "
            f"(spread {_secs(self.after_spread_s)}) repaired ({change})"
        )


def measure(rerun: Callable[[frozenset], Any], sites: frozenset, timings: int) -> Cost | None:
    """Time `rerun` as written and with `sites` promoted, alternately, `timings` times each
    (None when `timings` is 0 or a run raised).

    The search's own runs are not timed: the first run of an op at a wider dtype compiles
    it (JAX) or warms its kernels, which is no cost of the repair.

    Args:
        rerun: the framework's re-runner (`diag.diverge.cause.Rerun`).
        sites: the cause's site keys.
        timings: how many times each is run.
    """
    before: list[float] = []
    after: list[float] = []
    for _ in range(timings):
        for keys, into in ((frozenset(), before), (sites, after)):
            clock = time.perf_counter()
            try:
                rerun(keys)
            except Exception:  # noqa: BLE001 - both ran in the search; a flaky function
                return None
            into.append(time.perf_counter() - clock)
    if not before:
        return None
    return Cost(
        statistics.median(before),
        statistics.median(after),
        max(before) - min(before),
        max(after) - min(after),
        len(before),
    )


def _secs(s: float) -> str:
    """``12.3 ms``, ``1.24 s``."""
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
