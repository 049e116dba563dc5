"""Elementwise accuracy tables: every 16-bit input, float32 samples, every backend.

Which backend computes what the math says for the elementwise functions every model uses
(exp, tanh, erf, gelu, ...)? For each backend x function x dtype, every finite bfloat16 and
float16 input in the function's domain, and 10^6 float32 samples plus hard cases, are run on
the backend and compared with the correctly rounded value (`diag.accuracy.truth` proves each
one, falling back to mpmath). `diag accuracy` prints the tables; `tables` is the library call.

Names are loaded on first use, so the worker (`python -m diag.accuracy.worker`, which may run
under a Python that has only numpy and its framework) imports nothing else of this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FUNCTIONS",
    "Row",
    "Tables",
    "baseline",
    "check",
    "tables",
]

_WHERE = {
    "FUNCTIONS": "diag.accuracy.functions",
    "Row": "diag.accuracy.measure",
    "Tables": "diag.accuracy.tables",
    "tables": "diag.accuracy.tables",
    "baseline": "diag.accuracy.baseline",
    "check": "diag.accuracy.baseline",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'diag.accuracy' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
