"""What `diag check` found: each drift (where, what, old -> new, and the rule it broke) and the
whole result with its exit code. Kept apart from `diag.gate.baseline` (how a baseline is built and
compared) so that renderers and the JUnit writer read a result type, not the comparison.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CAUSE_KINDS",
    "FEATURE_FIELDS",
    "Cause",
    "Check",
    "Drift",
    "causes",
    "feature_drifts",
    "features_of",
    "setting_drifts",
    "show",
]

#: The fields of a matmul's recorded features (`diag.arith.precision.features`) that describe its
#: unit's arithmetic; the evidence and the seconds it took are not compared.
FEATURE_FIELDS = (
    "product_exact",
    "extra_bits",
    "rounding",
    "block_fma_width",
    "order",
    "subnormals",
)


@dataclass(frozen=True)
class Drift:
    """One thing that changed: where, what, old and new value, and why it counts.

    Attributes:
      where: `probe | case | backend`, `fingerprint <backend> precision=.. via=..`,
        `features <backend> precision=.. via=.. dtype=..` or `setting <name>`.
      what: the metric or field (`status`, `bound_ratio`, `record`, ...).
      old: the baseline's value.
      new: this run's value.
      why: the rule it broke, in words.
    """

    where: str
    what: str
    old: Any
    new: Any
    why: str

    def text(self) -> str:
        return f"{self.where}: {self.what} {show(self.old)} -> {show(self.new)} ({self.why})"


def show(v: Any) -> str:
    """A value as a drift line shows it: 6 significant digits, a digest cut to 12 hex."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    return json.dumps(v, default=str) if not isinstance(v, str) else v


@dataclass
class Check:
    """What `check` found.

    Attributes:
      drifts: every drift, records first.
      missing: baseline records absent from the run (also drifts).
      extra: run records the baseline does not have (also drifts).
      failures: records of the run that failed or errored; those that failed in the
        baseline too are known failures, the others also appear as status drift.
      key_mismatch: `section: name old -> new` for hardware and versions (settings are drift).
      notes: what was compared and what was skipped, and why.
      compared: records compared.
      results: per run record key: (status of the record, drift texts), for JUnit.
      known_failures: records that failed or errored in the baseline too, unchanged.
    """

    drifts: list[Drift] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    key_mismatch: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    known_failures: list[str] = field(default_factory=list)

    def causes(self) -> list[Cause]:
        """The drifts grouped under the changes that explain them (`causes`)."""
        return causes(self.drifts)

    def view(self) -> dict[str, Any]:
        """What the drift view shows, as plain data (`diag.report.drift_view` renders it):
        each cause with its folded details, the key mismatches, failures, information."""
        return {
            "exit_code": self.exit_code,
            "summary": {
                "compared": self.compared,
                "drifts": len(self.drifts),
                "missing": len(self.missing),
                "new": len(self.extra),
                "failed": len(self.failures),
            },
            "causes": [
                {
                    "text": c.text(),
                    "explains": c.text()[len(c.head.text()) + 2 :],
                    "head": _drift_view(c.head),
                    "same": [_drift_view(d) for d in c.same],
                    "arithmetic": [_drift_view(d) for d in c.arithmetic],
                    "records": [
                        {"key": k, "drifts": [_drift_view(d) for d in ds]}
                        for k, ds in c.records.items()
                    ],
                }
                for c in self.causes()
            ],
            "key_mismatch": list(self.key_mismatch),
            "notes": list(self.notes),
            "failures": list(self.failures),
            "known_failures": list(self.known_failures),
        }

    @property
    def exit_code(self) -> int:
        """1 when anything drifted, else 0 (the CLI's exit code).

        A record that fails now and failed in the baseline too is a known failure: listed
        (and a JUnit failure), not drift; one that newly fails changed status, which is.
        """
        return 1 if self.drifts else 0


def _drift_view(d: Drift) -> dict[str, str]:
    return {"where": d.where, "what": d.what, "old": show(d.old), "new": show(d.new), "why": d.why}


def features_of(meta: dict) -> dict[str, list[dict]]:
    """Backend -> its recorded matmul features (run.json's `backends[name]["features"]`),
    each cut to its setting, dtype and `FEATURE_FIELDS` (what a baseline keeps)."""
    out = {}
    for name, info in (meta.get("backends") or {}).items():
        entries = (info or {}).get("features")
        if entries:
            out[name] = [
                {k: e.get(k) for k in ("precision", "via", "dtype") + FEATURE_FIELDS}
                for e in entries
                if isinstance(e, dict)
            ]
    return out


def feature_drifts(old: dict[str, list[dict]], new: dict[str, list[dict]]) -> list[Drift]:
    """Each feature of a backend's matmul unit that differs between a baseline and a run.

    The features are decided exactly (bit-for-bit predictions of crafted inputs), so the same
    unit gives the same values on every run: any change means a driver, runtime or library
    changed how the unit adds, which is drift even when every record still passes.

    Args:
      old, new: `features_of` of the baseline and of the run.

    Returns:
      One Drift per changed feature, and one per (setting, dtype) measured in one run only.
    """
    return setting_drifts(
        old,
        new,
        kind="features",
        keys=("precision", "via", "dtype"),
        fields=FEATURE_FIELDS,
        why="the matmul unit's arithmetic changed",
        shown=lambda e: "measured",
    )


def setting_drifts(
    old: dict[str, list[dict]],
    new: dict[str, list[dict]],
    *,
    kind: str,
    keys: tuple[str, ...],
    fields: tuple[str, ...],
    why: str,
    shown: Callable[[dict], Any],
) -> list[Drift]:
    """Per backend, the entries measured at each setting (`keys`) that differ in `fields`.

    Shared by fingerprints and features: one Drift per changed field, and one per setting
    measured in one run only (its value shown by `shown`).
    """
    out = []
    for backend in sorted(set(old) | set(new)):
        a = {tuple(e.get(k) for k in keys): e for e in old.get(backend, [])}
        b = {tuple(e.get(k) for k in keys): e for e in new.get(backend, [])}
        for key in sorted(set(a) | set(b), key=str):
            where = f"{kind} {backend} " + " ".join(f"{k}={v}" for k, v in zip(keys, key))
            if key not in a or key not in b:
                out.append(
                    Drift(
                        where,
                        kind,
                        shown(a[key]) if key in a else None,
                        shown(b[key]) if key in b else None,
                        "measured in only one of the two runs",
                    )
                )
                continue
            for f in fields:
                if a[key].get(f) != b[key].get(f):
                    out.append(Drift(where, f, a[key].get(f), b[key].get(f), why))
    return out


# ---------------------------------------------------------------------------------------------
# Drift said once per cause


#: Where-prefixes of drifts that belong to no record: a changed setting, fingerprint or
#: feature of a backend's arithmetic, a backend that did not run.
CAUSE_KINDS = ("setting ", "fingerprint ", "features ", "backend ")


@dataclass
class Cause:
    """One change and everything it explains, said once.

    Attributes:
      head: the change itself (a setting, a fingerprint field, a backend, or a record's first
        drift when nothing else explains it).
      same: the same change seen under other names (one `XLA_FLAGS` edit is the env var, and
        each backend's record of it: one old -> new, one cause).
      arithmetic: fingerprint and feature drifts this cause explains (a backend's matmul
        measured to add differently after the change).
      records: record key -> its drifts, for the records that drifted on the backends this
        cause reaches.
    """

    head: Drift
    same: list[Drift] = field(default_factory=list)
    arithmetic: list[Drift] = field(default_factory=list)
    records: dict[str, list[Drift]] = field(default_factory=dict)

    @property
    def backends(self) -> set[str]:
        """The backends whose own arithmetic or settings this cause names
        (`setting jax-cpu jax_default_matmul_precision` -> jax-cpu).

        A worker's copy of an environment variable the cause also names (`setting torch-cpu
        XLA_FLAGS` beside `setting env XLA_FLAGS`) is no evidence that the framework reads
        it (torch never reads XLA_FLAGS), so it reaches no backend's records.
        """
        names = [d.where.split(" ") for d in [self.head, *self.same]]
        env = {w[2] for w in names if len(w) > 2 and w[:2] == ["setting", "env"]}
        return {
            _backend_of(" ".join(w))
            for w in names
            if not (w[0] == "setting" and len(w) > 2 and w[2] in env)
        } - {""}

    def text(self) -> str:
        """One line: the change, where else it shows, and how much it explains."""
        parts = [self.head.text()]
        own = (
            [] if self.head.where.startswith(CAUSE_KINDS) else self.records.get(self.head.where, [])
        )
        if own:  # a record nothing else explains: its other drifts beside the first
            parts.append(
                "also " + ", ".join(f"{d.what} {show(d.old)} -> {show(d.new)}" for d in own)
            )
        if self.same:
            parts.append("the same change in " + ", ".join(d.where for d in self.same))
        explained = []
        if self.arithmetic:
            explained.append(f"{len(self.arithmetic)} fingerprint/feature field(s)")
        others = {k: v for k, v in self.records.items() if k != self.head.where}
        if others:
            n = sum(map(len, others.values()))
            explained.append(f"{n} drift(s) of {len(others)} record(s)")
        if explained:
            parts.append("with it: " + ", ".join(explained))
        return "; ".join(parts)


def _backend_of(where: str) -> str:
    """The backend a drift's `where` names, or "" (`setting env XLA_FLAGS`)."""
    if " | " in where:
        return where.split(" | ")[2] if where.count(" | ") >= 2 else ""
    words = where.split(" ")
    return (
        words[1]
        if len(words) > 1
        and words[0] in ("fingerprint", "features", "backend", "setting")
        and words[1] != "env"
        else ""
    )


def causes(drifts: list[Drift]) -> list[Cause]:
    """Group drifts under the changes that explain them, each cause once.

    A setting changed to the same new value under several names is one cause; a backend's
    fingerprint and feature drifts go under a setting cause that names that backend, else
    under the first of them; a record's drifts go under the cause that names its backend
    (a setting, its arithmetic, the backend itself), else they are a cause of their own
    (its first drift the head, the others folded beside it).

    Args:
      drifts: `Check.drifts`.

    Returns:
      Causes: settings first, then arithmetic, backends, then records nothing explains.
    """
    out: list[Cause] = []
    by_value: dict[tuple[str, str], Cause] = {}
    rest = []
    for d in drifts:
        if d.where.startswith("setting "):
            # Unset and empty are the same value (the env var reads None, a worker "").
            key = (show(d.old or ""), show(d.new or ""))
            if key in by_value:
                by_value[key].same.append(d)
            else:
                by_value[key] = Cause(d)
                out.append(by_value[key])
        else:
            rest.append(d)
    for d in [d for d in rest if d.where.startswith(("fingerprint ", "features "))]:
        owner = _owner(out, _backend_of(d.where))
        if owner is None:
            out.append(Cause(d))
        else:
            owner.arithmetic.append(d)
    out.extend(Cause(d) for d in rest if d.where.startswith("backend "))
    for d in rest:
        if d.where.startswith(CAUSE_KINDS):
            continue
        owner = _owner(out, _backend_of(d.where))
        if owner is None:
            owner = next((c for c in out if c.head.where == d.where), None)
            if owner is None:
                out.append(Cause(d))
                continue
        owner.records.setdefault(d.where, []).append(d)
    return out


def _owner(found: list[Cause], backend: str) -> Cause | None:
    """The first cause (not a record's own) that names `backend` (either backend of an
    agreement record's pair `a|b`)."""
    names = set(backend.split("|")) - {""}
    return next(
        (c for c in found if names & c.backends and c.head.where.startswith(CAUSE_KINDS)), None
    )
