"""One DuplicateRequestIdError: the engine, the coordinator (for routed and still unrouted
requests) and the client raise or answer the same class, with the same wire form, and the
request that holds the id is not disturbed."""

import re

import pytest

from megatron.core.inference import coordinator, engines, errors
from megatron.core.inference.coordinator import InferenceClient, InferenceCoordinator
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.errors import DuplicateRequestIdError, InferenceRequestError
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import gpt_model, prompts
from tests.unit_tests.transformer.single_rank import on_single_rank

from .cluster import run_with_client, running_cluster

MESSAGE = "request id 'same' is already in use by an unfinished request; use a fresh id"
WIRE = {"type": "DuplicateRequestIdError", "message": MESSAGE, "details": {"request_id": "same"}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_there_is_one_class():
    assert coordinator.DuplicateRequestIdError is engines.DuplicateRequestIdError is errors.DuplicateRequestIdError
    assert issubclass(DuplicateRequestIdError, ValueError)  # a request's fault, answered as such
    assert DuplicateRequestIdError(request_id="same").to_dict() == WIRE
    assert InferenceRequestError.from_dict(WIRE) == DuplicateRequestIdError(request_id="same")


def _engine(pg):
    return DynamicInferenceEngine(
        gpt_model(pg), pg_collection=pg, block_size=4, num_blocks=16, max_tokens_per_step=16, max_sequence_length=32
    )


def _drain(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@on_single_rank
def test_the_engine_refuses_a_held_id_and_finishes_the_request_holding_it(pg):
    reference = _engine(pg)
    reference.add_request("same", prompts([5])[0], GREEDY)
    expected = [t for o in _drain(reference) for t in o.new_token_ids]

    engine = _engine(pg)
    engine.add_request("same", prompts([5])[0], GREEDY)
    with pytest.raises(DuplicateRequestIdError, match=f"^{re.escape(MESSAGE)}$") as err:
        engine.add_request("same", prompts([7])[0], GREEDY)
    assert err.value.to_dict() == WIRE
    outputs = _drain(engine)
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("same", "length")]
    engine.add_request("same", prompts([5])[0], GREEDY)  # a finished request's id is free again


@on_single_rank
def test_the_coordinator_answers_a_routed_duplicate_in_the_wire_form(pg):
    with running_cluster([_engine(pg)]) as served:

        async def scenario(client):
            first = await client.submit(prompts([5])[0], GREEDY, request_id="same")
            async with InferenceClient(served.address) as other:
                duplicate = await (await other.submit(prompts([7])[0], GREEDY, request_id="same")).result()
            with pytest.raises(DuplicateRequestIdError, match=f"^{re.escape(MESSAGE)}$"):
                await client.submit(prompts([7])[0], GREEDY, request_id="same")  # refused by the client itself
            return duplicate, await first.result()

        duplicate, first = run_with_client(served, scenario)
    assert (duplicate["finish_reason"], duplicate["error"]) == ("error", WIRE)
    assert (first["finish_reason"], first["generated_tokens"]) == ("length", 6)


def test_the_coordinator_answers_a_duplicate_of_a_request_waiting_for_an_engine():
    waiting_room = InferenceCoordinator().start()  # no engine: requests wait unrouted
    try:

        async def scenario(client):
            first = await client.submit([1], GREEDY, request_id="same")
            async with InferenceClient(waiting_room.address) as other:
                duplicate = await (await other.submit([2], GREEDY, request_id="same")).result()
            client.abort("same")
            return duplicate, await first.result()

        duplicate, first = run_with_client(waiting_room, scenario)
    finally:
        waiting_room.stop()
    assert (duplicate["finish_reason"], duplicate["error"]) == ("error", WIRE)
    assert first["finish_reason"] == "abort"
