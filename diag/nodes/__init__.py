"""Bad-device and bad-host scan: the same deterministic work on every device, then a vote.

Fleets see silent data corruption from a few devices per thousand, and most of it is wrong
*finite* values, not NaN. A single-machine diagnostic cannot tell a wrong result from a right
one without a reference; a vote can. `scan` runs deterministic workloads (bf16 and fp32
matmul chains, a softmax, one training step, or the user's own callable) on every device,
digests every output bit for bit, and compares:

* across devices, per (workload, repeat): the digest a strict majority holds is the reference;
  devices that differ are suspects. With two devices that disagree there is no majority: the
  scan says so and names both unless a stored golden digest breaks the tie;
* across repeats on one device: repeat r uses input ``r % INPUTS_PER_WORKLOAD``, so every input
  is seen several times; a device whose repeats of the same input disagree is intermittent;
* with a golden digest stored for this device kind and jax/jaxlib version (`--save-golden`);
* NaN/Inf counts, and timing: a device whose *fastest* repeat is slower than `slow_factor` times
  the median device is a straggler (`slow`), reported apart from wrong results.

Inputs alternate between two seeded arrays so that a stale output (a device "stuck" on its
previous result) differs from the right one; with one fixed input it would be invisible.

Multi-host scans use JAX's own runtime: `jax.distributed.initialize` and
`jax.experimental.multihost_utils.process_allgather`; every process computes the same verdict
from the gathered digests and process 0 writes it. jax is imported inside functions only:
`import diag` stays framework-free, and ``--host-devices`` must set XLA_FLAGS before jax starts.

Detection: a device that corrupts each call independently with probability p is caught by a
scan of R repeats over W workloads with probability ``1 - (1 - p) ** (R * W)`` (each faulty
call changes the output bits, and the other devices hold a strict majority), see
`detection_probability` and `repeats_for`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from diag.errors import (EXIT_BAD_NODE, EXIT_NUMERICAL_FAILURE, EXIT_OK, DiagError,
                         UsageError)
from diag.numerics import (NAN_ULP, as_dtype, bits_view, dtype_name, is_supported,
                           ulp_distance)

__all__ = [
    "BUILTIN_WORKLOADS",
    "EXIT_SELFTEST_MISSED",
    "FAULT_KINDS",
    "INPUTS_PER_WORKLOAD",
    "NODES_SCHEMA",
    "Injection",
    "NodeScanError",
    "Observations",
    "Workload",
    "analyze",
    "builtin_workload",
    "check_injections",
    "default_golden_dir",
    "detection_probability",
    "injection_outcomes",
    "load_workload",
    "parse_injection",
    "repeats_for",
    "report_context",
    "scan",
    "write_run",
]

NODES_SCHEMA = "diag.nodes/1"
GOLDEN_SCHEMA = "diag.golden/1"
#: Distinct seeded inputs per workload; repeat r uses input r % INPUTS_PER_WORKLOAD.
INPUTS_PER_WORKLOAD = 2
FAULT_KINDS = ("nan", "bitflip", "stuck", "slow")
#: Exit code when an injected fault was not found and no device is a suspect: the self-test
#: is a check that failed (1), not a bad device (3: none was named), not bad usage (2).
EXIT_SELFTEST_MISSED = EXIT_NUMERICAL_FAILURE
_DIGEST_BYTES = 32
_NAME_BYTES = 64


class NodeScanError(DiagError):
    """The scan itself could not run (jax missing, distributed start-up failed)."""


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One deterministic workload: ``build()`` returns ``fn(x) -> array`` (jax imported).

    Attributes:
      name: shown in reports; a builtin name or the user's ``module:function``.
      shape: the input's shape; diag draws the inputs from the scan seed.
      dtype: the input's dtype name.
      build: called once, after jax is imported, to get the callable.
      version: part of the golden key; bump when a builtin's computation changes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    build: Callable[[], Callable]
    version: str = "1"

    def key(self, seed: int) -> str:
        """What a golden digest depends on besides hardware and library versions."""
        return f"{self.name}/v{self.version}/seed={seed}/{list(self.shape)}/{self.dtype}"

    def make_input(self, seed: int, index: int) -> np.ndarray:
        """Input `index` (deterministic in seed, workload name and index; host numpy)."""
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode()), index])
        return rng.standard_normal(self.shape).astype(as_dtype(self.dtype))


def _weights(seed: int, shapes, dtype) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 0x90DE])
    return [(rng.standard_normal(s) / math.sqrt(s[0])).astype(as_dtype(dtype)) for s in shapes]


def _matmul_chain(dtype: str) -> Callable[[], Callable]:
    @functools.lru_cache(maxsize=None)  # one jitted function per process: compiled once
    def build():
        import jax
        import jax.numpy as jnp

        ws = _weights(1, [(128, 128)] * 4, dtype)

        def chain(x):
            for w in ws:  # tanh keeps every layer's values in [-1, 1]: no overflow in bf16
                x = jnp.tanh(x @ w)
            return x

        return jax.jit(chain)

    return build


@functools.lru_cache(maxsize=None)
def _softmax():
    import jax

    return jax.jit(lambda x: jax.nn.softmax(4.0 * x, axis=-1))


@functools.lru_cache(maxsize=None)
def _train_step():
    import jax
    import jax.numpy as jnp

    w1, w2 = _weights(2, [(32, 64), (64, 10)], "float32")

    def loss_fn(params, x):
        a, b = params
        logits = jnp.tanh(x @ a) @ b
        labels = jnp.argmax(x[:, :10], axis=-1)  # deterministic targets drawn from the input
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    def step(x):
        params = (jnp.asarray(w1), jnp.asarray(w2))
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        new = [p - 0.1 * g for p, g in zip(params, grads)]
        return jnp.concatenate([new[0].ravel(), new[1].ravel(), loss[None]])

    return jax.jit(step)


#: diag's golden workloads, in scan order.
BUILTIN_WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (
        Workload("matmul_bf16", (128, 128), "bfloat16", _matmul_chain("bfloat16")),
        Workload("matmul_f32", (128, 128), "float32", _matmul_chain("float32")),
        Workload("softmax", (64, 1024), "float32", _softmax),
        Workload("train_step", (64, 32), "float32", _train_step),
    )
}


def builtin_workload(name: str) -> Workload:
    """A builtin workload by name.

    Raises:
        UsageError: no builtin has that name.
    """
    if name not in BUILTIN_WORKLOADS:
        raise UsageError(f"unknown workload {name!r}; builtins: {', '.join(BUILTIN_WORKLOADS)}, "
                         "or your own as module:function or path/to/file.py:function")
    return BUILTIN_WORKLOADS[name]


def load_workload(spec: str, shape: Sequence[int] = (128, 128),
                  dtype: str = "float32") -> Workload:
    """A builtin name, or the user's ``module:function`` / ``path/file.py:function``.

    The user's callable receives a device-committed array of `shape` and `dtype` and returns an
    array; diag calls it once per device to compile (not judged), then once per device per
    repeat. It must be deterministic: the scan votes on its output bits.

    Raises:
        UsageError: the spec is malformed, the module cannot be imported or has no such
            callable, or the shape/dtype is invalid.
    """
    if ":" not in spec:
        return builtin_workload(spec)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UsageError(f"--workload {spec!r}: expected module:function or file.py:function")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"--input-shape {list(shape)}: expected positive sizes")
    dtype = dtype_name(dtype)

    def build():
        try:
            if module_name.endswith(".py"):
                path = Path(module_name)
                if not path.is_file():
                    raise UsageError(f"--workload {spec!r}: no file {path}")
                mod_spec = importlib.util.spec_from_file_location(f"_diag_workload_{path.stem}",
                                                                  path)
                module = importlib.util.module_from_spec(mod_spec)
                mod_spec.loader.exec_module(module)
            else:
                if os.getcwd() not in sys.path:  # the `diag` script does not put cwd on the path
                    sys.path.insert(0, os.getcwd())
                module = importlib.import_module(module_name)
        except ImportError as e:
            raise UsageError(f"--workload {spec!r}: cannot import {module_name}: {e}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UsageError(f"--workload {spec!r}: {module_name} has no callable {attr!r}")
        return fn

    return Workload(spec, shape, dtype, build)


# ---------------------------------------------------------------------------------------------
# Fault injection and detection probability
# ---------------------------------------------------------------------------------------------

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
    device: Optional[int] = None
    process: Optional[int] = None
    seed: int = 0
    delay: float = 0.002

    def applies_to(self, device_id: int, process_index: int) -> bool:
        return ((self.device is None or self.device == device_id)
                and (self.process is None or self.process == process_index))

    def spec(self) -> str:
        """The ``--inject`` text that gives this injection back."""
        parts = [f"device={self.device}" if self.device is not None else "",
                 f"process={self.process}" if self.process is not None else "",
                 f"kind={self.kind}", f"rate={self.rate:g}",
                 f"seed={self.seed}" if self.seed else "",
                 f"delay={self.delay:g}" if self.kind == "slow" else ""]
        return ",".join(p for p in parts if p)

    def describe(self) -> str:
        where = ", ".join(p for p in (f"device {self.device}" if self.device is not None else "",
                                      f"process {self.process}" if self.process is not None
                                      else "") if p)
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
        raise UsageError(f"--inject {text!r}: unknown key(s) {', '.join(sorted(unknown))}; "
                         "expected device, process, kind, rate, seed, delay")
    kind = fields.get("kind")
    if kind not in FAULT_KINDS:
        raise UsageError(f"--inject {text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
    try:
        inj = Injection(kind=kind, rate=float(fields.get("rate", 1.0)),
                        device=int(fields["device"]) if "device" in fields else None,
                        process=int(fields["process"]) if "process" in fields else None,
                        seed=int(fields.get("seed", 0)),
                        delay=float(fields.get("delay", 0.002)))
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


def _detection(repeats: int, workloads: int, injections: Sequence[Injection]) -> dict[str, Any]:
    rates = sorted({0.1, 0.01, 0.001} | {i.rate for i in injections if i.kind != "slow"},
                   reverse=True)
    return {
        "formula": "P(detect) = 1 - (1 - rate)^(R*W)",
        "repeats": repeats, "workloads": workloads, "calls_per_device": repeats * workloads,
        "rows": [{"rate": p, "p_detect": detection_probability(p, repeats, workloads),
                  "repeats_for_99": repeats_for(p, workloads, 0.99)} for p in rates],
    }


def check_injections(injections: Sequence[Injection],
                     devices: Sequence[tuple[int, int]]) -> None:
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
        raise UsageError(f"--inject {inj.spec()!r}: {what} in this scan ({have}); name one of "
                         "the scanned devices")


def _id_ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3, 7"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def injection_outcomes(nodes: Mapping[str, Any], injections: Sequence[Injection],
                       slow_factor: float = 1.5) -> list[dict[str, Any]]:
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
    calls = repeats * n_work
    out = []
    for inj in injections:
        devs = [d for d in nodes.get("devices", [])
                if inj.applies_to(d["device_id"], d["process_index"])]
        fired = sum(int(d.get("injected_calls") or 0) for d in devs)
        caught = sum(int(d.get("injected_caught") or 0) for d in devs)
        hit = [d for d in devs if d.get("injected_calls")]
        if inj.kind == "slow":
            found = any("slow" in d.get("kinds", []) for d in hit)
            r99 = None
        else:
            found = any(d.get("verdict") == "suspect" and d.get("injected_caught")
                        for d in hit)
            r99 = repeats_for(inj.rate, n_work, 0.99)
        where = f"the injected {inj.describe()}"
        if found:
            text = (f"self-test passed: {where} was found ({caught} of {fired} faulty call(s) "
                    "flagged)" if inj.kind != "slow" else
                    f"self-test passed: {where} was found (the device is reported slow)")
        elif fired == 0:
            p = detection_probability(inj.rate, repeats, n_work)
            text = (f"self-test FAILED: {where} never fired in {repeats} repeat(s) x {n_work} "
                    f"workload(s) = {calls} call(s) per device (chance it fires at least once: "
                    f"{100 * p:.3g}%), so nothing was tested")
            if r99 is not None:
                text += f"; to expect to see it (99%) use --repeats {r99}"
            elif inj.rate < 1:
                text += ("; a slow fault needs rate=1 to be seen (stragglers are judged by "
                         "their fastest repeat)")
        elif inj.kind == "slow":
            why = ("a straggler is judged by its fastest repeat, so a slow fault needs rate=1"
                   if inj.rate < 1 else
                   "two or more devices are needed to compare times" if
                   len(nodes.get("devices", [])) < 2 else
                   f"the delay did not lift its fastest repeat above {slow_factor:g} x the "
                   f"median device; inject a longer delay=SECONDS")
            text = f"self-test FAILED: {where} fired but the device was not reported slow: {why}"
        else:
            refs = nodes.get("references") or {}
            if refs.get("majority") or refs.get("golden"):
                why = "the faulty outputs' bits equal the reference (the fault changed nothing)"
            else:
                why = ("there was no reference to compare with (too few devices for a majority "
                       "and no stored golden digest), and " +
                       (f"with {repeats} repeat(s) no input is seen twice"
                        if repeats <= INPUTS_PER_WORKLOAD else
                        "the device's repeats of the same input agreed with each other"))
            text = (f"self-test FAILED: {where} fired on {fired} call(s) but diag flagged "
                    f"{caught}: {why}")
        out.append({"spec": inj.spec(), "kind": inj.kind, "rate": inj.rate,
                    "devices": [d["device_id"] for d in devs], "fired": fired,
                    "caught": caught, "found": bool(found), "repeats_for_99": r99,
                    "text": text})
    return out


def _corrupt(out: np.ndarray, kind: str, stale: np.ndarray, rng: np.random.Generator):
    """A corrupted copy of `out` (never `out` itself)."""
    if kind == "stuck":
        return stale.copy()
    bad = np.array(out, copy=True)
    flat = bits_view(bad.reshape(-1))
    i = int(rng.integers(flat.size))
    if kind == "nan" and is_supported(bad.dtype):
        bad.reshape(-1)[i] = np.nan
        return bad
    bit = int(rng.integers(8 * bad.dtype.itemsize))  # bitflip (and nan on a non-float output)
    flat[i] ^= flat.dtype.type(1 << bit)
    return bad


# ---------------------------------------------------------------------------------------------
# Observations and the verdict (pure numpy: testable without jax)
# ---------------------------------------------------------------------------------------------

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
    max_ulp: Optional[np.ndarray] = None

    @property
    def repeats(self) -> int:
        return int(self.digests.shape[2])


def references(digests: np.ndarray, golden: Optional[Mapping[str, Sequence[str]]],
               workloads: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
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


def _ulp_text(ulps: Optional[float]) -> str:
    """A ULP distance for people: `NAN_ULP` (a NaN against a number) reads "NaN"."""
    if ulps is None:
        return "—"
    return "NaN" if ulps >= NAN_ULP else f"{ulps:.6g}"


def _runs(repeats: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in repeats[:limit])
    return shown + (f" (+{len(repeats) - limit} more)" if len(repeats) > limit else "")


def analyze(obs: Observations, golden: Optional[Mapping[str, Sequence[str]]] = None,
            slow_factor: float = 1.5, fail_on_slow: bool = False) -> dict[str, Any]:
    """Vote on the gathered observations: per-device verdicts, suspects, stragglers, notes.

    Args:
      obs: the observations of every device.
      golden: {workload name: [digest per input index]} from the golden store, or None.
      slow_factor: a device is `slow` when its fastest repeat is slower than this times the
        median device's median repeat (the fastest repeat: one noisy sample does not count).
      fail_on_slow: stragglers become suspects (exit 3) too.

    Returns:
      The verdict as JSON-ready data: ``devices``, ``suspects``, ``slow``, ``hosts``, ``notes``,
      ``exit_code``.
    """
    digests = obs.digests
    D, W, R = digests.shape
    names = obs.workloads
    ref, src = references(digests, golden, names)
    known = src != ""
    mismatch = (digests != ref[None]) & known[None]
    disagree = (digests != digests[:1]).any(axis=0)  # [W, R]
    undecided = np.broadcast_to((~known & disagree)[None], digests.shape).copy()
    nonfinite = obs.nan + obs.inf
    ref_nonfinite = np.zeros((W, R), dtype=np.int64)
    for w in range(W):
        for r in range(R):
            holders = nonfinite[digests[:, w, r] == ref[w, r], w, r]
            ref_nonfinite[w, r] = holders.min() if holders.size else 0
    bad_nonfinite = nonfinite > ref_nonfinite[None]
    golden_bad = np.zeros_like(mismatch)
    for w, name in enumerate(names):
        gold = (golden or {}).get(name)
        if gold:
            for r in range(R):
                golden_bad[:, w, r] = digests[:, w, r] != gold[r % INPUTS_PER_WORKLOAD]
    # Intermittent: a device's repeats of the same input disagree with its own usual answer.
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
    # Without a reference, a call that some devices also got wrong on other repeats of the same
    # input points at them: the devices that are consistent are cleared.
    blamed = intermittent.any(axis=0) & undecided[0]  # [W, R]
    undecided &= ~(blamed[None] & ~intermittent)

    per_repeat = obs.times.sum(axis=1)  # [D, R]: one repeat of every workload
    med = np.median(per_repeat, axis=1)
    fastest = per_repeat.min(axis=1)
    fleet = float(np.median(med))
    slow = (fastest > slow_factor * fleet) if D >= 2 and fleet > 0 else np.zeros(D, bool)

    devices, suspects, stragglers = [], [], []
    for d, dev in enumerate(obs.devices):
        kinds, why, evidence = [], [], []
        for w, name in enumerate(names):
            for flag, label in ((mismatch[d, w], "differs from the majority"),
                                (undecided[d, w], "no majority"),
                                (intermittent[d, w], "repeats of the same input disagree"),
                                (golden_bad[d, w], "differs from the stored golden digest"),
                                (bad_nonfinite[d, w], "NaN/Inf where the reference has none")):
                rs = [int(r) for r in np.nonzero(flag)[0]]
                if rs:
                    item = {"workload": name, "what": label, "repeats": rs}
                    if label == "differs from the majority" and obs.max_ulp is not None:
                        ulps = obs.max_ulp[d, w, rs]
                        ulps = ulps[np.isfinite(ulps)]
                        if ulps.size:
                            item["max_ulp"] = float(ulps.max())
                    evidence.append(item)
        counts = {
            "mismatch": int(mismatch[d].sum()),
            "no-majority": int(undecided[d].sum()),
            "intermittent": int(intermittent[d].sum()),
            "golden": int(golden_bad[d].sum()),
            "nan": int(bad_nonfinite[d].sum()),
        }
        texts = {
            "mismatch": "differs from the majority on {n}/{c} calls",
            "no-majority": "{n}/{c} calls have no majority to vote with (too few devices agree "
                           "and no golden digest is stored)",
            "intermittent": "repeats of the same input disagree on {n} calls",
            "golden": "differs from the stored golden digest on {n}/{c} calls",
            "nan": "NaN/Inf where the reference has none on {n} calls",
        }
        for kind, n in counts.items():
            if n:
                kinds.append(kind)
                why.append(texts[kind].format(n=n, c=W * R))
        ulp_values = [e["max_ulp"] for e in evidence if "max_ulp" in e]
        if ulp_values:
            why.append(f"max {_ulp_text(max(ulp_values))} ULP from the majority output")
        wrong = mismatch[d] | undecided[d] | intermittent[d] | golden_bad[d] | bad_nonfinite[d]
        where = [f"{name} repeats {_runs([int(r) for r in np.nonzero(wrong[w])[0]])}"
                 for w, name in enumerate(names) if wrong[w].any()]
        if where:
            why.append("wrong calls: " + "; ".join(where))
        ratio = float(med[d] / fleet) if fleet > 0 else 1.0
        is_slow = bool(slow[d])
        suspect = bool(kinds) or (is_slow and fail_on_slow)
        if is_slow:
            kinds.append("slow")
            why.append(f"fastest repeat {fastest[d] * 1e3:.3g} ms > {slow_factor:g} x the "
                       f"median device's {fleet * 1e3:.3g} ms")
        verdict = "suspect" if suspect else ("slow" if is_slow else "ok")
        entry = {
            **dev, "verdict": verdict, "kinds": kinds,
            "reason": "; ".join(why) if why else "agrees with the majority on every call",
            "calls": W * R, "mismatched_calls": counts["mismatch"],
            "nan_count": int(obs.nan[d].sum()), "inf_count": int(obs.inf[d].sum()),
            "intermittent_calls": counts["intermittent"],
            "golden_mismatch_calls": counts["golden"], "undecided_calls": counts["no-majority"],
            "max_ulp": max(ulp_values) if ulp_values else None,
            "injected_calls": int(obs.injected[d].sum()),
            "injected_caught": int((obs.injected[d] & (mismatch[d] | intermittent[d]
                                                        | golden_bad[d] | undecided[d])).sum()),
            "time_median_s": float(med[d]), "time_min_s": float(fastest[d]),
            "time_ratio": ratio, "evidence": evidence[:20],
        }
        devices.append(entry)
        short = {k: dev[k] for k in ("device_id", "process_index", "host")}
        if suspect:
            suspects.append({**short, "reason": entry["reason"], "kinds": kinds})
        elif is_slow:
            stragglers.append({**short, "reason": why[-1], "time_ratio": ratio})

    notes = []
    if D == 1:
        notes.append("one device: no vote across devices; only repeats of the same input and "
                     "a stored golden digest are compared")
    elif D == 2:
        notes.append("two devices: when they disagree there is no majority; both are named "
                     "unless a stored golden digest or a repeat disagreement points at one")
    if R < INPUTS_PER_WORKLOAD + 1:
        notes.append(f"with {R} repeat(s) no input is seen twice: intermittent faults on a "
                     f"single device are not checked (use --repeats >= {INPUTS_PER_WORKLOAD + 1})")
    if (~known & disagree).any():
        notes.append("some calls had no majority and no golden digest: the devices involved "
                     "are all named")
    for w, name in enumerate(names):
        if (ref_nonfinite[w] > 0).any():
            notes.append(f"workload {name} returns NaN/Inf in the reference output itself: a "
                         "property of the workload, not of a device")
    kinds_seen = sorted({str(dev.get("kind")) for dev in obs.devices})
    if len(kinds_seen) > 1:
        notes.append(f"mixed device kinds ({', '.join(kinds_seen)}): different hardware may "
                     "legitimately give different bits")
    if golden and mismatch.sum() == 0 and golden_bad.all(axis=0).any():
        notes.append("every device differs from the stored golden digest on some call: the "
                     "golden may come from other flags or software; check, then --save-golden")

    hosts: dict[tuple, dict[str, Any]] = {}
    for entry in devices:
        h = hosts.setdefault((entry["process_index"], entry["host"]), {
            "process_index": entry["process_index"], "host": entry["host"], "devices": 0,
            "suspects": 0, "slow": 0})
        h["devices"] += 1
        h["suspects"] += entry["verdict"] == "suspect"
        h["slow"] += entry["verdict"] == "slow"
    for h in hosts.values():
        h["verdict"] = "suspect" if h["suspects"] else ("slow" if h["slow"] else "ok")
    return {
        "verdict": "suspect" if suspects else "ok",
        "exit_code": EXIT_BAD_NODE if suspects else EXIT_OK,
        "devices": devices, "suspects": suspects, "slow": stragglers,
        "hosts": list(hosts.values()),
        "references": {"majority": int((src == "majority").sum()),
                       "golden": int((src == "golden").sum()),
                       "undecided": int((~known).sum())},
        "fleet_median_repeat_s": fleet,
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------------
# Golden digests
# ---------------------------------------------------------------------------------------------

def default_golden_dir() -> Path:
    """``$DIAG_GOLDEN_DIR``, else ``$DIAG_CACHE_DIR/golden``, else ``~/.cache/diag/golden``.

    Entries live two folders deep (``<kind>/<versions>.json``), where ``diag cache clear``,
    which clears the ground-truth cache, does not reach.
    """
    if os.environ.get("DIAG_GOLDEN_DIR"):
        return Path(os.environ["DIAG_GOLDEN_DIR"]).expanduser()
    if os.environ.get("DIAG_CACHE_DIR"):
        return Path(os.environ["DIAG_CACHE_DIR"]).expanduser() / "golden"
    return Path.home() / ".cache" / "diag" / "golden"


def _mark_cache_folder(gdir: Path) -> None:
    """When the golden store lives in diag's cache folder (``$DIAG_CACHE_DIR/golden``), mark
    that folder as diag's, so `diag cache clear` accepts the folder diag created."""
    from diag.oracle.cache import GroundTruthCache, default_cache_dir

    if Path(gdir) == default_cache_dir() / "golden":
        try:
            GroundTruthCache(default_cache_dir()).mark()
        except OSError:  # saving the golden digests reports any real write problem
            pass


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "unknown"


def golden_path(root: Path, platform: str, kind: str, versions: Mapping[str, str]) -> Path:
    """Where the golden digests of one device kind and jax/jaxlib version live."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(versions.items()))
    return Path(root) / _safe(f"{platform}-{kind}") / f"{_safe(tag)}.json"


def _load_golden(path: Path, keys: Mapping[str, str]) -> dict[str, list[str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    stored = data.get("workloads", {}) if isinstance(data, dict) else {}
    out = {}
    for name, key in keys.items():
        entry = stored.get(key)
        if isinstance(entry, list) and len(entry) == INPUTS_PER_WORKLOAD:
            out[name] = [str(x) for x in entry]
    return out


def _save_golden(path: Path, keys: Mapping[str, str], digests: np.ndarray,
                 meta: Mapping[str, Any]) -> int:
    """Store the unanimous digest per (workload, input); returns the entries written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    stored = data.get("workloads", {}) if isinstance(data, dict) else {}
    n = 0
    for w, key in enumerate(keys.values()):
        per_input = []
        for k in range(INPUTS_PER_WORKLOAD):
            values = np.unique(digests[:, w, k::INPUTS_PER_WORKLOAD])
            per_input.append(str(values[0]) if len(values) == 1 else None)
        if all(per_input):
            stored[key] = per_input
            n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"schema": GOLDEN_SCHEMA, **meta, "saved": time.time(),
                               "workloads": stored}, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return n


# ---------------------------------------------------------------------------------------------
# Running on devices (jax)
# ---------------------------------------------------------------------------------------------

def _import_jax(host_devices: Optional[int]):
    """Import jax, first forcing `host_devices` CPU devices when asked.

    Raises:
        UsageError: jax was already started in this process with another CPU device count.
        NodeScanError: jax is not installed.
    """
    flag = "--xla_force_host_platform_device_count"
    already = "jax" in sys.modules
    if host_devices is not None:
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
        os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={host_devices}"])
    try:
        import jax
    except ImportError:
        raise NodeScanError("diag nodes needs jax: pip install 'diag[jax]' (or jax[tpu], "
                            "jax[cuda12])") from None
    if host_devices is not None and already:
        have = len(jax.devices("cpu"))
        if have != host_devices:
            raise UsageError(f"--host-devices {host_devices}: jax was already started in this "
                             f"process with {have} CPU device(s); XLA reads "
                             f"{flag} once, so scan in a fresh process")
    return jax


def _init_distributed(jax, coordinator: Optional[str], num_processes: Optional[int],
                      process_id: Optional[int], timeout: int) -> None:
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise UsageError("--coordinator, --num-processes and --process-id go together; give "
                         "all three, or none to let jax detect the cluster (TPU pod, SLURM)")
    kwargs: dict[str, Any] = {"initialization_timeout": timeout}
    if coordinator is not None:
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes,
                      process_id=process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NodeScanError(f"jax.distributed could not start ({first}); outside a TPU pod or "
                            "SLURM job pass --coordinator HOST:PORT --num-processes N "
                            "--process-id I on every host") from None


class _StdoutToStderr:
    """Send fd 1 to stderr while jax.distributed runs: its C++ collectives (Gloo) print
    connection lines on stdout, which would corrupt ``--json`` output a scheduler parses."""

    def __enter__(self):
        sys.stdout.flush()
        self._saved = os.dup(1)
        os.dup2(2, 1)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._saved, 1)
        os.close(self._saved)
        return False


def _nonfinite(arr: np.ndarray) -> tuple[int, int]:
    if not is_supported(arr.dtype):
        return 0, 0
    return int(np.isnan(arr).sum()), int(np.isinf(arr).sum())


@dataclass
class _Local:
    """This process's share: its devices' digests and timings, and the outputs for ULPs."""

    devices: list
    digests: np.ndarray   # uint8 [d, W, R, 32]
    nan: np.ndarray
    inf: np.ndarray
    times: np.ndarray
    injected: np.ndarray
    outputs: list = field(default_factory=list)  # [d][w][r] host arrays
    compile_s: float = 0.0  # the warm-up calls: compiling for every device


def _run_local(jax, devices, workloads: Sequence[Workload], repeats: int, seed: int,
               injections: Sequence[Injection], process_index: int) -> _Local:
    d_n, w_n = len(devices), len(workloads)
    shape = (d_n, w_n, repeats)
    local = _Local(devices, np.zeros(shape + (_DIGEST_BYTES,), np.uint8),
                   np.zeros(shape, np.int32), np.zeros(shape, np.int32),
                   np.zeros(shape, np.float64), np.zeros(shape, bool),
                   [[[None] * repeats for _ in range(w_n)] for _ in range(d_n)])
    fns = [w.build() for w in workloads]
    inputs = [[w.make_input(seed, k) for k in range(INPUTS_PER_WORKLOAD + 1)] for w in workloads]
    inj = [[i for i in injections if i.applies_to(dev.id, process_index)] for dev in devices]
    rngs = [np.random.default_rng([i.seed for i in inj[d]] + [process_index, dev.id])
            for d, dev in enumerate(devices)]
    # Warm-up (compile) on the extra input; its output is what a "stuck" device returns first.
    last = [[None] * w_n for _ in range(d_n)]
    t0 = time.perf_counter()
    for w, fn in enumerate(fns):
        for d, dev in enumerate(devices):
            try:
                last[d][w] = np.asarray(fn(jax.device_put(inputs[w][-1], dev)))
            except DiagError:
                raise
            except Exception as e:
                raise NodeScanError(f"workload {workloads[w].name} raised on device {dev.id}: "
                                    f"{type(e).__name__}: {e}") from None
    local.compile_s = time.perf_counter() - t0
    for r in range(repeats):
        for w, fn in enumerate(fns):
            x = inputs[w][r % INPUTS_PER_WORKLOAD]
            for d, dev in enumerate(devices):
                xd = jax.device_put(x, dev)
                jax.block_until_ready(xd)
                faults = [i for i in inj[d] if rngs[d].random() < i.rate]
                t0 = time.perf_counter()
                y = fn(xd)
                jax.block_until_ready(y)
                if any(i.kind == "slow" for i in faults):
                    time.sleep(max(i.delay for i in faults if i.kind == "slow"))
                local.times[d, w, r] = time.perf_counter() - t0
                out = np.asarray(y)
                delivered = out
                for i in faults:
                    if i.kind != "slow":
                        delivered = _corrupt(delivered, i.kind, last[d][w], rngs[d])
                last[d][w] = out
                local.injected[d, w, r] = bool(faults)
                local.outputs[d][w][r] = delivered
                digest = hashlib.sha256(np.ascontiguousarray(bits_view(delivered)).tobytes())
                local.digests[d, w, r] = np.frombuffer(digest.digest(), np.uint8)
                local.nan[d, w, r], local.inf[d, w, r] = _nonfinite(delivered)
    return local


def _hexes(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 32] -> str array [...] of hex digests."""
    flat = raw.reshape(-1, raw.shape[-1])
    return np.array([bytes(row).hex() for row in flat], dtype=object).reshape(raw.shape[:-1])


def _name_bytes(text: str) -> np.ndarray:
    raw = text.encode()[:_NAME_BYTES]
    return np.frombuffer(raw + b"\0" * (_NAME_BYTES - len(raw)), np.uint8).copy()


def _name_text(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode(errors="replace")


def _local_ulps(local: _Local, ref: np.ndarray) -> np.ndarray:
    """Max ULP distance of each local output from a local copy of the reference output."""
    d_n, w_n, r_n = local.nan.shape
    out = np.full((d_n, w_n, r_n), np.nan)
    hexes = _hexes(local.digests)
    for w in range(w_n):
        for r in range(r_n):
            holders = [d for d in range(d_n) if hexes[d, w, r] == ref[w, r]]
            if not holders:
                continue
            good = local.outputs[holders[0]][w][r]
            for d in range(d_n):
                y = local.outputs[d][w][r]
                if hexes[d, w, r] != ref[w, r] and is_supported(y.dtype) \
                        and y.dtype == good.dtype and y.shape == good.shape:
                    out[d, w, r] = float(ulp_distance(y, good).max())
    return out


def _gather(jax, local: _Local, process_index: int, host: str, distributed: bool):
    """Every process's rows, in process order: (device dicts, arrays...)."""
    kinds = [dev.device_kind for dev in local.devices]
    if not distributed:
        devs = [{"device_id": int(dev.id), "process_index": process_index, "host": host,
                 "kind": kinds[i], "platform": dev.platform}
                for i, dev in enumerate(local.devices)]
        return devs, local.digests, local.nan, local.inf, local.times, local.injected
    from jax.experimental import multihost_utils as mu

    counts = np.asarray(mu.process_allgather(np.array([len(local.devices)], np.int32)))
    counts = counts.reshape(-1)
    dmax = int(counts.max())

    def pad(a, fill=0):
        extra = dmax - a.shape[0]
        if extra == 0:
            return a
        return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, a.dtype)])

    ids = pad(np.array([dev.id for dev in local.devices], np.int32), -1)
    meta = np.stack([_name_bytes(host), _name_bytes(kinds[0] if kinds else ""),
                     _name_bytes(local.devices[0].platform if local.devices else "")])
    g = [np.asarray(mu.process_allgather(a)) for a in (
        ids, meta, pad(local.digests), pad(local.nan), pad(local.inf),
        pad(local.times.astype(np.float32)), pad(local.injected.astype(np.uint8)))]
    g_ids, g_meta, g_dig, g_nan, g_inf, g_times, g_inj = g
    devs, rows = [], []
    for p in range(len(counts)):
        for i in range(int(counts[p])):
            devs.append({"device_id": int(g_ids[p, i]), "process_index": p,
                         "host": _name_text(g_meta[p, 0]), "kind": _name_text(g_meta[p, 1]),
                         "platform": _name_text(g_meta[p, 2])})
            rows.append((p, i))
    take = lambda a: np.stack([a[p, i] for p, i in rows])  # noqa: E731
    return (devs, take(g_dig), take(g_nan), take(g_inf), take(g_times).astype(np.float64),
            take(g_inj).astype(bool))


def _gather_ulps(local_ulps: np.ndarray, distributed: bool, counts_rows) -> np.ndarray:
    if not distributed:
        return local_ulps
    from jax.experimental import multihost_utils as mu

    dmax, rows = counts_rows
    extra = dmax - local_ulps.shape[0]
    if extra:
        local_ulps = np.concatenate([local_ulps, np.full((extra,) + local_ulps.shape[1:],
                                                         np.nan)])
    g = np.asarray(mu.process_allgather(local_ulps.astype(np.float32))).astype(np.float64)
    return np.stack([g[p, i] for p, i in rows])


def _versions(jax) -> dict[str, str]:
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except Exception:
        jaxlib_version = "unknown"
    return {"jax": jax.__version__, "jaxlib": jaxlib_version}


def scan(*, workloads: Optional[Sequence[Workload]] = None, repeats: int = 10, seed: int = 0,
         host_devices: Optional[int] = None, platform: Optional[str] = None,
         injections: Sequence[Injection] = (), distributed: bool = False,
         coordinator: Optional[str] = None, num_processes: Optional[int] = None,
         process_id: Optional[int] = None, init_timeout: int = 60,
         golden_dir: Optional[os.PathLike] = None, save_golden: bool = False,
         use_golden: bool = True, slow_factor: float = 1.5,
         fail_on_slow: bool = False) -> dict[str, Any]:
    """Scan every local device (every device of every process with `distributed`).

    Args:
      workloads: what to run; default every builtin (`BUILTIN_WORKLOADS`).
      repeats: R, calls per device per workload; inputs alternate between two seeded arrays.
      seed: draws the inputs (and is part of the golden key).
      host_devices: force this many CPU devices (sets XLA_FLAGS before jax is imported);
        implies platform "cpu".
      platform: "cpu", "gpu" or "tpu"; default jax's default backend.
      injections: faults diag applies to chosen devices' outputs (self-test).
      distributed: start `jax.distributed` first (auto-detected on TPU pods and SLURM, or
        the explicit `coordinator`, `num_processes`, `process_id`).
      init_timeout: seconds to wait for every process to join.
      golden_dir: the golden store (default `default_golden_dir()`).
      save_golden: store this scan's digests as golden when every device agrees.
      use_golden: compare with a stored golden digest when there is one.
      slow_factor: straggler threshold, see `analyze`.
      fail_on_slow: stragglers count as suspects.

    Returns:
      The nodes.json data: the verdict of `analyze` plus ``process_index``,
      ``num_processes``, ``workloads``, ``golden``, ``injections``, ``detection``,
      ``selftest`` (None without injections, else ``{"verdict": "found" | "missed",
      "injections": injection_outcomes(...)}``), timings. ``exit_code`` is 3 with a suspect,
      else `EXIT_SELFTEST_MISSED` (1) when an injected fault was not found, else 0. Every
      process returns the same verdict; only ``process_index`` differs (and ``selftest``,
      which covers the injections that process was given).

    Raises:
      UsageError: bad arguments, jax already started with another device count, an
        injection that matches no scanned device, or (`diag.flags.BadFlag`) a flag in
        XLA_FLAGS that XLA refuses, found in a throwaway process before jax is imported
        here (XLA would abort this one).
      NodeScanError: jax missing, distributed start-up failed, or a workload raised.
    """
    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: expected at least 1")
    if host_devices is not None and host_devices < 1:
        raise UsageError(f"--host-devices {host_devices}: expected at least 1")
    if slow_factor <= 1:
        raise UsageError(f"--slow-factor {slow_factor:g}: expected a factor above 1")
    workloads = list(workloads) if workloads else list(BUILTIN_WORKLOADS.values())
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise UsageError(f"workload given twice: {', '.join(names)}")
    t_start = time.perf_counter()
    if "jax" not in sys.modules:
        # XLA aborts the whole process on a flag it does not know; find out in a throwaway one.
        from diag.flags import validate_xla_flags

        validate_xla_flags()
    jax = _import_jax(host_devices)
    # Gloo prints on stdout; --json output must stay parseable.
    with _StdoutToStderr() if distributed else contextlib.nullcontext():
        if distributed:
            _init_distributed(jax, coordinator, num_processes, process_id, init_timeout)
        elif any(v is not None for v in (coordinator, num_processes, process_id)):
            raise UsageError("--coordinator/--num-processes/--process-id need --distributed")
        try:
            platform = platform or ("cpu" if host_devices is not None else None)
            try:
                devices = jax.local_devices(backend=platform) if platform else jax.local_devices()
                every = jax.devices(platform) if platform else jax.devices()
            except RuntimeError as e:
                raise UsageError(f"--platform {platform}: {str(e).splitlines()[0]}") from None
            check_injections(injections, [(int(d.id), int(d.process_index)) for d in every])
            pid, nproc = jax.process_index(), jax.process_count()
            host = socket.gethostname()
            t_run = time.perf_counter()
            local = _run_local(jax, devices, workloads, repeats, seed, injections, pid)
            run_s = time.perf_counter() - t_run
            devs, raw, nan, inf, times, injected = _gather(jax, local, pid, host, distributed)
            digests = _hexes(raw)
            kind, plat = devs[0]["kind"], devs[0]["platform"]
            versions = _versions(jax)
            keys = {w.name: w.key(seed) for w in workloads}
            gdir = Path(golden_dir) if golden_dir else default_golden_dir()
            gpath = golden_path(gdir, plat, kind, versions)
            golden = _load_golden(gpath, keys) if use_golden else {}
            ref, _ = references(digests, golden, names)
            if distributed:
                counts = [sum(1 for d in devs if d["process_index"] == p) for p in range(nproc)]
                rows = [(p, i) for p in range(nproc) for i in range(counts[p])]
                ulps = _gather_ulps(_local_ulps(local, ref), True, (max(counts), rows))
            else:
                ulps = _local_ulps(local, ref)
        finally:
            if distributed:
                try:
                    jax.distributed.shutdown()
                except Exception:  # shutting down is best effort; the verdict is already computed
                    pass
    obs = Observations(devs, names, digests, nan, inf, times, injected, ulps)
    result = analyze(obs, golden, slow_factor=slow_factor, fail_on_slow=fail_on_slow)
    selftest = None
    if injections:
        outcomes = injection_outcomes({**result, "repeats": repeats, "workloads": names},
                                      injections, slow_factor)
        missed = [o for o in outcomes if not o["found"]]
        selftest = {"verdict": "missed" if missed else "found", "injections": outcomes}
        if missed and not result["suspects"]:
            # A self-test that did not see its own fault must not read as a clean fleet.
            result["exit_code"] = EXIT_SELFTEST_MISSED
    golden_info: dict[str, Any] = {"path": str(gpath), "compared": sorted(golden),
                                   "saved": 0}
    if save_golden:
        if result["suspects"]:
            result["notes"].append("golden not saved: the scan found suspects")
        elif pid == 0:
            _mark_cache_folder(gdir)
            golden_info["saved"] = _save_golden(gpath, keys, digests, {
                "platform": plat, "device_kind": kind, **versions, "host": host,
                "devices": len(devs)})
    return {
        "schema": NODES_SCHEMA,
        "process_index": pid, "num_processes": nproc, "platform": plat, "device_kind": kind,
        "versions": versions, "repeats": repeats, "seed": seed,
        "inputs_per_workload": INPUTS_PER_WORKLOAD,
        "workloads": [{"name": w.name, "shape": list(w.shape), "dtype": w.dtype,
                       "key": w.key(seed)} for w in workloads],
        "golden": golden_info,
        "injections": [{"kind": i.kind, "rate": i.rate, "device": i.device,
                        "process": i.process, "seed": i.seed, "text": i.describe()}
                       for i in injections],
        "detection": _detection(repeats, len(workloads), injections),
        "selftest": selftest,
        "local_devices": len(devices), "compile_seconds": local.compile_s,
        "scan_seconds": run_s - local.compile_s,
        "seconds_per_device": (run_s - local.compile_s) / max(len(devices), 1),
        "total_seconds": time.perf_counter() - t_start,
        **result,
    }


# ---------------------------------------------------------------------------------------------
# Run folder and report
# ---------------------------------------------------------------------------------------------

_STATUS = {"ok": "pass", "slow": "warn", "suspect": "fail"}


def write_run(nodes: Mapping[str, Any], out: os.PathLike | str = "reports",
              argv: Optional[Sequence[str]] = None) -> Path:
    """Write a run folder: run.json, one record per device in results.jsonl, and nodes.json.

    The per-device records (``kind: "node"``, status pass / warn for slow / fail for a suspect)
    let the ordinary report and tools read a scan like any run; nodes.json keeps everything.

    Returns:
      The run folder.
    """
    from diag.environment import collect
    from diag.results import Record, RunDir, new_run_id

    run_id = new_run_id()
    run = RunDir.create(out, run_id, collect(list(argv) if argv is not None else None))
    for d in nodes.get("devices", []):
        run.append(Record(
            op="nodes", probe="nodes.scan",
            case=f"process {d['process_index']} device {d['device_id']}",
            params={"device_id": d["device_id"], "process_index": d["process_index"],
                    "host": d["host"], "repeats": nodes.get("repeats")},
            backend=f"jax-{d.get('platform', '')}",
            device={"platform": d.get("platform"), "kind": d.get("kind"), "id": d["device_id"],
                    "host": d["host"], "process_index": d["process_index"]},
            dtype="", kind="node", status=_STATUS[d["verdict"]], reason=d["reason"],
            metrics={k: d.get(k) for k in ("calls", "mismatched_calls", "nan_count",
                                           "inf_count", "intermittent_calls",
                                           "golden_mismatch_calls", "undecided_calls",
                                           "max_ulp", "injected_calls", "injected_caught",
                                           "time_ratio")},
            timings={"run_s_median": d.get("time_median_s"), "run_s_min": d.get("time_min_s")},
            framework={"name": "jax", **(nodes.get("versions") or {})}, run_id=run_id))
    data = {**nodes, "run_id": run_id}
    tmp = run.path / ".nodes.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, run.path / "nodes.json")
    run.update_meta(state="finished", finished=time.time(), command="nodes",
                    exit_code=nodes.get("exit_code"),
                    nodes={"verdict": nodes.get("verdict"),
                           "selftest": (nodes.get("selftest") or {}).get("verdict"),
                           "suspects": len(nodes.get("suspects", [])),
                           "devices": len(nodes.get("devices", []))})
    return run.path


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def report_context(nodes: Mapping[str, Any]) -> dict[str, Any]:
    """What the HTML report's nodes section shows, from a run folder's nodes.json.

    Returns:
      {"verdict", "suspects", "slow", "rows", "hosts", "detection", "notes", "injections",
      "summary"}; every value is plain data (the template escapes it).
    """
    def ms(x):
        return f"{1e3 * x:.3g} ms" if isinstance(x, (int, float)) else "—"

    rows = []
    for d in nodes.get("devices", []):
        nonfinite = (d.get("nan_count") or 0) + (d.get("inf_count") or 0)
        rows.append({
            "verdict": d.get("verdict", ""), "process_index": d.get("process_index"),
            "host": d.get("host", ""), "device_id": d.get("device_id"),
            "kind": d.get("kind", ""), "mismatched": d.get("mismatched_calls", 0),
            "calls": d.get("calls", 0), "nonfinite": nonfinite,
            "max_ulp": _ulp_text(d.get("max_ulp")),
            "time": ms(d.get("time_median_s")), "ratio": f"{d.get('time_ratio', 1.0):.2f}",
            "reason": d.get("reason", ""),
        })
    det = nodes.get("detection") or {}
    detection = [{"rate": f"{row['rate']:g}", "p": f"{100 * row['p_detect']:.4g}%",
                  "r99": row["repeats_for_99"]} for row in det.get("rows", [])]
    n_dev = len(rows)
    summary = (f"{n_dev} device(s) on {len(nodes.get('hosts', []))} host(s), "
               f"{nodes.get('repeats')} repeat(s) x {len(nodes.get('workloads', []))} "
               f"workload(s); {len(nodes.get('suspects', []))} suspect(s), "
               f"{len(nodes.get('slow', []))} slow")
    return {
        "verdict": nodes.get("verdict", "ok"), "summary": summary,
        "suspects": list(nodes.get("suspects", [])), "slow": list(nodes.get("slow", [])),
        "rows": rows, "hosts": list(nodes.get("hosts", [])), "detection": detection,
        "detection_formula": det.get("formula", ""),
        # A self-test's outcome is the first thing to read when faults were injected.
        "notes": [o.get("text", "") for o in (nodes.get("selftest") or {}).get("injections", [])]
        + list(nodes.get("notes", [])),
        "injections": [i.get("text", "") for i in nodes.get("injections", [])],
    }
