#!/usr/bin/env bash
# Sets everything up, starts autobyted on an embedded SQLite database, trains a 2-rank gloo job that
# streams to it, and shows what the daemon saw and decided.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/quickstart.py "$@"
