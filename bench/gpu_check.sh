#!/usr/bin/env bash
# The GPU check of issue 6 (bench/gpu_check.py): inferd on CUDA in bf16 with and without CUDA graphs, transformers'
# generate on the same random weights (SmolLM2-135M's and a 1B Llama's shapes), and `inferd profile` on a short
# ladder; under 5 minutes on one H200. Results (gpu_check.json, summary.txt, PNGs when matplotlib is there) go to
# $OUT when it is set, else .cache/gpu_check.
#
#   bash bench/gpu_check.sh              # on the GPU machine, from anywhere (it runs from the repo root)
#   bash bench/gpu_check.sh --dry-run    # the same code on the CPU, tiny shapes, seconds (part of `make test`)
#
# Python: $PYTHON, else `python`, else `python3`; inferd need not be installed (PYTHONPATH=the repo root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT_DIR="${OUT:-.cache/gpu_check}"
mkdir -p "$OUT_DIR"
# the calibrated device peaks (inferd/telemetry/roofline.py) are cached with the results unless told otherwise
export INFERD_CACHE_DIR="${INFERD_CACHE_DIR:-$OUT_DIR/cache}"
exec "$PY" bench/gpu_check.py --out "$OUT_DIR" "$@"
