"""Arithmetic: which arithmetic a backend's matmul really uses.

`precision` fingerprints a matmul with crafted inputs, `features` measures its unit's
features (exact products, extra bits, rounding, block FMA), `unit_model` is the numpy model
of such a unit, `dot_algorithms` the emulated dot algorithms (BF16_BF16_F32, TF32, ...).
"""


def __getattr__(name: str):
    """Submodules load on first use: `diag.arith.X` works after a bare `import diag`."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
