#!/usr/bin/env bash
# Real GPU evidence for the fixtures, from a machine with NVIDIA GPUs (Docker is not needed).
#
# Records what the machine's own tools print - `nvidia-smi` (table, `-q -x`, `-L`, `topo -m`) and
# the kernel log (`dmesg -T`, else `journalctl -k`) - then runs cudamedic on the machine:
# `cudamedic collect local` (the bundle, as a .tar.gz), `cudamedic classify` of it, and
# `cudamedic sweep --host local`. Everything lands in OUT_ROOT/<gpu>/ (default
# tests/fixtures/real/<gpu>/, <gpu> from `nvidia-smi -L`, e.g. nvidia-h200), with meta.txt (date,
# GPU, count, driver and CUDA versions) and a .source beside each file saying where it came from.
#
#   scripts/gpu-check.sh [OUT_ROOT]
#
# cudamedic is $CUDAMEDIC if set, else .venv/bin/cudamedic, else it is installed into .venv-gpu
# from this checkout (`pip install -e .`); when none can be had, the raw recordings are still
# kept and the script says so. Each command has a timeout (a hung nvidia-smi costs 60 s).
# Exit status: 0 recorded, 2 no nvidia-smi on this machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT=${1:-tests/fixtures/real}
T=60

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: no nvidia-smi on this machine: nothing to record" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
raw="$work/raw"
mkdir -p "$raw"

record() {  # record FILE COMMAND...: stdout and stderr as printed, and the exit status
  local file=$1
  shift
  timeout -k 5 "$T" "$@" >"$raw/$file" 2>&1
  echo "$?" >"$raw/$file.rc"
  printf '%s\n' "$*" >"$raw/$file.cmd"
}
record nvidia-smi.txt nvidia-smi
timeout -k 5 "$T" nvidia-smi -q -x >"$raw/nvidia-smi.xml" 2>/dev/null
echo "$?" >"$raw/nvidia-smi.xml.rc"
echo "nvidia-smi -q -x" >"$raw/nvidia-smi.xml.cmd"
record nvidia-smi-L.txt nvidia-smi -L
record nvidia-smi-topo.txt nvidia-smi topo -m
record dmesg.txt dmesg -T
if [ "$(cat "$raw/dmesg.txt.rc")" != 0 ] && command -v journalctl >/dev/null 2>&1; then
  record dmesg.txt journalctl -k --no-pager -o short-iso -n 50000
fi

# What the recordings say of the machine: the first GPU's name, how many, driver and CUDA.
name=$(sed -n 's/^GPU 0: \(.*\) (UUID:.*/\1/p' "$raw/nvidia-smi-L.txt" | head -n 1)
count=$(grep -c '^GPU [0-9]*:' "$raw/nvidia-smi-L.txt" || true)
driver=$(sed -n 's/.*Driver Version: *\([0-9.]*\).*/\1/p' "$raw/nvidia-smi.txt" | head -n 1)
cuda=$(sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' "$raw/nvidia-smi.txt" | head -n 1)
slug=$(printf '%s' "${name:-unknown-gpu}" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
dest="$OUT_ROOT/${slug:-unknown-gpu}"
mkdir -p "$dest"
today=$(date -u +%Y-%m-%d)
{
  echo "recorded: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "gpu: ${name:-unknown}"
  echo "gpus: ${count:-0}"
  echo "driver: ${driver:-unknown}"
  echo "cuda: ${cuda:-unknown}"
  echo "kernel: $(uname -r)"
  echo "by: scripts/gpu-check.sh"
} >"$dest/meta.txt"
machine="a machine with ${count:-?} x ${name:-unknown GPU}, driver ${driver:-?}, CUDA ${cuda:-?}"

source_note() {  # source_note FILE TEXT: the .source beside a fixture
  printf 'Recorded on %s by scripts/gpu-check.sh on %s (a GPU machine lent to a cudamedic session): %s\n' \
    "$today" "$machine" "$2" >"$dest/$1.source"
}
for f in nvidia-smi.txt nvidia-smi.xml nvidia-smi-L.txt nvidia-smi-topo.txt dmesg.txt; do
  cp "$raw/$f" "$dest/$f"
  source_note "$f" "\`$(cat "$raw/$f.cmd")\` as it printed it (exit status $(cat "$raw/$f.rc"))."
done
source_note meta.txt "what the recordings beside it say of the machine."
echo "gpu-check: recorded $machine in $dest"

# cudamedic on the same machine.
CM=${CUDAMEDIC:-}
if [ -z "$CM" ] && [ -x .venv/bin/cudamedic ]; then CM=.venv/bin/cudamedic; fi
if [ -z "$CM" ]; then
  echo "gpu-check: installing cudamedic into .venv-gpu (pip install -e .) ..." >&2
  if python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q -e . >&2; then
    CM=.venv-gpu/bin/cudamedic
  else
    echo "gpu-check: cudamedic could not be installed here: only the raw recordings are kept" >&2
    exit 0
  fi
fi
export CUDAMEDIC_OUT_DIR="$work/out" CUDAMEDIC_STATE_DIR="$work/state"
printf 'hosts:\n  local: {address: 127.0.0.1}\n' >"$work/inventory.yaml"
export CUDAMEDIC_INVENTORY="$work/inventory.yaml"

timeout -k 5 300 "$CM" collect local --tar --json >"$work/collect.json" 2>"$dest/collect.stderr.txt"
echo "$?" >"$work/collect.rc"
bundle=$(sed -n 's/.*"bundle": "\([^"]*\)".*/\1/p' "$work/collect.json" | head -n 1)
if [ -n "$bundle" ] && [ -f "$bundle" ]; then
  cp "$bundle" "$dest/bundle-local.tar.gz"
  source_note bundle-local.tar.gz "\`cudamedic collect local --tar\` (secrets redacted at collection)."
  timeout -k 5 120 "$CM" classify "$bundle" --json >"$dest/classify.json" 2>"$dest/classify.stderr.txt"
  source_note classify.json "\`cudamedic classify\` of bundle-local.tar.gz."
  source_note classify.stderr.txt "what \`cudamedic classify\` said on standard error."
else
  echo "gpu-check: collect wrote no bundle (exit $(cat "$work/collect.rc")): see $dest/collect.stderr.txt" >&2
fi
source_note collect.stderr.txt "what \`cudamedic collect local\` said on standard error."
timeout -k 5 600 "$CM" sweep --host local --json >"$dest/sweep.json" 2>"$dest/sweep.stderr.txt"
echo "gpu-check: sweep exit status $?" >&2
source_note sweep.json "\`cudamedic sweep --host local --json\`."
source_note sweep.stderr.txt "what \`cudamedic sweep --host local\` said on standard error."
if [ -z "${PREFECT_API_URL:-}" ]; then  # the embedded server the sweep started for this state dir
  timeout -k 5 60 "$CM" server stop >/dev/null 2>&1 || true
fi
echo "gpu-check: done: $dest"
