"""Item 18: a string prompt is text on every entry point: tokenized where there is a tokenizer (the
engine, LLM, the handoff front ends, the HTTP server; exactly one BOS when the tokenizer asks
for one; token lists untouched), refused with a typed PromptTypeError where there is none (the
coordinator client; the coordinator answers a raw submit with one error reply). "123" is never
read as the token ids [1, 2, 3]."""

import asyncio

import httpx
import msgpack
import pytest

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.errors import RequestRejectedError
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.inference.engines.common import gpt_model
from tests.unit_tests.inference.handoff.common import build_engine, nixl
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import BOS, EOS, train_tiny_tokenizer
from tests.unit_tests.transformer.single_rank import on_single_rank

from ..coordinator.cluster import peer_socket, running_cluster
from ..coordinator.engine_double import HashEngine, expected_tokens
from ..server.harness import openai_server

BYTES = ByteLevelTokenizer()
DIGITS = [ord("1"), ord("2"), ord("3")]  # "123" as text
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _run(engine) -> dict[str, tuple[int, list[int]]]:
    """Step ``engine`` until idle: request id -> (prompt tokens, generated tokens)."""
    results: dict[str, tuple[int, list[int]]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            count, tokens = results.get(output.request_id, (output.prompt_tokens, []))
            results[output.request_id] = (count, tokens + list(output.new_token_ids))
    return results


@on_single_rank
def test_the_engine_and_llm_tokenize_text_and_refuse_it_without_a_tokenizer(pg):
    engine = DynamicInferenceEngine(
        gpt_model(pg, vocab_size=BYTES.vocab_size),
        tokenizer=BYTES,
        block_size=4,
        num_blocks=32,
        max_requests=4,
        max_sequence_length=48,
        pg_collection=pg,
    )
    engine.add_request("text", "123", GREEDY)
    engine.add_request("ids", DIGITS, GREEDY)
    engine.add_request("raw ids", [1, 2, 3], GREEDY)
    results = _run(engine)
    assert results["text"] == results["ids"] and results["text"][0] == 3
    assert results["raw ids"][1] != results["ids"][1]  # the ids 1, 2, 3 are another prompt

    bare = DynamicInferenceEngine(
        gpt_model(pg, vocab_size=BYTES.vocab_size),
        block_size=4,
        num_blocks=32,
        max_sequence_length=48,
        pg_collection=pg,
    )
    bare.add_request("kept", DIGITS, GREEDY)
    for prompt, reason in (
        ("hello", "a text prompt needs a tokenizer and there is none here"),
        ([1.5, 2], "the token list holds float values"),
        (["1", "2"], "the token list holds str values"),
    ):
        with pytest.raises(RequestRejectedError) as refused:
            bare.add_request("refused", prompt, GREEDY)
        assert refused.value.to_dict()["type"] == "PromptTypeError" and refused.value.details == {"reason": reason}
    assert list(_run(bare)) == ["kept"]  # nothing of the refused requests was queued

    llm = LLM(gpt_model(pg, vocab_size=BYTES.vocab_size), BYTES, block_size=4, num_blocks=32, pg_collection=pg)
    from_text, from_ids = llm.generate(["123", DIGITS], GREEDY)
    assert from_text.prompt_token_ids == DIGITS and from_text.token_ids == from_ids.token_ids


@on_single_rank
def test_exactly_one_bos_when_the_tokenizer_asks_for_one(pg, tmp_path):
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}
    asking = HuggingFaceTokenizer(train_tiny_tokenizer(tmp_path / "asks", config=config))
    plain = HuggingFaceTokenizer(train_tiny_tokenizer(tmp_path / "plain", config={**config, "add_bos_token": False}))
    text = "the cat sat on a mat."
    ids = plain.tokenize(text)
    assert asking.bos == plain.bos == 1 and ids[0] != 1

    def prompts_seen(tokenizer, prompts):
        llm = LLM(gpt_model(pg, vocab_size=320), tokenizer, block_size=4, num_blocks=32, pg_collection=pg)
        return [output.prompt_token_ids for output in llm.generate(prompts, GREEDY)]

    # A template that already wrote the BOS gets no second one; token lists are used as given.
    assert prompts_seen(asking, [text, BOS + text, ids]) == [[1] + ids, [1] + ids, ids]
    assert prompts_seen(plain, [text]) == [ids]


@on_single_rank
def test_the_handoff_front_ends_tokenize_text(pg):
    def engine(**options):
        return build_engine(gpt_model(pg, vocab_size=260), pg, tokenizer=BYTES, **options)

    prefill = PrefillSide(engine(prefix_caching=False), nixl("prefill"))
    prefill.add_request("p", "123", GREEDY)
    records = []
    while not records:
        records += prefill.step().records
    assert records[0].prompt_tokens == DIGITS

    decode = DecodeSide(engine(), nixl("decode"))
    prefill_end = HandoffChannel("tcp://127.0.0.1:0", bind=True)
    front = DisaggregatedEngine(decode, HandoffChannel(prefill_end.address, bind=False))
    front.add_request("d", "123", GREEDY)
    # The decode side also announces its readers; the prefill message carries the token ids.
    prefills = []
    while not prefills:
        messages = prefill_end.receive(timeout_ms=10_000)
        assert messages, "no prefill message within 10 s"
        prefills += [payload for kind, payload in messages if kind == "prefill"]
    assert [payload["prompt_tokens"] for payload in prefills] == [DIGITS]


def test_the_coordinator_client_refuses_text_and_the_coordinator_answers_it_once():
    with running_cluster([HashEngine()]) as coordinator:

        async def scenario():
            async with InferenceClient(coordinator.address) as client:
                for prompt in ("hello", "123"):
                    with pytest.raises(RequestRejectedError, match="a text prompt needs a tokenizer"):
                        await client.submit(prompt, GREEDY, request_id="text")
                assert client.in_flight == 0
                return await (await client.submit(DIGITS, GREEDY, request_id="text")).result()

        assert asyncio.run(scenario())["generated_tokens"] == 4

        # A peer that sends text anyway gets exactly one reply: the typed error.
        raw = peer_socket(coordinator, "client")  # a client of this launch (its key pair)
        params = {"temperature": 0.0, "max_tokens": 2}
        replies = []
        with raw:
            for request_id, prompt in (("hello", "hello"), ("floats", [1.5])):
                submit = {"request_id": request_id, "prompt_tokens": prompt, "sampling_params": params}
                raw.send(msgpack.packb(["submit", submit]))
            while raw.poll(1000 if len(replies) < 2 else 200):
                replies += msgpack.unpackb(raw.recv())[1]["outputs"]
        assert [(r["request_id"], r["finish_reason"], r["error"]["type"]) for r in replies] == [
            ("hello", "error", "PromptTypeError"),
            ("floats", "error", "PromptTypeError"),
        ]
        assert not coordinator.router.routes


def test_http_text_prompts_are_tokenized_once():
    with openai_server() as (server, coordinator):
        response = httpx.post(
            server.url + "/v1/completions", json={"model": "megatron", "prompt": "123", "max_tokens": 3}
        )
    assert response.json()["usage"]["prompt_tokens"] == 3
    assert response.json()["choices"][0]["text"] == BYTES.detokenize(expected_tokens(DIGITS, 3))
