"""What a backend module is: the `Backend` protocol every `diag.backends.*_backend` keeps.

A backend module moves arrays to its device and back, compiles (or warms up) an op and runs
it, and owns its precision knobs and HLO; the ops themselves live in their own modules under
probes/ (`diag.probes.<op>`), each with a builder per framework: `on_jax(backend,
**op_args)` returns the function the worker times (`diag.worker.main.build`). Which ops a
backend runs follows from those builders (`BackendSpec.ops`), and one test runs every
backend x op against the oracle (tests/test_backend_conformance.py), as optax's common test
runs every transformation. Adding a backend is one module that satisfies this protocol plus
one `BackendSpec` row.

Modules satisfy a Protocol structurally (PEP 544): `isinstance(module, Backend)` checks the
members exist, a type checker checks their signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = ["Backend", "Prepared"]


class Prepared(NamedTuple):
    """What `Backend.prepare` returns.

    Attributes:
      run: a thunk that runs the op on its arguments (what the worker times).
      compile_s: seconds preparing took (compiling it, or an eager op's warm-up call).
      first: (result, seconds) when preparing was one plain call of the op, an eager op's
        warm-up; None when it compiled without running (`jax.jit` ahead of time) or when the
        call was mostly compilation (torch_xla's lazy graph). A worker may take that call as
        the op's one timed run when it alone took the repeat budget (`first_call` in the
        record's timings): it then includes what a first call costs, which for a 0.25 s call
        is a small part (an op that jits its parts compiles them on the way).
    """

    run: Callable[[], Any]
    compile_s: float
    first: tuple[Any, float] | None = None


@runtime_checkable
class Backend(Protocol):
    """The functions a worker calls on a backend module (`diag.worker.main`).

    An optional `hlo_text(fn, args) -> str | None` gives the compiled HLO an A/B run diffs.
    """

    def discover(self) -> list[str]:
        """The platforms (device types) the framework sees here."""
        ...

    def setup(self, platform: str) -> dict[str, Any]:
        """Open the platform's first device; return `device`, `framework` and `settings`
        (what run.json's `backends.<name>` records)."""
        ...

    def put(self, x: np.ndarray) -> Any:
        """A host array on the device, bit for bit."""
        ...

    def get(self, x: Any) -> np.ndarray:
        """A device array back on the host, bit for bit."""
        ...

    def block(self, x: Any) -> None:
        """Wait until `x` (an op's result, any pytree the op returns) is computed."""
        ...

    def prepare(self, fn: Callable[..., Any], args: list[Any]) -> Prepared:
        """Compile or warm up `fn` for `args` (`Prepared`)."""
        ...
