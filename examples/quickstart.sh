#!/usr/bin/env bash
# The main job, from a fresh machine: install, train a small GPT on the built-in corpus with
# torchrun on 4 CPU processes (TP2 x PP2), save a checkpoint, generate text from it.
#   bash examples/quickstart.sh [extra training flags]      (RUN_DIR=... picks the run directory)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Install unless this checkout's package already imports (an editable install, or PYTHONPATH).
here='import os, sys, torch, megatron; sys.exit(os.path.realpath(megatron.__path__[0]) != os.path.realpath("megatron"))'
if ! python3 -P -c "$here" 2>/dev/null; then
    python3 -m pip install -q torch==2.13.0
    python3 -m pip install -q -e .
fi
export OMP_NUM_THREADS=1
RUN=${RUN_DIR:-runs/quickstart}
rm -rf "$RUN"

python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 300 \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --log-interval 25 --eval-interval 100 --eval-iters 2 \
    --save "$RUN" --save-interval 300 --metrics-jsonl "$RUN/metrics.jsonl" "$@"

python3 examples/inference/offline_inference.py --load "$RUN" \
    --prompts "def __init__(self" "import " "class " --num-tokens-to-generate 96 --temperature 0.7 --top-k 20 --seed 7 \
    --output-json "$RUN/generations.json"
