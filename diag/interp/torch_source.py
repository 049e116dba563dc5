"""Where a PyTorch op was called from: the user's line, from the stack or an autograd node.

Forward ops read the Python stack at dispatch time; backward ops read the tag `NodeLines` put on
the autograd node that runs them (or anomaly mode's traceback).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import sysconfig
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode

from diag.interp import DIAG_DIR, SITE_PACKAGES, installed_library
from diag.interp.torch_ops import flat_args

# torch's frames and the kernel's and its policies' own; diag's probe ops (diag/backends) are
# the code being hunted when the training-step probe calls the hunt, so they count as the user's.
_DIAG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = (
    os.path.normcase(os.path.dirname(torch.__file__)) + os.sep,
    *(os.path.normcase(os.path.join(_DIAG, d)) + os.sep for d in ("interp", "nan", "diverge")),
)
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"]) + os.sep
_TB_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


_USER_FILE: dict[str, bool] = {}


def is_user_file(path: str) -> bool:
    """Whether `path` is the user's own code: not torch's, not the standard library's, not an
    installed library's (transformers in a venv's site-packages), not diag's kernel. diag's
    own probe ops count as the user's wherever diag is installed.

    A base interpreter's site-packages lies under its standard library folder, a venv's does
    not: testing the stdlib prefix alone made every library in a venv the user's code, and a
    decision inside transformers lost its library line (seen as "transformers 5.24 breaks it").
    """
    r = _USER_FILE.get(path)
    if r is None:
        p = os.path.normcase(os.path.abspath(path))
        r = _USER_FILE[path] = not (
            p.startswith(_SKIP_DIRS)
            or path.startswith("<")
            or (p.startswith(_STDLIB) and not p.startswith(DIAG_DIR))
            or installed_library(p)
        )
    return r


def source_from_stack() -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame of the user's own code."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return f.f_code.co_filename, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return "", 0, ""


_LIBRARY_FILE: dict[str, bool] = {}


def _is_library_file(path: str) -> bool:
    """Whether `path` is an installed library's file, not torch's or diag's (cached per path:
    the stack is walked on every op)."""
    r = _LIBRARY_FILE.get(path)
    if r is None:
        p = os.path.normcase(os.path.abspath(path))
        r = _LIBRARY_FILE[path] = bool(SITE_PACKAGES.search(p)) and not p.startswith(_SKIP_DIRS)
    return r


def library_from_stack() -> str:
    """``modeling_gpt2.py:58 (eager_attention_forward)``: the innermost frame of an installed
    library (not torch, not diag) below the user's line, or "" when the op was called from
    the user's own code."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if is_user_file(path):
            return ""
        if _is_library_file(path):
            return f"{os.path.basename(path)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return ""


def lines_from_stack() -> tuple[tuple[str, int, str], str]:
    """`source_from_stack` and `library_from_stack` in one walk of the stack: (the user's
    (file, line, function), the innermost installed library's ``file.py:LINE (function)``
    below it, or "")."""
    src, lib = stack_lines(sys._getframe(1))
    return src, library_text(lib)


def library_text(lib: tuple[str, int, str] | None) -> str:
    """``modeling_gpt2.py:58 (eager_attention_forward)`` for a library frame of
    `stack_lines`, "" for None."""
    return "" if lib is None else f"{os.path.basename(lib[0])}:{lib[1]} ({lib[2]})"


#: Per file: 1 the user's, 2 an installed library's, 0 neither (torch's, diag's, the standard
#: library's): the stack is walked on every op, 30 frames deep under a model.
_FILE_KIND: dict[str, int] = {}


def stack_lines(
    f: FrameType | None,
) -> tuple[tuple[str, int, str], tuple[str, int, str] | None]:
    """`lines_from_stack` from frame `f` outwards, the library frame left unformatted
    (`library_text` formats it only for the ops a report shows)."""
    library = None
    kinds = _FILE_KIND
    while f is not None:
        code = f.f_code
        path = code.co_filename
        kind = kinds.get(path)
        if kind is None:
            kind = kinds[path] = 1 if is_user_file(path) else 2 if _is_library_file(path) else 0
        if kind == 1:
            return (code.co_filename, f.f_lineno, code.co_name), library
        if kind == 2 and library is None:
            library = (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return ("", 0, ""), library


class NodeLines(TorchFunctionMode):
    """Tags each autograd node made by a torch call with the user line that made it.

    Runs above autograd, where a call's outputs already have their `grad_fn`. Nodes a call
    made without returning them (inside a composite op, a custom Function's) are reached
    through `next_functions` and get the same line; tagging stops at nodes already tagged.
    """

    def __init__(self, key: object):
        super().__init__()
        self.key = key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled():  # no node is made (an optimizer's update)
            return out
        src = None
        for t in flat_args(out, []):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            stack = [node] if node is not None else []
            while stack:
                n = stack.pop()
                if n is None or type(n).__name__ == "AccumulateGrad":
                    continue
                md = n.metadata
                if md.get("diag_src", (None,))[0] is self.key:
                    continue
                if src is None:
                    src = source_from_stack()
                md["diag_src"] = (self.key, src)
                stack.extend(fn for fn, _ in n.next_functions)
        return out


def source_from_node(node, key: object) -> tuple[str, int, str]:
    """The forward line of an autograd node: our tag, else anomaly mode's traceback if the
    user turned it on."""
    try:
        md = node.metadata
    except Exception:  # noqa: BLE001 - nodes without metadata
        return "", 0, ""
    tag = md.get("diag_src")
    if tag is not None and tag[0] is key:
        return tag[1]
    tb = md.get("traceback_")
    for entry in reversed(tb or []):
        m = _TB_LINE.search(entry)
        if m and is_user_file(m["file"]):
            return m["file"], int(m["line"]), m["func"]
    return "", 0, ""


@contextlib.contextmanager
def module_stack(stack: list[str]):
    """Keep `stack` holding the class names of the nn.Modules being called, outermost first.

    Global module hooks, removed on the way out: the NaN hunt and the diverge shadow both name
    the module an op ran in (`path`) from this stack.
    """

    def enter(module, inputs):
        stack.append(type(module).__name__)

    def leave(module, inputs, output):
        if stack:
            stack.pop()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        yield stack
    finally:
        for h in hooks:
            h.remove()
