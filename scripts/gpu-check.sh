#!/usr/bin/env bash
# The GPU check in one call on a fresh GPU machine: uses the carried checkout as it is
# (PYTHONPATH, nothing installed, nothing fetched), then runs benchmarks/gpu_check.py, which caps
# each step and writes gpu-check.json, gpu-check.txt and gpu-check-logs.txt.
#
#   bash scripts/gpu-check.sh [OUT_DIR] [gpu_check options: --budget-s 470 --quick --only ...]
#
# OUT_DIR defaults to $OUT (the device tool's output folder). Without a CUDA device every GPU step
# is reported as skipped and the exit status is 0. Wheels in .whl/ (e.g. a newer protobuf than the
# machine's, downloaded beforehand with `pip download --no-deps`) are installed into a private
# folder first, offline.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=${OUT:-}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out=$1; shift; fi
if [ -z "$out" ]; then echo "usage: scripts/gpu-check.sh OUT_DIR [options] (or set OUT)" >&2; exit 2; fi
mkdir -p "$out"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/autobyte-gpu-check-site.XXXXXX)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "gpu-check: installing the carried wheels in .whl/ failed" >&2; exit 2; }
fi
export PYTHONPATH="$PWD/client:$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The whole call stays inside the budget (default 470 s) plus a margin for the report.
exec timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-520}" "$PYTHON" -m benchmarks.gpu_check --out "$out" "$@"
