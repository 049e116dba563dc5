"""The arithmetic a backend's matmul really uses, measured inside a worker: its precision
fingerprint per setting (`diag.arith.precision.fingerprint`), its unit's features
(`diag.arith.precision.features`), and `diag env`'s per-backend report. Split from
`diag.worker.main`, which calls them after a job's cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from diag.plan.registry import FINGERPRINT_OP, build

__all__ = ["matmul_features", "matmul_fingerprints", "worker_env"]


def _precision_settings(spec) -> list[tuple[str, str]]:
    """(precision, via) pairs a backend can express: default, then each level both ways."""
    from diag.backends import not_applicable

    pairs = [("default", "none")]
    for prec in spec.precisions:
        for via in spec.precision_via:
            params = {"precision": prec, "precision_via": via}
            if prec != "default" and not_applicable(spec, FINGERPRINT_OP, params) is None:
                pairs.append((prec, via))
    return pairs


def matmul_fingerprints(backend, settings: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Inside a worker: the fingerprint of the backend module's matmul per (precision, via).

    Args:
      backend: a set-up backend module (put/get/matmul).
      settings: (precision, via) pairs to measure.

    Returns:
      One JSON-ready entry per setting: precision, via and `Fingerprint.to_json()`, or
      label ERROR with the exception as evidence (one failing setting is a finding).
    """
    from diag.arith.precision import fingerprint

    fps = []
    for prec, via in settings:
        fn = build(backend, FINGERPRINT_OP, precision=prec, precision_via=via)

        def on_device(a, b, fn=fn):
            return backend.get(fn(backend.put(a), backend.put(b)))

        entry: dict[str, Any] = {"precision": prec, "via": via}
        try:
            entry.update(fingerprint(on_device).to_json())
        except Exception as e:
            entry.update(label="ERROR", evidence=[f"{type(e).__name__}: {e}"[:300]])
        fps.append(entry)
    return fps


def matmul_features(
    backend, settings: list[tuple[str, str]], dtypes: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    """Inside a worker: `diag.arith.precision.features` of the backend's matmul per
    (precision, via).

    Args:
      backend: a set-up backend module (put/get/matmul).
      settings: (precision, via) pairs to measure.
      dtypes: input dtypes to measure at every setting; None (`diag env --deep`): float32,
        plus bf16 and fp16 at the default setting.

    Returns:
      One JSON-ready entry per (setting, dtype): precision, via, `Features.to_json()` (or
      `error`) and the `seconds` it took.
    """
    from diag.arith.precision import features

    out = []
    for prec, via in settings:
        fn = build(backend, FINGERPRINT_OP, precision=prec, precision_via=via)

        def on_device(a, b, fn=fn):
            return backend.get(fn(backend.put(a), backend.put(b)))

        for dtype in dtypes or ("float32",) + (
            ("bfloat16", "float16") if prec == "default" else ()
        ):
            entry: dict[str, Any] = {"precision": prec, "via": via}
            t0 = time.perf_counter()
            try:
                entry.update(features(on_device, dtype).to_json())
            except Exception as e:  # one failing setting is a finding, not the end
                entry.update(dtype=dtype, error=f"{type(e).__name__}: {e}"[:300])
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            out.append(entry)
    return out


def worker_env(
    framework: str, emit: Callable[..., None], fingerprints: bool = True, deep: bool = False
) -> None:
    """Inside a worker: each present backend's device, versions, settings, fingerprints
    (and with `deep`, the arithmetic features of its matmul, `diag env --deep`).

    Emits one `backend` event per backend of `framework` whose platform is present, then
    `done` with the platforms seen.
    """
    import importlib

    from diag.backends import BACKENDS

    specs = [s for s in BACKENDS.values() if s.framework == framework and s.default]
    backend = importlib.import_module(specs[0].module)
    platforms = backend.discover()
    for spec in specs:
        if spec.platform not in platforms:
            continue
        info = backend.setup(spec.platform)
        fps = matmul_fingerprints(backend, _precision_settings(spec) if fingerprints else [])
        if deep:
            info["features"] = matmul_features(backend, _precision_settings(spec))
        emit(event="backend", backend=spec.name, fingerprints=fps, **info)
    emit(event="done", platforms=platforms)
