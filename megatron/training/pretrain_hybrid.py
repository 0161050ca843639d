"""Pretrain a hybrid Mamba/attention model (``megatron-pretrain-hybrid``,
``python -m megatron.training.pretrain_hybrid``). Under torchrun, e.g. on 4 CPU processes::

    torchrun --nproc-per-node 4 --no-python megatron-pretrain-hybrid --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --hybrid-layer-pattern "M*|M-" --num-layers 4 \\
        --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 \\
        --global-batch-size 16 --train-iters 50 --lr 1e-3

The pattern uses M (Mamba-2), * (attention), - (MLP), | (pipeline stage boundary) and
/ (multi-token prediction depths, e.g. "M*M-/*-").
"""

import sys

from megatron.training.entry import run


def main(argv: list[str] | None = None) -> int:
    return run("hybrid", argv)


if __name__ == "__main__":
    sys.exit(main())
