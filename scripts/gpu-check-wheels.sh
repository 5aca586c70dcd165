#!/usr/bin/env bash
# Run HERE (not on the GPU machine, which fetches nothing) before a GPU check, when that machine's
# protobuf or grpcio is older than this checkout's generated protocol code needs (the check's
# environment step says so): downloads the wheels of the versions this environment runs, for the
# GPU machine's Python (3.12, x86-64), into .whl/ (git-ignored). Then name .whl in the device call's
# carry; scripts/gpu-check.sh installs them offline into a private folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TARGET_PYTHON=${TARGET_PYTHON:-3.12}
versions=$("$PYTHON" -c 'import google.protobuf, grpc; print(f"protobuf=={google.protobuf.__version__} grpcio=={grpc.__version__}")')
mkdir -p .whl
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $versions
ls -la .whl
