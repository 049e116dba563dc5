"""How long `diag nodes` takes per device, and how likely it is to catch a faulty device.

Run: python benchmarks/bench_nodes.py [--devices 8] [--trials 10] [--parts 1,2,3]

Prints, from one process with N forced CPU host devices:
  1. scan time per device for the builtin workloads (compile once per device, then per repeat),
     as medians over repeated scans with their spread;
  2. detection probability versus R: the formula 1 - (1 - p)^(R*W) next to the fraction of
     scans, each with a fresh injection seed, that named the device carrying a fault of rate p;
  3. the torch builtins' time per call on the CPU (one torch device, next to jax's from part 1),
     and what each process pays to collect its configuration fingerprint (versions, settings,
     the measured float32 matmul arithmetic) in a multi-process scan, jax and torch.
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
    ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3")
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}

    print(f"diag nodes benchmark: {args.devices} CPU host devices")
    if 1 in parts:
        _scan_time(args)
    if 2 in parts:
        _detection(args)
    if 3 in parts:
        _torch_and_fingerprint(args)


def _scan_time(args) -> None:
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



def _detection(args) -> None:
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


def _torch_and_fingerprint(args) -> None:
    import jax

    from diag.nodes import config
    from diag.nodes.distributed import JaxRuntime
    from diag.nodes.torch_runtime import TorchRuntime

    print("\n3. torch builtins on the CPU (one device), and the configuration fingerprint")
    print(f"{'R':>4} {'per call':>10} {'spread':>7}")
    for repeats in (10, 40):
        per_call = []
        for _ in range(5):
            r = nodes.scan(repeats=repeats, framework="torch", use_golden=False)
            per_call.append(r.seconds_per_device / (repeats * len(r.workloads)))
        med, spread = _median_spread(per_call)
        print(f"{repeats:>4} {med * 1e3:>7.3f} ms {spread:>6.0%}   raw: "
              + ", ".join(f"{x * 1e3:.3f}" for x in per_call))
    for name, rt in (("jax", JaxRuntime(jax, "cpu", False)), ("torch", TorchRuntime(None, False))):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fp = config.fingerprint(rt.settings())
            times.append(time.perf_counter() - t0)
        med, spread = _median_spread(times)
        print(f"fingerprint ({name}, {len(fp)} keys): {med * 1e3:.1f} ms median, spread "
              f"{spread:.0%}; raw ms: " + ", ".join(f"{x * 1e3:.1f}" for x in times))


if __name__ == "__main__":
    main()
