"""A workload for the torchrun self-test of `diag nodes` (examples/slurm_torchrun.sh SELFTEST=1).

It plays two faults diag does not put there itself, keyed on the rank:
- rank 1's "device" returns a wrong finite value (a silent data corruption): a hardware suspect;
- rank 2's code leaves ``torch.set_float32_matmul_precision("medium")`` on (a numerics setting
  the other ranks do not have): misconfigured, with the keys that differ, whether or not its
  bits differ (on CPUs without bf16 matmul units "medium" computes float32 anyway).
"""

import torch
import torch.distributed as dist

RANK = dist.get_rank() if dist.is_initialized() else 0
if RANK == 2:
    torch.set_float32_matmul_precision("medium")


def work(x):
    """tanh(x @ x.T), 1e-3 too large in one element on rank 1."""
    y = torch.tanh(x @ x.T)
    if RANK == 1:
        y[0, 0] += 1e-3
    return y
