#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite, two tests at a time
# (pytest-xdist): most of a test's time is its ranks and daemons starting and waiting on each
# other, so two at a time fit this 2-core machine (docs/results.md has the suite's time both ways).
# `bash scripts/test.sh -n 0 ...` runs them one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 "$@"
