"""Inputs and ground truth of a run's cases: drawn once on the host, computed once per input.

Every backend receives the same input bits (written once as raw-bit .npy files the workers
read), and the truth is computed once per input set, on the host, never on the device under
test (`diag.oracle`, disk-cached by input hash).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from diag import numerics
from diag.probes import INPUT_MAKERS, PROBES
from diag.suite import Case


class _Inputs:
    """Input arrays per input key: drawn once on the host, written once as raw bits."""

    def __init__(self, work: Path):
        self.work = work
        self._arrays: dict[str, list[np.ndarray]] = {}
        self._paths: dict[str, list[str]] = {}
        self._digests: dict[str, list[str]] = {}

    def digests(self, case: Case) -> list[str]:
        """sha256 of each input's bits, to check what a backend received."""
        if case.input_key not in self._digests:
            self._digests[case.input_key] = [numerics.bits_digest(a) for a in self.get(case)]
        return self._digests[case.input_key]

    def get(self, case: Case) -> list[np.ndarray]:
        if case.input_key not in self._arrays:
            probe = PROBES[case.op]
            rng = np.random.default_rng(case.seed)
            dtype = numerics.as_dtype(case.dtype)
            arrays = [INPUT_MAKERS[case.inputs](rng, shape, dtype)
                      for shape in probe.input_shapes(case.params)]
            paths = []
            for i, a in enumerate(arrays):
                path = self.work / f"in-{case.input_key}-{i}.npy"
                np.save(path, numerics.bits_view(a))
                paths.append(str(path))
            self._arrays[case.input_key] = arrays
            self._paths[case.input_key] = paths
        return self._arrays[case.input_key]

    def paths(self, case: Case) -> list[str]:
        self.get(case)
        return self._paths[case.input_key]


class _Truth:
    """Ground truth per case from the probe's oracle (disk-cached by input hash), computed
    once per input set and truth parameters (top_k and approx_max_k with the same k share)."""

    def __init__(self, inputs: _Inputs, cache_dir: str | None):
        from diag.oracle.cache import GroundTruthCache, default_cache_dir

        self._cache = GroundTruthCache(cache_dir or default_cache_dir())
        self._inputs = inputs
        self._memo: dict[str, Any] = {}

    def get(self, case: Case):
        probe = PROBES[case.op]
        key = json.dumps([probe.truth.__name__, case.input_key,
                          [case.params[a] for a in probe.truth_args]])
        if key not in self._memo:
            self._memo[key] = probe.truth(self._inputs.get(case), case.params, self._cache)
        return self._memo[key]
