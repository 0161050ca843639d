"""Item 10: one request's fan-out (prompts x n) is capped, and a large request takes turns with the
others: it keeps at most ``max_in_flight_per_request`` engine requests in flight, so a small
request sent while it runs reaches the engine after that many of its choices, not after all.
Fairness is checked on the order of events in the engine, never on wall-clock time."""

import threading

import httpx

from megatron.core.inference.server import ServerConfig, launcher

from ..coordinator.cluster import wait_until
from ..coordinator.engine_double import HashEngine, expected_tokens
from ..server.harness import TOKENIZER, openai_server

WINDOW = 16  # ServerConfig's default max_in_flight_per_request
BIG = [f"big {i}" for i in range(40)]


class WatchedEngine(HashEngine):
    """The engine double, also noting how many requests of the same HTTP request (ids
    ``<http id>-<choice>``) were unfinished each time one was added."""

    def __init__(self):
        super().__init__()
        self.unfinished_at_add: dict[str, list[int]] = {}

    def add_request(self, request_id, prompt_tokens, sampling_params, **kwargs):
        group = _http_id(request_id)
        with self._lock:
            siblings = sum(_http_id(other) == group for other in self.requests)
        self.unfinished_at_add.setdefault(group, []).append(siblings + 1)
        super().add_request(request_id, prompt_tokens, sampling_params, **kwargs)


def _http_id(request_id: str) -> str:
    """The HTTP request an engine request serves a choice of (its id is ``<http id>-<choice>``)."""
    return request_id.rsplit("-", 1)[0]


def _text(prompt: str, count: int) -> str:
    return TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), count))


def _adds(engine: HashEngine) -> list[str]:
    return [event[1] for event in engine.log if event[0] == "add"]


def test_fan_out_over_the_default_caps_is_400_before_reaching_an_engine():
    engine = HashEngine()
    with openai_server([engine]) as (server, coordinator):
        too_many = httpx.post(
            server.url + "/v1/completions", json={"model": "megatron", "prompt": ["p"] * 257, "max_tokens": 1}
        )
        too_many_n = httpx.post(server.url + "/v1/completions", json={"model": "megatron", "prompt": "p", "n": 17})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "at most 256 per request (max_prompts_per_request)" in too_many.json()["error"]["message"]
    assert too_many_n.status_code == 400 and too_many_n.json()["error"]["param"] == "n"
    assert not _adds(engine)


def test_configured_caps_are_400_naming_the_cap():
    engine = HashEngine()
    with openai_server([engine], max_prompts_per_request=8, max_n=3) as (server, coordinator):
        too_many = httpx.post(
            server.url + "/v1/completions", json={"model": "megatron", "prompt": ["p"] * 9, "max_tokens": 1}
        )
        too_many_ids = httpx.post(
            server.url + "/v1/completions", json={"model": "megatron", "prompt": [[1, 2]] * 9, "max_tokens": 1}
        )
        n_completion = httpx.post(server.url + "/v1/completions", json={"model": "megatron", "prompt": "p", "n": 4})
        chat = {"model": "megatron", "messages": [{"role": "user", "content": "p"}], "n": 4}
        n_chat = httpx.post(server.url + "/v1/chat/completions", json=chat)
        at_the_caps = httpx.post(
            server.url + "/v1/completions", json={"model": "megatron", "prompt": ["p"] * 8, "n": 3, "max_tokens": 1}
        )
    for response in (too_many, too_many_ids):
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "prompt holds 9 prompts but this server accepts at most 8 per request "
            "(max_prompts_per_request); send several requests",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_value",
        }
    for response in (n_completion, n_chat):
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        assert (
            response.json()["error"]["message"]
            == "n=4 is more than this server's limit of 3 choices per prompt (max_n)"
        )
    assert at_the_caps.status_code == 200 and len(at_the_caps.json()["choices"]) == 24
    assert len(_adds(engine)) == 24  # only the request within the caps reached the engine


def test_a_small_request_is_not_queued_behind_a_large_one():
    engine = WatchedEngine()
    engine.pause()  # hold every request at its first token while the order of arrival is observed
    with openai_server([engine]) as (server, coordinator):
        results = {}

        def post(name, prompt):
            body = {"model": "megatron", "prompt": prompt, "max_tokens": 3}
            results[name] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        big = threading.Thread(target=post, args=("big", BIG))
        big.start()
        wait_until(lambda: len(_adds(engine)) >= WINDOW, "the large request's first window to arrive")
        small = threading.Thread(target=post, args=("small", "small"))
        small.start()
        wait_until(lambda: len(set(map(_http_id, _adds(engine)))) == 2, "the small request to arrive")
        engine.resume()
        big.join(60)
        small.join(60)
        wait_until(lambda: not coordinator.router.routes, "routing state to clear")
    order = _adds(engine)
    # The small request arrived right after the large one's first window, not after its 24 choices.
    assert len(order) == len(BIG) + 1 and _http_id(order[WINDOW]) == results["small"].json()["id"]
    big_id = results["big"].json()["id"]
    assert max(engine.unfinished_at_add[big_id]) == WINDOW
    assert [choice["text"] for choice in results["big"].json()["choices"]] == [_text(p, 3) for p in BIG]
    assert results["small"].json()["choices"][0]["text"] == _text("small", 3)
    assert ServerConfig().max_in_flight_per_request == WINDOW


def test_megatron_serve_flags_set_the_caps():
    configured = launcher.server_config(
        launcher.parse_args(["--load", "ckpt", "--max-prompts-per-request", "8", "--max-n", "3"])
    )
    default = launcher.server_config(launcher.parse_args(["--load", "ckpt"]))
    assert (configured.max_prompts_per_request, configured.max_n) == (8, 3)
    assert (default.max_prompts_per_request, default.max_n) == (256, 16)
