#!/usr/bin/env python3
"""Offline batch generation with the dynamic inference engine (see
:mod:`megatron.core.inference.offline_inference` for the flags), e.g.:

    python examples/inference/offline_inference.py --load runs/quickstart --prompts "def fib(n):" \\
        --num-tokens-to-generate 32 --output-json out.json
"""

import sys

from megatron.core.inference.offline_inference import main

if __name__ == "__main__":
    sys.exit(main())
