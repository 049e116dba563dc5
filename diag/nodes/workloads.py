"""What `diag nodes` runs on every device: diag's builtin workloads and the user's own.

A workload is deterministic by contract: the scan votes on its output bits, so the same input
must give the same bits on every healthy device of one kind.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diag.errors import UsageError
from diag.nodes.seeded import weights
from diag.numerics import as_dtype, dtype_name

#: Distinct seeded inputs per workload; repeat r uses input r % INPUTS_PER_WORKLOAD.
INPUTS_PER_WORKLOAD = 2


@dataclass(frozen=True)
class Workload:
    """One deterministic workload: ``build()`` returns ``fn(x) -> array`` (jax imported).

    Attributes:
      name: shown in reports; a builtin name or the user's ``module:function``.
      shape: the input's shape; diag draws the inputs from the scan seed.
      dtype: the input's dtype name.
      build: called once, after jax is imported, to get the callable.
      version: part of the golden key; bump when a builtin's computation changes.
      build_torch: the same computation written in torch (builtins,
        `diag.nodes.torch_workloads`); a user's workload is one callable for both, given the
        framework's own array.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    build: Callable[[], Callable]
    version: str = "1"
    build_torch: Callable[[], Callable] | None = None

    def build_for(self, framework: str) -> Callable:
        """The callable for `framework` ("jax" or "torch")."""
        if framework == "jax":
            return self.build()
        if self.build_torch is None:
            raise UsageError(f"workload {self.name} has no {framework} version")
        return self.build_torch()

    def key(self, seed: int) -> str:
        """What a golden digest depends on besides hardware and library versions."""
        return f"{self.name}/v{self.version}/seed={seed}/{list(self.shape)}/{self.dtype}"

    def make_input(self, seed: int, index: int) -> np.ndarray:
        """Input `index` (deterministic in seed, workload name and index; host numpy)."""
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode()), index])
        return rng.standard_normal(self.shape).astype(as_dtype(self.dtype))


# The builtins are built from the JAX implementations of diag's ops (diag.probes), the
# same functions `diag run` judges against the oracle: one definition of each op. Rebuilding
# them on those ops left every builtin's compiled HLO and output bits as they were (jax-cpu
# 0.10.2, seeds 0, 1, 7), so golden digests saved by an older diag still apply (version "1").


def _matmul_chain(dtype: str) -> Callable[[], Callable]:
    @functools.cache  # one jitted function per process: compiled once
    def build():
        import jax
        import jax.numpy as jnp

        from diag.backends import jax_backend
        from diag.probes import matmul as matmul_op

        matmul = matmul_op.on_jax(jax_backend)  # the framework's default precision
        ws = weights(1, [(128, 128)] * 4, dtype)

        def chain(x):
            for w in ws:  # tanh keeps every layer's values in [-1, 1]: no overflow in bf16
                x = jnp.tanh(matmul(x, w))
            return x

        return jax.jit(chain)

    return build


@functools.cache
def _softmax():
    import jax

    from diag.backends import jax_backend
    from diag.probes import softmax as softmax_op

    softmax = softmax_op.on_jax(jax_backend)  # over the last axis
    return jax.jit(lambda x: softmax(4.0 * x))


@functools.cache
def _train_step():
    """One SGD step of the backend's tanh MLP (`diag.probes.train_step.on_jax`), flattened into one
    array (new weights, then the loss) so one digest covers all of it."""
    import jax
    import jax.numpy as jnp

    from diag.backends import jax_backend
    from diag.probes import train_step as train_step_op

    w1, w2 = weights(2, [(32, 64), (64, 10)], "float32")
    step = train_step_op.on_jax(
        jax_backend, lr=0.1
    )  # labels are drawn from the input: deterministic

    def flat_step(x):
        out = step(x, w1, w2)
        return jnp.concatenate([out["w1"].ravel(), out["w2"].ravel(), out["loss"][None]])

    return jax.jit(flat_step)


def _torch(name: str, *args) -> Callable[[], Callable]:
    """The torch version of a builtin (`diag.nodes.torch_workloads`, imported when built)."""

    def build():
        from diag.nodes import torch_workloads  # loads torch

        return getattr(torch_workloads, name)(*args)

    return build


#: diag's golden workloads, in scan order.
BUILTIN_WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "matmul_bf16",
            (128, 128),
            "bfloat16",
            _matmul_chain("bfloat16"),
            build_torch=_torch("matmul_chain", "bfloat16"),
        ),
        Workload(
            "matmul_f32",
            (128, 128),
            "float32",
            _matmul_chain("float32"),
            build_torch=_torch("matmul_chain", "float32"),
        ),
        Workload("softmax", (64, 1024), "float32", _softmax, build_torch=_torch("softmax")),
        Workload("train_step", (64, 32), "float32", _train_step, build_torch=_torch("train_step")),
    )
}


def builtin_workload(name: str) -> Workload:
    """A builtin workload by name.

    Raises:
        UsageError: no builtin has that name.
    """
    if name not in BUILTIN_WORKLOADS:
        raise UsageError(
            f"unknown workload {name!r}; builtins: {', '.join(BUILTIN_WORKLOADS)}, "
            "or your own as module:function or path/to/file.py:function"
        )
    return BUILTIN_WORKLOADS[name]


def load_workload(spec: str, shape: Sequence[int] = (128, 128), dtype: str = "float32") -> Workload:
    """A builtin name, or the user's ``module:function`` / ``path/file.py:function``.

    The user's callable receives a device-committed array of `shape` and `dtype` (a jax array,
    or a torch tensor on the rank's device under ``--framework torch``) and returns an array;
    diag calls it once per device to compile (not judged), then once per device per repeat.
    It must be deterministic: the scan votes on its output bits.

    Raises:
        UsageError: the spec is malformed, the module cannot be imported or has no such
            callable, or the shape/dtype is invalid.
    """
    if ":" not in spec:
        return builtin_workload(spec)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UsageError(f"--workload {spec!r}: expected module:function or file.py:function")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"--input-shape {list(shape)}: expected positive sizes")
    dtype = dtype_name(dtype)

    def build():
        try:
            if module_name.endswith(".py"):
                path = Path(module_name)
                if not path.is_file():
                    raise UsageError(f"--workload {spec!r}: no file {path}")
                mod_spec = importlib.util.spec_from_file_location(
                    f"_diag_workload_{path.stem}", path
                )
                module = importlib.util.module_from_spec(mod_spec)
                mod_spec.loader.exec_module(module)
            else:
                if os.getcwd() not in sys.path:  # the `diag` script does not put cwd on the path
                    sys.path.insert(0, os.getcwd())
                module = importlib.import_module(module_name)
        except ImportError as e:
            raise UsageError(f"--workload {spec!r}: cannot import {module_name}: {e}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UsageError(f"--workload {spec!r}: {module_name} has no callable {attr!r}")
        return fn

    return Workload(spec, shape, dtype, build, build_torch=build)
