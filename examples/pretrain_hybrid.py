#!/usr/bin/env python3
"""Pretrain a hybrid Mamba/attention model. Launch with torchrun, e.g. on 4 CPU processes:

    torchrun --nproc-per-node 4 examples/pretrain_hybrid.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --hybrid-layer-pattern "M*|M-" --num-layers 4 \\
        --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 \\
        --global-batch-size 16 --train-iters 50 --lr 1e-3

The pattern uses M (Mamba-2), * (attention), - (MLP), | (pipeline stage boundary) and
/ (multi-token prediction depths, e.g. "M*M-/*-").
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.models.hybrid import HybridModel  # noqa: E402
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec  # noqa: E402
from megatron.training.entry import run  # noqa: E402


def model_provider(args, config, vocab_size, pg_collection):
    """This pipeline stage's HybridModel."""
    pp_rank, pp_size = pg_collection.rank("pp"), pg_collection.size("pp")
    return HybridModel(
        config,
        get_hybrid_stack_local_spec(),
        vocab_size,
        args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        pg_collection=pg_collection,
    )


if __name__ == "__main__":
    sys.exit(run("hybrid", model_provider))
