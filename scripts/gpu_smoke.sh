#!/usr/bin/env bash
# GPU smoke test on one CUDA GPU: 20 bf16 training steps of a small MoE model, the FP8 expert backends
# (torch._scaled_grouped_mm; TransformerEngine when installed) against the fp8_emulated reference, and a
# compiled generation against the eager one (scripts/gpu_smoke.py prints the table), then every test
# marked `cuda`. Exits non-zero when a check or a test fails.
#
#     scripts/gpu_smoke.sh [--steps N]        # extra arguments go to scripts/gpu_smoke.py
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python scripts/gpu_smoke.py --device cuda "$@"
# The table above already ran what test_gpu_smoke's cuda test runs: skip it here.
python -m pytest -q -m cuda -k "not gpu_smoke" tests
