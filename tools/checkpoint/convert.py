#!/usr/bin/env python3
"""The ``megatron-convert`` command as a script (see
:mod:`megatron.core.models.checkpoint_converter` for the flags):

    python tools/checkpoint/convert.py --loader hf --saver megatron --load-dir HF_DIR --save-dir OUT
"""

import sys

from megatron.core.models.checkpoint_converter import main

if __name__ == "__main__":
    sys.exit(main())
