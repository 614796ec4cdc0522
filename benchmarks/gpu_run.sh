#!/usr/bin/env bash
# One device-tool call (about 4 minutes on an H100): the GPU check, then scaling on CUDA.
# Carry the captum wheel (and transformers' if the machine's is older than 5.24) in .whl/:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl captum==0.9.0 transformers==5.24.0
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
mkdir -p "${OUT:-/tmp/out}"
python3 benchmarks/gpu_check.py | tee "${OUT:-/tmp/out}/gpu_check.md"
python3 benchmarks/scaling.py --device cuda --lengths 64 256 1024 2048 4096 --batches 1 8 32 \
    --batch-length 512 --repeats 5 --json "${OUT:-/tmp/out}/scaling_cuda.json" | tee "${OUT:-/tmp/out}/scaling_cuda.md"
