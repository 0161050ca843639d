#!/usr/bin/env python3
"""Serve a training checkpoint over the OpenAI-compatible HTTP API from one process: the
``megatron-serve`` command as a script (see :mod:`megatron.core.inference.server.launcher`).

    python examples/inference/serve.py --load runs/quickstart --port 8000
"""

import sys

from megatron.core.inference.server.launcher import main

if __name__ == "__main__":
    sys.exit(main())
