"""Where a JAX equation came from: the user's line, or the library line no user frame covers.

Reads JAX's private source-info API; importing it is guarded here, so a JAX without it fails
with an `InterpError` naming what is missing.
"""

from __future__ import annotations

import functools
import os
import re

import jax

from diag.interp import InterpError, installed_library

try:
    from jax._src import source_info_util as siu
    from jax.extend import core as jcore
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise InterpError(
        f"this JAX ({jax.__version__}) lacks the internals diag's op-by-op "
        f"evaluation reads ({e}); use jax 0.4.30 or later"
    ) from e

Literal = jcore.Literal


def source(eqn) -> tuple[str, str, int, str]:
    """("file.py:LINE (function)", full path, line, function) of the user's line for `eqn`."""
    try:
        frames = siu.user_frames(eqn.source_info.traceback)
        frame = next((f for f in frames if is_user_file(f.file_name)), None)
    except Exception:  # noqa: BLE001 - private API; an unknown line is not fatal
        frame = None
    if frame is None:
        return "", "", 0, ""
    base = os.path.basename(frame.file_name)
    func = frame.function_name.rsplit(".", 1)[-1]  # a qualname on Python >= 3.11
    return f"{base}:{frame.start_line} ({func})", frame.file_name, frame.start_line, func


def inner_source(eqn) -> tuple[str, str, int, str]:
    """For an equation run whole (shard_map, pmap): the first user line inside its body."""
    for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
            jaxpr = getattr(sub, "jaxpr", sub)
            for inner in getattr(jaxpr, "eqns", ()):
                got = source(inner)
                if got[0]:
                    return got
                got = inner_source(inner)
                if got[0]:
                    return got
    return "", "", 0, ""


def name_stack(eqn) -> str:
    """The equation's transformation name stack (``jvp(...)``, ``transpose(...)``)."""
    return str(eqn.source_info.name_stack)


# JAX's tracing machinery: never the line a report should name, even as the library's line.
MACHINERY = re.compile(
    r"jax[/\\]_src[/\\](interpreters[/\\]|core\.py|pjit\.py|api\.py|"
    r"api_util\.py|linear_util\.py|source_info_util\.py|"
    r"traceback_util\.py|dispatch\.py|custom_derivatives\.py|"
    r"ad_checkpoint\.py|lax[/\\]control_flow)"
)
# jnp's operator and array plumbing (`a + b`, `x.mean()`): never the library line that helps.
PLUMBING = re.compile(r"jax[/\\]_src[/\\]numpy[/\\]")


def library_line(eqn) -> str:
    """``linalg.py:1234 (norm)``: the innermost frame of JAX's own library (not its tracing
    machinery) that wrote `eqn`, for equations no user frame is recorded for."""
    try:
        frames = eqn.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return ""
    for f in frames:
        if not MACHINERY.search(f.file_name):
            return f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"
    return ""


def library_beside(eqn, src: str) -> str:
    """The innermost library frame that wrote `eqn` (optax's Adam, jax.nn.softmax), if it is
    not the user's own line `src` or jnp's operator plumbing."""
    try:
        frames = eqn.source_info.traceback.frames
    except Exception:  # noqa: BLE001 - private API
        return ""
    for f in frames:
        if MACHINERY.search(f.file_name) or PLUMBING.search(f.file_name):
            continue
        line = f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"
        user = src.split(" (", 1)[0]
        return "" if line.split(" (", 1)[0] == user or is_user_file(f.file_name) else line
    return ""


@functools.cache
def is_user_file(path: str) -> bool:
    """Whether `path` is the user's code: what JAX counts as such (not JAX's, not the standard
    library's) that is not an installed library's either.

    JAX excludes its own folder and the standard library's; a base interpreter's
    site-packages lies under the latter, a venv's does not, so in a venv JAX counts optax's
    and flax's files as the user's, and a NaN born in optax's Adam was placed at
    ``transform.py:300`` instead of the user's update line. diag's own probe ops stay the
    user's wherever diag is installed.
    """
    try:
        jax_says = siu.is_user_filename(path)
    except Exception:  # noqa: BLE001 - private API
        return False
    p = os.path.normcase(os.path.abspath(path))
    return jax_says and not installed_library(p)


def where(eqn, outer: tuple) -> tuple[str, str]:
    """(user line, library line) of an equation. JAX library code (a derivative rule, a jitted
    library function) is traced without the user's frames: then the user line is that of the
    innermost enclosing equation (`outer`, outermost first) that has one."""
    src = source(eqn)[0] or inner_source(eqn)[0]
    if src:
        return src, library_beside(eqn, src)
    for o in reversed(outer):
        src = source(o)[0]
        if src:
            break
    return src, library_line(eqn)
