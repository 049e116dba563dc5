"""Formatting shared by every op family's verdict: where an element is, a number in a reason.
"""

from __future__ import annotations

import numpy as np


def format_index(flat: int, shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + ")"


def _fmt(x: float) -> str:
    return f"{x:.4g}"
