#!/bin/bash
# Megatron-LM's examples/mamba/train.sh (its 800M hybrid recipe), scaled down to a tiny model on
# 2 CPU processes (data parallel, gloo instead of nccl); every other flag as in the original.
#   bash train_mamba_hybrid_tiny.sh DATA_PATH TOKENIZER_PATH

TENSOR_MODEL_PARALLEL_SIZE=1
HYBRID_LAYER_PATTERN="M-*M-"
HIDDEN_SIZE=256
NUM_ATTENTION_HEADS=4
GLOBAL_BATCH_SIZE=4

DATA_PATH=$1
TOKENIZER_PATH=$2

CHECKPOINT_DIR="./checkpoints"
DATACACHE_DIR="./data-cache"
TENSORBOARD_DIR="./tensorboard"

mkdir -p ${CHECKPOINT_DIR}
mkdir -p ${DATACACHE_DIR}
mkdir -p ${TENSORBOARD_DIR}

SEQ_LEN=32
TRAIN_SAMPLES=20
LR_WARMUP_SAMPLES=4
LR_DECAY_SAMPLES=16 # TRAIN_SAMPLES - LR_WARMUP_SAMPLES

options=" \
       --tensor-model-parallel-size ${TENSOR_MODEL_PARALLEL_SIZE} \
       --sequence-parallel \
       --pipeline-model-parallel-size 1 \
       --use-distributed-optimizer \
       --overlap-param-gather \
       --overlap-grad-reduce \
       --untie-embeddings-and-output-weights \
       --init-method-std 0.02 \
       --position-embedding-type none \
       --hybrid-layer-pattern ${HYBRID_LAYER_PATTERN} \
       --hidden-size ${HIDDEN_SIZE} \
       --num-attention-heads ${NUM_ATTENTION_HEADS} \
       --group-query-attention \
       --num-query-groups 2 \
       --seq-length ${SEQ_LEN} \
       --max-position-embeddings ${SEQ_LEN} \
       --train-samples ${TRAIN_SAMPLES} \
       --lr-warmup-samples ${LR_WARMUP_SAMPLES} \
       --lr-decay-samples ${LR_DECAY_SAMPLES} \
       --save ${CHECKPOINT_DIR} \
       --load ${CHECKPOINT_DIR} \
       --data-path ${DATA_PATH} \
       --data-cache-path ${DATACACHE_DIR} \
       --split 99,1,0 \
       --tokenizer-type GPTSentencePieceTokenizer \
       --tokenizer-model ${TOKENIZER_PATH} \
       --distributed-backend gloo \
       --micro-batch-size 1 \
       --global-batch-size ${GLOBAL_BATCH_SIZE} \
       --lr 2.5e-4 \
       --min-lr 2.5e-5 \
       --lr-decay-style cosine \
       --weight-decay 0.1 \
       --clip-grad 1.0 \
       --attention-dropout 0.0 \
       --hidden-dropout 0.0 \
       --disable-bias-linear \
       --normalization RMSNorm \
       --adam-beta1 0.9 \
       --adam-beta2 0.95 \
       --log-interval 1 \
       --save-interval 5 \
       --eval-interval 5 \
       --eval-iters 2 \
       --bf16 \
       --use-mcore-models \
       --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec \
       --no-create-attention-mask-in-dataloader \
       --tensorboard-dir ${TENSORBOARD_DIR}"

torchrun --nproc_per_node 2 "$(dirname "$0")/../../../examples/pretrain_hybrid.py" ${options}
