#!/usr/bin/env python3
"""The ``megatron-serve`` command as a script, Megatron's name for it: serve a checkpoint over
the OpenAI-compatible HTTP API, under torchrun for TP/PP/DP replicas (see
:mod:`megatron.core.inference.server.launcher` for the flags):

    torchrun --standalone --nproc-per-node 4 tools/run_text_generation_server.py --load runs/quickstart \\
        --tensor-model-parallel-size 2 --port 8000
"""

import sys

from megatron.core.inference.server.launcher import main

if __name__ == "__main__":
    sys.exit(main())
