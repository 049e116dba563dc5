"""Settings: the XLA and framework flags audit (`flags`) and the environment report
(`environment`) of a host.
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.settings.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
