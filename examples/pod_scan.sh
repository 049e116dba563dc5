#!/usr/bin/env bash
# Pod-wide bad-node scan: run THIS SAME COMMAND on every host of the job.
#
#   TPU pod slice:  gcloud compute tpus tpu-vm ssh NAME --worker=all --command="bash pod_scan.sh"
#   SLURM:          srun --nodes=N --ntasks-per-node=1 bash pod_scan.sh
#   anything else:  DIAG_COORDINATOR=host0:12345 DIAG_NUM_PROCESSES=N DIAG_PROCESS_ID=I bash pod_scan.sh
#
# On a TPU pod and under SLURM, `jax.distributed.initialize()` finds the coordinator, the number
# of processes and this process's index by itself (TPU metadata; SLURM_* variables), so
# `--distributed` needs nothing else. Elsewhere set the three DIAG_* variables above on each host.
# Every process scans its local devices; digests are gathered with JAX's multihost utilities and
# process 0 writes the verdict (reports/<run-id>/nodes.json, report.html) and prints the JSON.
# Every process exits 3 when a suspect device or host was found, 0 when all agree.
#
# Every process also gathers its configuration (versions, XLA_FLAGS, JAX precision settings, the
# measured matmul arithmetic): a host whose configuration differs from the majority is listed
# under "misconfigured" with the keys that differ, apart from the "suspects" (hardware).
#
# Self-test on one CPU machine (3 processes, 2 devices each; process 1 corrupts its outputs,
# process 2 runs with --xla_cpu_enable_fast_math=true):
#   SELFTEST=1 bash examples/pod_scan.sh
# PYTHON names the interpreter diag is installed in (default: python3 on PATH).
set -euo pipefail

PYTHON="${PYTHON:-python3}"

REPEATS="${REPEATS:-20}"
OUT="${OUT:-reports}"
args=(nodes --distributed --repeats "$REPEATS" --out "$OUT" --json)
if [[ -n "${DIAG_COORDINATOR:-}" ]]; then
  args+=(--coordinator "$DIAG_COORDINATOR" --num-processes "$DIAG_NUM_PROCESSES"
         --process-id "$DIAG_PROCESS_ID")
fi

if [[ "${SELFTEST:-0}" == 1 ]]; then
  port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for i in 0 1 2; do
    extra=()
    flags="${XLA_FLAGS:-}"
    [[ $i == 1 ]] && extra=(--inject "process=1,kind=bitflip,rate=0.2")
    [[ $i == 2 ]] && flags="$flags --xla_cpu_enable_fast_math=true"
    XLA_FLAGS="$flags" "$PYTHON" -m diag.cli nodes --distributed --coordinator "127.0.0.1:$port" --num-processes 3 \
      --process-id "$i" --host-devices 2 --repeats "$REPEATS" -w matmul_f32,softmax \
      --out "$OUT" --json "${extra[@]}" > "$OUT.p$i.json" 2> "$OUT.p$i.log" &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  "$PYTHON" - "$OUT.p0.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
print("exclude:", [(s["host"], s["process_index"], s["device_id"]) for s in data["suspects"]])
print("misconfigured:", [(m["host"], m["process_index"], [d["key"] for d in m["differs"]])
                         for m in data["misconfigured"]])
PY
  exit "$rc"
fi

# The JSON's "suspects" list (device_id, process_index, host, reason) is the exclusion list;
# "misconfigured" (process_index, host, differs: [{key, value, majority}]) the hosts to fix.
exec "$PYTHON" -m diag.cli "${args[@]}"
