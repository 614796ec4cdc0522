#!/usr/bin/env bash
# The GPU measurements, as device-tool calls on one warm machine:
#   bash benchmarks/gpu_run.sh check   # CPU/CUDA/streaming agreement, bf16, costs; Llama-1B bf16 scaling
#   bash benchmarks/gpu_run.sh fp32    # Llama-1B fp32 scaling
#   bash benchmarks/gpu_run.sh answers # answers' CPU/CUDA agreement; Llama-1B bf16 answer costs
#   bash benchmarks/gpu_run.sh architectures # CPU/CUDA agreement of the adapter's fallbacks
#   bash benchmarks/gpu_run.sh mixing  # CPU/CUDA agreement of the context-mixing methods (NormAttention,
#                                      # ALTI, ALTI-Logit, Value Zeroing, LearnedAttention, DecompX), both
#                                      # modes, and of encoder-decoders' answers (span and rows); every new
#                                      # method's cost in one run at 4k and 16k tokens (docs/benchmarks.rst's
#                                      # CPU table, on the card)
#   bash benchmarks/gpu_run.sh alti    # ALTI's contributions compiled (a Triton kernel there): the context-mixing
#                                      # agreement with them, then ALTI at 4k and 16k, eager blocks against compiled
#   bash benchmarks/gpu_run.sh keybias # sdpa's forward+backward with heads one wider (the key bias) or padded
#                                      # to 8, per backend, bf16 and fp32: whether the key bias can ride on a card
#   bash benchmarks/gpu_run.sh padding # the deletion metrics' batches of one length against padded batches
#                                      # (benchmarks/length_batches.py on the card)
#   bash benchmarks/gpu_run.sh vlm     # a vision-language answer's context metrics, the tower rerun per ablated
#                                      # prompt against the images encoded once (benchmarks/vlm_context_metrics.py)
#   bash benchmarks/gpu_run.sh zeroing # Value Zeroing of a bfloat16 model: its layers re-run as float32 copies
#                                      # against bfloat16 re-runs, time and error (benchmarks/value_zeroing_precision.py)
#   bash benchmarks/gpu_run.sh kernels # the Triton kernels against the eager reductions and their launch shapes
#                                      # timed; Llama-1B bf16 (4k-32k and 8 x 2k) with each block reduction;
#                                      # an answer's rows at 16k with the kernels (at most 10 min)
# Carry the captum wheel (and transformers' for a machine older than 5.24) in .whl/:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl captum==0.9.0 transformers==5.24.0
set -euo pipefail
out="${OUT:-/tmp/out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/captum-*.whl
if ! python3 -c "import sys, transformers as t; sys.exit(tuple(map(int, t.__version__.split('.')[:2])) < (5, 24))"; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/transformers-*.whl
fi
if ! python3 -c "import scipy" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/scipy-*.whl
fi
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
scaling() {  # dtype
    python3 benchmarks/scaling.py --model llama-1b --device cuda --dtype "$1" --lengths 4096 16384 32768 \
        --batches 1 --repeats 3 --json "$out/llama1b_$1.json" | tee "$out/llama1b_$1.md"
}
case "${1:-check}" in
    check) python3 benchmarks/gpu_check.py | tee "$out/gpu_check.md"; scaling bfloat16 ;;
    fp32) scaling float32 ;;
    answers)
        python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.answer_agreement()" \
            | tee "$out/answers_check.md"
        python3 benchmarks/llm_answers.py --model llama-1b --device cuda --dtype bfloat16 --lengths 4096 16384 \
            --token-rows-max 4096 --json "$out/llm_answers_llama1b_bf16.json" | tee "$out/llm_answers_llama1b_bf16.md" ;;
    zeroing)
        python3 benchmarks/value_zeroing_precision.py --device cuda --lengths 256 1024 --repeats 3 \
            --json "$out/value_zeroing_precision.json" | tee "$out/value_zeroing_precision.md" ;;
    mixing)
        python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.context_mixing_agreement(); gpu_check.seq2seq_answer_agreement()" \
            | tee "$out/mixing_check.md"
        python3 benchmarks/scaling.py --model llama --device cuda --lengths 4096 16384 --batches 1 --repeats 3 \
            --runs "forward (sdpa)" "forward+backward (sdpa)" NormAttention "NormAttention(residual=True)" LearnedAttention \
            DecompX KnockoutLRP ALTI --json "$out/context_mixing_one_run.json" | tee "$out/context_mixing_one_run.md" ;;
    alti)
        python3 -c "import sys; sys.path[:0] = ['benchmarks']; from captum_attention.maps import context_mixing, streaming
streaming.FUSED_DEVICES['cuda'], streaming.COMPILE_AFTER_SECONDS, context_mixing.ALTI_COMPILE_MIN_PAIRS = True, 0.0, 0
import gpu_check; gpu_check.context_mixing_agreement()" | tee "$out/alti_compiled_check.md"
        for reduction in eager compiled; do
            python3 benchmarks/scaling.py --model llama --device cuda --lengths 4096 16384 --batches 1 --eager-max 0 \
                --repeats 3 --reduction "$reduction" --runs "forward (sdpa)" "forward+backward (sdpa)" ALTI \
                --json "$out/alti_$reduction.json" | tee "$out/alti_$reduction.md"
        done ;;
    keybias)
        python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.widened_heads()" \
            | tee "$out/widened_heads.md" ;;
    padding)
        python3 benchmarks/length_batches.py --device cuda | tee "$out/length_batches.md" ;;
    vlm)
        python3 benchmarks/vlm_context_metrics.py --device cuda --json "$out/vlm_context_metrics.json" \
            | tee "$out/vlm_context_metrics.md" ;;
    architectures)
        python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.architecture_agreement()" \
            | tee "$out/architectures_check.md" ;;
    kernels)  # each step under its own time limit, so that one that hangs leaves the rest their time (10 min at
              # most, about 7 on an H200); the tables go to one log, the figures to four JSON files
        log="$out/kernels.md"
        step() {  # seconds, then the command
            local limit=$1; shift
            timeout "$limit" "$@" 2>&1 | tee -a "$log" || echo "stopped ($?): $*" | tee -a "$log"
        }
        cat "$out/device.txt" >>"$log"
        step 90 python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.kernel_agreement()"
        step 60 python3 -c "import sys; sys.path[:0] = ['benchmarks']; import gpu_check; gpu_check.kernel_tiles()"
        runs=("forward (sdpa)" "forward+backward (sdpa)" GradSAM AttentionRollout TransformerAttribution RawAttention
              attention_erasure NormAttention)
        bf16() {  # reduction, seconds, repeats, lengths
            step "$2" python3 benchmarks/scaling.py --model llama-1b --device cuda --dtype bfloat16 --reduction "$1" \
                --lengths $4 --batches 1 8 --batch-length 2048 --eager-max 0 --repeats "$3" --runs "${runs[@]}" \
                --json "$out/llama1b_bf16_$1.json"
        }
        bf16 triton 150 2 "4096 16384 32768"
        bf16 eager 100 1 "4096 16384 32768"
        bf16 compiled 60 1 "4096 16384"
        step 140 python3 benchmarks/llm_answers.py --model llama-1b --device cuda \
            --dtype bfloat16 --lengths 16384 --token-rows-max 16384 --methods grad_sam transformer_attribution rollout \
            --json "$out/llm_answers_llama1b_bf16_triton.json" ;;
esac
