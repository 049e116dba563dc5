"""A/B setting experiments: the B side's environment and the compiled-HLO difference.

`diag run --ab NAME=VALUE` runs each backend twice, as is (A) and with the setting (B), each
in its own worker (XLA reads its flags once, at start-up).
"""

from __future__ import annotations

import os
import re

from diag.errors import UsageError

__all__ = ["parse_ab", "AB_SUFFIX"]


# The A/B variant of a backend runs as `<backend>+B`: same device, the setting applied.
AB_SUFFIX = "+B"
HLO_EXCERPT_LINES = 40
# An HLO instruction: `[ROOT] [%]name = type opcode(operands), ...`.
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def _hlo_ops(lines: list[str]) -> dict[str, int]:
    """Instruction counts by opcode in HLO text."""
    counts: dict[str, int] = {}
    for line in lines:
        m = _HLO_OP.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def parse_ab(assignments: list[str] | None,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an A/B experiment's B side from `NAME=VALUE` assignments.

    `XLA_FLAGS` and `LIBTPU_INIT_ARGS` values are appended to the flags in effect on the A
    side (`base`: the environment the A worker gets, a library caller's `env=` included);
    a JAX config name (`jax_default_matmul_precision=highest`) becomes the environment
    variable JAX reads it from at start-up (`JAX_DEFAULT_MATMUL_PRECISION`).

    Args:
      assignments: `NAME=VALUE` strings.
      base: the A side's environment (default: this process's).

    Raises:
      UsageError: an assignment that is not NAME=VALUE.
    """
    base = os.environ if base is None else base
    env: dict[str, str] = {}
    for item in assignments or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--ab expects NAME=VALUE (an environment variable or a JAX "
                             f"config option), got {item!r}")
        if name.lower().startswith("jax_"):
            name = name.upper()
        if name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
            current = env.get(name, base.get(name, ""))
            value = f"{current} {value}".strip()
        env[name] = value
    return env
