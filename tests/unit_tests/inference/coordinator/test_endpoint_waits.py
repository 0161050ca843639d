"""The engine endpoint blocks while its engine waits on peers, and wakes on their messages.

A disaggregated decode engine (real engine, NIXL, ZeroMQ channel, coordinator) whose request
waits for a mute prefill worker steps at most once per ``idle_wait_s``, not in a loop, and
answers the request as soon as the worker's message arrives; one whose pull never ends (a
peer silent for a while) checks it every ``TRANSFER_POLL_S``, not in a loop, and decodes the
request once the pull ends. (Before, both cases spun a core, for as long as the process lived.)"""

import asyncio
import threading
import time

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.coordinator.messages import error_output
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.serving import TRANSFER_POLL_S, DisaggregatedEngine, HandoffChannel, PrefillWorker
from megatron.core.inference.handoff.transport import NixlTransport, TransferState
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.coordinator.cluster import wait_until
from tests.unit_tests.inference.handoff.common import build_engine, build_model, nixl
from tests.unit_tests.transformer.single_rank import on_single_rank

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WINDOW_S = 1.0  # how long the tests watch an engine that cannot progress
HEARTBEATS_PER_S = 4  # each coordinator heartbeat wakes the endpoint for one step


class _StalledTransport(NixlTransport):
    """NIXL whose pulls are posted for real but do not end until :attr:`resumed` is set (a
    peer silent that long)."""

    def __init__(self, name):
        super().__init__(name)
        self.resumed = threading.Event()

    def poll(self, handle):
        return super().poll(handle) if self.resumed.is_set() else TransferState.PENDING


class _StepCounter:
    def __init__(self, engine):
        self.count = 0
        self._step = engine.step
        engine.step = self

    def __call__(self):
        self.count += 1
        return self._step()

    def rate(self, seconds: float) -> float:
        """Steps per second over about ``seconds`` (measured: a busy machine may sleep longer)."""
        before, started = self.count, time.monotonic()
        time.sleep(seconds)
        return (self.count - before) / (time.monotonic() - started)


def _decode_engine(pg, transport, prefill_address: str) -> DisaggregatedEngine:
    decode = DecodeSide(build_engine(build_model("gpt", pg, vocab_size=260), pg), transport)
    return DisaggregatedEngine(decode, HandoffChannel(prefill_address, bind=False))


def _serve(engine, scenario):
    """Run ``scenario(client)`` against ``engine`` behind a coordinator and a real endpoint thread."""
    with InferenceCoordinator() as coordinator:
        endpoint = EngineEndpoint(engine, coordinator.address)
        thread = threading.Thread(target=endpoint.run, daemon=True)
        thread.start()

        async def main():
            async with InferenceClient(coordinator.address) as client:
                return await scenario(client)

        try:
            return asyncio.run(main())
        finally:
            endpoint.request_stop()
            thread.join(30)
            assert not thread.is_alive(), "the endpoint did not stop"


def _next_prefill(channel: HandoffChannel, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for kind, payload in channel.receive(100):
            if kind == "prefill":
                return payload
    raise AssertionError("no prefill message reached the prefill worker")


@on_single_rank
def test_waiting_for_a_mute_prefill_worker_blocks_and_its_message_wakes_the_engine(pg):
    prefill_end = HandoffChannel("tcp://127.0.0.1:0", bind=True)  # the test is the prefill worker
    engine = _decode_engine(pg, nixl("decode"), prefill_end.address)
    steps = _StepCounter(engine)
    idle_wait_s = EngineEndpoint.__init__.__kwdefaults__["idle_wait_s"]

    async def scenario(client):
        handle = await client.submit([5, 6, 7], PARAMS, request_id="r")
        assert (await asyncio.to_thread(_next_prefill, prefill_end))["request_id"] == "r"
        steps_per_s = await asyncio.to_thread(steps.rate, WINDOW_S)
        error = {"type": "PrefillFailedError", "message": "the prefill engine failed", "details": {}}
        prefill_end.send("finished", output=error_output("r", error, prompt_tokens=3))
        return steps_per_s, await asyncio.wait_for(handle.result(), 20)

    steps_per_s, result = _serve(engine, scenario)
    assert steps_per_s <= (1 / idle_wait_s + HEARTBEATS_PER_S) * 1.5, steps_per_s
    assert result["finish_reason"] == "error" and result["error"]["message"] == "the prefill engine failed"
    prefill_end.close()


@on_single_rank
def test_a_stalled_pull_is_checked_every_transfer_poll_interval_and_completes_when_it_ends(pg):
    prefill_end = HandoffChannel("tcp://127.0.0.1:0", bind=True)
    prefill = PrefillSide(build_engine(build_model("gpt", pg, vocab_size=260), pg, prefix_caching=False), nixl("p"))
    worker = PrefillWorker(prefill, prefill_end)
    worker_thread = threading.Thread(target=worker.run, daemon=True)
    worker_thread.start()
    transport = _StalledTransport("decode-stalled")
    engine = _decode_engine(pg, transport, prefill_end.address)
    steps = _StepCounter(engine)

    async def scenario(client):
        handle = await client.submit([5, 6, 7], PARAMS, request_id="r")
        await asyncio.to_thread(wait_until, lambda: engine.decode.pulling, "the pull to start", 30)
        steps_per_s = await asyncio.to_thread(steps.rate, WINDOW_S)
        transport.resumed.set()
        return steps_per_s, await asyncio.wait_for(handle.result(), 20)

    try:
        steps_per_s, result = _serve(engine, scenario)
    finally:
        worker.stopped.set()
        worker_thread.join(30)
    assert steps_per_s <= (1 / TRANSFER_POLL_S + HEARTBEATS_PER_S) * 1.5, steps_per_s
    assert result["finish_reason"] == "length" and result["generated_tokens"] == PARAMS.max_tokens
    assert engine.decode.stats["imports"] == 1 and not engine.decode.pulling
