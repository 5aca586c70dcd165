#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite, two tests at a time
# (pytest-xdist): most of a test's time is its ranks and daemons starting and waiting on each
# other. A test marked `alone` (a measurement another test's load would distort) runs with none
# beside it (tests/helpers/turns.py). `bash scripts/test.sh -n 0 ...` runs them one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist worksteal "$@"
