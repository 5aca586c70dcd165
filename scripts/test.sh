#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite in two parts: first every
# test that may run beside another, two at a time (pytest-xdist, a file at a time per worker: a
# module's fixtures start once, the heaviest files first, tests/conftest.py), then the tests marked
# `alone` (a measurement
# another test's load would distort), one at a time. Arguments go to both parts, e.g.
# `bash scripts/test.sh tests/test_cli.py`; `bash scripts/test.sh -n 0` runs the first part one at a
# time too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --turns shared "$@"
shared=$?
[ "$shared" = 2 ] && exit 2  # interrupted (Ctrl-C): the second part does not start
.venv/bin/python -m pytest -n 0 --turns alone "$@"
alone=$?
# 5: no test of that part was selected (e.g. a file with no `alone` test); fails only if neither had one
if [ "$shared" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
for rc in "$shared" "$alone"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
