"""What `diag check` found: each drift (where, what, old -> new, and the rule it broke) and the
whole result with its exit code. Kept apart from `diag.baseline` (how a baseline is built and
compared) so that renderers and the JUnit writer read a result type, not the comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["FEATURE_FIELDS", "Check", "Drift", "feature_drifts", "features_of",
           "setting_drifts", "show"]

#: The fields of a matmul's recorded features (`diag.precision.features`) that describe its
#: unit's arithmetic; the evidence and the seconds it took are not compared.
FEATURE_FIELDS = ("product_exact", "extra_bits", "rounding", "block_fma_width", "order",
                  "subnormals")


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
    """

    drifts: list[Drift] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    key_mismatch: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """1 when anything drifted, else 0 (the CLI's exit code).

        A record that fails now and failed in the baseline too is a known failure: listed
        (and a JUnit failure), not drift; one that newly fails changed status, which is.
        """
        return 1 if self.drifts else 0


def features_of(meta: dict) -> dict[str, list[dict]]:
    """Backend -> its recorded matmul features (run.json's `backends[name]["features"]`),
    each cut to its setting, dtype and `FEATURE_FIELDS` (what a baseline keeps)."""
    out = {}
    for name, info in (meta.get("backends") or {}).items():
        entries = (info or {}).get("features")
        if entries:
            out[name] = [{k: e.get(k) for k in ("precision", "via", "dtype") + FEATURE_FIELDS}
                         for e in entries if isinstance(e, dict)]
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
    return setting_drifts(old, new, kind="features", keys=("precision", "via", "dtype"),
                          fields=FEATURE_FIELDS, why="the matmul unit's arithmetic changed",
                          shown=lambda e: "measured")


def setting_drifts(old: dict[str, list[dict]], new: dict[str, list[dict]], *, kind: str,
                   keys: tuple[str, ...], fields: tuple[str, ...], why: str,
                   shown: Callable[[dict], Any]) -> list[Drift]:
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
                out.append(Drift(where, kind, shown(a[key]) if key in a else None,
                                 shown(b[key]) if key in b else None,
                                 "measured in only one of the two runs"))
                continue
            for f in fields:
                if a[key].get(f) != b[key].get(f):
                    out.append(Drift(where, f, a[key].get(f), b[key].get(f), why))
    return out
