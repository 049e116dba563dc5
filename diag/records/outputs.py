"""Files a command writes where the user said (`--out`, `-o`, `--junit`): one way to prepare
the path and one way to say why it cannot be written.

A bad output path must cost the user one line and exit 2 before work is lost, never a
traceback after it: a folder given where a file is meant, a file standing where a parent
folder must be, a full disk (the folder, what is free there and what is needed).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from diag.errors import UsageError

__all__ = [
    "human_bytes",
    "no_space",
    "prepare_output",
    "output_errors",
    "is_no_space",
    "run_disk_full",
]


def is_no_space(e: BaseException) -> bool:
    """Whether an error is a full disk (or a full quota)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    """A size in bytes as a person reads it: `512 B`, `3.4 KB`, `1.2 GB` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def no_space(folder: str | os.PathLike, needed: float | None = None) -> str:
    """The words for a full disk: the folder, what is free there and what is needed."""
    try:
        free = f", {human_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = ""
    need = f"; about {human_bytes(needed)} more needed" if needed else ""
    return (
        f"no space left on the device holding '{folder}'{free}{need}; free some space or "
        "choose another folder"
    )


def prepare_output(path: str | os.PathLike, what: str, option: str) -> Path:
    """Make `path` ready to be written as a file: create its missing parent folders.

    Every file a command writes where the user said (`--junit`, `-o`, `--out`) goes through
    here first, so a bad path is one line before any work is lost, never a traceback.

    Args:
      path: the file the user named.
      what: what the file is, for the message (`the JUnit file`).
      option: the option that named it, for the message (`--junit`).

    Returns:
      The path, as a `Path`.

    Raises:
      UsageError: the path is a folder, a file stands where a parent folder must be, or a
        parent cannot be created (the cause in words).
    """
    path = Path(path)
    hint = f"pass {option} with a writable file path"
    if path.is_dir() or str(path).endswith(os.sep):
        raise UsageError(
            f"cannot write {what} to '{path}': it is a folder; {hint} (e.g. '{path / 'out'}')"
        )
    blocker = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(
            f"cannot write {what} to '{path}': '{blocker}' is a file, not a folder; {hint}"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot write {what} to '{path}': {_why(e, path.parent)}; {hint}"
        ) from None
    return path


def _stamp(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _why(e: OSError, folder: Path, needed: float | None = None) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space(folder, needed)
    return (e.strerror or str(e)).lower() if e.strerror else str(e)


@contextlib.contextmanager
def output_errors(
    path: str | os.PathLike, what: str, option: str, needed: float | None = None
) -> Iterator[Path]:
    """Write `path` inside this block: an OSError (a full disk, no permission) becomes one
    UsageError line naming the file and the cause, and a partial file is removed."""
    path = prepare_output(path, what, option)
    before = _stamp(path)
    try:
        yield path
    except OSError as e:
        with contextlib.suppress(OSError):
            if path.is_file() and _stamp(path) != before:  # cut short here: not a file to keep
                path.unlink()
        raise UsageError(
            f"cannot write {what} to '{path}': {_why(e, path.parent, needed)}"
        ) from None


def run_disk_full(folder: Path, results: Path, written: int, planned: int) -> str:
    """A full disk under a run folder, in one line: where, what is free, what is needed (the
    bytes per record written so far times the records left: an estimate)."""
    try:
        size = results.stat().st_size
    except OSError:
        size = 0
    per = size / written if written else 4096
    try:  # run.json is rewritten whole (a temp copy, then a rename)
        meta = 2 * (folder / "run.json").stat().st_size
    except OSError:
        meta = 0
    need = per * max(planned - written, 0) + meta
    return f"run aborted: {no_space(folder, need)}; {written} finished record(s) kept in {folder}"
