#!/usr/bin/env python3
"""Pretrain a hybrid Mamba/attention model: the ``megatron-pretrain-hybrid`` command as a
script (see :mod:`megatron.training.pretrain_hybrid`), e.g. under torchrun on 4 CPU processes:

    torchrun --nproc-per-node 4 examples/pretrain_hybrid.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --hybrid-layer-pattern "M*|M-" --num-layers 4 \\
        --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 \\
        --global-batch-size 16 --train-iters 50 --lr 1e-3
"""

import sys

from megatron.training.pretrain_hybrid import main

if __name__ == "__main__":
    sys.exit(main())
