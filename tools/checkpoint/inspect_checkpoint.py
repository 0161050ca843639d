#!/usr/bin/env python3
"""The ``megatron-inspect-ckpt`` command as a script: list a checkpoint's tensors and objects.

python tools/checkpoint/inspect_checkpoint.py runs/gpt
"""

import sys

from megatron.core.dist_checkpointing.inspect_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
