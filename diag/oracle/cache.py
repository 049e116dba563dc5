"""On-disk cache of ground truth, keyed by what determines it, so CI does not pay twice.

Beside the truths it keeps two kinds of derived entry (`derived_key`, `put_mapped`,
`get_mapped`): arrays every backend's verdict shares that were slow to compute (a long-K
matmul's error bound, `diag.run.store.CaseStore.shared`) and large seeded input sets
(`diag.plan.inputs.STORE_INPUT_BYTES`). Their keys name everything the value depends on, source
code included, and a run memory-maps them read-only: the workers map cached inputs in place.

The key hashes the op name, every input's dtype, shape and bytes, the output dtype, any op
parameters and `ORACLE_VERSION`; a change to any of them is a different entry, and bumping the
version when the oracle's arithmetic changes invalidates everything computed before. Values are
stored as the unsigned-integer bit view (`.npy`, so -0.0 and NaN payloads survive) next to a JSON
file with the dtype, shape, method and fallback count.

What the cache promises, because a wrong or missing cache must never change a verdict:

* **Verified reads.** The JSON holds a sha256 over the metadata and the value's bits; `get`
  recomputes it, and an entry that does not match (a flipped bit on disk, a torn copy) or whose
  JSON is damaged is a miss with a warning, so the oracle recomputes and overwrites it. A
  corrupt entry would otherwise be a false ``fail`` blamed on the backend.
* **Never fatal.** A cache that cannot be written (a read-only folder, a HOME where
  ``~/.cache`` cannot be created) is reported once per process on the ``diag.oracle.cache``
  logger (stderr by default) and the run goes on uncached.
* **Deletes only its own files.** When diag creates the cache folder it writes a marker
  (`MARKER`, in the CACHEDIR.TAG format backup tools know); `clear` refuses a folder without
  it, and even in a marked folder removes only files named like diag's entries
  (``<key[:2]>/<key>.npy|.json``) and, in ``jax``, like JAX's compilation cache's.
* **Atomic, umask-respecting writes.** Each file is written to a temporary name in the same
  folder and moved into place with `os.replace`, so a reader never sees half an entry, even when
  two runs share the folder; files are created with mode 0666 less the umask, like every other
  file diag writes (not `mkstemp`'s 0600).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.errors import DiagError
from diag.numerics import as_dtype, bits_digest, bits_view, dtype_name, from_bits
from diag.oracle.cache_folder import (
    JAX_SUBFOLDER,
    MARKER,
    CacheFolder,
    NotACache,
    default_cache_dir,
    jax_cache_dir,
)

__all__ = [
    "JAX_SUBFOLDER",
    "MARKER",
    "ORACLE_VERSION",
    "CacheFolder",
    "CachedTruth",
    "GroundTruthCache",
    "MappedEntry",
    "NotACache",
    "default_cache_dir",
    "jax_cache_dir",
    "source_digest",
]

#: Bump when any oracle's arithmetic changes: old entries then stop matching.
ORACLE_VERSION = "1"

log = logging.getLogger(__name__)
_warned_unwritable: set[str] = set()


def source_digest(*code: Any) -> str:
    """sha256 over the source files that define `code` (functions, classes or modules).

    Part of the key of an entry computed by diag's own code (a bound, a seeded input): any
    edit to a file its arithmetic lives in makes a new key, so no version number has to be
    remembered for it to be bumped.
    """
    files = sorted({inspect.getsourcefile(inspect.unwrap(c)) or "" for c in code})
    return hashlib.sha256("".join(_file_digest(f) for f in files).encode()).hexdigest()


@functools.cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:  # no source to read (a frozen build): the library versions still key it
        return ""


@dataclass(frozen=True)
class CachedTruth:
    """One cache entry: the value and its metadata (method, fallbacks, dtype, shape, ...)."""

    value: np.ndarray
    meta: dict


@dataclass(frozen=True)
class MappedEntry:
    """A verified entry memory-mapped read-only from the cache (`GroundTruthCache.get_mapped`).

    Attributes:
      value: the array, a read-only view of the file: pages are read as they are used and
        belong to the page cache, not to the process that maps them.
      meta: the metadata it was stored with.
      path: the .npy file (a worker may map it too; nothing may write to it).
      digest: sha256 of the value's bits (`diag.numerics.bits_digest`), checked on the way in.
    """

    value: np.ndarray
    meta: dict
    path: Path
    digest: str


def _checksum(meta: dict, bits: np.ndarray) -> str:
    """sha256 over the metadata (without its own checksum) and the value's bits."""
    h = _meta_hash(meta)
    bits = np.ascontiguousarray(bits)
    h.update(f"|{bits.dtype.str}{bits.shape}|".encode())
    # The buffer itself: no copy of a large value. (numpy's stubs declare ndarray.__buffer__
    # only for Python >= 3.12.)
    h.update(memoryview(bits).cast("B"))  # type: ignore[arg-type]
    return h.hexdigest()


def _identity(*paths: Path) -> tuple:
    """What tells a file apart from its replacement or an in-place change: inode, size and
    modification time (ns) of each path."""
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))


def _meta_hash(meta: dict):
    return hashlib.sha256(
        json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode()
    )


class _Corrupt(Exception):
    """An entry whose bits or metadata do not match its checksum (the path says which)."""


def _read_meta(path: Path) -> dict:
    """An entry's JSON sidecar. A missing one is an absent entry (OSError, a silent miss);
    one that is not a JSON object (cut short, overwritten) is a damaged entry (`_Corrupt`),
    which the caller warns about before recomputing it."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Corrupt(path) from e
    if not isinstance(meta, dict):
        raise _Corrupt(path)
    return meta


class GroundTruthCache(CacheFolder):
    """Directory of cached oracle results: ``<root>/<key[:2]>/<key>.npy`` + ``.json``.

    The folder itself (its marker, atomic writes, `clear`, `info`) is `CacheFolder`'s.
    """

    def __init__(self, root: str | Path | None = None):
        """Args:
        root: cache directory; default `default_cache_dir()`. Created (and marked) on first
            write.
        """
        super().__init__(root)
        self._writable = True
        # key -> the identity of the entry's two files when this object last verified it: a
        # file replaced (every write is an atomic rename: a new inode) or changed in place (a
        # new mtime or size) is verified again; an unchanged one is not hashed twice (a run
        # reads a truth once per backend, and sha256 is ~1 ms per MB).
        self._verified: dict[str, tuple] = {}

    @staticmethod
    def key(op: str, inputs: Sequence[np.ndarray], out_dtype, **params: Any) -> str:
        """Hex sha256 of (op, inputs' dtypes/shapes/bytes, out dtype, params, oracle version)."""
        h = hashlib.sha256()
        h.update(f"diag-oracle/{ORACLE_VERSION}/{op}/{dtype_name(out_dtype)}".encode())
        h.update(json.dumps(params, sort_keys=True, default=str).encode())
        for x in inputs:
            x = np.ascontiguousarray(x)
            h.update(f"|{dtype_name(x.dtype)}{x.shape}|".encode())
            # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
            h.update(memoryview(bits_view(x)).cast("B"))  # type: ignore[arg-type]
        return h.hexdigest()

    @staticmethod
    def derived_key(kind: str, parts: Any) -> str:
        """Hex sha256 of an entry that is not a ground truth (a bound, a seeded input).

        Args:
          kind: what the entry is (`shared`, `inputs`): entries of two kinds never collide.
          parts: JSON-able data naming everything the value depends on (the caller's
            contract: leave one out and a stale value could be read back).
        """
        h = hashlib.sha256(f"diag-{kind}/{ORACLE_VERSION}/".encode())
        h.update(json.dumps(parts, sort_keys=True, default=str).encode())
        return h.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.npy", d / f"{key}.json"

    def get(self, key: str) -> CachedTruth | None:
        """The entry for `key`, or None if absent, unreadable or failing its checksum.

        A checksum mismatch is logged (the entry is then recomputed and overwritten by the
        caller's `put`); an entry without a checksum (written by an older diag) is a silent miss.
        """
        npy, meta_path = self._paths(key)
        try:
            seen = _identity(npy, meta_path)  # before reading: a later swap is seen next time
            meta = _read_meta(meta_path)
            # Mapped, not read: the checksum pass and the caller's use read the page cache,
            # and a truth the run's memo lets go of costs it no memory.
            try:
                bits = np.load(
                    npy,
                    mmap_mode="r" if math.prod(meta.get("shape") or [1]) else None,
                    allow_pickle=False,
                )
            except (EOFError, ValueError) as e:  # empty or shorter than its header says
                raise _Corrupt(npy) from e
            stored = meta.get("sha256")
            if stored is None:
                return None
            if self._verified.get(key) != seen:
                if stored != _checksum(meta, bits):
                    log.warning(
                        "diag: ground-truth cache entry %s failed its checksum "
                        "(corrupted on disk); recomputing it",
                        npy,
                    )
                    return None
                self._verified[key] = seen
            value = from_bits(bits, meta["dtype"]).reshape(meta["shape"])
        except _Corrupt as bad:
            log.warning(
                "diag: ground-truth cache entry %s is damaged (empty, cut short or not "
                "JSON); recomputing it",
                bad.args[0],
            )
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, DiagError):
            return None
        return CachedTruth(value=value, meta=meta)

    def get_mapped(self, key: str) -> MappedEntry | None:
        """The entry for `key` written by `put_mapped`, memory-mapped read-only, or None.

        Verified as `get` verifies, without reading the value into the process's memory: the
        metadata's own checksum, then sha256 over the mapped bits against the digest it
        holds. An entry that fails (a flipped bit, a truncated file) is a miss with a warning,
        so the caller recomputes it and `put_mapped` overwrites it; one that is absent or
        unreadable is a silent miss.
        """
        npy, meta_path = self._paths(key)
        try:
            seen = _identity(npy, meta_path)  # before reading: a later swap is seen next time
            meta = _read_meta(meta_path)
            if meta.get("sha256") is None or "bits_sha256" not in meta:
                return None
            if meta["sha256"] != _meta_hash(meta).hexdigest():
                raise _Corrupt(meta_path)
            try:  # (an empty array has no bytes to map)
                bits = np.load(
                    npy, mmap_mode="r" if math.prod(meta["shape"]) else None, allow_pickle=False
                )
            except (EOFError, ValueError) as e:  # empty, or shorter than its header says
                raise _Corrupt(npy) from e
            if list(bits.shape) != meta["shape"]:
                raise _Corrupt(npy)
            if self._verified.get(key) != seen:
                if bits_digest(bits) != meta["bits_sha256"]:
                    raise _Corrupt(npy)
                self._verified[key] = seen
            value = from_bits(bits, meta["dtype"])
        except _Corrupt as bad:
            log.warning(
                "diag: ground-truth cache entry %s failed its checksum (corrupted on "
                "disk); recomputing it",
                bad.args[0],
            )
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, DiagError):
            return None
        return MappedEntry(value=value, meta=meta, path=npy, digest=meta["bits_sha256"])

    def put_mapped(
        self, key: str, value: np.ndarray, meta: dict | None = None
    ) -> MappedEntry | None:
        """Store `value` as `put` does, for `get_mapped`; returns the stored entry, mapped.

        The checksum is the bits' sha256 (the digest diag checks inputs with) plus one over
        the metadata, so a reader verifies the value in one pass over the map.

        Returns None, without raising, when the cache cannot be written (as `put`).
        """
        value = np.ascontiguousarray(value)
        bits = bits_view(value)
        full = dict(meta or {})
        full.update(
            dtype=dtype_name(as_dtype(value.dtype)),
            shape=list(value.shape),
            oracle_version=ORACLE_VERSION,
            bits_sha256=bits_digest(bits),
        )
        full["sha256"] = _meta_hash(full).hexdigest()
        npy = self._write(key, bits, full)
        if npy is None:
            return None
        mapped = np.load(npy, mmap_mode="r", allow_pickle=False) if value.size else bits
        return MappedEntry(
            value=from_bits(mapped, full["dtype"]), meta=full, path=npy, digest=full["bits_sha256"]
        )

    def put(self, key: str, value: np.ndarray, meta: dict | None = None) -> Path | None:
        """Store `value` (bit view) and `meta` atomically; returns the .npy path.

        Returns None, without raising, when the cache cannot be written: the first such failure
        per folder and process is logged, and this cache object stops trying.
        """
        value = np.ascontiguousarray(value)
        bits = bits_view(value)
        full = dict(meta or {})
        full.update(
            dtype=dtype_name(as_dtype(value.dtype)),
            shape=list(value.shape),
            oracle_version=ORACLE_VERSION,
        )
        full["sha256"] = _checksum(full, bits)
        return self._write(key, bits, full)

    def _write(self, key: str, bits: np.ndarray, full: dict) -> Path | None:
        if not self._writable:
            return None
        npy, meta_path = self._paths(key)
        try:
            self._ensure_root()
            npy.parent.mkdir(exist_ok=True)
            self._atomic_write(npy, lambda f: np.save(f, bits, allow_pickle=False))
            # The .json is written last: get() needs both, so a crash in between leaves a miss.
            self._atomic_write(
                meta_path, lambda f: f.write(json.dumps(full, sort_keys=True).encode())
            )
        except OSError as e:
            self._writable = False
            where = str(self.root)
            if where not in _warned_unwritable:
                _warned_unwritable.add(where)
                log.warning(
                    "diag: ground-truth cache %s is not writable (%s); going on "
                    "uncached: set DIAG_CACHE_DIR or --cache-dir to a writable folder "
                    "to keep ground truth between runs",
                    where,
                    e.strerror or type(e).__name__,
                )
            return None
        return npy
