"""A real training run across frameworks: one small transformer, same weights, N steps.

See docs/train.md. `import diag.train` loads no framework: `jax_model` and `torch_model` are
imported only where they run (a worker, `compare_ports`).
"""

from diag.train.config import PORT_BUGS, TrainConfig, init_params, make_batches, with_bug
from diag.train.hunt import locate_nan
from diag.train.ports import PortReport, compare_ports
from diag.train.reference import run_reference

__all__ = [
    "TrainConfig",
    "PORT_BUGS",
    "init_params",
    "make_batches",
    "with_bug",
    "run_reference",
    "compare_ports",
    "PortReport",
    "locate_nan",
]
