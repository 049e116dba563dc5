"""A recorded run of every shipped suite's small cases: worker outputs and their judgement.

`python -m tests.judge_reference` runs the real worker code (`run_job`, in this process) of
jax-cpu, torch-cpu and emu-bf16x1 on every shipped suite's cases up to `MAX_HOST_BYTES`,
keeps their outputs (tests/data/judge_reference.npz) and diag's verdicts on them, each
backend's and each pair's agreement (tests/data/judge_reference.json). Recorded on the code
before every op moved into its own module under probes/.

The outputs are stored, not recomputed, so that what is compared does not depend on the CPU
(bf16 units, BLAS kernels): `tests/test_judge_reference.py` judges the stored bits again with
today's code and must get the same status, reason and metrics, record for record.
"""

from __future__ import annotations

import io
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
#: The shipped suites by name; `train` by a copy at small sizes (tests/data/train_small.toml);
#: `ci` as it was when the reference was recorded (tests/data/recorded/ci.toml): its bf16
#: softmax entry has drawn other inputs since (rows that show excess precision), a new case
#: with no recorded outputs, tested by tests/test_edges.py.
SUITES = (str(DATA / "recorded" / "ci.toml"), "preflight", "matmul", "sampling", "elementwise",
          "train_step", str(DATA / "train_small.toml"))
BACKENDS = ("jax-cpu", "torch-cpu", "emu-bf16x1")
#: Cases whose host estimate is above this are not run, and those where a backend's outputs
#: take more than `MAX_OUTPUT_BYTES` are not kept (the record stays a few MB).
MAX_HOST_BYTES = 160 << 20
MAX_OUTPUT_BYTES = 96 << 10
#: Significant digits a float metric is kept to: the float64 BLAS behind a bound may differ
#: in its last bits between CPUs; every other metric is exact at far fewer digits.
DIGITS = 12


def canon(value):
    """Metrics as JSON-ready data: floats to `DIGITS` significant digits, NaN/inf as text."""
    if isinstance(value, dict):
        return {str(k): canon(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return repr(v) if not math.isfinite(v) else float(f"{v:.{DIGITS}g}")
    if value is None or isinstance(value, str):
        return value
    return repr(value)


def name(suite: str) -> str:
    """A suite's name (the record's key), for a shipped name or a path."""
    return Path(suite).stem


def cases(suite: str):
    from diag.plan.suite import load_suite

    return [c for c in load_suite(suite).cases if c.host_bytes <= MAX_HOST_BYTES]


def judge_all(suite, cases_, events, judge, specs, probes) -> list[dict]:
    """Every verdict and agreement of `cases_` as records (the runner's order)."""
    out = []
    for case in cases_:
        done = [(s, events[s.name][case.id]) for s in specs if case.id in events[s.name]]
        judged = []
        for spec, event in done:
            outcome = judge.outcome(case, spec, event)
            ev = judge.evaluate(case, spec, outcome)
            out.append({"suite": suite, "case": case.label, "backend": spec.label,
                        "status": ev.status, "reason": ev.reason, "metrics": canon(ev.metrics)})
            judged.append((spec.label, outcome, ev.context))
        for i, (b, y, context) in enumerate(judged):
            for a, x, _ in judged[:i]:
                (na, xa), (nb, xb) = sorted([(a, x), (b, y)], key=lambda p: p[0])
                v = probes[case.op].agree(xa, xb, (na, nb), context)
                status, reason, metrics = v.status, v.reason, v.metrics
                out.append({"suite": suite, "case": case.label, "backend": f"{na}|{nb}",
                            "status": status, "reason": reason, "metrics": canon(metrics)})
    return out


def _too_big(cs, events) -> set[str]:
    """Cases whose outputs take more than `MAX_OUTPUT_BYTES` on some backend, but for the
    smallest case of each suite entry (every entry keeps one case)."""
    size = {c.id: max((sum(Path(o["path"]).stat().st_size for o in ev[c.id].outputs)
                       for ev in events.values() if c.id in ev), default=0) for c in cs}
    big = {cid for cid, n in size.items() if n > MAX_OUTPUT_BYTES}
    for entry in {c.probe for c in cs}:
        mine = [c.id for c in cs if c.probe == entry]
        if mine and all(cid in big for cid in mine):
            big.discard(min(mine, key=size.__getitem__))
    return big


def record() -> None:
    from diag.backends import get_spec, not_applicable
    from diag.worker.main import run_job
    from diag.worker.protocol import parse_event
    from diag.run.judge import Judge
    from diag.plan.registry import PROBES

    arrays, meta, records = {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        judge = Judge(work, str(work / "cache"))
        specs = [get_spec(n) for n in BACKENDS]
        for path in SUITES:
            suite = name(path)
            cs = cases(path)
            events = {}
            for spec in specs:
                mine = [c for c in cs if not_applicable(spec, c.op, c.params) is None]
                job = {"backend": spec.name, "label": spec.name, "out_dir": str(work / suite),
                       "repeats": 1, "fingerprint": [],
                       "cases": [{"id": c.id, "op": c.op,
                                  "op_args": {**PROBES[c.op].fixed_args, **c.op_args},
                                  "hunt_nans": PROBES[c.op].hunt_nans,
                                  "inputs": judge.store.inputs.paths(c),
                                  "input_dtypes": [c.dtype] * len(judge.store.inputs.paths(c))}
                                 for c in mine]}
                (work / suite).mkdir(exist_ok=True)
                stream = io.StringIO()
                if mine:
                    run_job(job, stream)
                got = [json.loads(x) for x in stream.getvalue().splitlines()]
                events[spec.name] = {e["case"]: parse_event(e) for e in got
                                     if e.get("event") == "result"}
            big = _too_big(cs, events)
            cs = [c for c in cs if c.id not in big]
            for spec in specs:
                events[spec.name] = {k: v for k, v in events[spec.name].items() if k not in big}
                for cid, e in events[spec.name].items():
                    key = f"{suite}/{spec.name}/{cid}"
                    names = []
                    for i, o in enumerate(e.outputs):
                        arrays[f"{key}/{i}"] = np.load(o["path"])  # raw bits for floats
                        names.append({"name": o["name"], "dtype": o["dtype"]})
                    meta[key] = {"outputs": names, "nan_report": e.nan_report}
            records += judge_all(suite, cs, events, judge, specs, PROBES)
    np.savez_compressed(DATA / "judge_reference.npz", **arrays)
    (DATA / "judge_reference.json").write_text(json.dumps(
        {"max_host_bytes": MAX_HOST_BYTES, "max_output_bytes": MAX_OUTPUT_BYTES, "backends": BACKENDS,
         "suites": [name(s) for s in SUITES],
         "events": meta, "records": records}, indent=0, sort_keys=True) + "\n")
    print(f"{len(records)} records, {len(arrays)} arrays", file=sys.stderr)


if __name__ == "__main__":
    record()
