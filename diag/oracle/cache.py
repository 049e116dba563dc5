"""On-disk cache of ground truth, keyed by what determines it, so CI does not pay twice.

The key hashes the op name, every input's dtype, shape and bytes, the output dtype, any op
parameters and `ORACLE_VERSION`; a change to any of them is a different entry, and bumping the
version when the oracle's arithmetic changes invalidates everything computed before. Values are
stored as the unsigned-integer bit view (`.npy`, so -0.0 and NaN payloads survive) next to a JSON
file with the dtype, shape, method and fallback count. Writes go to a temporary file in the same
directory followed by `os.replace`, so a reader never sees half an entry, even when two runs share
the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from diag.numerics import as_dtype, bits_view, dtype_name, from_bits

__all__ = ["ORACLE_VERSION", "CachedTruth", "GroundTruthCache", "default_cache_dir"]

#: Bump when any oracle's arithmetic changes: old entries then stop matching.
ORACLE_VERSION = "1"


def default_cache_dir() -> Path:
    """`$DIAG_CACHE_DIR` if set, else ``~/.cache/diag/oracle``."""
    env = os.environ.get("DIAG_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diag" / "oracle"


@dataclass(frozen=True)
class CachedTruth:
    """One cache entry: the value and its metadata (method, fallbacks, dtype, shape, ...)."""

    value: np.ndarray
    meta: dict


class GroundTruthCache:
    """Directory of cached oracle results: ``<root>/<key[:2]>/<key>.npy`` + ``.json``."""

    def __init__(self, root: Union[str, Path, None] = None):
        """Args:
        root: cache directory; default `default_cache_dir()`. Created on first write.
        """
        self.root = Path(root) if root is not None else default_cache_dir()

    @staticmethod
    def key(op: str, inputs: Sequence[np.ndarray], out_dtype, **params: Any) -> str:
        """Hex sha256 of (op, inputs' dtypes/shapes/bytes, out dtype, params, oracle version)."""
        h = hashlib.sha256()
        h.update(f"diag-oracle/{ORACLE_VERSION}/{op}/{dtype_name(out_dtype)}".encode())
        h.update(json.dumps(params, sort_keys=True, default=str).encode())
        for x in inputs:
            x = np.ascontiguousarray(x)
            h.update(f"|{dtype_name(x.dtype)}{x.shape}|".encode())
            h.update(bits_view(x).tobytes())
        return h.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.npy", d / f"{key}.json"

    def get(self, key: str) -> Optional[CachedTruth]:
        """The entry for `key`, or None if absent or unreadable (a corrupt entry is a miss)."""
        npy, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            bits = np.load(npy, allow_pickle=False)
            value = from_bits(bits, meta["dtype"]).reshape(meta["shape"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return CachedTruth(value=value, meta=meta)

    def put(self, key: str, value: np.ndarray, meta: Optional[dict] = None) -> Path:
        """Store `value` (bit view) and `meta` atomically; returns the .npy path."""
        npy, meta_path = self._paths(key)
        npy.parent.mkdir(parents=True, exist_ok=True)
        value = np.ascontiguousarray(value)
        full = dict(meta or {})
        full.update(dtype=dtype_name(as_dtype(value.dtype)), shape=list(value.shape),
                    oracle_version=ORACLE_VERSION)
        self._atomic_write(npy, lambda f: np.save(f, bits_view(value), allow_pickle=False))
        # The .json is written last: get() needs both, so a crash in between leaves a miss.
        self._atomic_write(meta_path, lambda f: f.write(json.dumps(full, sort_keys=True).encode()))
        return npy

    @staticmethod
    def _atomic_write(path: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
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
        if not self.root.is_dir():
            return []
        return [p for p in self.root.glob("*/*") if p.is_file() and p.suffix in (".npy", ".json")]

    def clear(self) -> int:
        """Remove every entry; returns the number of files removed."""
        n = 0
        for p in self._files():
            try:
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
        for d in self.root.glob("*") if self.root.is_dir() else []:
            if d.is_dir():
                try:
                    d.rmdir()
                except OSError:
                    pass
        return n

    def info(self) -> dict:
        """{"path": str, "entries": int, "bytes": int} of the cache directory."""
        files = self._files()
        return {
            "path": str(self.root),
            "entries": sum(1 for p in files if p.suffix == ".json"),
            "bytes": sum(p.stat().st_size for p in files),
        }
