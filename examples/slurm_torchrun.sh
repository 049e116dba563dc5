#!/usr/bin/env bash
# Bad-node scan of a PyTorch cluster: torchrun (one rank per GPU, NCCL; gloo on CPU), under SLURM.
#
#   SLURM, one torchrun per node:
#     sbatch --nodes=N --ntasks-per-node=1 --gpus-per-node=8 --wrap="srun bash slurm_torchrun.sh"
#   (NPROC ranks per node, default: the node's GPU count; node 0 is the rendezvous host.)
#   SLURM without torchrun (one task per GPU): export MASTER_ADDR/MASTER_PORT, then
#     srun --ntasks-per-node=8 python -m diag.cli nodes --distributed --framework torch --json
#   (diag reads the rank from SLURM_PROCID, the world size from SLURM_NTASKS, the GPU from
#   SLURM_LOCALID when torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not set.)
#
# Every rank runs the same workloads in torch on its device; digests are gathered with
# torch.distributed.all_gather; process 0 (rank 0) writes the verdict (reports/<run-id>/nodes.json,
# report.html) and prints the JSON on stdout: "suspects" (bad ranks/hosts/devices: exclude them)
# and "misconfigured" (ranks whose versions or numerics settings differ from the majority: fix
# them), each marking the ranks that are both. Every rank exits 3 when either list is non-empty;
# torchrun itself exits 1 when a rank exits non-zero, so this script exits with the JSON's
# exit_code on the node that holds rank 0.
#
# Self-test on one CPU machine (3 ranks over gloo; rank 1 corrupts its outputs, rank 2 runs with
# another float32 matmul precision; see examples/nodes_selftest_torch.py):
#   SELFTEST=1 bash examples/slurm_torchrun.sh
# PYTHON names the interpreter diag and torch are installed in (default: python3 on PATH);
# torchrun is run as "$PYTHON -m torch.distributed.run", the module behind the torchrun script.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
REPEATS="${REPEATS:-20}"
OUT="${OUT:-reports}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
free_port() {
  "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [[ "${SELFTEST:-0}" == 1 ]]; then
  launch=(--nnodes 1 --nproc-per-node 3 --master-addr 127.0.0.1 --master-port "$(free_port)")
  scan=(--repeats "$REPEATS" -w matmul_f32 -w "$here/nodes_selftest_torch.py:work"
        --input-shape 32,16)
  json="$OUT.torch.json"
else
  : "${SLURM_NNODES:?run under SLURM (srun), or SELFTEST=1 for the one-machine self-test}"
  nproc="${NPROC:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
  master="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
  launch=(--nnodes "$SLURM_NNODES" --nproc-per-node "$nproc" --node-rank "$SLURM_NODEID"
          --master-addr "$master" --master-port "${MASTER_PORT:-29500}")
  scan=(--repeats "$REPEATS")
  json="$OUT.node$SLURM_NODEID.json"
fi

mkdir -p "$(dirname "$OUT")"
rc=0
"$PYTHON" -m torch.distributed.run "${launch[@]}" -m diag.cli nodes --distributed \
  --framework torch --out "$OUT" --json "${scan[@]}" > "$json" || rc=$?
if [[ -s "$json" ]]; then  # this node ran rank 0: the verdict
  exec "$PYTHON" - "$json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
print("exclude:", [(s["host"], s["process_index"], s["device_id"]) for s in data["suspects"]])
print("misconfigured:", [(m["host"], m["process_index"], [d["key"] for d in m["differs"]])
                         for m in data["misconfigured"]])
sys.exit(data["exit_code"])
PY
fi
exit "$rc"
