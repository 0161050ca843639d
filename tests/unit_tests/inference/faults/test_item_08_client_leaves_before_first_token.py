"""Item 8: a client that leaves before its first token (whole or streamed request) gets the 499
path: its engine request is aborted, no 5xx is counted and at most one line is logged (no
traceback)."""

import contextlib
import logging
import socket

import pytest

from ..coordinator.cluster import wait_until
from ..coordinator.engine_double import HashEngine
from ..server.harness import openai_server, sample, scrape


@contextlib.contextmanager
def server_log_records():
    """Records of the loggers a server writes to (uvicorn's own do not reach the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "megatron")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _send_and_leave(url: str, body: bytes, engine: HashEngine) -> None:
    """POST ``body``, wait until the engine has the request, then close the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
        )
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        wait_until(lambda: any(event[0] == "add" for event in engine.log), "the request to reach the engine")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_leaving_before_the_first_token_is_a_quiet_499_and_an_abort(stream):
    engine = HashEngine()
    engine.pause()  # nothing generates: the request waits for its first token until the client leaves
    with openai_server([engine]) as (server, coordinator):
        body = f'{{"model": "megatron", "prompt": "wait", "max_tokens": 5, "stream": {str(stream).lower()}}}'
        with server_log_records() as records:
            _send_and_leave(server.url, body.encode(), engine)
            wait_until(lambda: list(engine.finished.values()) == ["abort"], "the abort to reach the engine")
            wait_until(lambda: not coordinator.router.routes, "routing state to clear")
            metrics = scrape(server.url)
        assert server.app.state.service.client.in_flight == 0
    assert sample(metrics, "megatron_requests_total", endpoint="/v1/completions", status="499") == 1
    assert sample(metrics, "megatron_requests_abandoned_total", endpoint="/v1/completions") == 1
    assert not any(("status_class", "5xx") in labels for _, labels in metrics)
    noisy = [record for record in records if record.levelno >= logging.WARNING]
    assert len(noisy) <= 1 and not any(record.exc_info for record in noisy), [r.getMessage() for r in noisy]
