"""Appending 1,000 runs of the ci suite to a history and querying it (issue 47).

    PYTHONPATH=$PWD python benchmarks/bench_history.py [--runs 1000] [--run-dir RUN_DIR]

A real run folder of the ci suite (made with `diag run --suite ci -b jax-cpu` when none is
given) is appended `--runs` times, each copy with its own run id, its bound ratios jittered
and, from run 700 on, one record's output digest changed (a planted move for the query to
find). Printed side by side:

* append: seconds per run (median and spread over every append), beside the floor of reading
  the run folder itself (run.json and results.jsonl, which every append must do), and the ratio;
* query: `diag.gate.series.read` of the whole history (every record's series and its moves)
  and of one record (`--record`), beside the floor of fetching the same rows from SQLite
  without looking at them, and the ratios; then the `diag history` command end to end;
* the file's size per run.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import describe, machine  # noqa: E402

from diag.gate import history, series  # noqa: E402

PLANTED_AT = 700


def _ci_run(tmp: Path) -> Path:
    out = tmp / "runs"
    r = subprocess.run(
        ["diag", "run", "--suite", "ci", "-b", "jax-cpu", "--no-report", "--json", "-o",
         str(out)], capture_output=True, text=True)
    return Path(json.loads(r.stdout)["run_dir"])


def _copy(src_meta: dict, src_recs: list[dict], dst: Path, n: int, rng: random.Random) -> None:
    meta = {**src_meta, "run_id": f"run-{n:05d}", "started": 1.8e9 + 60 * n}
    recs = []
    for i, rec in enumerate(src_recs):
        rec = json.loads(json.dumps(rec))
        m = rec.get("metrics") or {}
        if isinstance(m.get("bound_ratio"), float):
            m["bound_ratio"] *= 1 + rng.uniform(-1e-3, 1e-3)
        if i == 0 and n >= PLANTED_AT and m.get("output_digests"):
            m["output_digests"] = ["f" * 64 for _ in m["output_digests"]]
        recs.append(rec)
    (dst / "run.json").write_text(json.dumps(meta))
    (dst / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _summary(samples: list[float]) -> str:
    """Median, 10th and 90th percentile and maximum of many samples (all would be too many)."""
    q = statistics.quantiles(samples, n=10)
    return (f"median {statistics.median(samples):.4f} s, p10 {q[0]:.4f}, p90 {q[-1]:.4f}, "
            f"max {max(samples):.4f} ({len(samples)} samples)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--run-dir", type=Path)
    args = ap.parse_args()
    print(machine())
    tmp = Path(tempfile.mkdtemp(prefix="bench-history-"))
    src = args.run_dir or _ci_run(tmp)
    meta, recs = history.read_run(src)
    print(f"source: {src}: {len(recs)} records of suite {meta['suite']['name']}")
    work, db, rng = tmp / "copy", tmp / "h.db", random.Random(0)
    work.mkdir()
    appends, floors = [], []
    for n in range(1, args.runs + 1):
        _copy(meta, recs, work, n, rng)
        t0 = time.perf_counter()
        history.read_run(work)
        floors.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        history.append(db, work)
        appends.append(time.perf_counter() - t0)
    a, f = statistics.median(appends), statistics.median(floors)
    print(f"append ({args.runs} runs, {sum(appends):.2f} s in all): {_summary(appends)}")
    print(f"floor, reading the run folder: {_summary(floors)}")
    print(f"append / floor: {a / f:.2f}x")

    def fetch_all() -> None:
        con = sqlite3.connect(db)
        con.execute("SELECT record, run, status, data FROM records ORDER BY record, run").fetchall()
        con.close()

    key = f"{recs[0]['probe']} | {recs[0]['case']} | {recs[0]['backend']}"

    def fetch_one() -> None:
        con = sqlite3.connect(db)
        con.execute("SELECT * FROM records WHERE record = ?", (key,)).fetchall()
        con.close()

    for label, query, floor in (
        ("every record", lambda: series.read(db), fetch_all),
        ("one record", lambda: series.read(db, record=key), fetch_one),
    ):
        qs, fs = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            found = query()
            qs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            floor()
            fs.append(time.perf_counter() - t0)
        moved = [(s.record, [c.after.run for c in s.changes]) for s in found.moved]
        print(f"query, {label}: {describe(qs)}; moved: {moved}")
        print(f"floor, fetching the rows: {describe(fs)}")
        print(f"query / floor: {statistics.median(qs) / statistics.median(fs):.2f}x")
    t0 = time.perf_counter()
    r = subprocess.run(["diag", "history", str(db)], capture_output=True, text=True)
    print(f"`diag history` end to end: {time.perf_counter() - t0:.2f} s (exit {r.returncode})")
    print(f"file: {db.stat().st_size / 2**20:.1f} MiB, "
          f"{db.stat().st_size / args.runs / 1024:.1f} KiB per run")


if __name__ == "__main__":
    main()
