"""Where a JAX equation came from: the user's line, or the library line no user frame covers.

Reads JAX's private source-info API; importing it is guarded here, so a JAX without it fails
the hunt with a `NanHuntError` naming what is missing.
"""

from __future__ import annotations

import os
import re

from diag.nan import NanHuntError

import jax

try:
    from jax._src import source_info_util as _siu
    from jax.extend import core as _jcore
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise NanHuntError(f"this JAX ({jax.__version__}) lacks the internals diag's NaN hunt "
                       f"reads ({e}); use jax 0.4.30 or later") from e

_Literal = _jcore.Literal

def _source(eqn) -> tuple[str, str, int, str]:
    """("file.py:LINE (function)", full path, line, function) of the user's line for `eqn`."""
    try:
        frame = _siu.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - private API; an unknown line is not fatal
        frame = None
    if frame is None:
        return "", "", 0, ""
    base = os.path.basename(frame.file_name)
    func = frame.function_name.rsplit(".", 1)[-1]  # a qualname on Python >= 3.11
    return f"{base}:{frame.start_line} ({func})", frame.file_name, frame.start_line, func


def _inner_source(eqn) -> tuple[str, str, int, str]:
    """For an equation run whole (shard_map, pmap): the first user line inside its body."""
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
            jaxpr = getattr(sub, "jaxpr", sub)
            for inner in getattr(jaxpr, "eqns", ()):
                got = _source(inner)
                if got[0]:
                    return got
                got = _inner_source(inner)
                if got[0]:
                    return got
    return "", "", 0, ""


def _ns(eqn) -> str:
    return str(eqn.source_info.name_stack)


# JAX's tracing machinery: never the line a report should name, even as the library's line.
_MACHINERY = re.compile(r"jax[/\\]_src[/\\](interpreters[/\\]|core\.py|pjit\.py|api\.py|"
                        r"api_util\.py|linear_util\.py|source_info_util\.py|"
                        r"traceback_util\.py|dispatch\.py|custom_derivatives\.py|"
                        r"ad_checkpoint\.py|lax[/\\]control_flow)")


def _library_line(eqn) -> str:
    """``linalg.py:1234 (norm)``: the innermost frame of JAX's own library (not its tracing
    machinery) that wrote `eqn`, for equations no user frame is recorded for."""
    try:
        frames = eqn.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return ""
    for f in frames:
        if not _MACHINERY.search(f.file_name):
            return f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"
    return ""
