"""Which frames of a program are the user's and which an installed library's (PyTorch, JAX).

Claim: a file under any site-packages folder (a venv's as much as the base interpreter's,
whose site-packages lies under its standard library) is a library's, never the user's; diag's
own probe ops count as the user's wherever diag is installed; the standard library and
torch are neither. Before this held, every library in a venv counted as the user's code, and a
decision taken inside transformers lost its library line on a fresh venv.
"""

from __future__ import annotations

import os
import sysconfig

import pytest

pytest.importorskip("torch")

from diag.interp import torch_source  # noqa: E402


@pytest.mark.parametrize(
    "path",
    [
        "/home/me/.venvs/work/lib/python3.11/site-packages/transformers/generation/lp.py",
        "/usr/lib/python3/dist-packages/flax/linen/module.py",
        os.path.join(sysconfig.get_paths()["purelib"], "optax", "_src", "alias.py"),
    ],
)
def test_an_installed_library_is_never_the_users_code(path):
    assert not torch_source.is_user_file(path)
    assert torch_source._is_library_file(path)


def test_the_users_script_and_diags_probe_ops_are_the_users():
    assert torch_source.is_user_file("/home/me/project/train.py")
    probe_op = os.path.join(torch_source._DIAG, "backends", "torch_backend.py")
    assert torch_source.is_user_file(probe_op)
    kernel = os.path.join(torch_source._DIAG, "interp", "torch_mode.py")
    assert not torch_source.is_user_file(kernel)


def test_the_standard_library_and_torch_are_neither():
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "functools.py")
    assert not torch_source.is_user_file(stdlib)
    import torch

    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
    assert not torch_source.is_user_file(torch_file)
    assert not torch_source._is_library_file(torch_file)


def test_a_library_frame_below_the_users_line_is_named(tmp_path):
    """A function in a venv-like site-packages folder, called from a user file: the stack walk
    returns the user's line and the library's ``file.py:LINE (function)``."""
    lib = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "somelib"
    lib.mkdir(parents=True)
    (lib / "warp.py").write_text(
        "from diag.interp.torch_source import lines_from_stack\n\n"
        "def warp():\n    return lines_from_stack()\n"
    )
    user = tmp_path / "project" / "sample.py"
    user.parent.mkdir()
    user.write_text("def sample(warp):\n    return warp()\n")
    ns_lib: dict = {}
    exec(compile((lib / "warp.py").read_text(), str(lib / "warp.py"), "exec"), ns_lib)
    ns_user: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), ns_user)
    (path, line, func), library = ns_user["sample"](ns_lib["warp"])
    assert (path, line, func) == (str(user), 2, "sample")
    assert library == "warp.py:4 (warp)"


def test_jax_counts_an_installed_library_in_a_venv_as_a_library():
    """JAX's own rule excludes its folder and the standard library's, under which a base
    interpreter's site-packages lies but a venv's does not: diag adds site-packages, so an
    optax frame in a venv is never the user's line (a NaN born in Adam's update is placed at
    the user's step, with optax's line beside it)."""
    pytest.importorskip("jax")
    from diag.interp import jax_source

    venv_optax = "/home/me/.venvs/work/lib/python3.11/site-packages/optax/_src/transform.py"
    assert not jax_source.is_user_file(venv_optax)
    assert jax_source.is_user_file("/home/me/project/train.py")
    probe_op = os.path.join(torch_source._DIAG, "backends", "jax_backend.py")
    assert jax_source.is_user_file(probe_op)
