#!/usr/bin/env bash
# The first-GPU check of issue 29 (fits 10 minutes on one GPU; more rows with two): the smoke test, the
# single-GPU checks of rows 2, 3, 7, 9 and 10, and with two GPUs the pp 2 V 2 run with [1, 2048, 4096] bf16
# activations; prints one table (see scripts/gpu_check.py). Exits non-zero when a row failed.
#
#     scripts/gpu_check.sh              # on a GPU machine
#     scripts/gpu_check.sh --dry-run    # anywhere: the table logic and the commands' arguments, GPU rows skipped
#     PYTHON=/path/to/python scripts/gpu_check.sh    # default: python3
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
