"""The ground-truth cache's folder: where it is, the marker that makes it diag's, atomic
writes, and clearing only diag's own files (`CacheFolder`, the base of
`diag.oracle.cache.GroundTruthCache`; its promises are that module's docstring).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diag.errors import UsageError

__all__ = [
    "JAX_SUBFOLDER",
    "VENV_SUBFOLDER",
    "MARKER",
    "CacheFolder",
    "NotACache",
    "default_cache_dir",
    "jax_cache_dir",
]

#: The file that marks a folder as diag's cache (CACHEDIR.TAG: backup tools skip the folder).
MARKER = "CACHEDIR.TAG"
_MARKER_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_MARKER_TEXT = (
    f"{_MARKER_SIGNATURE}\n"
    "# This folder is a diag ground-truth cache (diag.oracle.cache).\n"
    "# `diag cache clear` deletes diag's entries here and nothing else.\n"
)
_MARKER_LINE = "# This folder is a diag ground-truth cache"
#: An entry file: ``<2 hex>/<64 hex>.npy`` or ``.json``, the 2 hex being the key's first two;
#: a second array of the same result has a suffix to its key (top-k's ``-indices``).
_ENTRY = re.compile(r"^([0-9a-f]{2})[0-9a-f]{62}(-[a-z]+)?\.(npy|json)$")
_HEX2 = re.compile(r"[0-9a-f]{2}")
#: A file of JAX's persistent compilation cache (jax/_src/lru_cache.py, jax 0.10):
#: ``<program name>-<64 hex key>-cache`` and its ``-atime``. `clear` removes these from
#: ``<cache>/jax`` and nothing else a user may have put there.
_JAX_ENTRY = re.compile(r"^.+-[0-9a-f]{64}-(cache|atime)$")
#: diag's own folders that may sit beside the entries (`diag.nodes` keeps golden digests in
#: ``$DIAG_CACHE_DIR/golden``); `clear` never enters them.
#: JAX's persistent compilation cache for diag's JAX workers lives in ``jax`` (`jax_cache_dir`).
JAX_SUBFOLDER = "jax"
#: The environments `diag bisect --package` builds, one per release tried (`diag.gate.releases`).
VENV_SUBFOLDER = "venvs"
_DIAG_SUBFOLDERS = ("golden", JAX_SUBFOLDER, VENV_SUBFOLDER)
_TMP_PREFIX = ".tmp-"
#: A temporary file older than this is a crashed writer's leftover; younger, a live write.
_STALE_TMP_S = 600.0


class NotACache(UsageError):
    """`clear` was pointed at a folder diag did not create as its cache."""


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$DIAG_CACHE_DIR` if set (in `environ`, default this process's), else
    ``~/.cache/diag/oracle``."""
    env = (os.environ if environ is None else environ).get("DIAG_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diag" / "oracle"


def jax_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """JAX's persistent compilation cache for diag's workers: ``jax`` in diag's cache folder.

    `diag.worker.host.worker_env` points JAX_COMPILATION_CACHE_DIR here unless the user set it;
    `GroundTruthCache.info` reports it and `clear` empties it.
    """
    return default_cache_dir(environ) / JAX_SUBFOLDER


def _is_entry(path: Path) -> bool:
    m = _ENTRY.match(path.name)
    return m is not None and m.group(1) == path.parent.name


def _diags_own(p: Path) -> bool:
    """Whether `p`, in a cache folder, is one of diag's: a temporary file, an entry folder
    (two hex digits) or one of diag's own subfolders."""
    return p.name.startswith(_TMP_PREFIX) or (
        p.is_dir() and bool(_HEX2.fullmatch(p.name) or p.name in _DIAG_SUBFOLDERS)
    )


class CacheFolder:
    """A cache folder: ``<root>/<key[:2]>/<key>.npy`` + ``.json`` entries, diag's marker,
    JAX's compilation cache in ``jax``."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self._ready = False  # the folder exists and is marked (or left unmarked on purpose)

    @property
    def marked(self) -> bool:
        """Whether the folder carries diag's cache marker (diag created it)."""
        try:
            return _MARKER_LINE in (self.root / MARKER).read_text(errors="replace")
        except OSError:
            return False

    def mark(self) -> bool:
        """Create the cache folder and mark it as diag's, as the first write does.

        An existing folder is marked only when it holds nothing but diag's own files (an older
        diag's cache, golden digests), never a folder of other files.

        Returns:
            Whether the folder is marked now.

        Raises:
            OSError: the folder or the marker cannot be written.
        """
        self._ready = False
        self._ensure_root()
        return self.marked

    def _ensure_root(self) -> None:
        if self._ready:
            return
        if not self.marked:
            if not (self.root.is_dir() and not all(map(_diags_own, self.root.iterdir()))):
                self.root.mkdir(parents=True, exist_ok=True)
                self._atomic_write(self.root / MARKER, lambda f: f.write(_MARKER_TEXT.encode()))
        self._ready = True

    @staticmethod
    def _atomic_write(path: Path, write: Callable) -> None:
        # O_EXCL with a random name (what mkstemp does) but mode 0666: the umask decides.
        for _ in range(100):
            tmp = path.parent / f"{_TMP_PREFIX}{secrets.token_hex(8)}{path.suffix}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no free temporary name in {path.parent}")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _files(self) -> list[Path]:
        """diag's entry files in the folder (nothing else, whatever else is there)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("??/*") if p.is_file() and _is_entry(p))

    def clear(self) -> int:
        """Remove diag's entries (and crashed writers' temporary files); returns the count.

        Only files named like entries, in a folder carrying diag's marker, are removed; the
        marker stays, and any other file is left where it is.

        Raises:
            NotACache: the folder exists but lacks diag's marker: diag did not create it, so
                nothing in it is removed.
        """
        if not self.root.exists():
            return 0
        try:  # a folder of nothing but diag's own (JAX's cache alone, say) is marked as diag's
            marked = self.marked or self.mark()
        except OSError:
            marked = False
        if not marked:
            raise NotACache(
                f"{self.root} is not a diag cache folder (no {MARKER} marker "
                "written by diag): nothing removed; pass the folder `diag cache "
                "info` shows, or delete an old diag cache by hand"
            )
        now = time.time()
        n = 0
        for d in self.root.iterdir():
            if not (d.is_dir() and _HEX2.fullmatch(d.name)):
                continue
            for p in d.iterdir():
                stale_tmp = (
                    p.name.startswith(_TMP_PREFIX)
                    and p.is_file()
                    and now - p.stat().st_mtime > _STALE_TMP_S
                )
                if not (p.is_file() and _is_entry(p)) and not stale_tmp:
                    continue
                try:
                    p.unlink()
                    n += 1
                except FileNotFoundError:
                    pass
            try:
                d.rmdir()  # only when empty: anything else in it stays
            except OSError:
                pass
        return n + self._clear_jax()

    def _clear_jax(self) -> int:
        """Remove the files of JAX's compilation cache (`_JAX_ENTRY`) kept in this (marked)
        folder; any other file there is not diag's and stays."""
        n = 0
        for p in _jax_files(self.root / JAX_SUBFOLDER):
            try:
                p.unlink()
                n += 1
            except OSError:  # another process writing there: left for the next clear
                pass
        with contextlib.suppress(OSError):  # only when empty: JAX's lock file, a user's file
            (self.root / JAX_SUBFOLDER).rmdir()
        return n

    def info(self, environ: Mapping[str, str] | None = None) -> dict:
        """{"path", "marked", "entries", "bytes"} of the cache directory (diag's files only),
        and "jax_compilation_cache": the JAX compilation cache diag's workers use.

        Args:
          environ: the environment the workers start from (default this process's): a
            JAX_COMPILATION_CACHE_DIR set there is the cache in use (the user's: `clear`
            leaves it), an empty one turns JAX's cache off; else ``<cache>/jax``.
        """
        files = self._files()
        info: dict[str, Any] = {
            "path": str(self.root),
            "marked": self.marked,
            "entries": sum(1 for p in files if p.suffix == ".json"),
            "bytes": sum(p.stat().st_size for p in files),
        }
        users = (os.environ if environ is None else environ).get("JAX_COMPILATION_CACHE_DIR")
        jax_dir = Path(users).expanduser() if users else self.root / JAX_SUBFOLDER
        if users == "" or not jax_dir.is_dir():
            return info
        jf = [p for p in jax_dir.rglob("*") if p.is_file()] if users else _jax_files(jax_dir)
        info["jax_compilation_cache"] = {
            "path": str(jax_dir),
            "set_by": "JAX_COMPILATION_CACHE_DIR" if users else "diag",
            "files": len(jf),
            "bytes": sum(p.stat().st_size for p in jf),
        }
        return info


def _jax_files(jax_dir: Path) -> list[Path]:
    """The files of JAX's compilation cache in `jax_dir` (its entries are one flat folder)."""
    if not jax_dir.is_dir():
        return []
    return sorted(p for p in jax_dir.iterdir() if p.is_file() and _JAX_ENTRY.match(p.name))
