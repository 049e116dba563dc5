"""The gate: a run held against what was accepted before.

`baseline` writes and reads a baseline, `drift` and `record_drift` say what moved and why
(once per cause), `junit` writes the result for a CI system. `history` keeps every run in one
SQLite file and `series` reads it back (since when did a record move, and what changed then);
`bisect` finds the first release (`releases`) or commit (`commits`) where records change.
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.gate.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
