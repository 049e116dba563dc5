"""Per-op tables from captured sessions, without a server.

XLA traces (JAX, PyTorch/XLA) are converted with the `xprof` package's
`raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})`: the trace viewer's JSON
events. On a CPU-only profile XProf's per-op tools (`hlo_stats`, `op_profile`) are empty, but
every executed HLO instruction is an event whose `args` carry `hlo_module` and `hlo_op`;
those are summed per instruction, and on a profile that has device planes (`/device:...`)
only the device's events count (the host's launch events would count twice). The
instruction's dtype and shape come from the module's optimised HLO (`diag.trace.hlo`).

Kineto traces (eager PyTorch, `torch.profiler` with `record_shapes=True`) are read as they
are: each `cpu_op` event carries `Input Dims` and `Input type`; time is self time (an op's
duration less its child ops'), so `aten::matmul` -> `aten::mm` is counted once.

`raw_to_tool_data` is a module upstream calls unsupported: every call to it is guarded, and
a failure becomes `summary_error` ("trace captured, summary unavailable: ..."), never a
failed case.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

from diag.trace import hlo

__all__ = ["summarise_session", "xla_events", "TOP_OPS"]

TOP_OPS = 10


def _unavailable(e: Exception) -> dict[str, Any]:
    return {"summary_error": f"trace captured, summary unavailable: {type(e).__name__}: {e}"[:300]}


def summarise_session(framework: str, folder: Path, hlo_text: str | None) -> dict[str, Any]:
    """The per-op summary of one captured session.

    Args:
      framework: `jax` (an XSpace, `*.xplane.pb`) or `torch` (a Kineto trace).
      folder: the session folder.
      hlo_text: the optimised HLO of the traced program, for dtypes and shapes (JAX).

    Returns:
      {"converter", "calls", "per_call_us", "ops": [{"name", "module", "count", "total_us",
      "per_call_us", "dtype", "shape"}, ... top `TOP_OPS` by time]}, or {"summary_error"}.
    """
    try:
        if framework == "torch":
            return _kineto_summary(folder)
        return _xla_summary(folder, hlo_text)
    except Exception as e:  # an unsupported converter API, a trace it cannot read
        return _unavailable(e)


def xla_events(folder: Path) -> list[dict[str, Any]]:
    """The trace_viewer events xprof converts a session's XSpace files to.

    Raises:
      FileNotFoundError: the session holds no `*.xplane.pb`.
      ImportError, or whatever the converter raises: xprof is absent or changed its API.
    """
    from xprof.convert import raw_to_tool_data as r2t

    paths = sorted(str(p) for p in Path(folder).glob("*.xplane.pb"))
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb file in {folder}")
    data, _content_type = r2t.xspace_to_tool_data(paths, "trace_viewer", {})
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    if not data:
        raise ValueError("xprof returned no trace_viewer data")
    return json.loads(data)["traceEvents"]


def _xprof_version() -> str:
    try:
        from xprof import version

        return getattr(version, "__version__", "?")
    except Exception:
        return "?"


def _xla_summary(folder: Path, hlo_text: str | None) -> dict[str, Any]:
    events = xla_events(folder)
    process = {
        e.get("pid"): (e.get("args") or {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    on_device = [e for e in ops if str(process.get(e.get("pid"), "")).startswith("/device:")]
    ops = on_device or ops
    shapes = hlo.instructions(hlo_text) if hlo_text else {}
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for e in ops:
        args = e["args"]
        key = (str(args.get("hlo_module", "")), str(args["hlo_op"]))
        row = table.setdefault(
            key,
            {
                "name": key[1],
                "module": key[0],
                "count": 0,
                "total_us": 0.0,
                **_dtype_shape(shapes, key[1]),
            },
        )
        row["count"] += 1
        row["total_us"] += float(e.get("dur", 0.0))
    # One execution of the program is one run_id; the timed repeats are the calls.
    per_call: dict[tuple, float] = {}
    for e in ops:
        key = (e["args"].get("hlo_module"), e["args"].get("run_id"))
        per_call[key] = per_call.get(key, 0.0) + float(e.get("dur", 0.0))
    calls = len(per_call) or 1
    return _finish(
        table.values(),
        calls,
        f"xprof {_xprof_version()} trace_viewer",
        device="device" if on_device else "host",
        call_us_samples=[round(v, 3) for v in per_call.values()],
    )


def _dtype_shape(shapes: dict[str, dict[str, str]], name: str) -> dict[str, str]:
    info = shapes.get(name)
    return (
        {"dtype": info["dtype"], "shape": info["shape"], "opcode": info["opcode"]}
        if info
        else {"dtype": "", "shape": "", "opcode": ""}
    )


def _finish(rows, calls: int, converter: str, **extra: Any) -> dict[str, Any]:
    """The summary: rows by time, per-call figures; `extra` holds `call_us_samples`, each
    call's own time (a measurement keeps its samples: its spread says what is noise)."""
    rows = sorted(rows, key=lambda r: -r["total_us"])
    for r in rows:
        r["total_us"] = round(r["total_us"], 3)
        r["per_call_us"] = round(r["total_us"] / calls, 3)
    return {
        "converter": converter,
        "calls": calls,
        "per_call_us": round(sum(r["total_us"] for r in rows) / calls, 3),
        "ops": rows[:TOP_OPS],
        "n_ops": len(rows),
        **extra,
    }


def _kineto_events(folder: Path) -> list[dict[str, Any]]:
    paths = sorted(Path(folder).glob("*.pt.trace.json*"))
    if not paths:
        raise FileNotFoundError(f"no .pt.trace.json file in {folder}")
    opener = gzip.open if paths[0].suffix == ".gz" else open
    with opener(paths[0], "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def _kineto_summary(folder: Path) -> dict[str, Any]:
    events = [e for e in _kineto_events(folder) if e.get("ph") == "X"]
    marks = [e for e in events if str(e.get("name", "")).startswith("diag:")]
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op"),
        key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0)),
    )
    if marks:  # only what ran inside the case's annotation
        lo, hi = marks[0]["ts"], marks[0]["ts"] + marks[0].get("dur", 0)
        ops = [e for e in ops if lo <= e["ts"] <= hi]
    # Self time: each op's duration less its direct children's, by nesting on one thread.
    self_us = [float(e.get("dur", 0)) for e in ops]
    depth = [0] * len(ops)
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and (
            ops[stack[-1]].get("tid") != e.get("tid")
            or ops[stack[-1]]["ts"] + ops[stack[-1]].get("dur", 0) <= e["ts"]
        ):
            stack.pop()
        if stack:
            self_us[stack[-1]] -= float(e.get("dur", 0))
            depth[i] = depth[stack[-1]] + 1
        stack.append(i)
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for e, t in zip(ops, self_us):
        args = e.get("args") or {}
        dims, types = args.get("Input Dims") or [], args.get("Input type") or []
        shape = ", ".join(str(list(d)) for d in dims if d)
        dtype = ", ".join(dict.fromkeys(str(x) for x in types if x))
        key = (str(e["name"]), shape)
        row = table.setdefault(
            key,
            {
                "name": key[0],
                "module": "",
                "count": 0,
                "total_us": 0.0,
                "dtype": dtype,
                "shape": shape,
                "opcode": "",
            },
        )
        row["count"] += 1
        row["total_us"] += max(t, 0.0)
    top_level = Counter(e["name"] for e, d in zip(ops, depth) if d == 0)
    calls = min(top_level.values()) if top_level else 1
    # Call k: the k-th run of each top-level op (each call runs the same ops, in order).
    seen: Counter[str] = Counter()
    per_call = [0.0] * calls
    for e, d in zip(ops, depth):
        if d == 0:
            if seen[e["name"]] < calls:
                per_call[seen[e["name"]]] += float(e.get("dur", 0.0))
            seen[e["name"]] += 1
    return _finish(
        table.values(),
        calls,
        "torch.profiler (Kineto trace)",
        device="host",
        call_us_samples=[round(v, 3) for v in per_call] if top_level else [],
    )
