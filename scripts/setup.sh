#!/usr/bin/env bash
# Creates .venv (if needed) and installs autobyte with every extra the demo and the tests use.
# Safe to run again: it only installs what is missing. Needs Python >= 3.10; run as root on a bare
# Debian machine to let it apt-get what is missing (python3-venv, iproute2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "setup: please install $* (needs root)" >&2; return 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    apt_install python3-venv
    "$PYTHON" -m venv .venv
  fi
fi
command -v ip >/dev/null || apt_install iproute2 || true

stamp=.venv/.autobyte-installed
want=$(cat setup.cfg setup.py pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into .venv (log: .venv/setup.log)"
  {
    .venv/bin/python -m pip install --upgrade pip
    # torch first and pinned: this exact CPU build is what the project is tested with.
    .venv/bin/python -m pip install 'torch==2.13.0'
    .venv/bin/python -m pip install -e '.[all,test,bench]'
  } > .venv/setup.log 2>&1 || { tail -30 .venv/setup.log >&2; echo "setup: installation failed" >&2; exit 1; }
  .venv/bin/python -c 'import torch, grpc, grpc_health, sqlalchemy, xgboost, autobyte, autobyted' \
    || { echo "setup: installation failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
