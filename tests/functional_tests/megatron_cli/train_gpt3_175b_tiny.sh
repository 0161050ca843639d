#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, scaled down to a tiny model on
# 4 CPU processes (TP 2 x PP 2); every other flag as in the original (the batch-size schedule
# scaled down with it: 2 sequences of 64 tokens, then the global batch).
#   bash train_gpt3_175b_tiny.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH

GPUS_PER_NODE=4
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=1
NODE_RANK=0

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3 # gpt2-vocab.json
MERGE_FILE=$4 # gpt2-merges.txt
DATA_PATH=$5  # <prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --step-batch-size-schedule "0:2 128:4"
    --train-iters 5
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 4
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 5
    --eval-interval 5
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${DISTRIBUTED_ARGS[@]} "$(dirname "$0")/../../../examples/pretrain_gpt.py" \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
