"""The vote: which device computed wrong bits, from every device's digests (pure numpy).

Testable without jax: `analyze` sees only digests, counts and timings, gathered from every
process, and every process computes the same verdict from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.errors import exit_code
from diag.nodes.result import NodeVote
from diag.nodes.workloads import INPUTS_PER_WORKLOAD
from diag.numerics import NAN_ULP


@dataclass
class Observations:
    """Everything the vote needs, for all devices of all processes.

    Attributes:
      devices: one dict per device: device_id, process_index, host, kind, platform.
      workloads: workload names, in order.
      digests: str array [D, W, R]: sha256 of each output's bits.
      nan: int array [D, W, R]; inf: int array [D, W, R].
      times: float array [D, W, R], seconds per call (until the output is ready).
      injected: bool array [D, W, R]: diag corrupted (or delayed) that call.
      max_ulp: float array [D, W, R]: ULP distance to the reference output where the owning
        process holds a copy of it, NaN where unknown or equal.
    """

    devices: list[dict[str, Any]]
    workloads: list[str]
    digests: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    times: np.ndarray
    injected: np.ndarray
    max_ulp: np.ndarray | None = None

    @property
    def repeats(self) -> int:
        return int(self.digests.shape[2])


def references(
    digests: np.ndarray, golden: Mapping[str, Sequence[str]] | None, workloads: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The reference digest per (workload, repeat) and where it came from.

    A strict majority of two or more devices wins; without one, the stored golden digest for
    that input;
    without either, "" (undecided).

    Returns:
        (ref [W, R] str array, source [W, R] array of "majority" | "golden" | "").
    """
    D, W, R = digests.shape
    ref = np.full((W, R), "", dtype=object)
    src = np.full((W, R), "", dtype=object)
    for w in range(W):
        gold = (golden or {}).get(workloads[w])
        for r in range(R):
            values, counts = np.unique(digests[:, w, r], return_counts=True)
            top = int(np.argmax(counts))
            if 2 * counts[top] > D and counts[top] >= 2:  # one device alone is no vote
                ref[w, r], src[w, r] = values[top], "majority"
            elif gold:
                ref[w, r], src[w, r] = gold[r % INPUTS_PER_WORKLOAD], "golden"
    return ref, src


def ulp_text(ulps: float | None) -> str:
    """A ULP distance for people: `NAN_ULP` (a NaN against a number) reads "NaN"."""
    if ulps is None:
        return "—"
    return "NaN" if ulps >= NAN_ULP else f"{ulps:.6g}"


def _runs(repeats: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in repeats[:limit])
    return shown + (f" (+{len(repeats) - limit} more)" if len(repeats) > limit else "")


@dataclass
class _Flags:
    """Which calls are wrong, and how: bool arrays [D, W, R] unless noted.

    Attributes:
      ref: [W, R] the reference digest; src: [W, R] where it came from (see `references`).
      known: [W, R] a reference exists; disagree: [W, R] not every device returned the same bits.
      mismatch: off the reference; undecided: devices disagree and there is no reference.
      intermittent: repeats of the same input on one device disagree.
      golden_bad: off the stored golden digest.
      ref_nonfinite: [W, R] NaN/Inf count of the reference output; bad_nonfinite: more
        NaN/Inf than the reference.
    """

    ref: np.ndarray
    src: np.ndarray
    known: np.ndarray
    disagree: np.ndarray
    mismatch: np.ndarray
    undecided: np.ndarray
    intermittent: np.ndarray
    golden_bad: np.ndarray
    ref_nonfinite: np.ndarray
    bad_nonfinite: np.ndarray

    def wrong(self, d: int) -> np.ndarray:
        """[W, R]: the calls of device `d` flagged for any reason."""
        return (
            self.mismatch[d]
            | self.undecided[d]
            | self.intermittent[d]
            | self.golden_bad[d]
            | self.bad_nonfinite[d]
        )


def _reference_nonfinite(nonfinite: np.ndarray, digests: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """[W, R]: the NaN/Inf count of the reference output (0 where no device holds it)."""
    _, W, R = digests.shape
    ref_nonfinite = np.zeros((W, R), dtype=np.int64)
    for w in range(W):
        for r in range(R):
            holders = nonfinite[digests[:, w, r] == ref[w, r], w, r]
            ref_nonfinite[w, r] = holders.min() if holders.size else 0
    return ref_nonfinite


def _golden_mismatch(
    digests: np.ndarray, golden: Mapping[str, Sequence[str]] | None, names: Sequence[str]
) -> np.ndarray:
    """[D, W, R]: the calls off the stored golden digest (False where none is stored)."""
    golden_bad = np.zeros(digests.shape, dtype=bool)
    for w, name in enumerate(names):
        gold = (golden or {}).get(name)
        if gold:
            for r in range(digests.shape[2]):
                golden_bad[:, w, r] = digests[:, w, r] != gold[r % INPUTS_PER_WORKLOAD]
    return golden_bad


def _intermittent(digests: np.ndarray, known: np.ndarray, mismatch: np.ndarray) -> np.ndarray:
    """[D, W, R]: a device's repeats of the same input disagree with its own usual answer."""
    D, W, R = digests.shape
    intermittent = np.zeros_like(mismatch)
    for d in range(D):
        for w in range(W):
            for k in range(INPUTS_PER_WORKLOAD):
                rs = np.arange(k, R, INPUTS_PER_WORKLOAD)
                values, counts = np.unique(digests[d, w, rs], return_counts=True)
                if len(values) > 1:
                    # The repeats to blame: those off the reference where there is one, else
                    # those off the device's own usual answer (all of them without one).
                    usual = values[int(np.argmax(counts))]
                    own = digests[d, w, rs] != usual
                    if 2 * counts.max() <= len(rs):
                        own[:] = True
                    intermittent[d, w, rs] = np.where(known[w, rs], mismatch[d, w, rs], own)
    return intermittent


def _flags(obs: Observations, golden: Mapping[str, Sequence[str]] | None) -> _Flags:
    """Flag every call that is wrong against the reference, the golden digest or itself."""
    digests = obs.digests
    ref, src = references(digests, golden, obs.workloads)
    known = src != ""
    mismatch = (digests != ref[None]) & known[None]
    disagree = (digests != digests[:1]).any(axis=0)  # [W, R]
    undecided = np.broadcast_to((~known & disagree)[None], digests.shape).copy()
    nonfinite = obs.nan + obs.inf
    ref_nonfinite = _reference_nonfinite(nonfinite, digests, ref)
    intermittent = _intermittent(digests, known, mismatch)
    # Without a reference, a call that some devices also got wrong on other repeats of the same
    # input points at them: the devices that are consistent are cleared.
    blamed = intermittent.any(axis=0) & undecided[0]  # [W, R]
    undecided &= ~(blamed[None] & ~intermittent)
    return _Flags(
        ref=ref,
        src=src,
        known=known,
        disagree=disagree,
        mismatch=mismatch,
        undecided=undecided,
        intermittent=intermittent,
        golden_bad=_golden_mismatch(digests, golden, obs.workloads),
        ref_nonfinite=ref_nonfinite,
        bad_nonfinite=nonfinite > ref_nonfinite[None],
    )


@dataclass
class _Timing:
    """Per-device repeat times [D] and the fleet's median repeat, in seconds."""

    median: np.ndarray
    fastest: np.ndarray
    fleet: float
    slow: np.ndarray
    slow_factor: float


def _timing(obs: Observations, slow_factor: float) -> _Timing:
    D = obs.digests.shape[0]
    per_repeat = obs.times.sum(axis=1)  # [D, R]: one repeat of every workload
    med = np.median(per_repeat, axis=1)
    fastest = per_repeat.min(axis=1)
    fleet = float(np.median(med))
    slow = (fastest > slow_factor * fleet) if D >= 2 and fleet > 0 else np.zeros(D, bool)
    return _Timing(median=med, fastest=fastest, fleet=fleet, slow=slow, slow_factor=slow_factor)


_EVIDENCE_LABELS = (
    ("mismatch", "differs from the majority"),
    ("undecided", "no majority"),
    ("intermittent", "repeats of the same input disagree"),
    ("golden_bad", "differs from the stored golden digest"),
    ("bad_nonfinite", "NaN/Inf where the reference has none"),
)

# {kind: (the _Flags field that counts it, its reason)}; {n} calls flagged of {c} made.
_KIND_TEXTS = {
    "mismatch": ("mismatch", "differs from the majority on {n}/{c} calls"),
    "no-majority": (
        "undecided",
        "{n}/{c} calls have no majority to vote with (too few devices agree "
        "and no golden digest is stored)",
    ),
    "intermittent": ("intermittent", "repeats of the same input disagree on {n} calls"),
    "golden": ("golden_bad", "differs from the stored golden digest on {n}/{c} calls"),
    "nan": ("bad_nonfinite", "NaN/Inf where the reference has none on {n} calls"),
}


def _evidence(obs: Observations, flags: _Flags, d: int) -> list[dict[str, Any]]:
    """Device `d`'s flagged repeats, one item per workload and reason."""
    evidence: list[dict[str, Any]] = []
    for w, name in enumerate(obs.workloads):
        for field, label in _EVIDENCE_LABELS:
            bad_rs = [int(r) for r in np.nonzero(getattr(flags, field)[d, w])[0]]
            if bad_rs:
                item: dict[str, Any] = {"workload": name, "what": label, "repeats": bad_rs}
                if field == "mismatch" and obs.max_ulp is not None:
                    ulps = obs.max_ulp[d, w, bad_rs]
                    ulps = ulps[np.isfinite(ulps)]
                    if ulps.size:
                        item["max_ulp"] = float(ulps.max())
                evidence.append(item)
    return evidence


def _device_verdict(
    obs: Observations, flags: _Flags, timing: _Timing, d: int, fail_on_slow: bool
) -> tuple[dict[str, Any], list[str]]:
    """Device `d`'s entry in `NodeVote.devices`, and the reasons its `reason` joins."""
    _, W, R = obs.digests.shape
    evidence = _evidence(obs, flags, d)
    per_kind = {k: int(getattr(flags, f)[d].sum()) for k, (f, _) in _KIND_TEXTS.items()}
    kinds = [kind for kind, n in per_kind.items() if n]
    why = [_KIND_TEXTS[kind][1].format(n=per_kind[kind], c=W * R) for kind in kinds]
    ulp_values = [e["max_ulp"] for e in evidence if "max_ulp" in e]
    if ulp_values:
        why.append(f"max {ulp_text(max(ulp_values))} ULP from the majority output")
    wrong = flags.wrong(d)
    where = [
        f"{name} repeats {_runs([int(r) for r in np.nonzero(wrong[w])[0]])}"
        for w, name in enumerate(obs.workloads)
        if wrong[w].any()
    ]
    if where:
        why.append("wrong calls: " + "; ".join(where))
    ratio = float(timing.median[d] / timing.fleet) if timing.fleet > 0 else 1.0
    is_slow = bool(timing.slow[d])
    suspect = bool(kinds) or (is_slow and fail_on_slow)
    if is_slow:
        kinds.append("slow")
        why.append(
            f"fastest repeat {timing.fastest[d] * 1e3:.3g} ms > {timing.slow_factor:g} x the "
            f"median device's {timing.fleet * 1e3:.3g} ms"
        )
    caught = flags.mismatch[d] | flags.intermittent[d] | flags.golden_bad[d] | flags.undecided[d]
    entry = {
        **obs.devices[d],
        "verdict": "suspect" if suspect else ("slow" if is_slow else "ok"),
        "kinds": kinds,
        "reason": "; ".join(why) if why else "agrees with the majority on every call",
        "calls": W * R,
        "mismatched_calls": per_kind["mismatch"],
        "nan_count": int(obs.nan[d].sum()),
        "inf_count": int(obs.inf[d].sum()),
        "intermittent_calls": per_kind["intermittent"],
        "golden_mismatch_calls": per_kind["golden"],
        "undecided_calls": per_kind["no-majority"],
        "max_ulp": max(ulp_values) if ulp_values else None,
        "injected_calls": int(obs.injected[d].sum()),
        "injected_caught": int((obs.injected[d] & caught).sum()),
        "time_median_s": float(timing.median[d]),
        "time_min_s": float(timing.fastest[d]),
        "time_ratio": ratio,
        "evidence": evidence[:20],
    }
    return entry, why


def _notes(
    obs: Observations, flags: _Flags, golden: Mapping[str, Sequence[str]] | None
) -> list[str]:
    """What the reader should know about how far the vote can see."""
    D, _, R = obs.digests.shape
    notes = []
    if D == 1:
        notes.append(
            "one device: no vote across devices; only repeats of the same input and "
            "a stored golden digest are compared"
        )
    elif D == 2:
        notes.append(
            "two devices: when they disagree there is no majority; both are named "
            "unless a stored golden digest or a repeat disagreement points at one"
        )
    if R < INPUTS_PER_WORKLOAD + 1:
        notes.append(
            f"with {R} repeat(s) no input is seen twice: intermittent faults on a "
            f"single device are not checked (use --repeats >= {INPUTS_PER_WORKLOAD + 1})"
        )
    if (~flags.known & flags.disagree).any():
        notes.append(
            "some calls had no majority and no golden digest: the devices involved are all named"
        )
    for w, name in enumerate(obs.workloads):
        if (flags.ref_nonfinite[w] > 0).any():
            notes.append(
                f"workload {name} returns NaN/Inf in the reference output itself: a "
                "property of the workload, not of a device"
            )
    kinds_seen = sorted({str(dev.get("kind")) for dev in obs.devices})
    if len(kinds_seen) > 1:
        notes.append(
            f"mixed device kinds ({', '.join(kinds_seen)}): different hardware may "
            "legitimately give different bits"
        )
    if golden and flags.mismatch.sum() == 0 and flags.golden_bad.all(axis=0).any():
        notes.append(
            "every device differs from the stored golden digest on some call: the "
            "golden may come from other flags or software; check, then --save-golden"
        )
    return notes


def _hosts(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (process, host): its device count, suspects, stragglers and verdict."""
    hosts: dict[tuple, dict[str, Any]] = {}
    for entry in devices:
        h = hosts.setdefault(
            (entry["process_index"], entry["host"]),
            {
                "process_index": entry["process_index"],
                "host": entry["host"],
                "devices": 0,
                "suspects": 0,
                "slow": 0,
            },
        )
        h["devices"] += 1
        h["suspects"] += entry["verdict"] == "suspect"
        h["slow"] += entry["verdict"] == "slow"
    for h in hosts.values():
        h["verdict"] = "suspect" if h["suspects"] else ("slow" if h["slow"] else "ok")
    return list(hosts.values())


def analyze(
    obs: Observations,
    golden: Mapping[str, Sequence[str]] | None = None,
    slow_factor: float = 1.5,
    fail_on_slow: bool = False,
) -> NodeVote:
    """Vote on the gathered observations: per-device verdicts, suspects, stragglers, notes.

    Args:
      obs: the observations of every device.
      golden: {workload name: [digest per input index]} from the golden store, or None.
      slow_factor: a device is `slow` when its fastest repeat is slower than this times the
        median device's median repeat (the fastest repeat: one noisy sample does not count).
      fail_on_slow: stragglers become suspects (exit 3) too.

    Returns:
      A `NodeVote`: per-device verdicts, suspects, stragglers, hosts, references, notes and
      the exit code (``to_dict()`` for JSON).
    """
    flags = _flags(obs, golden)
    timing = _timing(obs, slow_factor)
    devices, suspects, stragglers = [], [], []
    for d, dev in enumerate(obs.devices):
        entry, why = _device_verdict(obs, flags, timing, d, fail_on_slow)
        devices.append(entry)
        short = {k: dev[k] for k in ("device_id", "process_index", "host")}
        if entry["verdict"] == "suspect":
            suspects.append({**short, "reason": entry["reason"], "kinds": entry["kinds"]})
        elif entry["verdict"] == "slow":
            stragglers.append({**short, "reason": why[-1], "time_ratio": entry["time_ratio"]})
    src = flags.src
    return NodeVote(
        verdict="suspect" if suspects else "ok",
        exit_code=exit_code(bad_node=bool(suspects)),
        devices=devices,
        suspects=suspects,
        slow=stragglers,
        hosts=_hosts(devices),
        references={
            "majority": int((src == "majority").sum()),
            "golden": int((src == "golden").sum()),
            "undecided": int((~flags.known).sum()),
        },
        fleet_median_repeat_s=timing.fleet,
        notes=_notes(obs, flags, golden),
    )
