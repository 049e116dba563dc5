"""A baseline of the accuracy tables, and the check that names every row that changed.

`diag accuracy --baseline FILE` writes the rows' figures; `diag accuracy --check FILE`
measures again and names each row whose figures differ (exit 1), so a framework or library
upgrade that changes an elementwise function's results in any dtype is seen in CI. A row is
its backend, function, setting and dtype (`row_key`); its figures are the input count, the
not-correctly-rounded count, max ULP (equal to 1e-9 relative: it is printed and read back
as a decimal), the non-finite and flushed counts. Rows of the baseline that this run did not
measure (a narrower --function/--dtype/--backend) and new rows are named, not failures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diag.accuracy.measure import Row, row_key
from diag.errors import UsageError, exit_code

__all__ = ["FIGURES", "AccuracyBaselineError", "Check", "baseline", "check", "load", "save"]

FORMAT = "diag-accuracy-baseline/1"
#: The figures a check compares, in the order it names them.
FIGURES = ("inputs", "not_correctly_rounded", "max_ulp", "nonfinite_wrong", "flushed")


class AccuracyBaselineError(UsageError):
    """A baseline file that cannot be read (missing, not JSON, not an accuracy baseline)."""


@dataclass
class Check:
    """What `check` found: changed rows with their figures, and rows on one side only."""

    changed: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    compared: int = 0

    @property
    def exit_code(self) -> int:
        return exit_code(failed=bool(self.changed))


def baseline(rows: Sequence[Row]) -> dict:
    """The baseline of `rows`: {format, rows: {row_key: {figure: value}}}."""
    return {
        "format": FORMAT,
        "rows": {row_key(r): {f: getattr(r, f) for f in FIGURES} for r in rows},
    }


def save(data: dict, path: Path) -> Path:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def load(path: Path) -> dict:
    """A baseline file `save` wrote; AccuracyBaselineError (exit 2) when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise AccuracyBaselineError(
            f"{path}: cannot read the baseline ({e.strerror}); write "
            "one with `diag accuracy --baseline FILE`"
        ) from None
    except json.JSONDecodeError as e:
        raise AccuracyBaselineError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not isinstance(data.get("rows"), dict)
    ):
        raise AccuracyBaselineError(
            f"{path}: not an accuracy baseline (format {FORMAT!r} "
            "expected); write one with `diag accuracy --baseline FILE`"
        )
    return data


def _same(old, new) -> bool:
    if isinstance(old, float) or isinstance(new, float):
        return math.isclose(float(old), float(new), rel_tol=1e-9, abs_tol=1e-12)
    return old == new


def check(rows: Sequence[Row], data: dict) -> Check:
    """Compare measured `rows` with a baseline `data` (`load`)."""
    result = Check()
    now = baseline(rows)["rows"]
    for key, figures in now.items():
        old = data["rows"].get(key)
        if old is None:
            result.new.append(key)
            continue
        result.compared += 1
        diffs = [
            f"{f} {old.get(f)} -> {figures[f]}"
            for f in FIGURES
            if not _same(old.get(f), figures[f])
        ]
        if diffs:
            result.changed[key] = diffs
    result.missing = [k for k in data["rows"] if k not in now]
    return result
