"""The worker: one subprocess per backend, and the host's side of talking to it.

`protocol` is the typed job and event stream (both ways), `host` starts workers and reads
their events, `interpreter` picks the Python each framework's worker runs under, `main` is
the worker process itself (``python -m diag.worker.main JOB.json``), `faults` the injected
faults its tests use.
"""
