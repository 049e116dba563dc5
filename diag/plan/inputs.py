"""The inputs and ground truth of a run's cases.

The makers (`INPUT_MAKERS`, named by suite files' `inputs`, in `diag.plan.makers`) draw
seeded arrays with numpy. Every backend receives the same input bits (written once as raw-bit
.npy files the workers read), and the truth is computed once per input set, on the host,
never on the device under test (`diag.oracle`, disk-cached by input hash). Large seeded inputs
are kept in that cache too (`STORE_INPUT_BYTES`): a later run maps them, and so do its
workers, instead of drawing them again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from diag import numerics
from diag.plan.makers import INPUT_MAKERS
from diag.plan.registry import PROBES

if TYPE_CHECKING:
    from diag.plan.suite import Case

__all__ = ["INPUT_MAKERS", "InputStore", "TruthStore", "CostMemo"]


#: Arrays larger than this are kept by the host as files in the work folder and memory-mapped
#: when used, not held: a run's memory stays that of one case, not of the whole suite.
SPILL_BYTES = 1 << 20


def _spill(path: Path, a: np.ndarray) -> np.ndarray | None:
    """Write `a`'s raw bits to `path` once; return `a` when it is small enough to keep, else
    None (it is mapped from the file when used, `_mapped`)."""
    np.save(path, numerics.bits_view(a) if numerics.is_supported(a.dtype) else a)
    return a if a.nbytes <= SPILL_BYTES else None


def _mapped(path: str, dtype) -> np.ndarray:
    data = np.load(path, mmap_mode="r")
    return numerics.from_bits(data, dtype) if numerics.is_supported(dtype) else data


#: An input set of at least this many bytes, drawn by one of `INPUT_MAKERS`, is stored in the
#: ground-truth cache and mapped from there by later runs and their workers. numpy draws
#: normals at ~150 MB/s here (a [256, 65536] float32 pair: ~1 s), while a stored set costs a
#: map and the sha256 every run takes of its inputs anyway; smaller sets take milliseconds
#: to draw and stay out of the cache. The shipped matmul suite stores its two largest
#: long-K sets (192 MB).
STORE_INPUT_BYTES = 16 << 20


class InputStore:
    """Input arrays per input key: drawn once on the host, written once as raw bits, which
    the workers and the host both map (large ones are not kept in the host's memory).

    Args:
      work: the run's work folder, where inputs not kept in the cache are written.
      cache: where large seeded input sets are kept between runs (`STORE_INPUT_BYTES`);
        None: always draw them. Files in the cache are only ever mapped read-only, by the
        host and the workers; the run's work folder, deleted after the run, holds none.
    """

    def __init__(self, work: Path, cache=None):
        self.work = work
        self.cache = cache
        self._arrays: dict[str, list[np.ndarray | None]] = {}
        self._dtypes: dict[str, list[np.dtype]] = {}  # per array: a set may mix dtypes
        self._paths: dict[str, list[str]] = {}
        self._digests: dict[str, list[str]] = {}

    def digests(self, case: Case) -> list[str]:
        """sha256 of each input's bits, to check what a backend received."""
        if case.input_key not in self._digests:
            self._digests[case.input_key] = [numerics.bits_digest(a) for a in self.get(case)]
        return self._digests[case.input_key]

    def get(self, case: Case) -> list[np.ndarray]:

        key = case.input_key
        if key in self._arrays:
            # A large input is mapped afresh for each use and let go after it: a map held
            # for the whole run would keep every page it touched resident.
            return [
                a if a is not None else _mapped(p, dt)
                for a, p, dt in zip(self._arrays[key], self._paths[key], self._dtypes[key])
            ]
        probe = PROBES[case.op]
        dtype = numerics.as_dtype(case.dtype)
        keys = self._store_keys(case, probe, dtype)
        stored = [self.cache.get_mapped(k) for k in keys]
        if keys and all(e is not None for e in stored):
            self._keep(key, stored, dtype)
            return [e.value for e in stored]
        rng = np.random.default_rng(case.seed)
        if probe.make_inputs is not None:  # inputs made as a set (a model's weights)
            arrays = probe.make_inputs(rng, case.params, dtype)
        else:
            arrays = [
                INPUT_MAKERS[case.inputs](rng, shape, dtype)
                for shape in probe.input_shapes(case.params)
            ]
        stored = [
            self.cache.put_mapped(k, a, {"kind": "inputs", "case": case.label})
            for k, a in zip(keys, arrays)
        ]
        if keys and all(e is not None for e in stored):
            self._keep(key, stored, dtype)
            return arrays
        paths = [self.work / f"in-{case.input_key}-{i}.npy" for i in range(len(arrays))]
        self._arrays[key] = [_spill(p, a) for p, a in zip(paths, arrays)]
        self._dtypes[key] = [a.dtype for a in arrays]
        self._paths[key] = [str(p) for p in paths]
        return arrays

    def _store_keys(self, case: Case, probe, dtype) -> list[str]:
        """The cache keys of `case`'s input arrays, or [] when they are not kept there.

        A key holds what the bits depend on: the maker's name and the source of the module
        it lives in, the shapes, dtype and seed, the array's place in the set, and numpy's
        and ml_dtypes' versions (numpy does not promise the same stream from a seed across
        versions). Sets made by a probe's own `make_inputs` (a model's weights, small) are not
        kept.
        """
        if self.cache is None or probe.make_inputs is not None:
            return []
        from diag.oracle.cache import source_digest

        shapes = [list(s) for s in probe.input_shapes(case.params)]
        if sum(math.prod(s) for s in shapes) * dtype.itemsize < STORE_INPUT_BYTES:
            return []
        maker = INPUT_MAKERS[case.inputs]
        recipe = {
            "maker": case.inputs,
            "code": source_digest(maker),
            "shapes": shapes,
            "dtype": numerics.dtype_name(dtype),
            "seed": case.seed,
            "numpy": np.__version__,
            "ml_dtypes": ml_dtypes.__version__,
        }
        return [
            self.cache.derived_key("inputs", {**recipe, "index": i}) for i in range(len(shapes))
        ]

    def _keep(self, key: str, stored: list, dtype: np.dtype) -> None:
        """Use verified cache entries as the input set `key`: mapped, never copied."""
        self._arrays[key] = [None] * len(stored)
        self._dtypes[key] = [dtype] * len(stored)
        self._paths[key] = [str(e.path) for e in stored]
        self._digests[key] = [e.digest for e in stored]

    def paths(self, case: Case) -> list[str]:
        self.get(case)
        return self._paths[case.input_key]

    def dtypes(self, case: Case) -> list[str]:
        """Each input's dtype name (a set made by `make_inputs` may mix floats and integers:
        a model's weights and its token ids)."""
        self.get(case)
        return [
            numerics.dtype_name(d) if numerics.is_supported(d) else np.dtype(d).name
            for d in self._dtypes[case.input_key]
        ]


class CostMemo:
    """Values kept by what they would cost to get again, within a byte budget.

    A value that took long to compute for its size (a long-K matmul's bound: seconds for
    half a MB) is kept before one that is cheap (a 16.7M-element bound: 0.1 s for 134 MB):
    when the budget is full the value with the fewest seconds per byte goes first, the new
    one included. What is not kept is computed again when asked for (a ground truth then
    comes from the on-disk cache), so the memo bounds memory without changing any value.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._items: dict[str, tuple[Any, float, int]] = {}  # key -> (value, seconds, bytes)

    def get(self, key: str, compute: Callable[[], Any], nbytes: Callable[[Any], int]) -> Any:
        import time

        if key in self._items:
            return self._items[key][0]
        t0 = time.perf_counter()
        value = compute()
        self._items[key] = (value, time.perf_counter() - t0, nbytes(value))
        while sum(size for _, _, size in self._items.values()) > self.budget:
            cheapest = min(self._items, key=lambda k: self._items[k][1] / max(1, self._items[k][2]))
            del self._items[cheapest]
        return value


#: Host memory the memos of one run may hold (ground truths, arrays shared by backends).
MEMO_BYTES = 256 << 20


def _value_bytes(result: Any) -> int:
    return int(getattr(getattr(result, "value", None), "nbytes", 0))


class TruthStore:
    """Ground truth per case from the probe's oracle (disk-cached by input hash), computed
    once per input set and truth parameters (top_k and approx_max_k with the same k share),
    and kept in memory while `CostMemo`'s budget allows (else read again from the cache)."""

    def __init__(self, inputs: InputStore, cache_dir, memo: CostMemo | None = None):
        from diag.oracle.cache import GroundTruthCache, default_cache_dir

        #: The ground-truth cache (`cache_dir` may be one already, shared with the inputs).
        self.cache = (
            cache_dir
            if isinstance(cache_dir, GroundTruthCache)
            else GroundTruthCache(cache_dir or default_cache_dir())
        )
        self._inputs = inputs
        self._memo = memo if memo is not None else CostMemo(MEMO_BYTES)

    def key(self, case: Case) -> str:
        """What identifies a case's truth: the oracle, the inputs and the truth's parameters."""
        probe = PROBES[case.op]
        return json.dumps(
            [probe.truth_name, case.input_key, [case.params[a] for a in probe.truth_args]]
        )

    def get(self, case: Case):
        return self._memo.get(
            self.key(case),
            lambda: PROBES[case.op].truth(self._inputs.get(case), case.params, self.cache),
            _value_bytes,
        )
