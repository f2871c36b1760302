#!/usr/bin/env bash
# GPU smoke test on one CUDA GPU: 20 bf16 training steps of a small MoE model, the FP8 expert backends
# (torch._scaled_grouped_mm; TransformerEngine when installed) against the fp8_emulated reference, and a
# compiled generation against the eager one (scripts/gpu_smoke.py prints the table), then every test
# marked `cuda`. Both steps always run; exits non-zero at the end when a check or a test failed.
#
#     scripts/gpu_smoke.sh [--steps N]        # extra arguments go to scripts/gpu_smoke.py
#     PYTHON=/path/to/python scripts/gpu_smoke.sh    # default: python3 (many GPU hosts have no `python`)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PYTHON" scripts/gpu_smoke.py --device cuda "$@" || status=1
# Only the modules with cuda-marked tests are collected: another module's missing test extra is not an error
# here. The table above already ran what test_gpu_smoke's cuda test runs: skip it here.
mapfile -t cuda_modules < <(grep -l "mark\.cuda" tests/unit/test_*.py tests/multirank/test_*.py)
if [ "${#cuda_modules[@]}" -gt 0 ]; then
    "$PYTHON" -m pytest -q -m cuda -k "not gpu_smoke" "${cuda_modules[@]}" || status=1
fi
exit "$status"
