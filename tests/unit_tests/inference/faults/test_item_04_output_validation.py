"""Issue 19, item 4: outputs are validated one by one.

An engine (behind the real endpoint, over ZeroMQ) reports, in one batch, a valid terminal
output of one request and a malformed output of another: the valid one reaches its client,
the malformed one ends only its own request (one terminal error, and an abort at the engine),
and a third request in flight on the same engine finishes normally."""

import asyncio

from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.coordinator.cluster import run_with_client, running_cluster, wait_until
from tests.unit_tests.inference.coordinator.engine_double import HashEngine, expected_tokens


class _Malformed:
    """Stands for the engine's output of a request, with a field of the wrong type."""

    def __init__(self, output):
        self.output = output

    def to_dict(self):
        return {**self.output.to_dict(), "generated_tokens": "three"}


class _CorruptingEngine(HashEngine):
    """A HashEngine whose outputs for request ``"corrupted"`` are malformed on the wire."""

    def step(self):
        return [_Malformed(o) if o.request_id == "corrupted" else o for o in super().step()]


def test_a_malformed_output_fails_only_its_own_request():
    engine = _CorruptingEngine(step_delay_s=0.002)
    with running_cluster([engine]) as coordinator:

        async def scenario(client):
            short = SamplingParams(temperature=0.0, max_tokens=3)
            # Admitted while paused, all three start in the same step: each batch holds an output of each,
            # and "valid" and "corrupted" finish in the same one.
            await client.control("pause")
            valid = await client.submit([1], short, request_id="valid")
            corrupted = await client.submit([2], short, request_id="corrupted")
            other = await client.submit([3], SamplingParams(temperature=0.0, max_tokens=30), request_id="other")
            await client.control("resume")
            return await asyncio.wait_for(
                asyncio.gather(valid.result(), corrupted.result(), _collect(other)), timeout=20
            )

        valid, corrupted, other = run_with_client(coordinator, scenario)
        assert valid["finish_reason"] == "length" and valid["generated_tokens"] == 3
        assert corrupted["finish_reason"] == "error" and corrupted["error"]["type"] == "MalformedOutputError"
        assert "request output field 'generated_tokens' has type str" in corrupted["error"]["message"]
        assert [t for out in other for t in out["new_token_ids"]] == expected_tokens([3], 30)
        wait_until(lambda: "corrupted" not in engine.requests, "the corrupted request to end at the engine")
        assert coordinator.protocol_errors >= 1 and coordinator.router.routes == {}


async def _collect(handle):
    return [output async for output in handle]
