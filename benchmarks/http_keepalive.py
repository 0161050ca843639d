#!/usr/bin/env python3
"""Keep-alive latency of the HTTP server with its connection policy vs plain uvicorn, side by side.

Both sides serve the same FastAPI app (``build_app`` over a running coordinator) on a listening
socket made with protocol 0, as a caller hands one over: ours through ``ServerThread`` (TCP_NODELAY
on every accepted connection), the anchor through ``uvicorn.Server`` as the server ran before
(asyncio sets TCP_NODELAY only for sockets made with IPPROTO_TCP, so this one waits for delayed
ACKs). A client keeps one connection open per side and times ``--requests`` GET /health per trial;
trials alternate (and which side goes first alternates too); the median per-request latency of
each side gives the ratio.

    python benchmarks/http_keepalive.py --trials 7 --requests 20 --json http_keepalive.json

Prints each side's median ms per request and the ratio ours/anchor (< 1 is good).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import uvicorn

from megatron.core.benchmark_report import finish
from megatron.core.inference.coordinator import InferenceClient, InferenceCoordinator
from megatron.core.inference.server import ServerThread, build_app
from megatron.core.tokenizers import ByteLevelTokenizer


def protocol_zero_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


class PlainUvicorn:
    """The anchor: uvicorn's own server on a caller-made socket, in a thread."""

    def __init__(self, app, sock: socket.socket):
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info):
        self.server.should_exit = True
        self.thread.join(10)


def time_requests(port: int, count: int) -> float:
    """Seconds per GET /health over one keep-alive connection (after one warm-up request)."""
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the client is not what is measured

        def one():
            client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            response = b""
            while not response.endswith(b"}"):
                response += client.recv(4096)

        one()
        started = time.perf_counter()
        for _ in range(count):
            one()
        return (time.perf_counter() - started) / count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--requests", type=int, default=20, help="requests per trial")
    parser.add_argument("--json", default=None, help="write the results here")
    opts = parser.parse_args(argv)
    tokenizer = ByteLevelTokenizer()
    with InferenceCoordinator() as coordinator:
        ours_app = build_app(InferenceClient(coordinator.address), tokenizer)
        anchor_app = build_app(InferenceClient(coordinator.address), tokenizer)
        with (
            ServerThread(ours_app, sock=protocol_zero_socket()) as ours,
            PlainUvicorn(anchor_app, protocol_zero_socket()) as anchor,
        ):
            sides = {"ours": ours.port, "anchor": anchor.port}
            times = {name: [] for name in sides}
            for trial in range(opts.trials):
                order = list(sides) if trial % 2 == 0 else list(reversed(sides))
                for name in order:
                    times[name].append(time_requests(sides[name], opts.requests))
    medians_ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    result = {
        "ours_ms_per_request": medians_ms["ours"],
        "anchor_ms_per_request": medians_ms["anchor"],
        "ratio_ours_over_anchor": medians_ms["ours"] / medians_ms["anchor"],
        "trials": opts.trials,
        "requests_per_trial": opts.requests,
    }
    print(
        f"GET /health keep-alive: ours {medians_ms['ours']:.2f} ms, plain uvicorn on a protocol-0 socket "
        f"{medians_ms['anchor']:.2f} ms, ratio {result['ratio_ours_over_anchor']:.3f}"
    )
    finish(result, opts.json)
    return result


if __name__ == "__main__":
    main()
