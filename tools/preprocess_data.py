#!/usr/bin/env python3
"""The ``megatron-preprocess-data`` command as a script, Megatron's name for it (see
:mod:`megatron.core.datasets.preprocess_data` for the flags):

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod
"""

import sys

from megatron.core.datasets.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
