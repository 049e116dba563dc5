"""What a cause's repair costs in time: the function as written and as repaired, timed as the
cause search runs them.

The search already ran both: the baseline (every op as written) and the run that confirmed
the cause (its ops promoted). Both runs were timed as they ran and count as samples; then each
runs `cause.TIMINGS` more times, alternately, and the fastest of each side and its spread
(largest minus smallest) are said. The fastest, because the confirming run is the first run of
its ops at the wider dtype (JAX compiles them there; PyTorch warms its kernels), which is no
cost of the repair; the extra run is warm. A confirming run that started downstream of the
cause (`diag.diverge.jax_restart`) is counted with the part it skipped at that part's time in
the baseline run (the same ops, as written, on the same values); the extra runs run the whole
function. These are the re-runner's times (JAX: the jaxpr evaluated equation by equation;
PyTorch: eager, under a dispatch mode, on a fresh copy of the arguments, the copy not
counted), on the CPU: they say what computing those ops in the wider dtype costs beside the
rest of the function run the same way, not what a compiled kernel of either would take.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Cost:
    """The fastest seconds as written and repaired, and each one's spread (largest minus
    smallest), over `runs` runs of each."""

    before_s: float
    after_s: float
    before_spread_s: float
    after_spread_s: float
    runs: int

    def text(self) -> str:
        """``time op by op on the CPU (fastest of 2): 12.1 ms (spread 0.4 ms) as written,
        12.9 ms (spread 0.3 ms) repaired (+7%)``."""
        change = f"{(self.after_s / self.before_s - 1) * 100:+.0f}%" if self.before_s else "n/a"
        return (
            f"time op by op on the CPU (fastest of {self.runs}): {_secs(self.before_s)} "
            f"(spread {_secs(self.before_spread_s)}) as written, {_secs(self.after_s)} "
            f"(spread {_secs(self.after_spread_s)}) repaired ({change})"
        )


def measure(
    rerun: Callable[[frozenset], Any],
    sites: frozenset,
    timings: int,
    before: list[float],
    after: list[float],
) -> Cost | None:
    """Time `rerun` as written and with `sites` promoted, alternately, `timings` more times
    each, beside the search's own timed runs (None when `timings` is 0 or a run raised).

    Args:
        rerun: the framework's re-runner (`diag.diverge.cause.Rerun`).
        sites: the cause's site keys.
        timings: how many more times each is run.
        before: the search's own runs as written, timed (seconds).
        after: the search's own run that confirmed the cause, timed (seconds; with the part
            it skipped at its baseline time).
    """
    if timings <= 0:
        return None
    before, after = list(before), list(after)
    for _ in range(timings):
        for keys, into in ((frozenset(), before), (sites, after)):
            try:
                into.append(timed(rerun, keys, whole=True)[1])
            except Exception:  # noqa: BLE001 - both ran in the search; a flaky function
                return None
    if not before or not after:
        return None
    runs = min(len(before), len(after))
    before, after = before[:runs], after[:runs]
    return Cost(min(before), min(after), max(before) - min(before), max(after) - min(after), runs)


def timed(
    rerun: Callable[[frozenset], Any], sites: frozenset, whole: bool = False
) -> tuple[Any, float]:
    """`rerun(sites)` and its seconds: the wall time of the call, less the copy of the
    arguments a PyTorch re-run makes first (the re-runner's ``setup_s``), plus the time in
    the baseline run of the part a downstream JAX re-run skipped (its ``skipped_s``).
    `whole`: run the whole function (`rerun.whole`, where the re-runner may start
    downstream); the figures are still read from the re-runner."""
    run = getattr(rerun, "whole", rerun) if whole else rerun
    clock = time.perf_counter()
    got = run(sites)
    took = time.perf_counter() - clock - getattr(rerun, "setup_s", 0.0)
    return got, took + getattr(rerun, "skipped_s", 0.0)


def _secs(s: float) -> str:
    """``12.3 ms``, ``1.24 s``."""
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
