#!/usr/bin/env python3
"""Serve a training checkpoint over the OpenAI-compatible HTTP API from one process.

    python examples/inference/serve.py --load runs/quickstart --port 8000

Starts the coordinator, one engine over the checkpoint's model (its config and tokenizer come
from the checkpoint) and the HTTP server (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics), binds 127.0.0.1 unless ``--host`` says otherwise, and prints
``Serving on http://HOST:PORT`` when ready. Ctrl-C or SIGTERM shuts down cleanly. Engine and
server flags are those of ``tools/run_text_generation_server.py``, the torchrun launcher for
tensor / pipeline / data-parallel serving.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launcher():
    path = os.path.join(ROOT, "tools", "run_text_generation_server.py")
    spec = importlib.util.spec_from_file_location("run_text_generation_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    launcher = _launcher()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launcher.add_serving_args(parser)
    return launcher.serve_checkpoint(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
