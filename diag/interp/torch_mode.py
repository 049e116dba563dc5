"""The dispatch-mode skeleton both PyTorch policies run in: one function, every aten op.

A `TorchDispatchMode` sits below autograd, so it sees the aten ops of the forward pass and the
ones autograd's engine runs for the backward pass (`torch.autograd.set_multithreading_enabled
(False)` keeps the engine on the calling thread, where the mode is active). An op runs during
the backward pass exactly when `torch._C._current_autograd_node()` is set; its forward line
comes from the tag `NodeLines` puts on each autograd node as the forward pass creates it (or
from anomaly mode's traceback when the user turned that on; diag does not: it costs ~5x).
Forward lines come from the Python stack at dispatch time, skipping torch's frames and diag's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diag.interp.torch_source import NodeLines, module_stack, source_from_node, source_from_stack


class OpMode(TorchDispatchMode):
    """A dispatch mode that knows where each op runs; policies subclass it.

    A policy implements ``__torch_dispatch__`` and may call `observe` with an op's inputs
    and outputs (the policy callback; no-op here). `where` names the current op's line, phase
    and module path; `running` is the context one call of the user's function runs in.
    """

    def __init__(self) -> None:
        super().__init__()
        self.key = object()  # marks the tags this run put on autograd nodes
        self.modules: list[str] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in `torch._disable_dynamo`, which imports
        # torch._dynamo (and sympy: ~1.2 s) on the first op and costs a frame switch on every
        # op. The modes do not run under torch.compile (its regions are opaque to them anyway).
        return False

    def where(self, node=None) -> tuple[tuple[str, int, str], str, str]:
        """((file, line, function), phase, path) of the op being dispatched now.

        Args:
            node: the autograd node running (``torch._C._current_autograd_node()``), when the
                caller already read it.
        """
        if node is None:
            node = torch._C._current_autograd_node()
        if node is None:
            return source_from_stack(), "forward", "/".join(self.modules)
        return source_from_node(node, self.key), "backward", type(node).__name__

    def observe(self, func, ins: list, outs: list) -> None:
        """The policy callback: an op's input and output tensors after it ran (the diverge
        policy calls it with every float op it measured; each tensor's float64 shadow is then
        `shadow_of(t)`). Does nothing here: a subclass of a policy overrides it."""

    @contextlib.contextmanager
    def running(self) -> Iterator[OpMode]:
        """Module hooks, the single-threaded autograd engine, node tags and this mode."""
        with (
            module_stack(self.modules),
            torch.autograd.set_multithreading_enabled(False),
            NodeLines(self.key),
            self,
        ):
            yield self
