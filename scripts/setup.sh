#!/usr/bin/env bash
# Creates .venv (if needed) and installs autobyte with every extra the demo and the tests use.
# Safe to run again: it only installs what is missing. Needs Python >= 3.10; run as root on a bare
# Debian machine to let it apt-get what is missing (python3-venv, iproute2, and the PostgreSQL server
# whose initdb/pg_ctl the tests use to start a throwaway cluster of their own).
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
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! [ -x "$(pg_config --bindir 2>/dev/null)/initdb" ]; then
  # The tests start clusters of their own: the package's default cluster (and its server) is not wanted.
  if [ "$(id -u)" = 0 ] && [ ! -e /etc/postgresql-common/createcluster.conf ]; then
    mkdir -p /etc/postgresql-common && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
  fi
  apt_install postgresql || true
fi

stamp=.venv/.autobyte-installed
want=$(cat setup.cfg setup.py pyproject.toml native/* | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into .venv (log: .venv/setup.log)"
  {
    .venv/bin/python -m pip install --upgrade pip
    # torch first and pinned: this exact CPU build is what the project is tested with. Then the
    # build tools, and the package without build isolation, so that setup.py sees torch and compiles
    # the scheduler's native hot path (autobyte._native) against it; without a C++ compiler the
    # package installs anyway and runs the Python path (autobyte check-build says why).
    .venv/bin/python -m pip install 'torch==2.13.0' 'setuptools>=68' wheel ninja
    # torch pinned again in the same command: the lightning extra must never pull another torch.
    .venv/bin/python -m pip install --no-build-isolation -e '.[all,postgres,test,bench,lightning,hf]' 'torch==2.13.0'
  } > .venv/setup.log 2>&1 || { tail -30 .venv/setup.log >&2; echo "setup: installation failed" >&2; exit 1; }
  .venv/bin/python -c 'import torch, grpc, grpc_health, sqlalchemy, xgboost, psycopg, lightning, autobyte, autobyted' \
    || { echo "setup: installation failed" >&2; exit 1; }
  .venv/bin/autobyte check-build | sed -n 's/^native hot path: */setup: native hot path: /p; s/^ *why not/setup: why not/p' 
  echo "$want" > "$stamp"
fi
