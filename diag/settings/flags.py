"""Numerics settings audit: XLA flags, framework settings, and what each one risks.

Why: "same code, different math" is mostly settings nobody looks at. An f32 matmul is one
bf16 pass on TPU and TF32 on NVIDIA GPUs under JAX's defaults; torch's
`set_float32_matmul_precision('medium')` permits bf16 (on some CPUs too: oneDNN decides per
CPU, measured both ways);
`--xla_allow_excess_precision` (default true) lets XLA keep bf16 values in f32; and an
unknown flag in XLA_FLAGS kills every XLA process outright. This module

- parses XLA_FLAGS and LIBTPU_INIT_ARGS (`parse_flags`) and validates XLA_FLAGS in a
  throwaway process (`validate_xla_flags`), naming the bad flag instead of crashing;
- judges settings with `RULES`, a table of rules as data (one row per rule, with the
  one-line why and what to set instead), on the host without importing a framework
  (`host_findings`, stored in every run.json);
- names the flag a framework aborted on from its stderr (`flag_error`), for the workers
  `diag.worker.host` starts (`diag env`'s included).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from diag.errors import UsageError

__all__ = [
    "BadFlag",
    "Flag",
    "Rule",
    "RULES",
    "parse_flags",
    "host_flags",
    "validate_xla_flags",
    "flag_error",
    "findings",
    "host_findings",
    "check_flags",
]

FLAG_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
VALIDATE_TIMEOUT = 120.0
ENV_TIMEOUT = 300.0


class BadFlag(UsageError):
    """A flag in XLA_FLAGS or LIBTPU_INIT_ARGS that XLA would refuse (exit 2).

    Attributes:
      var: the environment variable holding it.
      flag: the offending flag (or token) as written.
    """

    def __init__(self, var: str, flag: str, why: str):
        self.var, self.flag = var, flag
        super().__init__(
            f"{var}: bad flag '{flag}': {why}; fix or remove it (every XLA "
            f"process started with it would abort)"
        )


@dataclass(frozen=True)
class Flag:
    """One `--name=value` token. A bare `--name` is a boolean set to true."""

    name: str
    value: str
    raw: str


def parse_flags(text: str | None, var: str = "XLA_FLAGS") -> list[Flag]:
    """Split an XLA_FLAGS-style string (shell quoting) into flags.

    Raises:
      BadFlag: unbalanced quotes, or a token that does not start with `--` (XLA would take
        it for the name of a flags file and abort when it cannot read it).
    """
    if not text or not text.strip():
        return []
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise BadFlag(var, text, f"cannot split it as shell words ({e})") from None
    flags = []
    for tok in tokens:
        if not tok.startswith("--") or len(tok) == 2:
            raise BadFlag(var, tok, "a flag must look like --name=value")
        name, eq, value = tok[2:].partition("=")
        flags.append(Flag(name=name, value=value if eq else "true", raw=tok))
    return flags


def host_flags(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """XLA_FLAGS and LIBTPU_INIT_ARGS parsed, for run.json: never raises.

    Returns:
      {var: {"raw": str | None, "flags": {name: value}}, plus "error" when unparsable}.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var in FLAG_VARS:
        entry: dict[str, Any] = {"raw": environ.get(var), "flags": {}}
        try:
            entry["flags"] = {f.name: f.value for f in parse_flags(environ.get(var), var)}
        except BadFlag as e:
            entry["error"] = str(e)
        out[var] = entry
    return out


_UNKNOWN = re.compile(r"Unknown flags? in (\w+): (\S+)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag (\S+?)\.?$", re.M)
_NOT_FILE = re.compile(
    r'Could not open file "([^"]*)" to read flags for environment '
    r'variable "(\w+)"'
)


def flag_error(stderr: str) -> BadFlag | None:
    """The bad flag an XLA process named before it aborted, if it named one."""
    if m := _UNKNOWN.search(stderr):
        return BadFlag(m.group(1), m.group(2), "XLA does not know this flag")
    if m := _BAD_VALUE.search(stderr):
        return BadFlag(
            "XLA_FLAGS",
            f"--{m.group(2)}={m.group(1)}",
            f"XLA cannot interpret the value '{m.group(1)}' for --{m.group(2)}",
        )
    if m := _NOT_FILE.search(stderr):
        return BadFlag(m.group(2), m.group(1), "a flag must look like --name=value")
    return None


_VALIDATE = "import jax.numpy as jnp; jnp.ones(2).sum().block_until_ready()"


def validate_xla_flags(
    environ: Mapping[str, str] | None = None, timeout: float = VALIDATE_TIMEOUT
) -> str:
    """Start a throwaway JAX process (CPU only) with these XLA_FLAGS and run a tiny op.

    XLA aborts any process whose XLA_FLAGS hold an unknown flag or a bad value; doing it
    here turns that into one line naming the flag. CPU only, so a TPU is never held.

    Returns:
      What was checked, for the report ("ok", or why it was skipped).

    Raises:
      BadFlag: XLA refused a flag (named in the message).
    """
    environ = dict(os.environ if environ is None else environ)
    if not parse_flags(environ.get("XLA_FLAGS"), "XLA_FLAGS"):
        return "nothing to validate (XLA_FLAGS unset)"
    from diag.backends import framework_installed

    if not framework_installed("jax"):
        return "not validated (jax is not installed)"
    env = {k: v for k, v in environ.items() if k != "LIBTPU_INIT_ARGS"}
    env["JAX_PLATFORMS"] = "cpu"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _VALIDATE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return f"not validated (the check did not finish within {timeout:g} s)"
    if proc.returncode == 0:
        return "ok: a JAX process started with these XLA_FLAGS"
    bad = flag_error(proc.stderr)
    if bad is not None:
        raise bad
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return f"not validated (the check process failed: {tail})"


# ---------------------------------------------------------------------------------------------
# Rules


def _truthy(v: Any) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on") if v is not None else False


def _set(v: Any) -> bool:
    return v is not None


_LOW_JAX_PRECISION = ("default", "fastest", "bfloat16", "tensorfloat32", "bfloat16_3x", "high")


@dataclass(frozen=True)
class Rule:
    """A numerics setting as data: where it is read, when it is risky, why, what instead.

    Attributes:
      id: a stable name for the rule.
      source: `env` (an environment variable), `xla` (a flag in XLA_FLAGS or
        LIBTPU_INIT_ARGS), `jax` (a jax.config value), `torch` or `torch_xla` (a setting
        that framework's worker reported); framework rules apply only where its worker ran.
      key: the variable, flag or setting name.
      risky: value (None when unset) -> whether to flag it.
      severity: `risk` (changes results) or `note` (worth knowing).
      why: one line: what it does to the numbers.
      instead: what to set instead.
      needs: backends one of which must be present (TF32 is NVIDIA only).
      unset: what unset means, for display.
    """

    id: str
    source: str
    key: str
    risky: Callable[[Any], bool]
    severity: str
    why: str
    instead: str
    needs: tuple[str, ...] = ()
    unset: str | None = None


RULES: tuple[Rule, ...] = (
    Rule(
        "xla-excess-precision",
        "xla",
        "xla_allow_excess_precision",
        lambda v: v is None or _truthy(v),
        "note",
        "XLA may keep bf16 intermediates in float32, so two parts of a bf16 program (a "
        "sampler's softmax and its argmax) can disagree, e.g. on the top token",
        "--xla_allow_excess_precision=false in XLA_FLAGS (and LIBTPU_INIT_ARGS on TPU) "
        "where bf16 results must be reproducible",
        unset="unset (default true)",
    ),
    Rule(
        "xla-cpu-fast-math",
        "xla",
        "xla_cpu_enable_fast_math",
        _truthy,
        "risk",
        "XLA:CPU may reassociate, approximate functions and assume no NaN/Inf",
        "--xla_cpu_enable_fast_math=false",
    ),
    Rule(
        "xla-gpu-fast-min-max",
        "xla",
        "xla_gpu_enable_fast_min_max",
        _truthy,
        "risk",
        "XLA:GPU min/max may drop NaNs, hiding a diverged value",
        "--xla_gpu_enable_fast_min_max=false",
    ),
    Rule(
        "xla-use-bf16",
        "env",
        "XLA_USE_BF16",
        _truthy,
        "risk",
        "torch_xla stores and computes every float32 tensor as bf16",
        "unset XLA_USE_BF16; cast to torch.bfloat16 explicitly where bf16 is wanted",
    ),
    Rule(
        "xla-downcast-bf16",
        "env",
        "XLA_DOWNCAST_BF16",
        _truthy,
        "risk",
        "torch_xla computes float32 as bf16 (and float64 as float32) on the device",
        "unset XLA_DOWNCAST_BF16; cast explicitly where bf16 is wanted",
    ),
    # torch_xla 2.9 still reads both variables (it only warns that XLA_USE_BF16 "will be
    # deprecated"); its worker measures whether float32 really was computed in bf16.
    Rule(
        "torch-xla-float32-as-bf16",
        "torch_xla",
        "float32_computed_as_bf16",
        _truthy,
        "risk",
        "measured: torch_xla computed a float32 tensor in bf16 (1 + 2^-12 came back as 1), "
        "so every float32 result on the XLA device has bf16's 8-bit significand",
        "unset XLA_USE_BF16 and XLA_DOWNCAST_BF16; cast to torch.bfloat16 explicitly",
    ),
    Rule(
        "torch-xla-matmul-precision",
        "torch_xla",
        "mat_mul_precision",
        lambda v: v is not None and v != "highest",
        "risk",
        "torch_xla's 'default' float32 matmul is one bf16 pass on TPU ('high': three)",
        "torch_xla.backends.set_mat_mul_precision('highest') where float32 matmuls matter",
        needs=("torch-xla-tpu", "torch-xla-cuda"),
    ),
    Rule(
        "nvidia-tf32-override",
        "env",
        "NVIDIA_TF32_OVERRIDE",
        lambda v: _set(v) and v != "0",
        "note",
        "only NVIDIA_TF32_OVERRIDE=0 forbids TF32; any other value leaves each library's "
        "default, so float32 matmuls may still run in TF32 (10-bit significands)",
        "NVIDIA_TF32_OVERRIDE=0 to keep float32 matmuls in float32 on NVIDIA GPUs",
    ),
    Rule(
        "torch-tf32-cublas-override",
        "env",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        _truthy,
        "risk",
        "torch uses TF32 for every float32 cuBLAS matmul whatever allow_tf32 says",
        "unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    ),
    Rule(
        "jax-matmul-precision-env",
        "env",
        "JAX_DEFAULT_MATMUL_PRECISION",
        lambda v: _set(v) and v.lower() in _LOW_JAX_PRECISION,
        "note",
        "on TPU and NVIDIA GPUs this lets every float32 matmul run in bf16 or TF32",
        "JAX_DEFAULT_MATMUL_PRECISION=highest, or precision=HIGHEST on the matmuls that "
        "need float32",
    ),
    Rule(
        "jax-matmul-precision",
        "jax",
        "jax_default_matmul_precision",
        lambda v: v is None or str(v).lower() in _LOW_JAX_PRECISION,
        "risk",
        "float32 matmuls use DEFAULT precision: one bf16 pass on TPU, TF32 on NVIDIA GPUs",
        "jax.config.update('jax_default_matmul_precision', 'highest'), or "
        "precision=HIGHEST on the matmuls that need float32",
        needs=("jax-gpu", "jax-tpu"),
        unset="unset (DEFAULT)",
    ),
    Rule(
        "jax-debug-nans",
        "jax",
        "jax_debug_nans",
        _truthy,
        "note",
        "every op's output is checked for NaN and re-run op by op: slow, for debugging",
        "leave jax_debug_nans off outside a NaN hunt (diag nan locates the first NaN)",
    ),
    Rule(
        "torch-matmul-precision",
        "torch",
        "float32_matmul_precision",
        lambda v: _set(v) and v != "highest",
        "risk",
        "'high' lets float32 matmuls use TF32 and 'medium' bf16 (measured: torch-cpu "
        "multiplies in bf16 under 'medium' on some CPUs, float32 on others)",
        "torch.set_float32_matmul_precision('highest')",
    ),
    Rule(
        "torch-cuda-tf32",
        "torch",
        "cuda.matmul.allow_tf32",
        _truthy,
        "risk",
        "float32 matmuls on NVIDIA Ampere and later run in TF32 (10-bit significands)",
        "torch.backends.cuda.matmul.allow_tf32 = False",
        needs=("torch-cuda",),
    ),
    Rule(
        "torch-cudnn-tf32",
        "torch",
        "cudnn.allow_tf32",
        _truthy,
        "risk",
        "float32 convolutions on NVIDIA Ampere and later run in TF32 (torch's default)",
        "torch.backends.cudnn.allow_tf32 = False",
        needs=("torch-cuda",),
    ),
    Rule(
        "torch-bf16-reduction",
        "torch",
        "cuda.matmul.allow_bf16_reduced_precision_reduction",
        _truthy,
        "note",
        "bf16 matmuls may reduce partial sums in bf16 instead of float32",
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False",
        needs=("torch-cuda",),
    ),
    Rule(
        "torch-fp16-reduction",
        "torch",
        "cuda.matmul.allow_fp16_reduced_precision_reduction",
        _truthy,
        "note",
        "fp16 matmuls may reduce partial sums in fp16 instead of float32",
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False",
        needs=("torch-cuda",),
    ),
    Rule(
        "torch-nondeterministic",
        "torch",
        "deterministic_algorithms",
        lambda v: v is False,
        "note",
        "CUDA kernels with atomics may give different float results run to run",
        "torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8",
        needs=("torch-cuda",),
    ),
)


def _merged_xla(flags: Mapping[str, Any]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for var in FLAG_VARS:
        merged.update((flags.get(var) or {}).get("flags", {}))
    return merged


def findings(facts: Mapping[str, Any], rules: tuple[Rule, ...] = RULES) -> list[dict]:
    """The rules that fire on these facts, as dicts a report shows.

    Args:
      facts: {"env": {VAR: value}, "flags": host_flags(), "jax", "torch", "torch_xla":
        settings or None, "backends": names of the backends present}. A framework's
        rule is skipped when that framework's settings are None (not examined), a
        rule with `needs` when none of those backends is present.
    """
    sources = {
        "env": facts.get("env") or {},
        "xla": _merged_xla(facts.get("flags") or {}),
        "jax": facts.get("jax"),
        "torch": facts.get("torch"),
        "torch_xla": facts.get("torch_xla"),
    }
    present = set(facts.get("backends") or ())
    out = []
    for rule in rules:
        values = sources[rule.source]
        if values is None or (rule.needs and not present & set(rule.needs)):
            continue
        value = values.get(rule.key)
        if not rule.risky(value):
            continue
        setting = {
            "env": rule.key,
            "xla": f"--{rule.key}",
            "jax": f"jax.config.{rule.key}",
            "torch": f"torch {rule.key}",
            "torch_xla": f"torch_xla {rule.key}",
        }[rule.source]
        out.append(
            {
                "rule": rule.id,
                "severity": rule.severity,
                "setting": setting,
                "value": (rule.unset or "unset") if value is None else str(value),
                "why": rule.why,
                "instead": rule.instead,
            }
        )
    return out


def host_findings(environ: Mapping[str, str] | None = None) -> list[dict]:
    """Findings from environment variables and XLA flags alone (no framework, no process)."""
    environ = os.environ if environ is None else environ
    return findings({"env": dict(environ), "flags": host_flags(environ)})


def check_flags(specs: list, env: dict[str, str], ab_env: dict[str, str]) -> None:
    """Refuse XLA_FLAGS/LIBTPU_INIT_ARGS that a JAX worker would abort on (as `diag env`).

    Only when a JAX backend is among `specs`. Syntax is checked here, on the host; whether
    XLA knows each flag is checked by JAX itself when it lists its devices (`diag.worker.host`,
    started with the same environment, no extra process), and for an A/B run whose B side
    changes the flags, in one throwaway JAX process (`validate_xla_flags`).

    Args:
      specs: the candidate backends (`diag.backends.BackendSpec`).

    Raises:
      BadFlag: naming the variable and the flag (exit 2).
    """
    from diag.backends import framework_installed

    if not any(s.framework == "jax" for s in specs):
        return
    b_env = {**env, **ab_env}
    for var in FLAG_VARS:
        parse_flags(env.get(var), var)
        parse_flags(b_env.get(var), var)
    if any(b_env.get(v) != env.get(v) for v in FLAG_VARS) and framework_installed("jax"):
        validate_xla_flags(b_env)
