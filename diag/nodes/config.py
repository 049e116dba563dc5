"""Why a host differs: each process's configuration fingerprint, compared across processes.

A host that runs with another XLA flag, another torch precision switch or another library
version computes other bits, or (worse) the same bits today and other bits on tomorrow's
model. The vote sees only bits; this module sees settings. Every process collects
`fingerprint` (framework-free keys here, the framework's own through `Runtime.settings`), the
fingerprints are gathered as JSON text, and `compare` names each process whose value of some
key differs from the value a strict majority of processes holds: **misconfigured**, with the
keys, its values and the majority's. That is judged apart from the vote (a misconfigured host
may compute identical bits, e.g. ``--xla_cpu_enable_fast_math=true`` on the builtins with jax
0.10.2 CPU; a hardware suspect may be configured like everyone else).

Keys that differ per process by design (rank variables, ports, host names, visible-device
lists) are not collected.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from diag.nodes.result import NodeVote
from diag.settings.environment import NUMERICS_ENV_VARS
from diag.settings.flags import FLAG_VARS, host_flags

__all__ = [
    "EXTRA_ENV_VARS",
    "LIBRARIES",
    "UNSET",
    "compare",
    "decode",
    "encode",
    "fingerprint",
    "judge",
    "misconfigured_lines",
    "reason",
]

UNSET = "(unset)"

#: Variables beyond `diag.settings.environment.NUMERICS_ENV_VARS` that change CPU or collective
#: arithmetic (vector ISA, thread counts, oneDNN's fp32 math mode, NCCL's algorithms).
EXTRA_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "TORCH_CUDNN_V8_API_ENABLED",
    "JAX_ENABLE_X64",
)

#: Per-process by design: never a misconfiguration.
_PER_PROCESS = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")

#: Installed distributions whose version changes the arithmetic (CUDA, cuDNN, NCCL, libtpu).
LIBRARIES = (
    "numpy",
    "ml_dtypes",
    "diag",
    "libtpu",
    "libtpu-nightly",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "nvidia-cudnn-cu12",
    "nvidia-cublas-cu12",
    "nvidia-nccl-cu12",
    "nvidia-cuda-runtime-cu12",
    "torch-xla",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fingerprint(
    settings: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's configuration: `settings` (the framework's, `Runtime.settings`) plus
    Python, library versions, CPU model, numerics environment variables and every flag of
    XLA_FLAGS / LIBTPU_INIT_ARGS (one key per flag).

    Returns:
      {key: value} with string values; an unset variable reads `UNSET`.
    """
    env = os.environ if environ is None else environ
    out = {"python": platform.python_version(), "cpu model": _cpu_model()}
    for lib in LIBRARIES:
        try:
            out[f"version {lib}"] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            pass
    for var in sorted(set(NUMERICS_ENV_VARS + EXTRA_ENV_VARS) - set(FLAG_VARS) - set(_PER_PROCESS)):
        out[f"env {var}"] = env.get(var, UNSET)
    for var, parsed in host_flags(env).items():
        for name, value in parsed["flags"].items():
            out[f"{var} --{name}"] = value
        if parsed.get("error"):
            out[var] = parsed["raw"] or ""
    out.update(settings)
    return out


def compare(
    fingerprints: Sequence[Mapping[str, str]], processes: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Name every process whose configuration differs from the majority's.

    Args:
      fingerprints: one `fingerprint` per process, in process order.
      processes: ``{process_index, host}`` per process, same order.

    Returns:
      (misconfigured, summary). ``misconfigured``: one entry per process that differs,
      ``{process_index, host, differs: [{key, value, majority}], reason}``; ``majority`` is
      None for a key no strict majority of processes agrees on (then every process is named
      for it: with two processes that differ, both). ``summary``: ``{processes,
      keys, reference: {key: majority value}, no_majority: [keys]}``.
    """
    n = len(fingerprints)
    keys = sorted(set().union(*fingerprints)) if fingerprints else []
    reference, no_majority = {}, []
    differs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for key in keys:
        values = [fp.get(key, UNSET) for fp in fingerprints]
        ((top, count),) = Counter(values).most_common(1)
        decided = 2 * count > n and count >= 2
        if decided:
            reference[key] = top
        elif n > 1 and len(set(values)) > 1:
            no_majority.append(key)
        for p, value in enumerate(values):
            if n > 1 and (value != top or not decided) and len(set(values)) > 1:
                differs[p].append(
                    {"key": key, "value": value, "majority": top if decided else None}
                )
    out = []
    for p, items in enumerate(differs):
        if items:
            out.append(
                {
                    **{k: processes[p][k] for k in ("process_index", "host")},
                    "differs": items,
                    "reason": reason(items),
                }
            )
    return out, {
        "processes": n,
        "keys": len(keys),
        "reference": reference,
        "no_majority": no_majority,
    }


def judge(
    vote: NodeVote, fingerprints: Sequence[Mapping[str, str]]
) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Compare the processes' configurations beside the vote, and mark who is both.

    Args:
      vote: what `diag.nodes.analyze` said of the bits (its ``suspects`` and ``hosts`` get a
        ``misconfigured`` flag here).
      fingerprints: one `fingerprint` per process, in process order.

    Returns:
      (misconfigured, summary, notes): `compare`'s entries, each with ``hardware_suspect``
      (and its reason saying so when it is both), `compare`'s summary, and notes.
    """
    procs: dict[int, dict[str, Any]] = {}
    for d in vote.devices:
        procs.setdefault(
            d["process_index"], {"process_index": d["process_index"], "host": d["host"]}
        )
    order = [procs.get(p, {"process_index": p, "host": ""}) for p in range(len(fingerprints))]
    misconfigured, summary = compare(fingerprints, order)
    bad_procs = {m["process_index"] for m in misconfigured}
    hw_procs = {s["process_index"] for s in vote.suspects}
    for m in misconfigured:
        m["hardware_suspect"] = m["process_index"] in hw_procs
        if m["hardware_suspect"]:
            m["reason"] += "; its outputs differ too: misconfigured and a hardware suspect"
    for s in vote.suspects:
        s["misconfigured"] = s["process_index"] in bad_procs
        if s["misconfigured"]:
            s["reason"] += "; its process's configuration differs too (see misconfigured)"
    for h in vote.hosts:
        h["misconfigured"] = h["process_index"] in bad_procs
    notes = []
    if summary["no_majority"]:
        notes.append(
            f"no majority of processes agrees on {', '.join(summary['no_majority'])}: "
            "every process is named for it"
        )
    return misconfigured, summary, notes


def reason(items: Sequence[Mapping[str, Any]], limit: int = 6) -> str:
    """One line: "configuration differs: KEY = VALUE (majority: VALUE); ..."."""
    shown = [
        f"{i['key']} = {i['value']}"
        + (f" (majority: {i['majority']})" if i["majority"] is not None else " (no majority)")
        for i in items[:limit]
    ]
    more = f"; +{len(items) - limit} more" if len(items) > limit else ""
    return "configuration differs: " + "; ".join(shown) + more


def encode(fp: Mapping[str, str]) -> str:
    """A fingerprint as the text that travels between processes."""
    return json.dumps(dict(fp), sort_keys=True)


def decode(text: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in json.loads(text).items()}


def misconfigured_lines(nodes: Any) -> list[str]:
    """The terminal's lines for a scan's misconfigured processes (`NodeScan` or its dict)."""
    data = nodes if isinstance(nodes, Mapping) else nodes.to_dict()
    bad = data.get("misconfigured") or []
    lines = [
        f"diag: process {m['process_index']} ({m['host']}): misconfigured: {m['reason']}"
        for m in bad
    ]
    if bad:
        lines.append(
            f"diag: {len(bad)} misconfigured process(es): "
            + ", ".join(f"process {m['process_index']} ({m['host']})" for m in bad)
            + "; configuration apart from hardware: see `misconfigured` in --json"
        )
    elif (data.get("config") or {}).get("processes", 0) > 1:
        cfg = data["config"]
        lines.append(
            f"diag: all {cfg['processes']} processes have the same configuration "
            f"({cfg['keys']} keys compared)"
        )
    return lines
