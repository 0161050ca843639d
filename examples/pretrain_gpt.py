#!/usr/bin/env python3
"""Pretrain a GPT model. Launch with torchrun, e.g. on 4 CPU processes:

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 4 --global-batch-size 16 --train-iters 50 --lr 1e-3 \\
        --save runs/gpt

Without --data-path (or with --data-path builtin) it trains on the built-in corpus.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec  # noqa: E402
from megatron.training.entry import run  # noqa: E402


def model_provider(args, config, vocab_size, pg_collection):
    """This pipeline stage's GPTModel."""
    pp_rank, pp_size = pg_collection.rank("pp"), pg_collection.size("pp")
    spec = get_gpt_layer_local_spec()
    return GPTModel(
        config,
        spec,
        vocab_size,
        args.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        mtp_block_spec=get_gpt_mtp_block_spec(spec) if args.mtp_num_layers else None,
        pg_collection=pg_collection,
    )


if __name__ == "__main__":
    sys.exit(run("gpt", model_provider))
