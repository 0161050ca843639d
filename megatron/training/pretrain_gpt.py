"""Pretrain a GPT model (``megatron-pretrain-gpt``, ``python -m megatron.training.pretrain_gpt``).

Run on one process, or under torchrun for TP/PP/DP/GTP, e.g. on 4 CPU processes::

    torchrun --nproc-per-node 4 --no-python megatron-pretrain-gpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 4 --global-batch-size 16 --train-iters 50 --lr 1e-3 \\
        --save runs/gpt

Without --data-path (or with --data-path builtin) it trains on the built-in corpus.
"""

import sys

from megatron.training.entry import run


def main(argv: list[str] | None = None) -> int:
    return run("gpt", argv)


if __name__ == "__main__":
    sys.exit(main())
