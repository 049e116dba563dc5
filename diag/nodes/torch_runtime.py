"""The scan's torch runtime: torch.distributed under torchrun or SLURM, gloo on CPU, NCCL on GPU.

Each rank scans one device: ``cuda:LOCAL_RANK`` when CUDA is there (NCCL), else the CPU (gloo);
a single-process torch scan covers every local CUDA device, or the CPU. The process group comes
from the launcher's environment (torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK; under ``srun`` SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID stand in for the rank
variables when MASTER_ADDR and MASTER_PORT are exported) or from ``--coordinator HOST:PORT
--num-processes N --process-id I``. torch is imported here, inside functions only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import numpy as np

from diag.errors import UsageError
from diag.nodes.local import Device
from diag.nodes.result import NodeScanError
from diag.nodes.workloads import Workload

__all__ = ["TORCHRUN_PREFIX", "TorchRuntime", "detect_framework", "import_torch"]

#: torchrun (torch.distributed.elastic) sets variables with this prefix in every worker
#: (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, ...); any of them, or RANK with LOCAL_RANK
#: and WORLD_SIZE, says the scan was started by torchrun.
TORCHRUN_PREFIX = "TORCHELASTIC_"

#: torch numerics switches, as attribute paths under ``torch`` (read when present: the
#: fp32_precision switches are torch >= 2.9, allow_tf32 the older spelling of the same).
TORCH_SWITCHES = (
    "backends.cuda.matmul.allow_tf32",
    "backends.cudnn.allow_tf32",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cudnn.deterministic",
    "backends.cudnn.benchmark",
    "backends.mkldnn.enabled",
    "backends.fp32_precision",
    "backends.cuda.matmul.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision",
    "backends.cudnn.conv.fp32_precision",
    "backends.mkldnn.conv.fp32_precision",
)


def detect_framework(environ: Mapping[str, str] | None = None) -> str:
    """ "torch" when a torchrun-started process's variables are set, else "jax"."""
    env = os.environ if environ is None else environ
    if any(k.startswith(TORCHRUN_PREFIX) for k in env):
        return "torch"
    return "torch" if all(v in env for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) else "jax"


def import_torch():
    """Import torch.

    Raises:
        NodeScanError: torch is not installed.
    """
    try:
        import torch
    except ImportError:
        raise NodeScanError(
            "diag nodes --framework torch needs torch: pip install 'diag[torch]'"
        ) from None
    return torch


def _rank_env(env: Mapping[str, str]) -> dict[str, int]:
    """RANK, WORLD_SIZE and LOCAL_RANK from torchrun's variables, or SLURM's under srun."""
    pairs = (
        ("RANK", "SLURM_PROCID"),
        ("WORLD_SIZE", "SLURM_NTASKS"),
        ("LOCAL_RANK", "SLURM_LOCALID"),
    )
    out = {}
    for name, slurm in pairs:
        value = env.get(name, env.get(slurm))
        if value is None and name != "LOCAL_RANK":
            raise UsageError(
                f"--distributed --framework torch: {name} is not set; start diag "
                "with torchrun (or srun with MASTER_ADDR and MASTER_PORT "
                "exported), or pass --coordinator HOST:PORT --num-processes N "
                "--process-id I"
            )
        out[name] = int(value or 0)
    return out


class TorchRuntime:
    """`diag.nodes.local.Runtime` on torch (and torch.distributed across ranks)."""

    framework = "torch"

    def __init__(
        self,
        platform: str | None,
        distributed: bool,
        coordinator=None,
        num_processes=None,
        process_id=None,
        timeout: int = 60,
    ):
        torch = self.torch = import_torch()
        if platform not in (None, "cpu", "gpu", "cuda"):
            raise UsageError(f"--platform {platform}: --framework torch scans cpu or gpu")
        self.cuda = platform != "cpu" and torch.cuda.is_available()
        if platform in ("gpu", "cuda") and not self.cuda:
            raise UsageError(f"--platform {platform}: torch sees no CUDA device")
        self.distributed = distributed
        self.process_index, self.process_count = 0, 1
        self.local_rank = 0
        if distributed:
            self._init(coordinator, num_processes, process_id, timeout)
        elif any(v is not None for v in (coordinator, num_processes, process_id)):
            raise UsageError("--coordinator/--num-processes/--process-id need --distributed")

    def _init(self, coordinator, num_processes, process_id, timeout: int) -> None:
        import torch.distributed as dist

        explicit = (coordinator, num_processes, process_id)
        if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
            raise UsageError(
                "--coordinator, --num-processes and --process-id go together; "
                "give all three, or none to use torchrun's environment"
            )
        env = (
            _rank_env(os.environ)
            if coordinator is None
            else {
                "RANK": process_id,
                "WORLD_SIZE": num_processes,
                "LOCAL_RANK": int(os.environ.get("LOCAL_RANK", 0)),
            }
        )
        if coordinator is None and not all(v in os.environ for v in ("MASTER_ADDR", "MASTER_PORT")):
            raise UsageError(
                "--distributed --framework torch: MASTER_ADDR and MASTER_PORT are "
                "not set; start diag with torchrun, or export them under srun"
            )
        self.local_rank = env["LOCAL_RANK"]
        if self.cuda:
            self.torch.cuda.set_device(self.local_rank % self.torch.cuda.device_count())
        try:
            dist.init_process_group(
                "nccl" if self.cuda else "gloo",
                init_method=f"tcp://{coordinator}" if coordinator else "env://",
                rank=env["RANK"],
                world_size=env["WORLD_SIZE"],
                timeout=timedelta(seconds=timeout),
            )
        except (ValueError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NodeScanError(f"torch.distributed could not start ({first})") from None
        self.process_index, self.process_count = dist.get_rank(), dist.get_world_size()

    def local_devices(self) -> list[Device]:
        torch = self.torch
        if not self.cuda:
            return [
                Device(
                    self.process_index if self.distributed else 0, "cpu", "cpu", torch.device("cpu")
                )
            ]
        idx = (
            [self.local_rank % torch.cuda.device_count()]
            if self.distributed
            else list(range(torch.cuda.device_count()))
        )
        return [
            Device(
                self.process_index if self.distributed else i,
                torch.cuda.get_device_name(i),
                "gpu",
                torch.device("cuda", i),
            )
            for i in idx
        ]

    def all_devices(self) -> list[tuple[int, int]]:
        if not self.distributed:
            return [(d.id, 0) for d in self.local_devices()]
        return [(rank, rank) for rank in range(self.process_count)]  # one device per rank

    def build(self, workload: Workload) -> Callable:
        return workload.build_for("torch")

    def put(self, x: np.ndarray, device: Device) -> Any:
        from diag.nodes.torch_workloads import from_numpy

        return from_numpy(x).to(device.handle)

    def ready(self, y: Any) -> None:
        device = getattr(y, "device", None)
        if self.cuda and device is not None and device.type == "cuda":
            self.torch.cuda.synchronize(device)  # that device's stream, not the current one

    def to_numpy(self, y: Any) -> np.ndarray:
        from diag.nodes.torch_workloads import to_numpy

        return to_numpy(y)

    def allgather(self, a: np.ndarray) -> np.ndarray:
        """Every rank's `a` ([P, *a.shape]); travels as bytes (NCCL needs CUDA tensors)."""
        import torch.distributed as dist

        a = np.ascontiguousarray(a)
        raw = self.torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
        if self.cuda:
            raw = raw.cuda()
        outs = [self.torch.empty_like(raw) for _ in range(self.process_count)]
        dist.all_gather(outs, raw)
        got = np.stack([o.cpu().numpy() for o in outs])
        return got.view(a.dtype).reshape((self.process_count,) + a.shape)

    def versions(self) -> dict[str, str]:
        return {"torch": str(self.torch.__version__)}

    def settings(self) -> dict[str, str]:
        """torch's versions (CUDA, cuDNN, NCCL), numerics switches, threads, CPU capability,
        device kinds, and the measured arithmetic of a float32 matmul on this rank's device."""
        torch = self.torch
        out = {
            "torch": str(torch.__version__),
            "torch.version.cuda": str(torch.version.cuda),
            "torch float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
            "torch cpu capability": str(torch.backends.cpu.get_cpu_capability()),
            "torch threads": str(torch.get_num_threads()),
        }
        with warnings.catch_warnings():  # allow_tf32 is deprecated for fp32_precision
            warnings.simplefilter("ignore")
            for path in TORCH_SWITCHES:
                value: Any = torch
                for part in path.split("."):
                    value = getattr(value, part, None)
                if value is not None:
                    out[f"torch.{path}"] = str(value)
        if self.cuda:
            out["cudnn"] = str(torch.backends.cudnn.version())
            nccl = getattr(torch.cuda, "nccl", None)
            out["nccl"] = ".".join(map(str, nccl.version())) if nccl else "none"
        out["device kinds"] = ", ".join(sorted({d.kind for d in self.local_devices()}))
        out["measured float32 matmul"] = self._matmul_fingerprint()
        return out

    def _matmul_fingerprint(self) -> str:
        from diag.arith.precision import fingerprint

        dev = self.local_devices()[0].handle
        torch = self.torch
        fp = fingerprint(
            lambda a, b: (torch.from_numpy(a).to(dev) @ torch.from_numpy(b).to(dev)).cpu()
        )
        return f"{fp.label} (input bits {list(fp.input_bits)}, accumulator {fp.accumulator})"

    def shutdown(self) -> None:
        if self.distributed:
            try:
                self.torch.distributed.destroy_process_group()
            except Exception:  # best effort; the verdict is already computed
                pass
