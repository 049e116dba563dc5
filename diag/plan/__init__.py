"""The plan: what will run where, decided before anything runs.

Suite files (`suite`), user functions as suite entries (`suite_fn`), cases and their seeded
inputs (`cases`, `inputs`), the op modules found under probes/ (`registry`, `probe`). The
runner reads what this stage decides; nothing here imports a framework or a later stage.
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.plan.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
