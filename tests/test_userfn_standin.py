"""A user's file that imports a framework this environment lacks still loads in a worker of
the other framework (torch_xla's own venv has no JAX): the absent imports get stand-ins, an
installed framework's missing submodule stays missing, and nothing stays in sys.modules."""

from __future__ import annotations

import sys
import textwrap

import pytest

from diag.userfn import load
from diag.userfn.load import UserFunctionError
from diag.userfn.standin import JAX_MODULES, standing_in

SOURCE = textwrap.dedent(
    """
    import nosuchfw_32x
    import nosuchfw_32x.numpy as xnp
    from nosuchfw_32x import nn
    import torch

    @nosuchfw_32x.jit
    def jitted(x):
        return xnp.sum(x)

    class Model(nn.Module):
        pass

    def torch_fn():
        return (lambda x: x * 2.0), (torch.arange(4.0),)
    """
)


def test_a_file_importing_an_absent_framework_loads(tmp_path):
    path = tmp_path / "mixed.py"
    path.write_text(SOURCE)
    with pytest.raises(UserFunctionError, match="No module named 'nosuchfw_32x'"):
        load(f"{path}:torch_fn")
    u = load(f"{path}:torch_fn", frozenset({"nosuchfw_32x"}))
    assert u.fn(*u.args).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert not any(m.startswith("nosuchfw_32x") for m in sys.modules)


def test_an_installed_frameworks_missing_submodule_stays_missing():
    pytest.importorskip("jax")
    with standing_in(JAX_MODULES), pytest.raises(ModuleNotFoundError):
        import jax.no_such_submodule_32x  # noqa: F401
