#!/usr/bin/env bash
# The main job on this machine: start the lab (simulated GPU hosts: real sshd + Docker engines
# replaying recorded real outputs), break training containers the way real ones break, and let
# cudamedic respond as a Prefect flow on the embedded local Prefect server (started once, reused):
# collect, diagnose, plan, wait for approval, fix, verify, write the post-mortem; then sweep the
# whole fleet twice. Run as root: `make demo`.
#
# Every run tells the same story: it is a fleet of its own (CUDAMEDIC_FLEET=demo-<time>), so its
# sweeps start afresh and the per-hour fix cap counts only its own fixes; with its default state
# dir (out/state) it also starts without the last run's team history. Each step's output is
# kept in OUT_DIR/demo-steps and checked at the end (scripts/check_demo.py): the demo exits 1
# when an outcome is not the one this comment promises (CI runs it: .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv/bin
CM="$VENV/cudamedic"

echo "== The lab: two Docker engines and eight simulated GPU hosts (sshd); reused when up, a first start takes ~30 s ..."
"$VENV/python" -m tests.lab up
# Containers an earlier demo or a test run killed half-way left on the lab go first (its sweeps
# would report them as findings of every host). Do not run the tests on this lab meanwhile.
"$VENV/python" -m tests.lab clean
# CUDAMEDIC_CONFIG (the lab's inventory), DOCKER_HOST (its GPU engine), and the engine without
# the toolkit's hook (CUDAMEDIC_LAB_PLAIN_DOCKER_HOST); any lab dir (CUDAMEDIC_LAB_DIR).
lab_env=$("$VENV/python" -m tests.lab env)
eval "$lab_env"
PLAIN=$CUDAMEDIC_LAB_PLAIN_DOCKER_HOST
if [ -z "${CUDAMEDIC_STATE_DIR:-}" ]; then
  # The demo's own state dir: each run starts without the team history the last one left
  # (its post-mortems would be cited as similar incidents, and the story would change).
  rm -f "$PWD/out/state/history.jsonl"
fi
export CUDAMEDIC_OUT_DIR=${CUDAMEDIC_OUT_DIR:-$PWD/out/demo}      # bundles and reports
export CUDAMEDIC_STATE_DIR=${CUDAMEDIC_STATE_DIR:-$PWD/out/state} # audit, history, Prefect DB
export CUDAMEDIC_FLEET="demo-$(date -u +%Y%m%d-%H%M%S)"
STEPS=$CUDAMEDIC_OUT_DIR/demo-steps
mkdir -p "$CUDAMEDIC_OUT_DIR" "$CUDAMEDIC_STATE_DIR"
rm -rf "$STEPS" && mkdir -p "$STEPS"
triage=
trap '[ -n "$triage" ] && kill "$triage" 2>/dev/null; true' EXIT

echo "== 0. The embedded Prefect server (SQLite, 127.0.0.1 only; started once, then reused;"
echo "      its first start creates the database and takes ~20 s); this demo is fleet $CUDAMEDIC_FLEET"
"$CM" server start

echo
echo "== 1. A DataLoader workload on gpu-healthy dies: /dev/shm is Docker's 64 MB"
docker volume create train-data >/dev/null
docker run -d --name train-shm --network none --gpus all -v train-data:/data \
  cudamedic-lab/busybox:1 \
  sh -c 'date > /data/started; nvidia-smi -L; dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=256 && sleep 3600' >/dev/null
sleep 2

echo
echo "== 2. cudamedic triage: diagnose, plan, and wait for a person's approval"
log=$STEPS/1-triage-train-shm.txt
"$CM" triage gpu-healthy --container train-shm --apply --no-input \
  --trigger "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error." >"$log" 2>&1 &
triage=$!
run_id=
for _ in $(seq 240); do
  run_id=$(grep -o 'waiting for approval: `cudamedic approve [0-9a-f-]*' "$log" | awk '{print $NF}' || true)
  [ -n "$run_id" ] && break
  kill -0 "$triage" 2>/dev/null || break
  sleep 0.5
done
sed -n '/^diagnosis/,/^Approve/p' "$log"
if [ -n "$run_id" ]; then
  echo
  echo "== 3. A person approves (from any shell, the Prefect UI, or Slack), as their OS user"
  echo "\$ cudamedic approve $run_id --reason 'shm is the cause'"
  "$CM" approve "$run_id" --reason "shm is the cause" 2>&1 | tee "$STEPS/2-approve.txt"
else
  echo "cudamedic triage did not wait for approval:" >&2
  cat "$log" >&2
fi
rc=0
wait "$triage" || rc=$?
triage=
echo "exit status: $rc" >>"$log"
echo
sed -n '/^incident:/,$p' "$log"
docker ps -a --filter name=train-shm --format '   {{.Names}}: {{.Status}}'

echo
echo "== 4. A fix that cannot work is rolled back to the exact original (engine without the toolkit hook)"
docker -H "$PLAIN" run -d --name train-nogpu --network none -e NVIDIA_VISIBLE_DEVICES=all \
  cudamedic-lab/busybox:1 sh -c 'nvidia-smi -L; sleep 3600' >/dev/null
sleep 2
log=$STEPS/3-triage-train-nogpu.txt
rc=0
"$CM" triage gpu-nohook --container train-nogpu --apply --yes >"$log" 2>&1 || rc=$?
echo "exit status: $rc" >>"$log"
sed -n '/^incident:/,$p' "$log"
docker -H "$PLAIN" ps -a --filter name=train-nogpu --format '   {{.Names}}: {{.Status}}'

# The demo's sweeps also run nccl-tests (off in runbooks/sweep.yaml; the lab's recorded run takes
# 2 s), so the slow-NCCL host is reported too.
SWEEP_BOOK="$CUDAMEDIC_STATE_DIR/sweep-demo.yaml"
sed 's/^nccl_tests: false/nccl_tests: true/' runbooks/sweep.yaml >"$SWEEP_BOOK"
grep -q '^nccl_tests: true' "$SWEEP_BOOK"

echo
echo "== 5. Fleet health sweep over every lab host (with nccl-tests): each planted host problem, once"
CUDAMEDIC_SWEEP_RUNBOOK=$SWEEP_BOOK "$CM" sweep >"$STEPS/4-sweep-first.txt"
cut -c1-180 "$STEPS/4-sweep-first.txt"

echo
echo "== 6. The same sweep again: nothing changed, so nothing is reported"
CUDAMEDIC_SWEEP_RUNBOOK=$SWEEP_BOOK "$CM" sweep >"$STEPS/5-sweep-second.txt"
cut -c1-180 "$STEPS/5-sweep-second.txt"

echo
echo "Reports: $CUDAMEDIC_OUT_DIR/reports; audit: \`cudamedic audit\` (and $CUDAMEDIC_STATE_DIR/audit.jsonl)"
echo "Prefect UI: http://127.0.0.1:${CUDAMEDIC_PREFECT_PORT:-4200} (flow runs, the post-mortem and sweep artifacts)"
echo "Stop the server with: CUDAMEDIC_STATE_DIR=$CUDAMEDIC_STATE_DIR $CM server stop; the lab with: make lab-down"
echo
"$VENV/python" scripts/check_demo.py "$STEPS"
