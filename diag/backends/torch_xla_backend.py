"""PyTorch/XLA backend (cpu, and the same code for tpu/cuda). Imported only inside a worker.

The torch math is each op module's `on_torch`, unchanged: the same op builders run on
torch_xla's lazy device, so an agreement record between `torch-cpu` and `torch-xla-cpu`
shows what compiling the same torch code with XLA does to its results. Only what differs
between eager and lazy execution lives here: opening the device, waiting for a result
(`torch_xla.sync()` traces, compiles and runs the pending graph), the matmul precision knob
(torch_xla's own `set_mat_mul_precision`, not torch's) and the compiled HLO.

torch_xla needs its own torch (torch-xla 2.9.0 wants torch 2.9.x; beside another torch the
import fails), so this module usually runs under another Python than diag's host
(`diag run --python torch-xla=PATH`, `diag.worker.host`). torch_xla reads XLA_FLAGS when it is
imported and appends `--xla_cpu_enable_fast_math=false`; `setup` reports the flags as XLA
got them. Verified on CPU only (torch 2.9.0, torch-xla 2.9.0).

HLO: when a worker starts, this module adds `--xla_dump_to` (a private temporary folder,
removed at exit) to XLA_FLAGS unless the user set one, so `hlo_text` can return the
optimised HLO XLA compiled for a case, which is where a setting such as
`--xla_allow_excess_precision=false` shows (`torch_xla._XLAC._get_xla_tensors_hlo` gives only
the HLO before XLA's passes, which such a setting does not change). Dumping costs
milliseconds per compiled graph.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shlex
import shutil
import tempfile
import time


def _dump_folder() -> str:
    """The folder XLA dumps compiled modules to: the user's `--xla_dump_to`, or a private one
    added to XLA_FLAGS (before torch_xla is imported: XLA reads its flags once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for token in shlex.split(flags):
        if token.startswith("--xla_dump_to="):
            return token.split("=", 1)[1]
    folder = tempfile.mkdtemp(prefix="diag-xla-dump-")
    atexit.register(shutil.rmtree, folder, True)
    _ADDED.extend([f"--xla_dump_to={folder}", "--xla_dump_hlo_as_text"])
    os.environ["XLA_FLAGS"] = " ".join([flags, *_ADDED]).strip()
    return folder


_ADDED: list[str] = []  # the flags diag added (not a setting of the user's: not recorded)
_DUMP = _dump_folder()

import torch  # noqa: E402
import torch_xla  # noqa: E402  (reads XLA_FLAGS, appends --xla_cpu_enable_fast_math=false)
import torch_xla.backends  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from diag.backends import torch_backend as _torch  # noqa: E402
from diag.backends.base import Prepared  # noqa: E402

FRAMEWORK = "torch_xla"
# The op implementations it runs: torch's (`on_torch` of each op module), on the lazy device.
IMPLEMENTATION = "torch"
# PJRT device types diag names as platforms (torch_xla's PJRT_DEVICE values, lower case).
_PLATFORMS = ("cpu", "tpu", "cuda")
# torch_xla's own matmul precision levels for float32 inputs (process-wide).
_PRECISION = {"default": None, "high": "high", "highest": "highest"}
# Environment variables torch_xla 2.9 still reads that change its numbers, with a probe of
# what each did in this process (measured in `setup`: they are easy to leave set by accident).
_SETTING_VARS = (
    "XLA_USE_BF16",
    "XLA_DOWNCAST_BF16",
    "XLA_USE_32BIT_LONG",
    "PJRT_DEVICE",
    "XLA_IR_DEBUG",
    "XLA_HLO_DEBUG",
)
_before_case: set[str] = set()


def discover() -> list[str]:
    """CPU always (a worker of its own can open it), and the device torch_xla would pick.

    Starting the runtime here makes XLA read XLA_FLAGS in the discovery process, so a flag it
    refuses is named before any run folder exists (`diag.worker.host`), as for JAX.
    """
    found = ["cpu"]
    xr.global_runtime_device_count()
    chosen = (xr.device_type() or "").lower()
    if chosen in _PLATFORMS and chosen not in found:
        found.append(chosen)
    elif torch_xla._found_libtpu and xr.tpu.num_available_chips() > 0:
        found.append("tpu")
    return found


def _float32_rounded_to_bf16() -> bool:
    """Whether float32 tensors are computed as bf16 here (XLA_USE_BF16/XLA_DOWNCAST_BF16):
    1 + 2^-12 survives a multiply by one in float32, not in bf16."""
    x = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32).to(_torch.device())
    return float((x * 1.0).cpu().item()) != 1.0 + 2.0**-12


def setup(platform: str) -> dict:
    # PJRT_DEVICE picks the device type for the whole process, before the runtime starts.
    os.environ["PJRT_DEVICE"] = platform.upper()
    device = torch_xla.device()
    _torch.use_device(device)
    kind = xm.xla_device_hw(device)
    return {
        "device": {
            "platform": platform,
            "kind": f"{kind} (torch_xla {device})",
            "id": device.index or 0,
            "count": xr.global_runtime_device_count(),
        },
        "framework": {
            "name": "torch_xla",
            "version": torch_xla.__version__,
            "torch": torch.__version__,
        },
        "settings": {
            # XLA_FLAGS as XLA got them, torch_xla's --xla_cpu_enable_fast_math=false
            # included, less the private dump folder diag added (a new path every run).
            "XLA_FLAGS": " ".join(
                t for t in shlex.split(os.environ.get("XLA_FLAGS", "")) if t not in _ADDED
            ),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
            **{var: os.environ.get(var) for var in _SETTING_VARS},
            "float32_computed_as_bf16": _float32_rounded_to_bf16(),
            "mat_mul_precision": torch_xla.backends.get_mat_mul_precision(),
            # torch's own setting; torch_xla does not read it (its knob is mat_mul_precision).
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
    }


put = _torch.put
get = _torch.get


def block(x) -> None:
    """Trace, compile and run every pending graph, and wait until it has run.

    `torch_xla.sync(wait=True)` alone returns before an asynchronous execution ends
    (measured, torch_xla 2.9 on CPU: a 1024^3 bf16 product "took" 0.1 ms); the device wait
    is what makes run times real.
    """
    torch_xla.sync()
    xm.wait_device_ops()


def _dumped() -> set[str]:
    return {p for p in glob.glob(os.path.join(_DUMP, "*after_optimizations.txt"))}


def prepare(fn, args):
    """Lazy tensors compile at the first `sync`: run once, and report that time (tracing,
    XLA compilation and one run) as compile time. Later runs reuse the compiled graph."""
    global _before_case
    _before_case = _dumped()
    t0 = time.perf_counter()
    block(fn(*args))
    return Prepared(lambda: fn(*args), time.perf_counter() - t0)


def hlo_text(fn, args) -> str | None:
    """The optimised HLO XLA compiled for this case (every graph since `prepare`), or None
    when XLA dumped nothing for it."""
    paths = sorted(_dumped() - _before_case)
    if not paths:
        return None
    return "\n".join(open(p, encoding="utf-8", errors="replace").read() for p in paths)


device = _torch.device


@contextlib.contextmanager
def precision_scope(precision: str):
    """torch_xla's matmul precision while the block runs, then the previous one.

    torch_xla ignores `torch.set_float32_matmul_precision`; its own setting is read when the
    graph is lowered, at `sync`, so the block's graph is synced while the setting is in effect.
    """
    setting = _PRECISION[precision]
    if setting is None:
        yield
        return
    previous = torch_xla._XLAC._xla_get_mat_mul_precision()
    torch_xla._XLAC._xla_set_mat_mul_precision(setting)
    try:
        yield
        torch_xla.sync()
    finally:
        torch_xla._XLAC._xla_set_mat_mul_precision(previous)
