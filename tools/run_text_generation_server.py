#!/usr/bin/env python3
"""The ``megatron-serve`` command as a script, Megatron's name for it: serve a checkpoint over
the OpenAI-compatible HTTP API, one TP/PP replica under torchrun, or data-parallel replicas that
it starts and supervises (see :mod:`megatron.core.inference.server.launcher` for the flags):

    torchrun --standalone --nproc-per-node 2 tools/run_text_generation_server.py --load runs/quickstart \\
        --tensor-model-parallel-size 2 --port 8000
    python tools/run_text_generation_server.py --load runs/quickstart --data-parallel-size 2 \\
        --tensor-model-parallel-size 2 --port 8000
"""

import sys

from megatron.core.inference.server.launcher import main

if __name__ == "__main__":
    sys.exit(main())
