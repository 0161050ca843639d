#!/usr/bin/env python3
"""Disaggregated prefill/decode: a prefill engine and a decode engine as separate processes,
KV state moved between them by NIXL, the coordinator in front.

    python examples/inference/disaggregated.py --prompts "Hello" "The sky is" \\
        --num-tokens-to-generate 32 --output-json out.json

Takes the flags of ``offline_inference.py`` (model or ``--load DIR``, prompts, engine,
sampling, ``--output-json``) and writes the same report; its ``stats`` add the bytes the
decode engine pulled and the transfer rate. The prefill process prefills each prompt to its
first token and pins its KV blocks (and Mamba state); the decode process pulls them over NIXL
(UCX; on CPU hosts ``UCX_NET_DEVICES=lo`` is used), admits the request straight into decode
and tells the prefill process to release the pin. This process runs the coordinator and the
client; the two engine processes die with it, and it fails at once, naming the process, when
one of them exits early (an engine that cannot load the checkpoint, say). Without NIXL it
stops before starting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import queue
import sys
import time

import torch

from megatron.core import parallel_state
from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference import offline_inference
from megatron.core.inference.checkpoint_loading import record_tokenizer
from megatron.core.inference.coordinator import InferenceClient, InferenceCoordinator, Role
from megatron.core.inference.coordinator.lifetime import die_with_parent
from megatron.core.inference.handoff.transport import NixlUnavailableError, require_nixl
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models.model_record import read_model_record
from megatron.core.tokenizers.factory import build_tokenizer


def _engine(args, role: str, num_blocks: int, num_requests: int):
    """This process's engine (a world of one rank) over the checkpoint of ``--load``, else the
    random model of the flags."""
    from megatron.core.inference.engines import DynamicInferenceEngine

    parallel_state.initialize_distributed("nccl" if torch.cuda.is_available() else "gloo")
    pg = parallel_state.initialize_model_parallel()
    model, tokenizer, _ = offline_inference.load_model(args, pg)
    return DynamicInferenceEngine(
        model,
        tokenizer=tokenizer,
        pg_collection=pg,
        block_size=args.kv_block_size,
        num_blocks=num_blocks,
        max_requests=args.max_requests or num_requests,
        max_tokens_per_step=args.max_tokens_per_step,
        max_sequence_length=args.max_sequence_length,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching or role == "decode",
        paused_block_budget=args.paused_block_budget,
        num_speculative_tokens=args.num_speculative_tokens,
    )


def prefill_process(args, num_blocks: int, num_requests: int, keys, addresses) -> None:
    from megatron.core.inference.handoff.prefill_side import PrefillSide
    from megatron.core.inference.handoff.serving import HandoffChannel, PrefillWorker
    from megatron.core.inference.handoff.transport import NixlTransport

    die_with_parent(mp.parent_process().pid)
    engine = _engine(args, "prefill", num_blocks, num_requests)
    channel = HandoffChannel("tcp://127.0.0.1:0", bind=True, keys=keys)  # only the decode process gets in
    worker = PrefillWorker(PrefillSide(engine, NixlTransport(f"prefill-{os.getpid()}")), channel)
    addresses.put(channel.address)
    worker.run()
    channel.close()


def decode_process(args, num_blocks: int, num_requests: int, prefill_address: str, coordinator: str, keys, results):
    from megatron.core.inference.coordinator import EngineEndpoint
    from megatron.core.inference.handoff.decode_side import DecodeSide
    from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
    from megatron.core.inference.handoff.transport import NixlTransport

    die_with_parent(mp.parent_process().pid)
    engine = _engine(args, "decode", num_blocks, num_requests)
    channel = HandoffChannel(prefill_address, bind=False, keys=keys)
    disaggregated = DisaggregatedEngine(DecodeSide(engine, NixlTransport(f"decode-{os.getpid()}")), channel)
    EngineEndpoint(disaggregated, coordinator, engine_id="decode", keys=keys).run()
    channel.send("stop")
    results.put(disaggregated.stats)
    channel.close()


class EngineProcessExitedError(MegatronRuntimeError):
    """An engine process ended before its part was done (its own error is in the output above)."""


def _ended(processes: dict[str, mp.Process], until: str) -> EngineProcessExitedError | None:
    """The error naming the first of ``processes`` that has ended, or None while all run."""
    for name, process in processes.items():
        if process.exitcode is not None:
            return EngineProcessExitedError(
                f"the {name} engine process exited with code {process.exitcode} {until}; its error is above"
            )
    return None


def _receive(items: mp.Queue, processes: dict[str, mp.Process], until: str):
    """The next item of ``items``, unless one of ``processes`` ends first (then
    :class:`EngineProcessExitedError`)."""
    while (ended := _ended(processes, until)) is None:
        with contextlib.suppress(queue.Empty):
            return items.get(timeout=0.1)
    with contextlib.suppress(queue.Empty):  # it may have put the item just before exiting
        return items.get(timeout=1.0)
    raise ended


async def _while_running(work, processes: dict[str, mp.Process], until: str):
    """``await work``, unless one of ``processes`` ends first (then :class:`EngineProcessExitedError`)."""
    task = asyncio.ensure_future(work)
    while (ended := _ended(processes, until)) is None:
        if (await asyncio.wait({task}, timeout=0.1))[0]:
            return task.result()
    if not (await asyncio.wait({task}, timeout=1.0))[0]:  # the work may have ended as the process did
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ended
    return task.result()


async def _generate(address: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    async with InferenceClient(address) as client:
        handles = [
            await client.submit(p, sp, request_id=f"request-{i}")
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        outputs = []
        for handle in handles:
            merged = dict(token_ids=[], log_probs=[], prompt_log_probs=None, finish_reason=None, error=None)
            async for output in handle:
                merged["token_ids"] += output["new_token_ids"]
                merged["log_probs"] += output["new_log_probs"]
                if output.get("prompt_log_probs") is not None:
                    merged["prompt_log_probs"] = output["prompt_log_probs"]
                merged["finish_reason"], merged["error"] = output["finish_reason"], output["error"]
            outputs.append(merged)
        await client.control("stop")
        return outputs


def main(argv=None) -> int:
    args = offline_inference.parse_args(argv)
    try:
        require_nixl()
    except NixlUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.load is not None:
        record = read_model_record(args.load)
        tokenizer = record_tokenizer(record, args.tokenizer_type, args.tokenizer_model)
    else:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        record = offline_inference.random_model_record(args, tokenizer.vocab_size)
    max_sequence_length = args.max_sequence_length or record.max_sequence_length
    prompts = [prompt_token_ids(p, tokenizer) for p in offline_inference.read_prompts(args)]
    num_blocks = offline_inference.kv_block_count(args, [len(p) for p in prompts], max_sequence_length)
    params = offline_inference.sampling_params(args, len(prompts))
    spawn = mp.get_context("spawn")
    addresses, results = spawn.Queue(), spawn.Queue()
    engines: dict[str, mp.Process] = {}
    with InferenceCoordinator(heartbeat_timeout_s=None) as coordinator:
        engine_keys = coordinator.keys.for_role(Role.ENGINE)  # over the spawn pipes, to the two children only
        try:
            engines["prefill"] = spawn.Process(
                target=prefill_process, args=(args, num_blocks, len(prompts), engine_keys, addresses)
            )
            engines["prefill"].start()
            prefill_address = _receive(addresses, engines, "before it was ready")
            engines["decode"] = spawn.Process(
                target=decode_process,
                args=(args, num_blocks, len(prompts), prefill_address, coordinator.address, engine_keys, results),
            )
            engines["decode"].start()
            started = time.perf_counter()
            outputs = asyncio.run(
                _while_running(_generate(coordinator.address, prompts, params), engines, "while requests were running")
            )
            elapsed = time.perf_counter() - started
            stats = _receive(results, {"decode": engines["decode"]}, "before it reported its stats")
        except EngineProcessExitedError as error:
            for engine in engines.values():  # the other one would wait for its peer forever
                engine.kill()
            print(f"error: {error}", file=sys.stderr)
            return 1
        finally:
            for engine in engines.values():
                engine.join(60)
    failed = [o for o in outputs if o["finish_reason"] == "error"]
    if failed:
        print(f"error: {len(failed)} requests failed, first: {failed[0]['error']}", file=sys.stderr)
        return 1
    num_generated = sum(len(o["token_ids"]) for o in outputs)
    gb_per_s = stats["handoff_gb_per_s"]
    print(
        f"{len(prompts)} requests, {num_generated} tokens in {elapsed:.2f} s: {num_generated / elapsed:.1f} output "
        f"tokens/s over {stats['steps']} decode steps; {stats['handoff_imports']} imports pulled "
        f"{stats['handoff_transferred_bytes']} KV bytes at {gb_per_s:.3f} GB/s"
    )
    if args.output_json:
        report = {
            "requests": [
                {
                    "prompt_tokens": p,
                    "generated_tokens": o["token_ids"],
                    "generated_text": tokenizer.detokenize(o["token_ids"]),
                    "prompt_log_probs": o["prompt_log_probs"],
                    "generated_log_probs": o["log_probs"],
                }
                for p, o in zip(prompts, outputs, strict=True)
            ],
            "stats": {key: stats[key] for key in ("steps", "pauses", "evictions", "prefix_cache_hits")}
            | {
                "output_tokens_per_s": num_generated / elapsed,
                "transferred_bytes": stats["handoff_transferred_bytes"],
                "transfer_gb_per_s": gb_per_s,
            },
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
