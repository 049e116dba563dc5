"""Profiler traces and compiled programs next to diag's numbers (`diag run --trace`).

A numerical finding is actionable only with the program that produced it beside it: which
fused op ran, in which dtype and shape, for how long, and what a more precise setting costs.
XProf and Holistic Trace Analysis show time only; diag's records show error only; this
package joins them.

    capture    inside a worker: one profiler session per (case, backend) in the run folder
               (an XProf logdir), the case's optimised HLO, the summary JSON
    summarise  per-op tables from the traces: xprof's converter for XLA traces, the Kineto
               trace's own events for eager PyTorch; a converter failure is "summary
               unavailable", never a failed run
    hlo        instruction shapes and dtypes from HLO text
    passes     for an A/B case whose outputs differ: the first XLA pass whose output differs
    serve      XProf's web UI on 127.0.0.1 only (`diag trace RUN --serve`)

Nothing here imports jax, torch or xprof at module level: `import diag.trace` is cheap, and
the framework is imported by the worker that already runs it.
"""

from __future__ import annotations

from diag.trace.layout import (
    HLO_DIR,
    PASSES_DIR,
    SESSIONS_DIR,
    SUMMARY_DIR,
    read_passes,
    read_summaries,
)

__all__ = ["HLO_DIR", "PASSES_DIR", "SESSIONS_DIR", "SUMMARY_DIR", "read_passes", "read_summaries"]
