"""``megatron-serve``: serve a training checkpoint over the OpenAI-compatible HTTP API.

One process (coordinator, engine and HTTP server)::

    megatron-serve --load runs/quickstart --port 8000

Data-parallel replicas, each of TP x PP ranks, started and supervised by megatron-serve::

    megatron-serve --load runs/quickstart --data-parallel-size 2 --tensor-model-parallel-size 2 --port 8000

or one replica of TP x PP ranks under torchrun::

    torchrun --standalone --nproc-per-node 2 --no-python megatron-serve --load runs/quickstart \\
        --tensor-model-parallel-size 2 --port 8000

(``python -m megatron.core.inference.server.launcher`` is the same command.) Each replica is
an engine built from the checkpoint (its model record and tokenizer from the checkpoint, its
weights loaded for the replica's layout); the replica's rank 0 talks to the coordinator and
broadcasts each batch of commands to the rest of its model-parallel group
(:class:`EngineEndpoint`); the coordinator spreads requests over the replicas.

With ``--data-parallel-size`` (or TP x PP > 1 without torchrun) this process runs the
coordinator and the HTTP server and starts every replica as a process group of its own, with
a torch.distributed world of its own (:class:`ReplicaSupervisor`): a replica that dies takes
no other one with it; its requests that have streamed nothing yet run again on another
replica, the others get one error each, and the replica is started again and registers again.
Under torchrun, the world is one replica and its rank 0 also runs the coordinator and the
HTTP server. The HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) binds 127.0.0.1 unless ``--host`` says otherwise; the coordinator and the replicas'
rendezvous stores bind 127.0.0.1, and the coordinator admits only the engines and the HTTP
server of this launch (CURVE keys generated at start; see the README's Security section).
``Serving on URL`` is printed once every replica has registered. SIGINT / SIGTERM stop every
replica after it has answered its in-flight requests (aborted), then the server and
coordinator; a second signal kills.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.errors import MegatronConfigError, MegatronRuntimeError
from megatron.core.inference.checkpoint_loading import default_device, load_inference_model, record_tokenizer
from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator, Role
from megatron.core.inference.coordinator.auth import KEYS_ENV
from megatron.core.inference.coordinator.coordinator import CoordinatorConfigError, check_settings
from megatron.core.inference.coordinator.lifetime import die_with_parent
from megatron.core.inference.coordinator.replicas import (
    PARENT_PID_ENV,
    REPLICA_ENV,
    ReplicaDevicesError,
    ReplicaSupervisor,
)
from megatron.core.inference.engines import DynamicInferenceEngine, add_cuda_graph_flag, add_long_prefill_flag
from megatron.core.inference.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from megatron.core.inference.server.chat_template import ChatTemplateError
from megatron.core.inference.server.serve import ServerThread, bind_socket
from megatron.core.inference.server.service import ServerConfig, ServerConfigError
from megatron.core.models.model_record import read_model_record
from megatron.core.process_groups import ParallelConfigError

REGISTRATION_TIMEOUT_S = 120.0
ADDRESS_BYTES = 256  # a coordinator address (tcp://host:port) fits
COORDINATOR_ENV = "MEGATRON_COORDINATOR_ADDRESS"  # for supervised replicas
STOP_TIMEOUT_S = 30.0  # for replicas to answer their in-flight requests and exit


class ReplicaRegistrationError(MegatronRuntimeError):
    """Not every engine replica registered with the coordinator in time, or one died first."""


class ServingLayoutError(MegatronConfigError):
    """The torchrun world does not match the replica layout the flags ask for."""


def add_serving_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The checkpoint, HTTP, engine, control-plane and server flags."""
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
    add_long_prefill_flag(engine)
    add_cuda_graph_flag(engine)
    control = parser.add_argument_group("coordinator (control plane)")
    control.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=30.0,
        help="an engine, client or coordinator silent this long is gone: its requests end with an error",
    )
    control.add_argument(
        "--route-timeout-s",
        type=float,
        default=30.0,
        help="longest a request waits for an engine replica while none is registered (then HTTP 503)",
    )
    control.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests that may wait for an engine replica; more get HTTP 429 at once",
    )
    control.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="longest a request may take from submit to its last token, then it ends with HTTP 504 (default: no limit)",
    )
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
    layout = parser.add_argument_group("layout")
    layout.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each its own process group started and restarted by megatron-serve",
    )
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
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_cuda_graphs=args.enable_cuda_graphs,
    )


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _keep_peers_on_loopback() -> None:
    """torch.distributed's own peer sockets (gloo, NCCL bootstrap) on the loopback interface, for
    worlds on this host, unless the environment names an interface."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback)


def _stop_on_signals(stop) -> None:
    """First SIGINT/SIGTERM: ``stop()`` (graceful); a second one: the default action."""

    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _bind_http(args: argparse.Namespace) -> socket.socket | None:
    """The HTTP socket (bound before anything loads, so that a taken port fails at once), or None
    after printing why it cannot be bound."""
    try:
        return bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"error: cannot serve on {args.host}:{args.port} ({exc.strerror}); pick another --port, or "
            "--port 0 for a free one",
            file=sys.stderr,
        )
        return None


def _coordinator(args: argparse.Namespace) -> InferenceCoordinator:
    return InferenceCoordinator(
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        route_timeout_s=args.route_timeout_s,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout_s,
    )


def _start_server(args, coordinator: InferenceCoordinator, sock, tokenizer, config) -> ServerThread:
    client = InferenceClient(coordinator.address, keys=coordinator.keys, heartbeat_timeout_s=args.heartbeat_timeout_s)
    server = ServerThread(client, sock=sock, tokenizer=tokenizer, config=config).start()
    print(f"Serving on {server.url}", flush=True)
    return server


def _wait_for_replicas(coordinator: InferenceCoordinator, num_replicas: int, check=lambda: None) -> None:
    """Until ``num_replicas`` engines registered; ``check()`` may raise meanwhile (a replica died)."""
    deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
    while len(coordinator.engine_ids) < num_replicas:
        check()
        if time.monotonic() > deadline:
            raise ReplicaRegistrationError(
                f"{len(coordinator.engine_ids)} of {num_replicas} engine replicas registered with the coordinator "
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


def _replica_endpoint(args, address: str | None, engine_id: str, coordinator=None) -> EngineEndpoint:
    """This rank's engine of the checkpoint, behind an endpoint of its replica's group."""
    pg = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    model, tokenizer, _ = load_inference_model(args.load, pg)
    engine = build_engine(args, model, tokenizer, pg)
    endpoint = EngineEndpoint(
        engine,
        address,
        engine_id=engine_id,
        group=pg.mp,
        keys=coordinator.keys if coordinator is not None else None,  # else launch_keys(): the key file
        heartbeat_timeout_s=args.heartbeat_timeout_s,
    )
    _stop_on_signals(endpoint.request_stop)
    return endpoint


def serve_checkpoint(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Serve ``args.load`` until SIGINT/SIGTERM (see the module doc); every process calls this.

    ``argv`` is the command line the supervised replicas are started with (default: this
    process's). Returns the exit status: 0, 2 when the HTTP socket cannot be bound (the other
    ranks are then ended by torchrun), 1 when a supervised replica dies before registering.
    Raises ServerConfigError / CheckpointingError / ServingLayoutError for bad options, a
    ``--load`` that is no checkpoint or a world that does not fit, before anything starts."""
    config = server_config(args)  # bad server options and checkpoints fail before anything starts
    check_settings(args.heartbeat_timeout_s, args.route_timeout_s, args.max_waiting_requests, args.request_timeout_s)
    record = read_model_record(args.load)
    config = dataclasses.replace(config, max_model_len=record.max_sequence_length)  # the engines' default
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.data_parallel_size < 1 or model_parallel < 1:
        raise ServingLayoutError(
            f"--data-parallel-size, --tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1; "
            f"got {args.data_parallel_size}, {args.tensor_model_parallel_size}, {args.pipeline_model_parallel_size}"
        )
    if REPLICA_ENV in os.environ:
        return _serve_supervised_replica(args)
    if "RANK" in os.environ:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if args.data_parallel_size != 1 or world_size != model_parallel:
            raise ServingLayoutError(
                f"under torchrun the world is one replica of TP x PP = {model_parallel} ranks, not {world_size} "
                f"(--data-parallel-size {args.data_parallel_size}); for data-parallel replicas run megatron-serve "
                "without torchrun with --data-parallel-size N (it starts and restarts them)"
            )
        return _serve_in_process(args, config)
    if args.data_parallel_size * model_parallel == 1:
        _keep_peers_on_loopback()
        return _serve_in_process(args, config)
    _keep_peers_on_loopback()
    return _supervise(args, config, record, sys.argv[1:] if argv is None else argv)


def _serve_in_process(args, config) -> int:
    """One replica in this world (one process, or torchrun's ranks); rank 0 is also the frontend."""
    parallel_state.initialize_distributed(_backend())
    is_frontend = dist.get_rank() == 0
    coordinator = server = sock = None
    try:
        if is_frontend:
            sock = _bind_http(args)
            if sock is None:
                # Leave at once (torchrun ends the other ranks), but with the group destroyed: NCCL
                # warns at exit about a group left alive, after the one line that says what is wrong.
                dist.destroy_process_group()
                return 2
            coordinator = _coordinator(args).start()
        address = _broadcast_address(coordinator.address if is_frontend else None, default_device())
        endpoint = _replica_endpoint(args, address, "replica-0", coordinator)
        dist.barrier()  # every rank has built its engine
        if is_frontend:
            _wait_for_replicas(coordinator, 1)
            server = _start_server(args, coordinator, sock, endpoint.engine.tokenizer, config)
        endpoint.run()
    finally:
        if server is not None:
            server.stop()
        if coordinator is not None:
            coordinator.stop()
    parallel_state.destroy_distributed()
    return 0


def _serve_supervised_replica(args) -> int:
    """A rank of a replica that a supervising megatron-serve started (see the module doc)."""
    die_with_parent(int(os.environ[PARENT_PID_ENV]))
    parallel_state.initialize_distributed(_backend())  # the supervisor's store of this replica
    endpoint = _replica_endpoint(args, os.environ.get(COORDINATOR_ENV), f"replica-{os.environ[REPLICA_ENV]}")
    endpoint.run()
    parallel_state.destroy_distributed()
    return 0


def _visible_devices() -> list[str] | None:
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def _supervise(args, config, record, argv: list[str]) -> int:
    """The frontend (coordinator + HTTP) here; every replica a supervised process group."""
    tokenizer = record_tokenizer(record)
    stop = threading.Event()
    _stop_on_signals(stop.set)
    sock = _bind_http(args)
    if sock is None:
        return 2
    coordinator = _coordinator(args).start()
    server = supervisor = None
    stop_timeout_s = STOP_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="megatron-serve-") as private:  # mode 0700: this user only
        keys_file = coordinator.keys.for_role(Role.ENGINE).save(os.path.join(private, "engine-keys.json"))
        try:
            supervisor = ReplicaSupervisor(
                [sys.executable, "-m", "megatron.core.inference.server.launcher", *argv],
                args.data_parallel_size,
                args.tensor_model_parallel_size * args.pipeline_model_parallel_size,
                env={KEYS_ENV: keys_file, COORDINATOR_ENV: coordinator.address},
                on_lost=lambda index, reason: coordinator.remove_engine(f"replica-{index}", reason),
                devices=_visible_devices(),
            )
            supervisor.start()

            def no_early_death():
                for index, reason in supervisor.poll():
                    raise ReplicaRegistrationError(f"replica {index} {reason} before registering; see its output above")

            _wait_for_replicas(coordinator, args.data_parallel_size, no_early_death)
            server = _start_server(args, coordinator, sock, tokenizer, config)
            while not stop.wait(0.1):
                supervisor.poll()
        except ReplicaRegistrationError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            stop_timeout_s = 0.0
            raise
        finally:
            if supervisor is not None:
                supervisor.stop(stop_timeout_s)
            if server is not None:
                server.stop()
            coordinator.stop()
    return 0


def main(argv=None) -> int:
    """``megatron-serve``: parse the flags and serve; a bad option is one line on stderr, exit 2."""
    args = parse_args(argv)
    try:
        return serve_checkpoint(args, argv)
    except (
        ServerConfigError,
        ChatTemplateError,
        ParallelConfigError,
        CheckpointingError,
        ServingLayoutError,
        CoordinatorConfigError,
        ReplicaDevicesError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
