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
export CUDAMEDIC_STATE_DIR=${CUDAMEDIC_STATE_DIR:-out/state}   # fix journal, locks, audit log
export CUDAMEDIC_OUT_DIR=$OUT
mkdir -p "$OUT"
PLAIN=unix:///tmp/cudamedic-lab/engines/plain/docker.sock

echo
echo "== 1. A DataLoader-style workload on the lab's GPU host fails: /dev/shm is Docker's 64 MB"
for c in $(docker ps -aq --filter name=train-); do docker rm -f "$c" >/dev/null; done
docker volume create train-data >/dev/null
docker run -d --name train-shm --network none --gpus all -v train-data:/data \
  cudamedic-lab/busybox:1 \
  sh -c 'date > /data/started; nvidia-smi -L; dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=256 && sleep 3600' >/dev/null
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
echo "== 4. Fix it safely: plan, apply, verify (the original is kept as a backup)"
"$VENV/cudamedic" fix gpu-healthy --container train-shm --apply --yes | sed -n '/^plan/,$p'
docker ps -a --filter name=train-shm --format '   {{.Names}}: {{.Status}}'

echo
echo "== 5. A container started without --gpus, on a host whose engine lacks the toolkit hook:"
echo "      the fix is tried, fails at start, and is rolled back to the exact original"
for c in $(docker -H "$PLAIN" ps -aq --filter name=train-); do docker -H "$PLAIN" rm -f "$c" >/dev/null; done
docker -H "$PLAIN" run -d --name train-nogpu --network none -e NVIDIA_VISIBLE_DEVICES=all \
  cudamedic-lab/busybox:1 sh -c 'nvidia-smi -L; sleep 3600' >/dev/null
sleep 2
"$VENV/cudamedic" fix gpu-nohook --container train-nogpu --apply --yes | sed -n '/^diagnosis/,/^  bundle/p;/^outcome/,$p' || true
docker -H "$PLAIN" ps -a --filter name=train-nogpu --format '   {{.Names}}: {{.Status}}'

echo
echo "Bundles are in $OUT, the audit log in $CUDAMEDIC_STATE_DIR/audit.jsonl."
echo "Stop the lab with: make lab-down"
