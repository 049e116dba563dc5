"""Self-test faults for `diag nodes` and the chance a scan catches a faulty device.

A scan that cannot fail proves nothing: `--inject` corrupts chosen devices' outputs so a user
can see the scan name them, and the detection formula says how many repeats that takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diag.errors import UsageError
from diag.nodes.workloads import INPUTS_PER_WORKLOAD

#: What ``--inject`` can do: the output faults of `diag.worker.faults` a device can show (``nan``,
#: ``bitflip``, ``stuck``), and ``slow``, a straggler's delay.
FAULT_KINDS = ("nan", "bitflip", "stuck", "slow")


@dataclass(frozen=True)
class Injection:
    """A fault diag applies to a workload's output on a chosen device, for self-tests.

    Attributes:
      kind: ``nan`` (one element set to NaN), ``bitflip`` (one random bit of one random
        element), ``stuck`` (the device returns its previous output), ``slow`` (the call takes
        `delay` seconds longer; a straggler, not a wrong result).
      rate: probability per call, drawn from a generator seeded by (seed, process, device).
      device: the jax device id (as the report names it); None: every device of `process`.
      process: the process index; None: any process.
      seed: the injection's random seed.
      delay: extra seconds per faulty call for ``slow``.
    """

    kind: str
    rate: float = 1.0
    device: int | None = None
    process: int | None = None
    seed: int = 0
    delay: float = 0.002

    def applies_to(self, device_id: int, process_index: int) -> bool:
        return (self.device is None or self.device == device_id) and (
            self.process is None or self.process == process_index
        )

    def spec(self) -> str:
        """The ``--inject`` text that gives this injection back."""
        parts = [
            f"device={self.device}" if self.device is not None else "",
            f"process={self.process}" if self.process is not None else "",
            f"kind={self.kind}",
            f"rate={self.rate:g}",
            f"seed={self.seed}" if self.seed else "",
            f"delay={self.delay:g}" if self.kind == "slow" else "",
        ]
        return ",".join(p for p in parts if p)

    def describe(self) -> str:
        where = ", ".join(
            p
            for p in (
                f"device {self.device}" if self.device is not None else "",
                f"process {self.process}" if self.process is not None else "",
            )
            if p
        )
        return f"{self.kind} at rate {self.rate:g} per call on {where}"


def parse_injection(text: str) -> Injection:
    """Parse ``device=3,kind=nan|bitflip|stuck|slow,rate=0.01[,process=I][,seed=S][,delay=s]``.

    Raises:
        UsageError: unknown key, bad value, no kind, or neither device nor process given.
    """
    fields: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise UsageError(f"--inject {text!r}: {part!r} is not key=value")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"device", "process", "kind", "rate", "seed", "delay"}
    if unknown:
        raise UsageError(
            f"--inject {text!r}: unknown key(s) {', '.join(sorted(unknown))}; "
            "expected device, process, kind, rate, seed, delay"
        )
    kind = fields.get("kind")
    if kind not in FAULT_KINDS:
        raise UsageError(f"--inject {text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
    try:
        inj = Injection(
            kind=kind,
            rate=float(fields.get("rate", 1.0)),
            device=int(fields["device"]) if "device" in fields else None,
            process=int(fields["process"]) if "process" in fields else None,
            seed=int(fields.get("seed", 0)),
            delay=float(fields.get("delay", 0.002)),
        )
    except ValueError as e:
        raise UsageError(f"--inject {text!r}: {e}") from None
    if not 0.0 < inj.rate <= 1.0:
        raise UsageError(f"--inject {text!r}: rate must be in (0, 1], got {inj.rate:g}")
    if inj.device is None and inj.process is None:
        raise UsageError(f"--inject {text!r}: name the faulty device=ID and/or process=INDEX")
    return inj


def detection_probability(rate: float, repeats: int, workloads: int = 1) -> float:
    """P(a device with per-call fault rate `rate` is caught) = 1 - (1 - rate)^(repeats*workloads).

    Assumes each faulty call changes the output bits and the other devices hold a strict
    majority (three or more devices, or a stored golden digest).
    """
    if rate <= 0:
        return 0.0
    if rate >= 1:
        return 1.0
    return -math.expm1(repeats * workloads * math.log1p(-rate))


def repeats_for(rate: float, workloads: int = 1, target: float = 0.99) -> int:
    """The smallest R with `detection_probability(rate, R, workloads) >= target`."""
    if rate >= 1:
        return 1
    if rate <= 0:
        raise UsageError("repeats_for: a fault rate of 0 is never detected")
    r = math.ceil(math.log1p(-target) / (workloads * math.log1p(-rate)))
    while detection_probability(rate, r, workloads) < target:  # guard the float rounding
        r += 1
    return max(r, 1)


def detection_table(
    repeats: int, workloads: int, injections: Sequence[Injection]
) -> dict[str, Any]:
    rates = sorted(
        {0.1, 0.01, 0.001} | {i.rate for i in injections if i.kind != "slow"}, reverse=True
    )
    return {
        "formula": "P(detect) = 1 - (1 - rate)^(R*W)",
        "repeats": repeats,
        "workloads": workloads,
        "calls_per_device": repeats * workloads,
        "rows": [
            {
                "rate": p,
                "p_detect": detection_probability(p, repeats, workloads),
                "repeats_for_99": repeats_for(p, workloads, 0.99),
            }
            for p in rates
        ],
    }


def check_injections(injections: Sequence[Injection], devices: Sequence[tuple[int, int]]) -> None:
    """Refuse an injection that matches no scanned device: a self-test that cannot fail.

    Args:
      injections: the requested faults.
      devices: (device id, process index) of every device the scan covers.

    Raises:
      UsageError: an injection names a device or process (or pair) that is not scanned.
    """
    pairs = sorted(set(devices))
    for inj in injections:
        if any(inj.applies_to(d, p) for d, p in pairs):
            continue
        ids = sorted({d for d, _ in pairs})
        procs = sorted({p for _, p in pairs})
        have = f"device ids {_id_ranges(ids)}"
        if len(procs) > 1 or inj.process is not None:
            have += f" on process(es) {_id_ranges(procs)}"
        if inj.device is not None and inj.device not in ids:
            what = f"no device {inj.device}"
        elif inj.process is not None and inj.process not in procs:
            what = f"no process {inj.process}"
        else:
            what = f"device {inj.device} is not on process {inj.process}"
        raise UsageError(
            f"--inject {inj.spec()!r}: {what} in this scan ({have}); name one of "
            "the scanned devices"
        )


def _id_ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3, 7"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _never_fired(inj: Injection, where: str, repeats: int, n_work: int, r99: int | None) -> str:
    """The self-test line for a fault that never fired: what would make it fire."""
    p = detection_probability(inj.rate, repeats, n_work)
    text = (
        f"self-test FAILED: {where} never fired in {repeats} repeat(s) x {n_work} "
        f"workload(s) = {repeats * n_work} call(s) per device (chance it fires at least once: "
        f"{100 * p:.3g}%), so nothing was tested"
    )
    if r99 is not None:
        text += f"; to expect to see it (99%) use --repeats {r99}"
    elif inj.rate < 1:
        text += (
            "; a slow fault needs rate=1 to be seen (stragglers are judged by their fastest repeat)"
        )
    return text


def _why_unseen(inj: Injection, nodes: Mapping[str, Any], repeats: int, slow_factor: float) -> str:
    """Why a fault that fired was not found: what diag could not see."""
    if inj.kind == "slow":
        return (
            "a straggler is judged by its fastest repeat, so a slow fault needs rate=1"
            if inj.rate < 1
            else "two or more devices are needed to compare times"
            if len(nodes.get("devices", [])) < 2
            else f"the delay did not lift its fastest repeat above {slow_factor:g} x the "
            f"median device; inject a longer delay=SECONDS"
        )
    refs = nodes.get("references") or {}
    if refs.get("majority") or refs.get("golden"):
        return "the faulty outputs' bits equal the reference (the fault changed nothing)"
    return (
        "there was no reference to compare with (too few devices for a majority "
        "and no stored golden digest), and "
        + (
            f"with {repeats} repeat(s) no input is seen twice"
            if repeats <= INPUTS_PER_WORKLOAD
            else "the device's repeats of the same input agreed with each other"
        )
    )


def injection_outcomes(
    nodes: Mapping[str, Any], injections: Sequence[Injection], slow_factor: float = 1.5
) -> list[dict[str, Any]]:
    """Whether the scan found each injected fault: a self-test that missed must say so.

    A corrupting injection (nan, bitflip, stuck) is found when a device it applies to got a
    faulty call that diag flagged and is named a suspect; a ``slow`` one when such a device is
    reported slow (or suspect for it). Not found has two causes, told apart because the cure
    differs: the fault never fired (rate x calls too small: more repeats, the number given), or
    it fired and diag could not see it (no reference to compare with, or a fault that left the
    bits unchanged; a straggler is judged by its fastest repeat, so a ``slow`` fault needs
    rate=1).

    Args:
      nodes: the verdict (``devices``, ``repeats``, ``workloads``) of `scan` / `analyze`.
      injections: the faults this process was asked to inject.
      slow_factor: the straggler threshold the scan used.

    Returns:
      One dict per injection: ``spec``, ``kind``, ``rate``, ``devices`` (ids it applied to),
      ``fired`` and ``caught`` calls, ``found`` (bool), ``repeats_for_99`` (None for slow) and
      ``text``, one line for people.
    """
    repeats = int(nodes.get("repeats") or 1)
    n_work = max(len(nodes.get("workloads") or []), 1)
    out = []
    for inj in injections:
        devs = [
            d
            for d in nodes.get("devices", [])
            if inj.applies_to(d["device_id"], d["process_index"])
        ]
        fired = sum(int(d.get("injected_calls") or 0) for d in devs)
        caught = sum(int(d.get("injected_caught") or 0) for d in devs)
        hit = [d for d in devs if d.get("injected_calls")]
        if inj.kind == "slow":
            found = any("slow" in d.get("kinds", []) for d in hit)
            r99 = None
        else:
            found = any(d.get("verdict") == "suspect" and d.get("injected_caught") for d in hit)
            r99 = repeats_for(inj.rate, n_work, 0.99)
        where = f"the injected {inj.describe()}"
        if found:
            text = (
                f"self-test passed: {where} was found ({caught} of {fired} faulty call(s) flagged)"
                if inj.kind != "slow"
                else f"self-test passed: {where} was found (the device is reported slow)"
            )
        elif fired == 0:
            text = _never_fired(inj, where, repeats, n_work, r99)
        elif inj.kind == "slow":
            why = _why_unseen(inj, nodes, repeats, slow_factor)
            text = f"self-test FAILED: {where} fired but the device was not reported slow: {why}"
        else:
            why = _why_unseen(inj, nodes, repeats, slow_factor)
            text = (
                f"self-test FAILED: {where} fired on {fired} call(s) but diag flagged "
                f"{caught}: {why}"
            )
        out.append(
            {
                "spec": inj.spec(),
                "kind": inj.kind,
                "rate": inj.rate,
                "devices": [d["device_id"] for d in devs],
                "fired": fired,
                "caught": caught,
                "found": bool(found),
                "repeats_for_99": r99,
                "text": text,
            }
        )
    return out
