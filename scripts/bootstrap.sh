#!/usr/bin/env bash
# Prepare a fresh machine for cudamedic: system packages the lab and the tests need, and the
# virtualenv.
# Idempotent; run as root (the lab starts dockerd and sshd). Usage: scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v busybox >/dev/null 2>&1 || need+=(busybox-static)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
# The fleet tests' PostgreSQL (tests/fleet.py starts its own cluster with initdb/pg_ctl).
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
# The metrics tests' real Prometheus and Alertmanager (tests/prom.py starts them on loopback).
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "bootstrap: need root to install: ${need[*]}" >&2; exit 1
  fi
  echo "bootstrap: installing Debian packages ${need[*]} (apt-get; a minute or two) ..."
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the packages' own services from starting: the lab starts its own.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi

PY=${PYTHON:-python3}
stamp=.venv/.cudamedic-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
  echo "bootstrap: upgrading pip ..."
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  echo "bootstrap: installing cudamedic and its dev tools into .venv (Prefect, pytest, ruff, mypy, markdown-it-py; 1-3 min) ..."
  .venv/bin/pip install -q -e '.[dev]'
  echo "bootstrap: .venv ready"
  echo "$want" > "$stamp"
fi
