#!/usr/bin/env bash
# The main job on this machine: start the lab (a simulated GPU host with a real Docker engine and
# sshd), break a training container the way real ones break, then let cudamedic collect the
# evidence over SSH and the Docker API and diagnose it. Run as root: `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv/bin

"$VENV/python" -m tests.lab up
eval "$("$VENV/python" -m tests.lab env)"   # CUDAMEDIC_CONFIG, DOCKER_HOST (the lab's GPU engine)
OUT=${CUDAMEDIC_DEMO_OUT:-out/demo}
mkdir -p "$OUT"

echo
echo "== 1. A DataLoader-style workload on the lab's GPU host fails: /dev/shm is Docker's 64 MB"
docker rm -f train-shm >/dev/null 2>&1 || true
docker run -d --name train-shm --network none --gpus all \
  -e NVIDIA_VISIBLE_DEVICES=all cudamedic-lab/busybox:1 \
  sh -c 'nvidia-smi -L; dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=256 && sleep 3600' >/dev/null
sleep 2
bundle=$("$VENV/cudamedic" collect gpu-healthy --container train-shm --out "$OUT" \
          --trigger "train-shm died in the DataLoader")
echo "bundle: $bundle"
"$VENV/cudamedic" classify "$bundle"

echo
echo "== 2. The same host reports Xid 79 in its kernel log (a GPU fell off the bus)"
bundle=$("$VENV/cudamedic" collect gpu-xid79 --out "$OUT")
echo "bundle: $bundle"
"$VENV/cudamedic" classify "$bundle"

echo
echo "== 3. dmesg is not permitted on this host; cudamedic falls back to journalctl -k"
bundle=$("$VENV/cudamedic" collect gpu-mismatch --out "$OUT")
echo "bundle: $bundle"
"$VENV/cudamedic" classify "$bundle"

echo
echo "Bundles are in $OUT. Stop the lab with: make lab-down"
