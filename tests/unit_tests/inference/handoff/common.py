"""Shared pieces of the handoff tests: tiny engines, NIXL transports, an in-process driver of
a prefill side and a decode side, and a single-engine reference run."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL's UCX on CPU hosts: before any agent exists

from megatron.core.inference.engines import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.handoff.decode_side import ABANDON, DecodeSide  # noqa: E402
from megatron.core.inference.handoff.prefill_side import PrefillSide  # noqa: E402
from megatron.core.inference.handoff.transport import (  # noqa: E402
    NixlTransport,
    TransferState,
    TransportError,
)
from megatron.core.inference.sampling import SamplingParams  # noqa: E402
from tests.unit_tests.inference.engines.common import (  # noqa: E402,F401
    collect,
    gpt_model,
    hybrid_model,
    new_result,
    prompts,
    run,
)

ENGINE = dict(block_size=4, max_tokens_per_step=16, max_sequence_length=48)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, return_prompt_logprobs=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=6, logprobs=True)


def build_model(kind: str, pg, **overrides):
    return gpt_model(pg, **overrides) if kind == "gpt" else hybrid_model(pg, **overrides)


def build_engine(model, pg, *, num_blocks: int = 32, prefix_caching: bool = True, **overrides):
    return DynamicInferenceEngine(
        model,
        **(
            ENGINE
            | dict(num_blocks=num_blocks, max_requests=8, enable_prefix_caching=prefix_caching, pg_collection=pg)
            | overrides
        ),
    )


def nixl(role: str) -> NixlTransport:
    return NixlTransport(f"{role}-{uuid.uuid4().hex[:8]}")


def baseline(engine) -> tuple[int, int | None, int]:
    """Free blocks, free Mamba slots and requests of an engine's context."""
    context = engine.context
    slots = context.mamba_slots.num_free_slots if context.mamba_slots is not None else None
    return context.num_free_blocks, slots, context.num_requests


def deliver_words(decode: DecodeSide, prefill: PrefillSide) -> None:
    for word, request_id in decode.take_words():
        (prefill.abandon if word == ABANDON else prefill.release)(request_id)


def run_handoff(prefill: PrefillSide, decode: DecodeSide, requests, params, on_record=None) -> dict:
    """Prefill ``requests`` (prompts) on one side and decode them on the other, in one process."""
    params = params if isinstance(params, list) else [params] * len(requests)
    by_id = {str(i): p for i, p in enumerate(params)}
    results = {str(i): new_result() for i in range(len(requests))}
    for index, prompt in enumerate(requests):
        prefill.add_request(str(index), prompt, params[index])
    while prefill.has_work() or decode.has_unfinished_requests():
        if prefill.has_work():
            done = prefill.step()
            collect(results, done.finished)
            for record in done.records:
                if on_record is not None:
                    on_record(record)
                decode.submit(record.request_id, record, by_id[record.request_id])
        collect(results, decode.step())
        deliver_words(decode, prefill)
    return results


def pair(kind: str, pg, *, decode_overrides=None, prefill_overrides=None, model_overrides=None, decode_transport=None):
    """A prefill side and a decode side over NIXL, each on its own engine of the same model."""
    model_overrides = model_overrides or {}
    prefill_engine = build_engine(
        build_model(kind, pg, **model_overrides), pg, prefix_caching=False, **(prefill_overrides or {})
    )
    decode_engine = build_engine(build_model(kind, pg, **model_overrides), pg, **(decode_overrides or {}))
    return (PrefillSide(prefill_engine, nixl("prefill")), DecodeSide(decode_engine, decode_transport or nixl("decode")))


def prefill_records(prefill: PrefillSide, requests: dict, params=GREEDY) -> dict:
    """Prefill ``{request_id: prompt}``; return ``{request_id: record}``."""
    for request_id, prompt in requests.items():
        prefill.add_request(request_id, prompt, params)
    records = {}
    while prefill.has_work():
        for record in prefill.step().records:
            records[record.request_id] = record
    return records


def drain(decode: DecodeSide, prefill: PrefillSide, results: dict | None = None, on_step=None) -> dict:
    results = {} if results is None else results
    while decode.has_unfinished_requests():
        collect(results, decode.step())
        deliver_words(decode, prefill)
        if on_step is not None:
            on_step()
    return results


def block_bytes(engine) -> int:
    """Bytes of one KV block (K and V, all layers of the stage)."""
    data = engine.context.kv_cache.data
    return data[:, :, 0].numel() * data.element_size()


class FaultyTransport(NixlTransport):
    """NIXL whose next ``post_failures`` posts raise, and whose next ``poll_failures`` pulls
    end failed once NIXL finishes them (after really being posted), the way NixlTransport
    reports a transfer NIXL failed: state, counters and handle alike, with an injected reason.

    Failing pulls are remembered by transfer id, not by ``id(handle)``: a released handle's
    memory is reused, so a later pull's handle could inherit the failure."""

    def __init__(self, name, post_failures=0, poll_failures=0):
        super().__init__(name)
        self.post_failures, self.poll_failures = post_failures, poll_failures
        self.failing: set[str] = set()

    def post_pull(self, transfer_id, peer, segments):
        if self.post_failures:
            self.post_failures -= 1
            raise TransportError("injected: the peer refused the connection")
        handle = super().post_pull(transfer_id, peer, segments)
        if self.poll_failures:
            self.poll_failures -= 1
            self.failing.add(transfer_id)
        return handle

    def poll(self, handle):
        if handle.transfer_id not in self.failing or handle.state is not TransferState.PENDING:
            return super().poll(handle)
        if self.agent.check_xfer_state(handle.impl) not in ("DONE", "ERR"):
            return TransferState.PENDING
        self.failing.discard(handle.transfer_id)
        return self._count(handle._end(TransferState.FAILED, "injected: the peer reported an error"))
