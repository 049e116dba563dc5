"""What is wrong with a run folder's records, said in the report's banner and by `diag report`.

A report that silently shows what is left of a damaged folder can hide a failure: a verdict of
PASS over 63 records while run.json counts 136. So the report compares what results.jsonl holds
with what the runner counted when it wrote run.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from diag.records.results import RunDir

__all__ = ["damage", "lost_records"]


def damage(run_dir: str | os.PathLike) -> list[str]:
    """What is wrong with a run folder's records, one sentence each (none if it is whole):
    lines of results.jsonl that cannot be read (`RecordsRead.problems`) and records lost
    (`lost_records`).

    Args:
      run_dir: a run folder.

    Returns:
      Sentences for the report's banner and the terminal.
    """
    run = RunDir(run_dir)
    lost = lost_records(run_dir)
    return run.read_results().problems(run.results_jsonl) + ([lost] if lost else [])


def lost_records(run_dir: str | os.PathLike) -> str | None:
    """A sentence when run.json counts more records than results.jsonl holds readable, else None.

    The runner writes run.json's `counts` from the records it appended, so a run that ended
    with fewer records in results.jsonl than counted lost some afterwards (the file cut
    short, or deleted), and a verdict read from what is left may hide a failure: the folder
    is damaged (`diag report` exits 2).
    """
    run = RunDir(run_dir)
    read = run.read_results()
    meta = run.read_run()
    counted = sum(v for v in meta.counts.values() if isinstance(v, int))
    # Only a readable record is held: an unreadable line or a torn last line that run.json
    # counted is a record lost (a torn line that was the run's one failure hides a `fail`).
    held = len(read.records)
    if meta.state == "running" or counted <= held:
        return None
    where = (
        f"{run.results_jsonl} is missing"
        if not run.results_jsonl.exists()
        else f"{run.results_jsonl} holds {len(read.records)} readable record(s)"
    )
    return (
        f"{where} while run.json counts {counted} ({_counts_text(meta.counts)}): "
        f"{counted - held} record(s) are lost (the verdict counts their statuses from "
        "run.json); the run folder is damaged: rerun the suite"
    )


def _counts_text(counts: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {s}" for s, n in counts.items() if isinstance(n, int) and n)
