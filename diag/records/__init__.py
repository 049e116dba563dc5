"""Records: what a run leaves on disk, and the one way to read it back.

`results` holds `Record` and `RunDir` (append + fsync, atomic run.json), `results_file`
reads results.jsonl back (tolerating one torn last line), `run_meta` is run.json's schema,
`outputs` checks where outputs may be written. Later stages (gate, report) read only this.
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.records.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
