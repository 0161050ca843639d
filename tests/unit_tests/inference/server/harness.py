"""A running OpenAI server over a coordinator and engine doubles, for tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.server import ServerConfig, ServerThread
from megatron.core.tokenizers import ByteLevelTokenizer

from ..coordinator.cluster import running_cluster
from ..coordinator.engine_double import HashEngine

TOKENIZER = ByteLevelTokenizer()
TOOL_OUTPUT = (
    '<think>need weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
THINK_OUTPUT = "<think>two plus two</think>four"


def scripted_output(prompt_tokens: list[int]) -> list[int] | None:
    """Scripted outputs for prompts that ask for them; the hash output otherwise."""
    text = TOKENIZER.detokenize(prompt_tokens)
    if "[tool]" in text:
        return TOKENIZER.tokenize(TOOL_OUTPUT)
    if "[think]" in text:
        return TOKENIZER.tokenize(THINK_OUTPUT)
    if "[eos]" in text:
        return TOKENIZER.tokenize("bye")
    return None


@contextlib.contextmanager
def openai_server(engines=None, **config) -> Iterator[tuple[ServerThread, object]]:
    """A server thread on a fresh loopback port with its coordinator; yields (server, coordinator)."""
    engines = engines if engines is not None else [HashEngine(script=scripted_output)]
    with running_cluster(engines) as coordinator:
        with app_server(coordinator, **config) as server:
            yield server, coordinator


def app_server(coordinator, **config) -> ServerThread:
    """Another server on the same coordinator (its own client and options)."""
    return ServerThread(InferenceClient(coordinator.address), tokenizer=TOKENIZER, config=ServerConfig(**config))


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The samples of a server's /metrics, parsed by prometheus-client: (name, labels) -> value."""
    text = httpx.get(url + "/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    """One sample's value (None when absent)."""
    return samples.get((name, frozenset(labels.items())))
