#!/usr/bin/env bash
# One GPU, under 8 minutes: real shapes (SmolLM-135M, Qwen2.5-0.5B width, Llama-3.2-1B) through `gradian attribute`
# in bf16 and nf4, the capture overhead on CUDA, tokens/s and peak GPU memory per stage, the logit-upcast peak.
#
#   bench/gpu_check.sh                # on a machine with one CUDA GPU (the project's venv: .venv, or PY=...)
#   bench/gpu_check.sh --cpu-smoke    # the same steps on CPU over small shapes: checks this script end to end
#   bench/gpu_check.sh --smoke        # --cpu-smoke cut to one shape, no nf4, one repetition (make bench-smoke)
#
# Needs `pip install 'gradian[quant]'` for the nf4 runs. Builds its models locally (random weights, cached under
# $GRADIAN_CACHE): nothing is downloaded. The last line of stdout is one JSON object (bench/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
export GRADIAN_PROGRESS=0 PYTHONPATH="${PYTHONPATH:-$PWD/src}"
# The data-aware fit and the scores run on the host: give them the GPU machine's cores (one on the shared CPU box).
if [ "${1:-}" = "--cpu-smoke" ] || [ "${1:-}" = "--smoke" ]; then
  export GRADIAN_THREADS="${GRADIAN_THREADS:-1}"; LIMIT="${GPU_CHECK_LIMIT:-1800}"
else
  export GRADIAN_THREADS="${GRADIAN_THREADS:-8}"; LIMIT="${GPU_CHECK_LIMIT:-480}"
fi
exec timeout --signal=TERM "$LIMIT" "$PY" bench/gpu_check.py "$@"
