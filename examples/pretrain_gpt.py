#!/usr/bin/env python3
"""Pretrain a GPT model: the ``megatron-pretrain-gpt`` command as a script (see
:mod:`megatron.training.pretrain_gpt` for the flags), e.g. under torchrun on 4 CPU processes:

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 4 --global-batch-size 16 --train-iters 50 --lr 1e-3 \\
        --save runs/gpt
"""

import sys

from megatron.training.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
