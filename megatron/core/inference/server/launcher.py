"""``megatron-serve``: serve a training checkpoint over the OpenAI-compatible HTTP API.

One process (coordinator, engine and HTTP server)::

    megatron-serve --load runs/quickstart --port 8000

or tensor / pipeline / data-parallel replicas on one host under torchrun::

    torchrun --standalone --nproc-per-node 4 --no-python megatron-serve --load runs/quickstart \\
        --tensor-model-parallel-size 2 --port 8000        # 2 replicas of TP2

(``python -m megatron.core.inference.server.launcher`` is the same command.) The world is
DP x (TP x PP): each model-parallel group is one engine replica built from the checkpoint
(its model record and tokenizer from the checkpoint, its weights loaded for this layout).
The group's rank 0 talks to the coordinator and broadcasts each batch of commands to the
rest of the group (:class:`EngineEndpoint`); the coordinator spreads requests over the
replicas. Global rank 0 also runs the coordinator and the HTTP server (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics), binds 127.0.0.1 unless ``--host``
says otherwise, and prints ``Serving on URL`` once every replica has registered. SIGINT /
SIGTERM stop every replica after it has answered its in-flight requests (aborted), then the
server and coordinator; a second signal kills.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.checkpoint_loading import default_device, load_inference_model
from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from megatron.core.inference.server.chat_template import ChatTemplateError
from megatron.core.inference.server.serve import ServerThread, bind_socket
from megatron.core.inference.server.service import ServerConfig, ServerConfigError
from megatron.core.models.model_record import read_model_record
from megatron.core.process_groups import ParallelConfigError

REGISTRATION_TIMEOUT_S = 120.0
ADDRESS_BYTES = 256  # a coordinator address (tcp://host:port) fits


class ReplicaRegistrationError(MegatronRuntimeError):
    """Not every engine replica registered with the coordinator in time."""


def add_serving_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The checkpoint, HTTP, engine and server flags."""
    parser.add_argument(
        "--load", required=True, help="checkpoint directory (root or iter_*); the model config is read from it"
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    http.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (see the printed URL)")
    engine = parser.add_argument_group("engine (per replica)")
    engine.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument(
        "--kv-block-count",
        type=int,
        default=None,
        help="KV blocks (default: enough for --max-requests requests of the full sequence length)",
    )
    engine.add_argument("--max-requests", type=int, default=16, help="requests decoding at once")
    engine.add_argument("--max-tokens-per-step", type=int, default=256)
    engine.add_argument("--enable-prefix-caching", action="store_true")
    engine.add_argument("--enable-chunked-prefill", action="store_true")
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", default="megatron", help="the model id requests must name")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    server.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longer prompts get HTTP 400 before reaching an engine"
    )
    defaults = ServerConfig()
    server.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=defaults.max_prompts_per_request,
        help="most prompts one /v1/completions request may hold",
    )
    server.add_argument("--max-n", type=int, default=defaults.max_n, help="most choices per prompt (n) a request gets")
    server.add_argument(
        "--http-header-timeout", type=float, default=defaults.header_timeout_s, help="seconds for a request head"
    )
    server.add_argument(
        "--http-body-timeout", type=float, default=defaults.body_timeout_s, help="seconds for a request body"
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or 'plain' (the built-in template), instead of the tokenizer's own",
    )
    server.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None)
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default="hermes")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megatron-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_args(parser)
    layout = parser.add_argument_group("layout of one replica (the rest of the world is data parallel)")
    layout.add_argument("--tensor-model-parallel-size", type=int, default=1)
    layout.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return parser.parse_args(argv)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompts_per_request=args.max_prompts_per_request,
        max_n=args.max_n,
        header_timeout_s=args.http_header_timeout,
        body_timeout_s=args.http_body_timeout,
        kv_block_size=args.kv_block_size,
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )


def build_engine(args: argparse.Namespace, model, tokenizer, pg) -> DynamicInferenceEngine:
    """This rank's engine over ``model``, sized by the engine flags."""
    blocks_per_request = -(-model.max_sequence_length // args.kv_block_size)
    return DynamicInferenceEngine(
        model,
        tokenizer=tokenizer,
        pg_collection=pg,
        block_size=args.kv_block_size,
        num_blocks=args.kv_block_count or args.max_requests * blocks_per_request,
        max_requests=args.max_requests,
        max_tokens_per_step=args.max_tokens_per_step,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def _stop_on_signals(endpoint: EngineEndpoint) -> None:
    """First SIGINT/SIGTERM: stop serving gracefully; a second one: the default action."""

    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        endpoint.request_stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _wait_for_replicas(coordinator: InferenceCoordinator, num_replicas: int) -> None:
    deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
    while len(coordinator.router.engines) < num_replicas:
        if time.monotonic() > deadline:
            raise ReplicaRegistrationError(
                f"{len(coordinator.router.engines)} of {num_replicas} engine replicas registered with the coordinator "
                f"within {REGISTRATION_TIMEOUT_S:.0f}s"
            )
        time.sleep(0.01)


def _broadcast_address(address: str | None, device: torch.device) -> str:
    """Global rank 0's coordinator address on every rank (as bytes in a tensor: no pickling)."""
    data = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8, device=device)
    if address is not None:
        encoded = address.encode()
        data[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).rstrip(b"\0").decode()


def serve_checkpoint(args: argparse.Namespace) -> int:
    """Serve ``args.load`` until SIGINT/SIGTERM (see the module doc); every rank calls this.

    Returns the exit status: 0, or 2 when global rank 0 cannot bind ``--host``/``--port``
    (the other ranks are then ended by torchrun). Raises ServerConfigError / CheckpointingError
    for bad options or a ``--load`` that is no checkpoint, before anything starts."""
    config = server_config(args)  # bad server options and checkpoints fail before anything starts
    read_model_record(args.load)
    parallel_state.initialize_distributed("nccl" if torch.cuda.is_available() else "gloo")
    pg = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    is_frontend = dist.get_rank() == 0
    coordinator = server = None
    try:
        if is_frontend:
            try:  # before loading, so that a taken port fails at once
                sock = bind_socket(args.host, args.port)
            except OSError as exc:
                print(
                    f"error: cannot serve on {args.host}:{args.port} ({exc.strerror}); pick another --port, or "
                    "--port 0 for a free one",
                    file=sys.stderr,
                )
                return 2
            coordinator = InferenceCoordinator().start()
        address = _broadcast_address(coordinator.address if is_frontend else None, default_device())
        model, tokenizer, _ = load_inference_model(args.load, pg)
        engine = build_engine(args, model, tokenizer, pg)
        endpoint = EngineEndpoint(engine, address, engine_id=f"replica-{pg.rank('dp')}", group=pg.mp)
        _stop_on_signals(endpoint)
        dist.barrier()  # every replica has sent its registration
        if is_frontend:
            _wait_for_replicas(coordinator, dist.get_world_size() // pg.size("mp"))
            config = dataclasses.replace(config, max_model_len=model.max_sequence_length)
            server = ServerThread(
                InferenceClient(coordinator.address), sock=sock, tokenizer=tokenizer, config=config
            ).start()
            print(f"Serving on {server.url}", flush=True)
        endpoint.run()
    finally:
        if server is not None:
            server.stop()
        if coordinator is not None:
            coordinator.stop()
    parallel_state.destroy_distributed()
    return 0


def main(argv=None) -> int:
    """``megatron-serve``: parse the flags and serve; a bad option is one line on stderr, exit 2."""
    args = parse_args(argv)
    try:
        return serve_checkpoint(args)
    except (ServerConfigError, ChatTemplateError, ParallelConfigError, CheckpointingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
