"""How long `diag nodes` takes per device, and how likely it is to catch a faulty device.

Run: python benchmarks/bench_nodes.py [--devices 8] [--trials 10]

Prints, from one process with N forced CPU host devices:
  1. scan time per device for the builtin workloads (compile once per device, then per repeat),
     as medians over repeated scans with their spread;
  2. detection probability versus R: the formula 1 - (1 - p)^(R*W) next to the fraction of
     scans, each with a fresh injection seed, that named the device carrying a fault of rate p.
"""

from __future__ import annotations

import argparse
import statistics
import time

from diag import nodes


def _median_spread(xs):
    return statistics.median(xs), (max(xs) - min(xs)) / statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--trials", type=int, default=100, help="scans per (rate, R) point")
    ap.add_argument("--rate", type=float, default=0.05, help="injected fault rate per call")
    args = ap.parse_args()

    print(f"diag nodes benchmark: {args.devices} CPU host devices")
    print("\n1. scan time per device (builtin workloads: matmul_bf16, matmul_f32, softmax, "
          "train_step)")
    first = nodes.scan(repeats=1, host_devices=args.devices, use_golden=False)
    print(f"compile (first scan in a process): {first.compile_seconds / args.devices:.3f} s "
          "per device")
    print(f"{'R':>4} {'repeats/dev':>12} {'per call':>10} {'spread':>7}")
    for repeats in (10, 40, 160):
        per_dev, per_call = [], []
        for _ in range(5):
            r = nodes.scan(repeats=repeats, host_devices=args.devices, use_golden=False)
            per_dev.append(r.seconds_per_device)
            per_call.append(r.seconds_per_device / (repeats * len(r.workloads)))
        med, spread = _median_spread(per_dev)
        print(f"{repeats:>4} {med:>10.4f} s {statistics.median(per_call) * 1e3:>7.3f} ms "
              f"{spread:>6.0%}")

    w = [nodes.builtin_workload("matmul_f32")]
    print(f"\n2. detection of a bitflip fault at rate {args.rate:g} per call on one device "
          f"(W=1, {args.trials} scans per R, each with its own injection seed)")
    print(f"{'R':>4} {'formula':>9} {'measured':>9}")
    t0 = time.perf_counter()
    for repeats in (2, 5, 10, 20, 40, 90):
        caught = 0
        for trial in range(args.trials):
            inj = nodes.Injection(kind="bitflip", rate=args.rate, device=1, seed=trial)
            r = nodes.scan(workloads=w, repeats=repeats, host_devices=args.devices,
                           injections=[inj], use_golden=False)
            caught += [s["device_id"] for s in r.suspects] == [1]
        print(f"{repeats:>4} {nodes.detection_probability(args.rate, repeats, 1):>9.1%} "
              f"{caught / args.trials:>9.1%}")
    print(f"R needed for 99% at this rate: {nodes.repeats_for(args.rate, 1, 0.99)} "
          f"(W=1), {nodes.repeats_for(args.rate, 4, 0.99)} (W=4 builtins); "
          f"part 2 took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
