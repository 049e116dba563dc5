"""The CI gate: save a run's verdict-relevant numbers as a baseline, check later runs against it.

A gate that fails on noise is switched off within a week, and one that cannot fail is worse, so
the drift rule is the tolerance policy itself (docs/baseline.md has the derivation):

* A record's verdict is a claim about ANY correct implementation: its error stays within the
  bound (`diag.tolerance`). Two correct implementations both keep it, so the error of either,
  as a ratio to the bound, may lie anywhere in [0, 1], and their outputs may differ by
  (r_old + r_new) b <= `AGREEMENT_FACTOR` b, the limit every agreement record uses. A ratio
  that moves inside [0, 1] is therefore no evidence of anything; a ratio that crosses 1 (either
  way) is: one of the two runs did not compute what it claims. The same holds for every metric
  that is judged against an allowance (`diag.gate.record_drift.RATIOS`: bound ratios, recall against
  its target, the train-step loss against its ULP screen).
* Counts of rule-breaking elements (NaN/Inf where the truth is finite, elements over the bound,
  invalid or wrong top-k rows, greedy paths that pick another token) are zero on every correct
  implementation; any change in them is drift (`diag.gate.record_drift.COUNTS`).
* A status that changes is drift; a record that disappears or appears is drift (a record the
  baseline lacks is one nothing gates: save the baseline again).
* A changed precision fingerprint (the arithmetic a backend's matmul uses at a setting) is drift,
  as is a changed arithmetic feature of its unit (`diag.arith.precision.features`: product
  exactness, extra bits, rounding, block FMA width, order, subnormals;
  `diag.gate.drift.feature_drifts`) and a changed numerics setting (XLA_FLAGS, JAX/torch
  precision config, numerics env vars).
* `bitwise=True` (same hardware, same versions: a deterministic setup) also compares the sha256
  of every output's bits and every metric exactly: any bit is drift.

This is torch._dynamo's `same()` done with the exact truth: `same()` compares the new result's
error against float64 with a multiple of the reference's error (a heuristic that alarms when the
reference happens to be very accurate); diag knows the bound every correct result keeps, so it
needs no multiplier.

The baseline is keyed by hardware (machine, CPU model, device kinds), versions (frameworks and
numerics libraries) and numerics settings. A hardware or version mismatch is reported and the
tolerance comparison still runs (the bounds hold on any hardware and version); a bitwise
comparison still compares every bit, and names the mismatch as the likely cause of each
changed output (an upgrade's effect, record by record; `diag bisect` then names the release).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from diag.errors import UsageError
from diag.gate.drift import Check, Drift, feature_drifts, features_of, setting_drifts
from diag.gate.drift import show as _show
from diag.gate.record_drift import DIGESTS, bad_values, kept_metrics, metric_drifts
from diag.records.results import RunDir, read_results

__all__ = [
    "BASELINE_SCHEMA",
    "BaselineError",
    "Check",
    "Drift",
    "build",
    "check",
    "load",
    "save",
    "write_junit",
]

BASELINE_SCHEMA = "diag.baseline/1"

#: The fields of a precision fingerprint that describe the arithmetic (not its evidence).
FINGERPRINT_FIELDS = ("label", "input_bits", "passes", "accumulator", "input_rounding")

#: The sections of a baseline's key: hardware and versions decide whether bits may be compared;
#: a change in settings is drift.
_KEY_SECTIONS = ("hardware", "versions", "settings")


class BaselineError(UsageError):
    """A baseline file (or a run folder given to `diag check`) diag cannot use: exit 2."""


# ---------------------------------------------------------------------------------------------
# Building a baseline


def record_key(rec: dict) -> str:
    """`probe | case | backend`: what identifies a record across runs."""
    return f"{rec.get('probe')} | {rec.get('case')} | {rec.get('backend')}"


def _fingerprints(meta: dict) -> dict[str, list[dict]]:
    out = {}
    for name, info in (meta.get("backends") or {}).items():
        fps = info.get("fingerprints")
        if fps:
            out[name] = [
                {k: fp.get(k) for k in ("precision", "via") + FINGERPRINT_FIELDS}
                for fp in fps
                if isinstance(fp, dict)
            ]
    return out


def run_key(meta: dict, records: list[dict] | None = None) -> dict[str, dict[str, Any]]:
    """What a baseline is valid for: hardware, versions and numerics settings of a run, and
    the source of the users' functions it ran (`code`).

    Args:
      meta: a run's run.json.
      records: its records: a user's function's record carries the sha256 of its module's
        source (`params.source_hash`), so a changed function drifts and a rerun does not.

    Returns:
      `{"hardware": ..., "versions": ..., "settings": ..., "code": ...}`, flat name -> value
      maps.
    """
    env = meta.get("environment") or {}
    hardware: dict[str, Any] = {k: env.get(k) for k in ("machine", "cpu_model")}
    versions: dict[str, Any] = {
        f"package {p}": v for p, v in sorted((env.get("packages") or {}).items()) if p != "diag"
    }
    settings: dict[str, Any] = {f"env {k}": v for k, v in sorted((env.get("env") or {}).items())}
    for name, info in sorted((meta.get("backends") or {}).items()):
        dev = info.get("device") or {}
        hardware[f"{name} device"] = f"{dev.get('platform')}/{dev.get('kind')} x{dev.get('count')}"
        fw = info.get("framework") or {}
        versions[f"{name} framework"] = " ".join(
            str(fw[k]) for k in ("name", "version", "jaxlib") if fw.get(k)
        )
        for k, v in sorted((info.get("settings") or {}).items()):
            settings[f"{name} {k}"] = v
    code = {
        f"function {p['function']} source": p["source_hash"]
        for p in (r.get("params") or {} for r in records or [])
        if isinstance(p, dict) and "source_hash" in p and "function" in p
    }
    return {"hardware": hardware, "versions": versions, "settings": settings, "code": code}


def build(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A baseline from a finished run folder.

    Args:
      run_dir: the folder `diag run` printed.

    Returns:
      The baseline document (schema `diag.baseline/1`).

    Raises:
      BaselineError: not a run folder, unreadable records, or a run that did not finish.
    """
    meta, records = _read_run(run_dir)
    _require_finished(run_dir, meta, "a baseline must hold every record")
    return {
        "schema": BASELINE_SCHEMA,
        "created": time.time(),
        "run_id": meta.get("run_id"),
        "suite": (meta.get("suite") or {}).get("name"),
        "key": run_key(meta, records),
        "backends": sorted(meta.get("backends") or {}),
        "fingerprints": _fingerprints(meta),
        "features": features_of(meta),
        "records": [
            {
                "probe": r.get("probe"),
                "case": r.get("case"),
                "backend": r.get("backend"),
                "kind": r.get("kind"),
                "op": r.get("op"),
                "dtype": r.get("dtype"),
                "params": r.get("params") or {},
                "status": r.get("status"),
                "metrics": kept_metrics(r.get("metrics") or {}),
                "digests": (r.get("metrics") or {}).get(DIGESTS),
            }
            for r in records
        ],
    }


def save(baseline: dict, path: str | os.PathLike) -> Path:
    """Write a baseline atomically (temp file + rename), sorted keys so diffs review well."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise BaselineError(
            f"{path}: cannot write the baseline ({e.strerror}); choose a writable path with -o"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a baseline file.

    Raises:
      BaselineError: missing, not JSON (truncated), not a diag baseline, or a field of the
        wrong type; the message names the file and the field.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BaselineError(
            f"{p}: no such baseline file; save one with `diag baseline RUN_DIR -o FILE`"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise BaselineError(
            f"{p}: not valid JSON{where}; the baseline is truncated or "
            "damaged: restore it or save it again with `diag baseline`"
        ) from None
    except OSError as e:
        raise BaselineError(f"{p}: cannot read the baseline ({e.strerror})") from None

    def bad(what: str) -> BaselineError:
        return BaselineError(
            f"{p}: {what}; not a baseline `diag baseline` wrote (schema "
            f"{BASELINE_SCHEMA}): save it again"
        )

    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise bad(f"schema is {got!r}")
    key = data.get("key")
    if not isinstance(key, dict) or not all(isinstance(key.get(s), dict) for s in _KEY_SECTIONS):
        raise bad("field 'key' must hold hardware, versions and settings objects")
    fps = data.get("fingerprints")
    if not isinstance(fps, dict) or not all(
        isinstance(v, list) and all(isinstance(f, dict) for f in v) for v in fps.values()
    ):
        raise bad("field 'fingerprints' must map backends to lists of objects")
    feats = data.get("features", {})  # absent from baselines saved before features were
    if not isinstance(feats, dict) or not all(
        isinstance(v, list) and all(isinstance(f, dict) for f in v) for v in feats.values()
    ):
        raise bad("field 'features' must map backends to lists of objects")
    if not isinstance(data.get("backends"), list):
        raise bad("field 'backends' must be a list")
    records = data.get("records")
    if not isinstance(records, list):
        raise bad("field 'records' must be a list")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not all(
            isinstance(rec.get(f), str) for f in ("probe", "case", "backend", "status")
        ):
            raise bad(f"record {i} lacks probe/case/backend/status strings")
        if not isinstance(rec.get("metrics"), dict):
            raise bad(f"record {i} ({record_key(rec)}): field 'metrics' must be an object")
        if (why := bad_values(rec)) is not None:
            raise bad(f"record {i} ({record_key(rec)}): {why}")
    return data


def _require_finished(run_dir: str | os.PathLike, meta: dict, why: str) -> None:
    """Refuse a run that did not finish (interrupted, aborted, killed while `running`)."""
    if (state := meta.get("state")) != "finished":
        code = meta.get("exit_code")
        ended = f" (it ended with exit code {code})" if isinstance(code, int) else ""
        raise BaselineError(
            f"{run_dir}: the run is {state!r}, not finished{ended}; {why}: "
            "rerun the suite to the end"
        )


def _read_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    run = RunDir(run_dir)
    if not run.run_json.is_file():
        raise BaselineError(
            f"{run_dir}: not a diag run folder (no run.json); pass the folder "
            "that `diag run` printed"
        )
    meta = run.read_meta()
    read = read_results(run.results_jsonl)
    if read.unreadable:
        raise BaselineError(
            f"{run.results_jsonl}: {read.problems(run.results_jsonl)[0]}; rerun the suite"
        )
    return meta, read.records


# ---------------------------------------------------------------------------------------------
# Checking a run against a baseline


def _fingerprint_drifts(old: dict, new: dict) -> list[Drift]:
    return setting_drifts(
        old,
        new,
        kind="fingerprint",
        keys=("precision", "via"),
        fields=FINGERPRINT_FIELDS,
        why="the matmul arithmetic at this setting changed",
        shown=lambda e: e.get("label"),
    )


def check(run_dir: str | os.PathLike, baseline: dict, *, bitwise: bool = False) -> Check:
    """Compare a run folder with a baseline, record by record.

    Args:
      run_dir: the run to check.
      baseline: a baseline from `load` (or `build`).
      bitwise: also require every output bit and metric to be unchanged (deterministic setups:
        same hardware, same versions). When the key's hardware or versions differ, each
        changed bit is still drift, with that difference named as its likely cause.

    Returns:
      Check.

    Raises:
      BaselineError: the run folder is unusable (damaged, or a run that did not finish), or
        the baseline is for another suite.
    """
    meta, records = _read_run(run_dir)
    _require_finished(run_dir, meta, "its missing records would read as drift")
    suite = (meta.get("suite") or {}).get("name")
    if baseline.get("suite") and suite != baseline["suite"]:
        raise BaselineError(
            f"the baseline is for suite {baseline['suite']!r}, the run is of "
            f"suite {suite!r}: check a run of the baseline's suite"
        )
    result = Check()
    one_sided = _backend_drifts(result, baseline, meta)
    portable = _key_drifts(result, baseline["key"], run_key(meta, records), one_sided, bitwise)
    _arithmetic_drifts(result, baseline, meta, one_sided)
    _record_drifts(result, baseline["records"], records, bitwise, portable)
    return result


def _backend_drifts(result: Check, baseline: dict, meta: dict) -> set[str]:
    """Backends in the baseline that did not run (drift) or ran but are new (a note).

    Returns:
      The backends on one side only: their settings and arithmetic are not compared.
    """
    old_backends = set(baseline.get("backends") or [])
    new_backends = set(meta.get("backends") or {})
    for name in sorted(old_backends - new_backends):
        result.drifts.append(
            Drift(
                f"backend {name}",
                "backend",
                "ran",
                "did not run",
                "in the baseline, absent from this run",
            )
        )
    for name in sorted(new_backends - old_backends):
        result.notes.append(f"backend {name} ran but is not in the baseline: its records are new")
    return old_backends ^ new_backends


def _key_drifts(
    result: Check, old_key: dict, key: dict, one_sided: set[str], bitwise: bool
) -> bool:
    """Compare the baseline's key with the run's: a changed setting is drift, changed hardware
    or versions a key mismatch (noted, with what it means for a bitwise check).

    Returns:
      Whether bits may be compared (same hardware and versions).
    """
    for section in (*_KEY_SECTIONS, "code"):  # `code`: absent from older baselines
        a, b = old_key.get(section) or {}, key.get(section) or {}
        for name in sorted(set(a) | set(b)):
            if a.get(name) == b.get(name) or name.split(" ")[0] in one_sided:
                continue
            if section == "code":
                result.drifts.append(
                    Drift(name, "sha256", a.get(name), b.get(name), "the function's source changed")
                )
            elif section == "settings":
                result.drifts.append(
                    Drift(
                        f"setting {name}",
                        "value",
                        a.get(name),
                        b.get(name),
                        "a numerics setting changed",
                    )
                )
            else:
                result.key_mismatch.append(
                    f"{section}: {name} {_show(a.get(name))} -> {_show(b.get(name))}"
                )
    if result.key_mismatch:
        result.notes.append(
            "the baseline was saved on other hardware or versions: records "
            "are compared by the tolerance rule (it holds on any hardware and "
            "version)"
            + (
                "; --bitwise still compares the bits: each output that changed is drift, "
                "with this difference named as its likely cause"
                if bitwise
                else ""
            )
        )
    elif bitwise:
        result.notes.append("same hardware and versions: outputs compared bit for bit")
    return not result.key_mismatch


def _arithmetic_drifts(result: Check, baseline: dict, meta: dict, one_sided: set[str]) -> None:
    """Changed precision fingerprints and matmul features of the backends both runs have."""
    result.drifts.extend(
        _fingerprint_drifts(
            {b: v for b, v in (baseline.get("fingerprints") or {}).items() if b not in one_sided},
            {b: v for b, v in _fingerprints(meta).items() if b not in one_sided},
        )
    )
    if "features" in baseline:
        result.drifts.extend(
            feature_drifts(
                {b: v for b, v in baseline["features"].items() if b not in one_sided},
                {b: v for b, v in features_of(meta).items() if b not in one_sided},
            )
        )
    else:
        result.notes.append(
            "the baseline records no matmul features (saved by an older diag): "
            "save it again to gate them"
        )


def _record_drifts(
    result: Check, baseline_records: list[dict], records: list[dict], bitwise: bool, portable: bool
) -> None:
    """Each run record against the baseline's copy (new ones are drift), then the baseline's
    records the run lacks (missing ones are drift). Across a version or hardware change, a
    bitwise check still compares the bits and names that change as each difference's likely
    cause."""
    versions_first = sorted(result.key_mismatch, key=lambda m: not m.startswith("versions"))
    likely = "" if portable else "; ".join(versions_first)
    old_records: dict[str, dict] = {}
    for rec in baseline_records:
        old_records[_unique(old_records, record_key(rec))] = rec
    seen: dict[str, dict] = {}
    for rec in records:
        k = _unique(seen, record_key(rec))
        seen[k] = rec
        drifts: list[Drift] = []
        if rec.get("status") in ("fail", "error"):
            result.failures.append(f"{k}: {rec.get('status')}: {rec.get('reason')}")
            if (old_records.get(k) or {}).get("status") == rec.get("status"):
                result.known_failures.append(result.failures[-1])
        if k not in old_records:
            result.extra.append(k)
            drifts = [
                Drift(
                    k,
                    "record",
                    None,
                    rec.get("status"),
                    "not in the baseline, so nothing gates it: save the baseline again",
                )
            ]
            result.drifts.extend(drifts)
        else:
            result.compared += 1
            drifts = metric_drifts(k, old_records[k], rec, bitwise, likely)
            result.drifts.extend(drifts)
        result.results[k] = {
            "status": rec.get("status"),
            "reason": rec.get("reason"),
            "drifts": [d.text() for d in drifts],
            "new": k not in old_records,
        }
    for k, rec in old_records.items():
        if k not in seen:
            result.missing.append(k)
            result.drifts.append(
                Drift(
                    k, "record", rec.get("status"), None, "in the baseline, missing from this run"
                )
            )
            result.results[k] = {
                "status": None,
                "reason": "missing from this run",
                "drifts": [f"{k}: missing from this run (baseline status {rec.get('status')})"],
                "new": False,
            }


def _unique(seen: dict, key: str) -> str:
    """`key`, or `key #2`, ... when a run holds the same triple more than once."""
    if key not in seen:
        return key
    n = 2
    while f"{key} #{n}" in seen:
        n += 1
    return f"{key} #{n}"


def write_junit(result: Check, path: str | os.PathLike, *, name: str = "diag check") -> Path:
    """One testcase per (probe, case, backend); see `diag.gate.junit.write`."""
    from diag.gate.junit import write

    return write(result, path, name=name)
