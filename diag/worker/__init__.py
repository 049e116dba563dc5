"""The worker: one subprocess per backend, and the host's side of talking to it.

`protocol` is the typed job and event stream (both ways), `host` starts workers and reads
their events, `interpreter` picks the Python each framework's worker runs under, `main` is
the worker process itself (``python -m diag.worker.main JOB.json``), `faults` the injected
faults its tests use.
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.worker.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
