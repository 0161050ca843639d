"""Command-line flags with Megatron's names, validated before any process group exists.

``parse_args(argv, world_size=...)`` returns an ``argparse.Namespace``; every bad or
contradictory combination raises :class:`ArgumentError` naming the flags at fault, and the
entry points turn that into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.config import ATTENTION_BACKENDS, MLA_FIELDS, RECOMPUTE_MODULES, TransformerConfig
from megatron.core.datasets.blend import parse_blend
from megatron.core.datasets.builtin_corpus import BUILTIN_DATA_PATH
from megatron.core.errors import MegatronConfigError
from megatron.core.models.hybrid.hybrid_layer_pattern import parse_hybrid_pattern
from megatron.core.models.model_record import ModelRecord, TokenizerRecord
from megatron.core.optimizer.optimizer_config import (
    MUON_COEFFICIENT_TYPES,
    MUON_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    OptimizerConfig,
    OptimizerConfigError,
)
from megatron.core.pipeline_parallel.schedules import microbatch_group_error
from megatron.core.tokenizers import DEFAULT_TOKENIZER_TYPE, check_tokenizer_inputs
from megatron.core.transformer.transformer_block import stage_layer_counts
from megatron.training.batch_schedule import BatchSchedule, BatchScheduleError
from megatron.training.checkpoint_args import apply_checkpoint_record, record_for_run
from megatron.training.result_validation import ERROR_TYPES


class ArgumentError(MegatronConfigError):
    """A bad or contradictory flag combination; the message names the flags."""


# argparse kwargs of a plain on/off flag, and of a refused one (present: True, absent: None).
_SWITCH = {"action": "store_true"}
_REFUSED_SWITCH = {"action": "store_const", "const": True}
_TIMING_NOTE = "only the iteration time is measured (Megatron's level 0)"
_WANDB_NOTE = "Weights & Biases logging is not built in"
_BACKGROUND_SAVE_NOTE = "--async-save writes from a background thread of the training process"
_EMBEDDING_WGRAD_NOTE = "the embedding's weight gradient is computed in its own backward step"

# Flags that select an implementation or a fusion this framework always uses: accepted, and
# their note is printed once on rank 0 when given (argparse kwargs, note).
IMPLEMENTATION_FLAGS = {
    "--use-mcore-models": (_SWITCH, "models are always megatron-core style (GPTModel, HybridModel)"),
    "--transformer-impl": (
        {"choices": ["local", "transformer_engine"], "default": None},
        "layers are this framework's own torch modules (fused kernels where the backend switch has them)",
    ),
    "--use-flash-attn": (_SWITCH, "attention already uses fused SDPA"),
    "--no-masked-softmax-fusion": (
        _SWITCH,
        "attention uses SDPA, which has no separate masked-softmax kernel to turn off",
    ),
    "--cross-entropy-loss-fusion": (
        _SWITCH,
        "the loss is always fused where the backend switch has a kernel (see --cross-entropy-fusion-impl)",
    ),
    "--no-create-attention-mask-in-dataloader": (
        _SWITCH,
        "no attention mask is ever built: attention is causal inside the kernel",
    ),
    "--use-checkpoint-args": (_SWITCH, "with --load the model flags always come from the checkpoint's model record"),
    "--log-throughput": (_SWITCH, "tokens/s and TFLOP/s are always in the log line"),
    "--num-workers": ({"type": int, "default": None}, "samples are read in the training process (no loader workers)"),
    "--no-mmap-bin-files": (_SWITCH, ".bin files are always memory-mapped (read on access)"),
    "--ckpt-format": (
        {"choices": ["torch_dist", "torch", "torch_dcp", "fsdp_dtensor"], "default": None},
        "checkpoints are always written and read as sharded torch.distributed.checkpoint directories (torch_dist); "
        "pickled per-rank files (torch) are never written nor loaded",
    ),
    "--tiktoken-pattern": ({"choices": ["v1", "v2"], "default": None}, "only TikTokenizer reads it (not supported)"),
    "--attention-softmax-in-fp32": (_SWITCH, "attention runs in SDPA, whose kernels keep the softmax in fp32"),
    "--apply-query-key-layer-scaling": (
        _SWITCH,
        "SDPA keeps the softmax in fp32, so fp16 needs no query-key scaling by the layer number",
    ),
    "--no-persist-layer-norm": (_SWITCH, "each norm is one kernel: there is no persistent variant"),
    "--timing-log-level": ({"type": int, "choices": [0, 1, 2], "default": None}, _TIMING_NOTE),
    "--timing-log-option": ({"choices": ["max", "minmax", "all"], "default": None}, _TIMING_NOTE),
    "--log-timers-to-tensorboard": (
        _SWITCH,
        "the iteration time is always written to TensorBoard (iteration-time); no other timers are measured",
    ),
    "--log-validation-ppl-to-tensorboard": (
        _SWITCH,
        "evaluation perplexities are always written to TensorBoard (lm loss validation ppl)",
    ),
    "--log-memory-to-tensorboard": (_SWITCH, "memory is always written to TensorBoard (mem-* tags)"),
    "--tensorboard-log-interval": (
        {"type": int, "default": None},
        "TensorBoard gets the record of every --log-interval iterations",
    ),
    "--tensorboard-queue-size": ({"type": int, "default": None}, "TensorBoard events are flushed at every record"),
    "--wandb-project": (
        {"type": str, "default": None},
        f"{_WANDB_NOTE} (nothing is sent over the network); the same scalars go to --tensorboard-dir and "
        "--metrics-jsonl",
    ),
    **dict.fromkeys(
        ("--wandb-exp-name", "--wandb-save-dir", "--wandb-entity"), ({"type": str, "default": None}, _WANDB_NOTE)
    ),
    **dict.fromkeys(
        ("--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save"),
        (_SWITCH, "every rank always writes its own shards of a checkpoint, in parallel"),
    ),
    "--ckpt-fully-parallel-load": (_SWITCH, "every rank always reads only the shards it needs, in parallel"),
    "--use-persistent-ckpt-worker": (_SWITCH, _BACKGROUND_SAVE_NOTE),
    "--async-ckpt-use-cpu-shm": (
        _SWITCH,
        f"{_BACKGROUND_SAVE_NOTE}, from copies in its own host memory (no shared-memory worker)",
    ),
    "--disable-gloo-process-groups": (
        _SWITCH,
        "no gloo groups are made beside the main backend's (checkpoints and the distributed optimizer use it)",
    ),
    "--async-strategy": ({"choices": ["mcore", "nvrx"], "default": None}, _BACKGROUND_SAVE_NOTE),
    "--ckpt-assume-constant-structure": (
        _SWITCH,
        "a hint for Megatron's save planner cache; saves here plan from the model each time",
    ),
    "--auto-detect-ckpt-format": (
        _SWITCH,
        "--load reads the torch_dist checkpoints this framework writes (see --ckpt-format)",
    ),
    "--dist-ckpt-optim-fully-reshardable": (
        _SWITCH,
        "optimizer state is always saved in parameter shape: it loads under any layout",
    ),
    "--verify-integrity": (
        _SWITCH,
        "every save records each item's checksum and every load verifies the items it reads",
    ),
    "--accumulate-allreduce-grads-in-fp32": (
        _SWITCH,
        "with --bf16 / --fp16 gradients are accumulated and reduced in fp32 unless --grad-reduce-in-bf16",
    ),
    "--moe-router-dtype": (
        {"choices": ["fp32"], "default": None},
        "the router always computes its logits and probabilities in fp32",
    ),
    "--moe-permute-fusion": (
        _SWITCH,
        "tokens are permuted to their experts by index ops; there is no separate kernel to choose",
    ),
    "--dataloader-type": (
        {"choices": ["single"], "default": None},
        "samples are read in order from the consumed-sample count (Megatron's single)",
    ),
    "--ddp-average-in-collective": (
        _SWITCH,
        "gradients are averaged over the data-parallel ranks: each is scaled by 1/DP before the sum",
    ),
    "--defer-embedding-wgrad-compute": (_SWITCH, _EMBEDDING_WGRAD_NOTE),
    "--wgrad-deferral-limit": ({"type": int, "default": None}, _EMBEDDING_WGRAD_NOTE),
    **dict.fromkeys(
        ("--overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush"),
        (_SWITCH, "pipeline sends and receives are always posted together as one asynchronous batch"),
    ),
    "--overlap-param-gather-with-optimizer-step": (
        _SWITCH,
        "the distributed optimizer's parameter gathers start once the whole step is done (with "
        "--overlap-param-gather they overlap the next forward pass)",
    ),
    "--overlap-moe-expert-parallel-comm": (
        _SWITCH,
        "expert-parallel all-to-alls are not overlapped with another micro-batch's computation here",
    ),
    "--use-transformer-engine-op-fuser": (
        _SWITCH,
        "layers are this framework's own torch modules (no Transformer Engine operation fuser)",
    ),
    "--no-use-layer-wise-param-layout": (
        _SWITCH,
        "the distributed optimizer keeps its flat bucket shards under Muon; each matrix's pieces are summed over "
        "the replicas before it is orthogonalized",
    ),
    "--dist-ckpt-strictness": (
        {
            "choices": [
                "assume_ok_unexpected",
                "log_unexpected",
                "log_all",
                "raise_unexpected",
                "raise_all",
                "return_unexpected",
                "return_all",
                "ignore_all",
            ],
            "default": None,
        },
        "a load reads the keys the model has: a missing one fails it, others in the checkpoint are ignored "
        "(Megatron's assume_ok_unexpected)",
    ),
}

_FP8_MESSAGE = "fp8 training is not supported; train in --bf16"
_FSDP_MESSAGE = (
    "FSDP is not supported; shard the optimizer state with --use-distributed-optimizer and the weights "
    "with --generalized-tensor-parallel-size"
)

# Flags with a meaning this framework does not implement: refused before any process group
# (argparse kwargs, what to do instead).
REFUSED_FLAGS = {
    "--fp8-format": ({"type": str}, _FP8_MESSAGE),
    "--fp8-recipe": ({"type": str}, _FP8_MESSAGE),
    "--fp8-amax-history-len": ({"type": int}, _FP8_MESSAGE),
    "--fp8-amax-compute-algo": ({"type": str}, _FP8_MESSAGE),
    "--fp8-param-gather": (_REFUSED_SWITCH, _FP8_MESSAGE),
    **dict.fromkeys(("--use-torch-fsdp2", "--use-megatron-fsdp"), (_REFUSED_SWITCH, _FSDP_MESSAGE)),
    "--tp-comm-overlap": (
        _REFUSED_SWITCH,
        "Transformer Engine's tensor-parallel communication overlap is not supported (no Transformer Engine here)",
    ),
    "--hierarchical-context-parallel-sizes": (
        {"nargs": "+", "type": int},
        "hierarchical context parallelism is not supported; use --context-parallel-size with --cp-comm-type "
        "p2p or all_gather",
    ),
    "--use-legacy-models": (
        _REFUSED_SWITCH,
        "the legacy models are not supported; models are always megatron-core style (GPTModel, HybridModel)",
    ),
}

# Megatron's flags that turn a fusion off: (flag, dest, what it fuses); _disabled_fusions maps them
# to the ops of megatron.core.fusions.
FUSION_FLAGS = (
    ("--no-rope-fusion", "apply_rope_fusion", "RoPE"),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", "the bias + GeLU activation"),
    ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "the bias + SwiGLU activation"),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias + dropout + residual add"),
)

# What --spec may name (module, function): the specs this framework builds for each family.
ACCEPTED_SPECS = {
    "gpt": {
        ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
        ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"),
    },
    "hybrid": {
        ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
        ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),
    },
}


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--cp-comm-type",
        choices=("p2p", "all_gather"),
        default="p2p",
        help="how attention exchanges K/V under --context-parallel-size > 1: ring (p2p) or all-gather",
    )
    g.add_argument("--generalized-tensor-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP: ranks the experts are split over")
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)",
    )
    g.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="lay ranks out with pipeline stages before data-parallel replicas (order tp-gtp-cp-pp-dp; "
        "default tp-gtp-cp-dp-pp)",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="split the data-parallel group into this many instances of consecutive ranks: optimizer state is "
        "sharded within an instance and gradients all-reduced across instances",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="launch each gradient bucket's all-reduce / reduce-scatter during backward",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="all-gather the distributed optimizer's updated parameters during the next forward",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per gradient bucket (default: max(40M, 1M x data-parallel size))",
    )
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="accumulate and reduce gradients in bf16")
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="linear layers write their weight gradient for DDP to add, instead of their wgrad GEMM "
        "accumulating into the fp32/bf16 main_grad (the fusion runs on CUDA)",
    )
    g.add_argument(
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="default: nccl when CUDA is available, else gloo",
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    # Virtual (interleaved) pipeline stages, Megatron's three spellings (one at most).
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual pipeline stage: V = num-layers / PP / this (interleaved schedule)",
    )
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="model chunks (virtual stages) per pipeline rank for the interleaved schedule",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers", type=int, default=None, help="layers of the first pipeline stage"
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers", type=int, default=None, help="layers of the last pipeline stage"
    )
    g.add_argument(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="count the embedding as one layer of the first stage's even share",
    )
    g.add_argument(
        "--account-for-loss-in-pipeline-split",
        action="store_true",
        help="count the output layer and loss as one layer of the last stage's even share",
    )
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="the interleaved schedule runs micro-batches through each virtual stage in groups of this size "
        "(default: --pipeline-model-parallel-size)",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="the same as --virtual-pipeline-model-parallel-size",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true", help="accepted for compatibility")
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "yarn", "none"], default=None)
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="DeepSeek's multi-latent attention (the --q-lora-rank, --kv-lora-rank and --*-head-dim flags)",
    )
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: rank of the query latent (default: none)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: rank of the key/value latent")
    g.add_argument("--qk-head-dim", type=int, default=128, help="MLA: unrotated query/key channels per head")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="MLA: rotated query/key channels per head")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: value channels per head")
    g.add_argument(
        "--rope-type",
        choices=["rope", "yarn"],
        default=None,
        help="yarn turns --position-embedding-type rope into YaRN (MLA's default, as in Megatron)",
    )
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN: the context extension factor")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN: mscale of the concentration factor")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: mscale_all_dim of the concentration factor")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None, help="YaRN (default 4096)")
    g.add_argument("--yarn-beta-fast", type=float, default=None, help="YaRN (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, default=None, help="YaRN (default 1)")
    g.add_argument(
        "--yarn-correction-range-round-to-int",
        action="store_true",
        default=None,
        help="YaRN: round the correction range outwards (the default)",
    )
    g.add_argument(
        "--no-yarn-correction-range-round-to-int", action="store_false", dest="yarn_correction_range_round_to_int"
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE frequency scaling (GPT models)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true", help="relu(x)^2 as the MLP activation instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys per head before RoPE")
    g.add_argument("--add-qkv-bias", action="store_true", help="a bias on the QKV projection only (Qwen2-style)")
    g.add_argument(
        "--rotary-interleaved",
        action="store_true",
        help="RoPE turns channel pairs (2i, 2i+1) (GPT-J) instead of the two halves of each head (Llama)",
    )
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="SDPA kernels for core attention: flash, fused (cuDNN), unfused / local (plain math), or auto "
        "(on CUDA cuDNN, then flash, memory-efficient, math: the first that takes the inputs)",
    )
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hybrid-layer-pattern", type=str, default=None)
    g.add_argument(
        "--hybrid-override-pattern", type=str, default=None, help="Megatron's older name of --hybrid-layer-pattern"
    )
    g.add_argument("--mamba-state-dim", type=int, default=128)
    g.add_argument("--mamba-head-dim", type=int, default=64)
    g.add_argument("--mamba-num-groups", type=int, default=8)
    g.add_argument(
        "--mamba-num-heads", type=int, default=None, help="Mamba heads (default: 2 x hidden size / head dim)"
    )
    g.add_argument("--mamba-chunk-size", type=int, default=128, help="SSD scan chunk (Megatron's 128)")
    g.add_argument("--mtp-num-layers", type=int, default=None)
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="full recompute: uniform checkpoints each run of --recompute-num-layers layers as one unit; "
        "block checkpoints the first --recompute-num-layers layers of each stage (default: every layer alone)",
    )
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per unit (uniform) or in all (block)")
    g.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        metavar="MODULE",
        help="selective recompute's parts: core_attn (the default), mlp, moe, shared_experts, moe_act (the "
        "experts' activation, recomputed with the second expert GEMM)",
    )
    g.add_argument(
        "--use-torch-compile",
        action="store_true",
        help="torch.compile each decoder layer (regional compilation; collectives stay outside)",
    )
    g.add_argument(
        "--cross-entropy-fusion-impl",
        choices=["native", "te", "linear"],
        default="native",
        help="native (Megatron's default): logits, then the fused cross-entropy kernel (te: the same, no "
        "Transformer Engine here); linear: the output layer and the loss in one chunked op where the fusion "
        "backend runs Triton (the logits are never materialized)",
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument(
        "--step-batch-size-schedule",
        nargs="+",
        default=None,
        metavar="THRESHOLD:BATCH",
        help="global batch size from each token threshold on (suffixes K, M, B, T), e.g. '0:16 2.4B:320' (one "
        "argument or several: a script's unquoted array expansion splits it)",
    )
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES samples up to --global-batch-size",
    )
    g.add_argument(
        "--eval-global-batch-size", type=int, default=None, help="samples per evaluation step (default: training's)"
    )
    g.add_argument(
        "--eval-micro-batch-size", type=int, default=None, help="micro-batch size of evaluation (default: training's)"
    )
    g.add_argument("--train-iters", type=int, default=None, help="or --train-samples")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="peak learning rate of the embeddings and the output layer (default: --lr)",
    )
    g.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="minimum learning rate of the embeddings and the output layer (default: --min-lr)",
    )
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument(
        "--override-opt-param-scheduler",
        "--override-opt_param-scheduler",  # Megatron's spelling
        action="store_true",
        help="on --load, use the scheduler flags instead of the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt-param-scheduler",
        "--use-checkpoint-opt_param-scheduler",  # Megatron's spelling
        action="store_true",
        help="on --load, use the checkpoint's scheduler settings",
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument(
        "--optimizer",
        choices=["adam", "sgd", "muon", "dist_muon"],
        default="adam",
        help="muon: Muon for the weight matrices, AdamW for the rest (dist_muon: muon with "
        "--use-distributed-optimizer)",
    )
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--muon-momentum", type=float, default=0.9, help="Muon's EMA momentum")
    g.add_argument(
        "--muon-no-split-qkv",
        action="store_false",
        dest="muon_split_qkv",
        help="orthogonalize the QKV weight as one matrix (default: Q, K and V apart)",
    )
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum in Muon")
    g.add_argument("--muon-scale-mode", choices=list(MUON_SCALE_MODES), default="spectral")
    g.add_argument(
        "--muon-fp32-matmul-prec",
        choices=list(MUON_MATMUL_PRECISIONS),
        default="medium",
        help="Newton-Schulz iterations in bf16 (low, medium) or fp32 (high)",
    )
    g.add_argument("--muon-coefficient-type", choices=list(MUON_COEFFICIENT_TYPES), default="quintic")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations per update")
    g.add_argument(
        "--muon-tp-mode",
        choices=list(MUON_TP_MODES),
        default="duplicated",
        help="duplicated / distributed: orthogonalize whole matrices (the same under every TP size); blockwise: "
        "each tensor-parallel shard alone",
    )
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="multiplies every Muon update")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--loss-scale", type=float, default=None, help="a constant loss scale (default: dynamic scaling with --fp16)"
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="dynamic loss scaling never goes below it")
    g.add_argument(
        "--loss-scale-window", type=int, default=1000, help="dynamic loss scaling: steps without overflow to grow"
    )
    g.add_argument("--hysteresis", type=int, default=2, help="dynamic loss scaling: overflows tolerated to shrink")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="indexed dataset prefix(es), or 'builtin' for the bundled corpus (default)",
    )
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument(
        "--tokenizer-type",
        type=str,
        default=None,
        help="default: GPT2BPETokenizer with --vocab-file / --merge-file (Megatron's), else ByteLevelTokenizer",
    )
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--eod-mask-loss", action="store_true", help="mask the loss on end-of-document tokens")
    g.add_argument("--vocab-size", type=int, default=None, help="for --mock-data; defaults to the tokenizer's")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the embedding and output layer to a multiple of this x --tensor-model-parallel-size rows "
        "(padded entries are masked; checkpoints hold the true rows)",
    )


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--metrics-jsonl", type=str, default=None, metavar="PATH")
    g.add_argument(
        "--logging-level", type=int, default=None, help="level of Python's root logger (10 debug ... 50 critical)"
    )
    g.add_argument("--log-params-norm", action="store_true", help="log the global L2 norm of the parameters")
    g.add_argument(
        "--log-num-zeros-in-grad", action="store_true", help="log the number of zero elements in the gradients"
    )
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--save-retain-interval",
        type=int,
        default=None,
        help="after each save keep only the newest checkpoint and those at multiples of this iteration count",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in a background thread while training continues (one save in flight at a time)",
    )
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (GPT: every MLP becomes MoE)")
    g.add_argument(
        "--moe-layer-freq",
        type=moe_layer_freq,
        default=1,
        help="MoE every k-th layer (an integer), or one 0/1 per layer as a list, e.g. '([0]*3+[1]*13)'",
    )
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="expert FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument(
        "--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], default="aux_loss"
    )
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="default: dropless")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument(
        "--moe-grouped-gemm", action="store_true", help="accepted: experts always run as grouped GEMMs where supported"
    )


def moe_layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: an integer, or a list of ints written as a literal or as
    Python's list arithmetic (``([0]*3+[1]*13)``), read without evaluating code."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer or a list of integers (e.g. 2, [0,1,1] or ([0]*3+[1]*13))"
        ) from None
    if not isinstance(result, (int, list)) or (isinstance(result, list) and not all(type(v) is int for v in result)):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a list of integers")
    return result


def _add_megatron_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (more Megatron flags)")
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="zero-centered norm weights: the norm multiplies by (1 + weight), weights start at 0",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="recompute the attention core in backward (= --recompute-granularity selective)",
    )
    g.add_argument(
        "--spec", nargs="*", default=None, metavar="MODULE NAME", help="accepted when it names the spec built here"
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="the same as --position-embedding-type rope (Megatron's older spelling)",
    )
    g.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="no learned absolute positions: --position-embedding-type none unless rope is chosen",
    )
    g.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="bit-reproducible runs: torch's deterministic algorithms, NCCL_ALGO=Ring and a fixed cuBLAS "
        "workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8) unless the environment sets them",
    )
    # Megatron's switches that send a fused op back to the torch reference path.
    for flag, dest, what in FUSION_FLAGS:
        g.add_argument(flag, action="store_false", dest=dest, help=f"run {what} on the torch reference path")


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule and exit")
    g.add_argument("--train-samples", type=int, default=None, help="sample-based training (instead of --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="with --train-samples (default: all of them)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    g.add_argument(
        "--lr-warmup-fraction", type=float, default=None, help="warm-up as a fraction of the decay iterations/samples"
    )
    g.add_argument("--exit-interval", type=int, default=None, help="save (with --save) and exit at a multiple of it")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save (with --save) and exit after it")
    g.add_argument(
        "--check-weight-hash-across-dp-replicas-interval",
        type=int,
        default=None,
        help="every N iterations, check that data-parallel replicas hold the same weights (fail if not)",
    )
    g.add_argument(
        "--rerun-mode",
        choices=["disabled", "validate_results", "report_stats"],
        default="validate_results",
        help="validate_results: re-run a step whose loss fails a check to tell transient, persistent and "
        "correct results apart (exit code 16: resume on another device; 17: diagnosed); report_stats: run "
        "every step twice and log the loss difference",
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action="store_true",
        default=True,
        help="a non-finite loss fails the result check (default; non-finite gradients always skip the step)",
    )
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")
    g.add_argument(
        "--check-for-spiky-loss", action="store_true", help="a loss 10x the largest of the first 100 fails a check"
    )
    g.add_argument(
        "--error-injection-rate",
        type=int,
        default=0,
        help="make a result check fail once in N steps per rank (testing --rerun-mode)",
    )
    g.add_argument("--error-injection-type", choices=list(ERROR_TYPES), default="transient_error")
    g.add_argument(
        "--result-rejected-tracker-filename",
        type=str,
        default=None,
        help="append one JSON line per failed result check and re-run outcome",
    )
    g.add_argument(
        "--test-mode",
        action="store_true",
        help="after every iteration, check that data- and tensor-parallel replicas hold the same weights",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on --exit-signal (to any rank), save (with --save) and exit after the current iteration",
    )
    g.add_argument("--exit-signal", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"], default="SIGTERM")
    g.add_argument("--manual-gc", action="store_true", help="disable automatic garbage collection; collect on cue")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations")
    g.add_argument(
        "--no-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="with --manual-gc: do not collect around evaluations",
    )
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="release cached CUDA memory after each step (1) and after evaluation too (2)",
    )


def _add_megatron_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data (more Megatron flags)")
    for split in ("train", "valid", "test"):
        g.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"the {split} split's own blend ([weight] prefix ...); exclusive with --data-path",
        )
    g.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")


def _add_megatron_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true", help="profile iterations --profile-step-start..end")
    g.add_argument(
        "--use-pytorch-profiler", action="store_true", help="with --profile: torch.profiler, trace in --tensorboard-dir"
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0])


def _add_compatibility_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "Megatron compatibility", "accepted and noted once at start-up (what they select is always used), or refused"
    )
    for flag, (kwargs, _) in IMPLEMENTATION_FLAGS.items():
        g.add_argument(flag, **kwargs)
    for flag, (kwargs, message) in REFUSED_FLAGS.items():
        g.add_argument(flag, default=None, help=f"refused: {message}", **kwargs)


def build_parser(model_family: str, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    _add_parallel_args(parser)
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_and_checkpoint_args(parser)
    _add_megatron_model_args(parser)
    _add_schedule_args(parser)
    _add_megatron_data_args(parser)
    _add_megatron_logging_args(parser)
    _add_compatibility_args(parser)
    parser.set_defaults(model_family=model_family)
    return parser


def _check_recompute_modules(args: argparse.Namespace) -> None:
    modules = args.recompute_modules
    if modules is None:
        return
    _require(args.recompute_granularity == "selective", "--recompute-modules needs --recompute-granularity selective")
    supported = ", ".join(RECOMPUTE_MODULES)
    discarding = sorted(set(modules) & {"layernorm", "mla_up_proj"})
    _require(
        not discarding,
        f"--recompute-modules {' '.join(discarding)} is not supported (it recomputes a module whose output the next "
        f"one keeps, which saves memory only by discarding that output, not implemented here); supported: {supported}",
    )
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
    _require(not unknown, f"--recompute-modules: unknown {', '.join(unknown)}; supported: {supported}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """Refused flags and, for accepted Megatron flags that select what is always used here, the
    notes printed once at start-up (``args.compatibility_notes``)."""
    for flag, (_, message) in REFUSED_FLAGS.items():
        value = getattr(args, _dest(flag))
        _require(value is None, f"{flag}: {message}")
    notes = []
    for flag, (_, note) in IMPLEMENTATION_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value not in (None, False):
            shown = flag if value is True else f"{flag} {value}"
            notes.append(f"{shown}: {note}")
    if args.spec is not None:
        spec = tuple(args.spec)
        _require(
            spec in ACCEPTED_SPECS[args.model_family],
            f"--spec {' '.join(spec)}: {args.model_family} models are built from this framework's own layer spec; "
            f"accepted: {sorted(' '.join(s) for s in ACCEPTED_SPECS[args.model_family])} (or drop --spec)",
        )
        notes.append(f"--spec {' '.join(spec)}: the {args.model_family} layer spec built here")
    if args.group_query_attention:
        notes.append("--group-query-attention: --num-query-groups alone sets the number of key/value heads")
    args.compatibility_notes = notes


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _iterations(samples: float, global_batch_size: int) -> int | float:
    """``samples`` in iterations of ``global_batch_size``; whole numbers stay integers."""
    iterations = samples / global_batch_size
    return int(iterations) if iterations == int(iterations) else iterations


def _check_schedule(args: argparse.Namespace) -> None:
    """Iteration- or sample-based training as Megatron has them; the sample forms become
    (possibly fractional) iterations of the constant global batch."""
    _require(
        (args.train_iters is None) != (args.train_samples is None),
        "--train-iters and --train-samples are mutually exclusive"
        if args.train_iters is not None
        else "--train-iters (or --train-samples) is required",
    )
    batch = args.global_batch_size
    if args.train_iters is not None:
        _require(args.train_iters >= 1, f"--train-iters must be >= 1, got {args.train_iters}")
        for flag, value, instead in (
            ("--lr-decay-samples", args.lr_decay_samples, "--lr-decay-iters"),
            ("--lr-warmup-samples", args.lr_warmup_samples or None, "--lr-warmup-iters"),
        ):
            _require(
                value is None, f"{flag} needs sample-based training (--train-samples); with --train-iters use {instead}"
            )
        warmup_flag = "--lr-warmup-iters"
    else:
        first = args.batch_schedule.batch_size(0)
        _require(
            args.train_samples >= first,
            f"--train-samples ({args.train_samples}) is less than one global batch ({first})",
        )
        for flag, value, instead in (
            ("--lr-decay-iters", args.lr_decay_iters, "--lr-decay-samples"),
            ("--lr-warmup-iters", args.lr_warmup_iters or None, "--lr-warmup-samples"),
        ):
            _require(
                value is None,
                f"{flag} needs iteration-based training (--train-iters); with --train-samples use {instead}",
            )
        schedule = args.batch_schedule
        args.train_iters = (
            args.train_samples // batch if schedule.is_constant else schedule.iterations(args.train_samples)
        )
        args.lr_decay_iters = _iterations(args.lr_decay_samples or args.train_samples, batch)
        args.lr_warmup_iters = _iterations(args.lr_warmup_samples, batch)
        warmup_flag = "--lr-warmup-samples"
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(not args.lr_warmup_iters, f"--lr-warmup-fraction and {warmup_flag} are mutually exclusive; give one")
        _require(
            0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}"
        )
        args.lr_warmup_iters = args.lr_warmup_fraction * args.lr_decay_iters
    _require(
        args.lr_warmup_iters <= args.lr_decay_iters,
        f"--lr-warmup-iters ({args.lr_warmup_iters}) must not exceed --lr-decay-iters ({args.lr_decay_iters})",
    )
    _require(
        args.exit_interval is None or args.exit_interval >= 1, f"--exit-interval must be >= 1, got {args.exit_interval}"
    )
    _require(
        args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
        f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}",
    )
    _require(args.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    _require(args.manual_gc or not args.manual_gc_interval, "--manual-gc-interval needs --manual-gc")
    if args.profile:
        _require(
            0 <= args.profile_step_start < args.profile_step_end,
            f"--profile-step-start ({args.profile_step_start}) must be below --profile-step-end "
            f"({args.profile_step_end})",
        )


def _check_data(args: argparse.Namespace) -> None:
    """Data sources (one --data-path blend, per-split blends, mock data or the built-in corpus)
    and the tokenizer's inputs."""
    per_split = {split: getattr(args, f"{split}_data_path") for split in ("train", "valid", "test")}
    given_per_split = [f"--{split}-data-path" for split, paths in per_split.items() if paths is not None]
    _require(not (args.mock_data and args.data_path), "--mock-data and --data-path are mutually exclusive")
    _require(
        not (given_per_split and (args.data_path or args.mock_data)),
        f"{', '.join(given_per_split)} and {'--mock-data' if args.mock_data else '--data-path'} are mutually exclusive",
    )
    _require(not given_per_split or per_split["train"], "--valid-data-path / --test-data-path need --train-data-path")
    blends = {}
    try:
        if args.data_path:
            blends["all"] = parse_blend(args.data_path, "--data-path")
        for split, paths in per_split.items():
            if paths is not None:
                blends[split] = parse_blend(paths, f"--{split}-data-path")
    except ValueError as error:
        raise ArgumentError(str(error)) from error
    for blend in blends.values():
        _require(
            BUILTIN_DATA_PATH not in blend.prefixes or len(blend.prefixes) == 1,
            f"'{BUILTIN_DATA_PATH}' (the built-in corpus) cannot be blended with other datasets",
        )
    args.data_blends = blends
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file or args.merge_file else DEFAULT_TOKENIZER_TYPE
    try:
        check_tokenizer_inputs(
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
        )
    except ValueError as error:
        raise ArgumentError(str(error)) from error
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
        builtin = not blends or any(BUILTIN_DATA_PATH in blend.prefixes for blend in blends.values())
        _require(
            args.mock_data or not builtin,
            "NullTokenizer cannot tokenize the built-in corpus; use --mock-data or --data-path",
        )
    for flag, path in (
        ("--tokenizer-model", args.tokenizer_model),
        ("--vocab-file", args.vocab_file),
        ("--merge-file", args.merge_file),
    ):
        _require(path is None or os.path.exists(path), f"{flag} {path}: no such file or directory")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the flags against each other and the world size; fill derived values.

    Raises ArgumentError naming the flags at fault. Runs before any process group exists.
    """
    if args.optimizer == "dist_muon":  # Megatron's older spelling
        args.optimizer, args.use_distributed_optimizer = "muon", True
    _refuse_unsupported(args)
    for flag in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "generalized_tensor_parallel_size",
        "micro_batch_size",
        "mamba_chunk_size",
    ):
        _require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    tp, pp, cp, gtp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
        args.generalized_tensor_parallel_size,
    )
    model_parallel = tp * pp * cp * gtp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) x "
        f"--generalized-tensor-parallel-size ({gtp}) = {model_parallel}",
    )
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    _validate_expert_parallel(args)
    _validate_optimizer_instances(args)
    # GTP peers read different micro-batches: they are part of the data-parallel width. CP peers
    # share each micro-batch (each keeps its chunks of the sequences).
    args.data_parallel_width = args.data_parallel_size * gtp
    if args.hybrid_override_pattern is not None:
        _require(
            args.hybrid_layer_pattern is None,
            "--hybrid-override-pattern is the older name of --hybrid-layer-pattern; give one of them",
        )
        args.hybrid_layer_pattern = args.hybrid_override_pattern
    if args.model_family == "hybrid" and args.num_layers is None and args.hybrid_layer_pattern is not None:
        try:  # Megatron's rule: the pattern gives the depth (and the MTP depth after '/')
            parsed = parse_hybrid_pattern(args.hybrid_layer_pattern)
        except ValueError as error:
            raise ArgumentError(f"invalid model flags: {error}") from error
        args.num_layers = parsed.num_layers
        if args.mtp_num_layers is None and parsed.mtp_patterns:
            args.mtp_num_layers = len(parsed.mtp_patterns)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "lr"):
        _require(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    _require(
        not args.overlap_param_gather or args.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer",
    )
    _require(
        args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
        f"--ddp-bucket-size must be >= 1, got {args.ddp_bucket_size}",
    )
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    _require(not (args.swiglu and args.squared_relu), "--squared-relu and --swiglu are mutually exclusive")
    _require(
        not args.use_rope_scaling or args.model_family == "gpt",
        "--use-rope-scaling is for GPT models (hybrid models have no RoPE scaling)",
    )
    _require(
        not (args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16),
        "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 are mutually exclusive",
    )
    _require(
        args.make_vocab_size_divisible_by >= 1,
        f"--make-vocab-size-divisible-by must be >= 1, got {args.make_vocab_size_divisible_by}",
    )
    _require(
        args.optimizer != "muon" or args.generalized_tensor_parallel_size == 1,
        "--optimizer muon does not support --generalized-tensor-parallel-size > 1 (Muon orthogonalizes whole "
        "matrices); shard the weights with --tensor-model-parallel-size",
    )
    try:
        optimizer_config_from_args(args)
    except OptimizerConfigError as error:
        raise ArgumentError(f"invalid optimizer flags: {error}") from error
    _check_data(args)
    args.batch_schedule = _batch_schedule(args)
    per_step = args.micro_batch_size * args.data_parallel_width
    for _, batch in args.batch_schedule.steps:
        _require(
            batch % per_step == 0,
            f"{'--global-batch-size' if args.batch_schedule.is_constant else 'the global batch size'} ({batch}) must "
            f"be a multiple of --micro-batch-size ({args.micro_batch_size}) x "
            f"data-parallel width ({args.data_parallel_width} = DP {args.data_parallel_size} x GTP {gtp}; CP peers "
            "share micro-batches)"
            + ("" if args.batch_schedule.is_constant else f" (batch schedule: {args.batch_schedule.describe()})"),
        )
    args.num_microbatches = args.global_batch_size // per_step
    _check_eval_batches(args)
    _check_schedule(args)
    _validate_virtual_pipeline(args)
    _require(
        args.num_attention_heads % tp == 0,
        f"--num-attention-heads ({args.num_attention_heads}) must be divisible by --tensor-model-parallel-size ({tp})",
    )
    if args.num_query_groups is not None:
        _require(
            args.num_query_groups % tp == 0,
            f"--num-query-groups ({args.num_query_groups}) must be divisible by --tensor-model-parallel-size ({tp})",
        )
        _require(
            args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by --num-query-groups "
            f"({args.num_query_groups})",
        )
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron's behaviour: nothing to split at TP=1
    if cp > 1:
        _require(
            args.seq_length % (2 * cp) == 0,
            f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size ({2 * cp}): "
            "each CP rank holds two load-balanced chunks of every sequence",
        )
        _require(
            not args.sequence_parallel or (args.seq_length // cp) % tp == 0,
            f"--sequence-parallel needs --seq-length / --context-parallel-size ({args.seq_length // cp}) "
            f"divisible by --tensor-model-parallel-size ({tp})",
        )
    if args.recompute_activations:
        _require(
            args.recompute_granularity in (None, "selective"),
            f"--recompute-activations is selective recompute; it contradicts --recompute-granularity "
            f"{args.recompute_granularity}",
        )
        args.recompute_granularity = "selective"  # Megatron's meaning
    for flag in ("recompute_method", "recompute_num_layers"):
        _require(
            getattr(args, flag) is None or args.recompute_granularity == "full",
            f"--{flag.replace('_', '-')} needs --recompute-granularity full",
        )
    _require(
        args.recompute_num_layers is None or args.recompute_num_layers >= 1,
        f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}",
    )
    _check_recompute_modules(args)
    _resolve_position_embedding(args)
    if (
        args.position_embedding_type == "rope"
        and (args.rope_type or ("yarn" if args.multi_latent_attention else None)) == "yarn"
    ):
        args.position_embedding_type = "yarn"  # Megatron's --rope-type, whose MLA default is YaRN
    _require(
        not args.multi_latent_attention or args.model_family == "gpt",
        "--multi-latent-attention is for GPT models (hybrid models' attention layers are standard)",
    )
    _require(
        not args.rotary_interleaved or args.position_embedding_type in ("rope", "yarn"),
        f"--rotary-interleaved needs --position-embedding-type rope (got {args.position_embedding_type})",
    )
    _require(
        args.position_embedding_type != "yarn" or (args.rotary_percent == 1.0 and not args.use_rope_scaling),
        "--position-embedding-type yarn rotates whole heads: it needs --rotary-percent 1.0 and no --use-rope-scaling",
    )
    args.disabled_fusions = _disabled_fusions(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({args.max_position_embeddings})",
        )
    if args.model_family == "hybrid":
        _require(args.hybrid_layer_pattern is not None, "--hybrid-layer-pattern is required for hybrid models")
    else:
        _require(args.hybrid_layer_pattern is None, "--hybrid-layer-pattern is only valid for hybrid models")
    args.stage_ends = _pipeline_stage_ends(args)
    if args.model_family == "gpt" and args.stage_ends == (None, None):
        _require(
            args.num_layers % pp == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})",
        )
    _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    _require(args.decoupled_min_lr is None or args.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None:
        decoupled_min = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        _require(
            0 <= decoupled_min <= args.decoupled_lr,
            f"the decoupled minimum LR ({decoupled_min}) must be in [0, --decoupled-lr ({args.decoupled_lr})]",
        )
    _require(
        not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
        "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive",
    )
    _require(args.save_interval is None or args.save is not None, "--save-interval needs --save")
    _require(args.save_interval is None or args.save_interval >= 1, "--save-interval must be >= 1")
    _require(args.save_retain_interval is None or args.save is not None, "--save-retain-interval needs --save")
    _require(
        args.save_retain_interval is None or args.save_retain_interval >= 1,
        f"--save-retain-interval must be >= 1, got {args.save_retain_interval}",
    )
    _require(not (args.finetune and args.load is None), "--finetune needs --load")
    _require(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    _require(
        args.moe_layer_freq == 1 or (args.model_family == "gpt" and args.num_experts),
        "--moe-layer-freq needs --num-experts and a GPT model (hybrid models place MoE layers with 'E' in "
        "--hybrid-layer-pattern)",
    )
    _require(args.error_injection_rate >= 0, f"--error-injection-rate must be >= 0, got {args.error_injection_rate}")
    interval = args.check_weight_hash_across_dp_replicas_interval
    _require(
        interval is None or interval >= 1,
        f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got {interval}",
    )
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    _require(
        args.eval_interval is None or args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}"
    )
    _require(
        args.mtp_num_layers is None or args.mtp_num_layers >= 1,
        f"--mtp-num-layers must be >= 1, got {args.mtp_num_layers}",
    )
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        config = transformer_config_from_args(args)
        if args.model_family == "hybrid":
            from megatron.core.models.hybrid.hybrid_layer_pattern import resolve_hybrid_pattern, select_stage_layers
            from megatron.core.ssm.mamba_mixer import MambaDims

            MambaDims.from_config(config, tp)
            pattern = resolve_hybrid_pattern(
                config.num_layers,
                config.mtp_num_layers,
                args.hybrid_layer_pattern,
                None,
                None,
                None,
                config.num_moe_experts,
            )
            select_stage_layers(pattern, pp, 0, args.virtual_pipeline_model_parallel_size or 1)
        else:
            first, last = args.stage_ends
            stage = {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last}
            stage_layer_counts(dataclasses.replace(config, **stage), pp)
    except ValueError as error:
        raise ArgumentError(f"invalid model flags: {error}") from error
    return args


def _resolve_position_embedding(args: argparse.Namespace) -> None:
    """--position-embedding-type, or Megatron's older --use-rotary-position-embeddings /
    --no-position-embedding, else the family's default (learned positions for GPT, none for hybrid)."""
    chosen = args.position_embedding_type
    if args.use_rotary_position_embeddings:
        _require(
            chosen in (None, "rope"),
            f"--use-rotary-position-embeddings contradicts --position-embedding-type {chosen}",
        )
        chosen = "rope"
    if not args.add_position_embedding and chosen != "rope":
        _require(
            chosen in (None, "none"),
            f"--no-position-embedding contradicts --position-embedding-type {chosen}",
        )
        chosen = "none"
    if chosen is None:
        chosen = "none" if args.model_family == "hybrid" else "learned_absolute"
    args.position_embedding_type = chosen


def _pipeline_stage_ends(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The layers of the first and the last pipeline stage of Megatron's uneven split:
    --decoder-first/last-pipeline-num-layers, or --account-for-embedding/loss-in-pipeline-split
    (the embedding / the loss counts as one layer of its stage's even share); (None, None) for
    an even split. The split itself is checked with the model flags (validate_args)."""
    pp = args.pipeline_model_parallel_size
    decoder = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    account = (args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split)
    if decoder == (None, None) and not any(account):
        return None, None
    _require(
        args.model_family == "gpt",
        "uneven pipeline stages are for GPT models; hybrid models place their stages with '|' in "
        "--hybrid-layer-pattern",
    )
    _require(
        pp > 1 and args.virtual_pipeline_model_parallel_size is None,
        "--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split need "
        "--pipeline-model-parallel-size > 1 and no virtual pipeline stages",
    )
    if any(account):
        _require(
            decoder == (None, None),
            "--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers are "
            "mutually exclusive",
        )
        total = args.num_layers + sum(account)
        _require(
            total % pp == 0,
            f"--num-layers ({args.num_layers}) plus the {sum(account)} accounted for must be divisible by "
            f"--pipeline-model-parallel-size ({pp})",
        )
        share = total // pp
        decoder = (share - 1 if account[0] else None, share - 1 if account[1] else None)
    return decoder


def _disabled_fusions(args: argparse.Namespace) -> list[str]:
    """The fused ops (megatron.core.fusions names) that Megatron's --no-*-fusion flags send back to
    the torch path: the activation's switch is the one of the activation the model uses."""
    activation_fused = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    off = {"rope": not args.apply_rope_fusion, "activation": not activation_fused}
    off["bias_dropout_add"] = not args.bias_dropout_fusion
    return [op for op, disabled in off.items() if disabled]


def _batch_schedule(args: argparse.Namespace) -> BatchSchedule:
    """The global batch sizes of the run (--step-batch-size-schedule, --rampup-batch-size or the
    constant --global-batch-size, default one micro-batch per data rank); sets
    ``args.global_batch_size`` to the final one."""
    text, rampup = args.step_batch_size_schedule, args.rampup_batch_size
    _require(not (text and rampup), "--step-batch-size-schedule and --rampup-batch-size are mutually exclusive")
    try:
        if text:
            schedule = BatchSchedule.parse(" ".join(text), args.seq_length)
            _require(
                args.global_batch_size in (None, schedule.final),
                f"--global-batch-size ({args.global_batch_size}) must be the schedule's last batch size "
                f"({schedule.final}) with --step-batch-size-schedule",
            )
        elif rampup:
            _require(args.global_batch_size is not None, "--rampup-batch-size needs --global-batch-size")
            schedule = BatchSchedule.rampup(*rampup, args.global_batch_size)
        else:
            schedule = BatchSchedule.constant(
                args.global_batch_size or args.micro_batch_size * args.data_parallel_width
            )
    except BatchScheduleError as error:
        flag = "--step-batch-size-schedule" if text else "--rampup-batch-size"
        raise ArgumentError(f"{flag}: {error}") from error
    args.global_batch_size = schedule.final
    return schedule


def _check_eval_batches(args: argparse.Namespace) -> None:
    """--eval-global-batch-size / --eval-micro-batch-size (default: training's): sets
    ``args.eval_num_microbatches``."""
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    _require(args.eval_micro_batch_size >= 1, f"--eval-micro-batch-size must be >= 1, got {args.eval_micro_batch_size}")
    per_step = args.eval_micro_batch_size * args.data_parallel_width
    _require(
        args.eval_global_batch_size >= 1 and args.eval_global_batch_size % per_step == 0,
        f"--eval-global-batch-size ({args.eval_global_batch_size}) must be a positive multiple of "
        f"--eval-micro-batch-size ({args.eval_micro_batch_size}) x data-parallel width ({args.data_parallel_width})",
    )
    args.eval_num_microbatches = args.eval_global_batch_size // per_step


def _validate_virtual_pipeline(args: argparse.Namespace) -> None:
    """Megatron's virtual-pipeline flags: ``--num-layers-per-virtual-pipeline-stage N`` gives
    ``V = num_layers / PP / N``; ``--virtual-pipeline-model-parallel-size V`` (or
    ``--num-virtual-stages-per-pipeline-rank V``) gives V directly. Sets
    ``args.virtual_pipeline_model_parallel_size`` (None: no interleaving; V = 1 runs 1F1B and
    says so in the compatibility notes)."""
    pp = args.pipeline_model_parallel_size
    given = [
        (flag, getattr(args, _dest(flag)))
        for flag in (
            "--num-layers-per-virtual-pipeline-stage",
            "--virtual-pipeline-model-parallel-size",
            "--num-virtual-stages-per-pipeline-rank",
        )
        if getattr(args, _dest(flag)) is not None
    ]
    _require(len(given) <= 1, f"{' and '.join(flag for flag, _ in given)} are mutually exclusive; give one")
    args.virtual_pipeline_model_parallel_size = None
    if not given:
        return
    flag, value = given[0]
    _require(value >= 1, f"{flag} must be >= 1, got {value}")
    vp = value
    if flag == "--num-layers-per-virtual-pipeline-stage":
        _require(
            args.num_layers % (pp * value) == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
            f"{flag} ({value})",
        )
        vp = args.num_layers // (pp * value)
    if vp == 1:
        args.compatibility_notes.append(f"{flag} {value}: one virtual stage per pipeline rank, the 1F1B schedule")
        return
    _require(pp > 1, f"{flag} {value}: virtual pipeline stages (V = {vp}) need --pipeline-model-parallel-size > 1")
    if args.model_family != "hybrid":
        _require(
            args.num_layers % (pp * vp) == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
            f"virtual pipeline size ({vp}) = {pp * vp}",
        )
    group = args.microbatch_group_size_per_virtual_pipeline_stage or pp
    per_step = args.micro_batch_size * args.data_parallel_width
    counts = [("", batch // per_step) for _, batch in args.batch_schedule.steps]
    for name, count in counts + [("evaluation ", args.eval_num_microbatches)]:
        error = microbatch_group_error(pp, count, group)
        _require(
            error is None,
            f"{name}micro-batches per step: {count}; {error} (set by --microbatch-group-size-per-virtual-pipeline-"
            "stage, default --pipeline-model-parallel-size)",
        )
    args.microbatch_group_size_per_virtual_pipeline_stage = group
    args.virtual_pipeline_model_parallel_size = vp


def parse_args(
    argv: list[str] | None = None,
    model_family: str = "gpt",
    world_size: int | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 without torchrun).

    With ``--load`` of a checkpoint the model flags not given come from its model record
    (:mod:`megatron.training.checkpoint_args`). ``args.non_default_args`` lists the flags whose
    value differs from the default (for the start-up summary)."""
    parser = build_parser(model_family)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    args = parser.parse_args(argv)
    explicit = given_destinations(parser, sys.argv[1:] if argv is None else argv)
    apply_checkpoint_record(args, explicit, ArgumentError)
    args.non_default_args = {
        action.option_strings[-1]: getattr(args, action.dest)
        for action in parser._actions
        if action.option_strings and action.dest != "help" and getattr(args, action.dest) != action.default
    }
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size)


def given_destinations(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options that ``argv`` gives (``--flag value`` or ``--flag=value``)."""
    options = parser._option_string_actions
    return {options[token.split("=", 1)[0]].dest for token in argv if token.split("=", 1)[0] in options}


def _validate_expert_parallel(args: argparse.Namespace) -> None:
    """Megatron's ETP default (the TP size), and EP x ETP dividing a pipeline stage's ranks."""
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    for flag, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        _require(value >= 1, f"{flag} must be >= 1, got {value}")
    stage = args.tensor_model_parallel_size * args.context_parallel_size * args.data_parallel_size
    _require(
        stage % (ep * etp) == 0,
        f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) = {ep * etp} must divide "
        f"the TP x CP x DP = {stage} ranks of a pipeline stage",
    )
    _require(
        args.generalized_tensor_parallel_size == 1 or (ep == 1 and etp == args.tensor_model_parallel_size),
        "--expert-model-parallel-size / --expert-tensor-parallel-size need --generalized-tensor-parallel-size 1",
    )


def _validate_optimizer_instances(args: argparse.Namespace) -> None:
    """--num-distributed-optimizer-instances: with the distributed optimizer, dividing the dense
    (DP x CP) and, with experts, the expert data-parallel replicas."""
    instances, flag = args.num_distributed_optimizer_instances, "--num-distributed-optimizer-instances"
    _require(instances >= 1, f"{flag} must be >= 1, got {instances}")
    if instances == 1:
        return
    _require(args.use_distributed_optimizer, f"{flag} {instances} needs --use-distributed-optimizer")
    replicas = {"data-parallel (DP x CP)": args.data_parallel_size * args.context_parallel_size}
    if args.num_experts:
        stage = args.tensor_model_parallel_size * args.context_parallel_size * args.data_parallel_size
        replicas["expert data-parallel"] = stage // (args.expert_model_parallel_size * args.expert_tensor_parallel_size)
    for what, size in replicas.items():
        _require(size % instances == 0, f"{flag} ({instances}) must divide the {size} {what} replicas")


def _mla_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of --multi-latent-attention (none without it)."""
    if not args.multi_latent_attention:
        return {}
    return {"multi_latent_attention": True, **{name: getattr(args, name) for name in MLA_FIELDS}}


def _yarn_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig YaRN fields of --position-embedding-type yarn (none otherwise)."""
    if args.position_embedding_type != "yarn":
        return {}
    given = {
        "yarn_original_max_position_embeddings": args.yarn_original_max_position_embeddings,
        "yarn_beta_fast": args.yarn_beta_fast,
        "yarn_beta_slow": args.yarn_beta_slow,
        "yarn_correction_range_round_to_int": args.yarn_correction_range_round_to_int,
    }
    return {
        "yarn_rotary_scaling_factor": args.rotary_scaling_factor,
        "yarn_mscale": args.mscale,
        "yarn_mscale_all_dim": args.mscale_all_dim,
        **{name: value for name, value in given.items() if value is not None},
    }


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The model configuration the flags describe."""
    return TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
        generalized_tensor_parallel_size=args.generalized_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        calculate_per_token_loss=args.calculate_per_token_loss,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        attention_backend=args.attention_backend,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else squared_relu if args.squared_relu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        qk_layernorm=args.qk_layernorm,
        add_qkv_bias=args.add_qkv_bias,
        rotary_interleaved=args.rotary_interleaved,
        **_yarn_fields(args),
        **_mla_fields(args),
        init_method_std=args.init_method_std,
        init_seed=args.seed,
        mamba_state_dim=args.mamba_state_dim,
        mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups,
        mamba_num_heads=args.mamba_num_heads,
        mamba_chunk_size=args.mamba_chunk_size,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
    )


def tokenizer_record_from_args(args: argparse.Namespace) -> TokenizerRecord:
    """The tokenizer the flags name."""
    return TokenizerRecord(
        args.tokenizer_type,
        args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size if args.tokenizer_type == "NullTokenizer" else None,
    )


def optimizer_config_from_args(args) -> OptimizerConfig:
    """The optimizer settings the training flags describe."""
    return OptimizerConfig(
        optimizer=args.optimizer,
        muon_momentum=args.muon_momentum,
        muon_nesterov=args.muon_nesterov,
        muon_split_qkv=args.muon_split_qkv,
        muon_scale_mode=args.muon_scale_mode,
        muon_extra_scale_factor=args.muon_extra_scale_factor,
        muon_num_ns_steps=args.muon_num_ns_steps,
        muon_coefficient_type=args.muon_coefficient_type,
        muon_tp_mode=args.muon_tp_mode,
        muon_fp32_matmul_prec=args.muon_fp32_matmul_prec,
        sgd_momentum=args.sgd_momentum,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )


def model_record_from_args(args: argparse.Namespace, vocab_size: int) -> ModelRecord:
    """The model record of a run: built once, it is what the trainer builds the model from and
    what its checkpoints store. With ``--load`` of a checkpoint it is the checkpoint's record
    with this run's layout and training behaviour; otherwise the pretraining flags'."""
    if getattr(args, "checkpoint_record", None) is not None:
        return record_for_run(args, args.checkpoint_record, tokenizer_record_from_args(args))
    return ModelRecord(
        family=args.model_family,
        config=transformer_config_from_args(args),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        layer_pattern=args.hybrid_layer_pattern,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        tokenizer=tokenizer_record_from_args(args),
    )
