"""An engine replica over a 2-rank model-parallel group: every rank applies the same commands in
the same order (the leader receives and broadcasts them), and only the leader replies."""

import asyncio
import threading

import torch.distributed as dist

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.dist_harness import run_distributed

from .engine_double import HashEngine, expected_tokens


def _serve_one_replica():
    engine = HashEngine(step_delay_s=0.002)
    group = dist.new_group([0, 1])
    if dist.get_rank() != 0:
        EngineEndpoint(engine, None, group=group).run()
        return engine.log, None
    coordinator = InferenceCoordinator().start()
    endpoint = EngineEndpoint(engine, coordinator.address, group=group)
    results = {}

    async def scenario():
        async with InferenceClient(coordinator.address) as client:
            short = await client.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=5), request_id="short")
            long = await client.submit([3], SamplingParams(max_tokens=4000), request_id="long")
            await long.next_output()
            long.abort()
            results["short"] = [t async for out in short for t in out["new_token_ids"]]
            results["long"] = (await long.result())["finish_reason"]
            await client.control("stop")

    client_thread = threading.Thread(target=lambda: asyncio.run(scenario()))
    client_thread.start()
    try:
        endpoint.run()
    finally:
        client_thread.join(10)
        coordinator.stop()
    return engine.log, results


def test_both_ranks_apply_the_same_commands_in_the_same_order():
    (leader_log, results), (follower_log, _) = run_distributed(_serve_one_replica, 2, timeout_s=60)
    assert results == {"short": expected_tokens([1, 2], 5), "long": "abort"}
    assert leader_log == follower_log
    assert [entry for entry in leader_log if entry[0] != "step"] == [
        ("add", "short"),
        ("add", "long"),
        ("abort", "long"),
    ]
