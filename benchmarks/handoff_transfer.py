#!/usr/bin/env python3
"""KV handoff transfer rate: our pull (block allocation, transfer plan, NixlTransport) against a
raw NIXL READ of the same number of bytes as one contiguous descriptor, in the same run,
between two processes.

    python benchmarks/handoff_transfer.py --layers 32 --blocks 256 --block-size 16 \\
        --kv-heads 8 --head-dim 128 --dtype bfloat16 --device cuda --json handoff.json

The source process holds a KV buffer ``[2, layers, blocks + 1, block_size, kv_heads, head_dim]``
whose first ``--blocks`` blocks are one request's prompt (as a fresh prefill pool hands them
out) and serves reads. This process holds a decode pool of twice as many blocks, half of it
taken by other requests with holes between them, and imports the request the way the decode
side does: the blocks come from ``BlockPool.allocate(..., PageReason.IMPORT)``, the runs from
``plan_kv``, the pull from ``NixlTransport.post_pull``; each trial times plan + post + wait +
release; both sides register their KV buffer with its unit (one block), so our pulls pick
indices from descriptor lists prepared once. Two variants of ours run beside it: *pipelined*,
the same import cut into ``--layer-groups`` groups of layers posted back to back (it also
reports when all its pulls were posted and when the first group landed), and *unprepared*, a
second puller without units that describes every run anew, as before prepared lists. The raw
side times describing, posting, waiting for and releasing one READ of the same bytes. Trials
alternate (ours, pipelined, unprepared, raw, ours, ...) after one warm-up round; the medians are
compared.
``--fragmented`` takes the destination blocks in the plain free-list order instead (one
descriptor per block and layer plane), to show what coalescing buys. Every pull of ours is
checked: the pulled blocks equal the source's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from megatron.core.inference.contexts.block_allocator import BlockPool, PageReason
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout, dtype_from_name
from megatron.core.inference.handoff.plan import layer_groups, plan_kv
from megatron.core.inference.handoff.transport import NixlTransport, TransferState


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64, help="blocks of the request that is pulled")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--source-device",
        default=None,
        help="device of the prefill-side buffer (default: --device), e.g. cuda:1 for GPU to GPU",
    )
    parser.add_argument("--trials", type=int, default=7, help="timed trials of each side (after one warm-up)")
    parser.add_argument("--fragmented", action="store_true", help="scattered destination blocks (no coalescing)")
    parser.add_argument("--layer-groups", type=int, default=4, help="layer groups of the pipelined variant")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    return parser.parse_args(argv)


def _buffer(args, num_blocks: int, device) -> torch.Tensor:
    shape = (2, args.layers, num_blocks + 1, args.block_size, args.kv_heads, args.head_dim)
    return torch.zeros(shape, dtype=dtype_from_name(args.dtype), device=device)


def _layout(args, peer, num_blocks: int) -> SourceLayout:
    return SourceLayout(
        peer,
        tuple(range(1, args.layers + 1)),
        (),
        0,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        num_blocks + 1,
        args.dtype,
        0,
        1,
    )


def _block_bytes(kv: torch.Tensor) -> int:
    return kv.stride(2) * kv.element_size()


def _source_content(args) -> torch.Tensor:
    kv = _buffer(args, args.blocks, "cpu")
    return kv.copy_(torch.rand(kv.shape, generator=torch.Generator().manual_seed(0)).to(kv))


def source(args, exports, stop) -> None:
    kv = _source_content(args).to(args.source_device or args.device)
    transport = NixlTransport(f"bench-source-{os.getpid()}")
    transport.register({"kv": kv}, {"kv": _block_bytes(kv)})
    exports.put(transport.export())
    stop.get()
    transport.close()


def destination_blocks(num_blocks: int, fragmented: bool) -> list[int]:
    """The request's blocks in a decode pool of ``2 * num_blocks`` whose first half is held by
    other requests except every other block (freed), as the decode side would allocate them."""
    pool = BlockPool(2 * num_blocks)
    held = pool.allocate(2 * num_blocks, PageReason.ADMISSION)
    pool.free(held[1:num_blocks:2] + held[num_blocks:])
    return pool.allocate(num_blocks, PageReason.ADMISSION if fragmented else PageReason.IMPORT)


def _wait(transport, handle) -> None:
    while transport.poll(handle) is TransferState.PENDING:
        pass
    if handle.state is not TransferState.DONE:
        raise RuntimeError(f"transfer failed: {handle.error}")
    transport.release(handle)


def _ratio(median: dict, name: str) -> float:
    return median["raw"] / median[name]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    spawn = mp.get_context("spawn")
    exports, stop = spawn.Queue(), spawn.Queue()
    worker = spawn.Process(target=source, args=(args, exports, stop))
    worker.start()
    try:
        peer = exports.get(timeout=120)
        num_local_blocks = 2 * args.blocks
        kv = _buffer(args, num_local_blocks, args.device)
        puller = NixlTransport(f"bench-puller-{os.getpid()}")
        puller.register({"kv": kv}, {"kv": _block_bytes(kv)})
        unprepared = NixlTransport(f"bench-unprepared-{os.getpid()}")
        unprepared.register({"kv": kv})
        record = HandoffRecord(
            "bench",
            [0] * (args.blocks * args.block_size),
            args.block_size,
            list(range(args.blocks)),
            [],
            [0],
            [0.0],
            [_layout(args, peer, args.blocks)],
            False,
        )
        local = _layout(args, {}, num_local_blocks)
        dst_blocks = destination_blocks(args.blocks, args.fragmented)

        def ours(transport=puller) -> int:
            segments = plan_kv(record, local, record.block_ids, dst_blocks)
            _wait(transport, transport.post_pull("bench", peer, segments))
            return len(segments)

        groups = layer_groups(local, -(-args.layers // args.layer_groups))
        first_landed, posted = [], []

        def pipelined() -> int:
            started = time.perf_counter()
            plans = [plan_kv(record, local, record.block_ids, dst_blocks, layers) for layers in groups]
            handles = [puller.post_pull("bench", peer, segments) for segments in plans]
            posted.append(time.perf_counter() - started)
            for index, handle in enumerate(handles):
                _wait(puller, handle)
                if index == 0:
                    first_landed.append(time.perf_counter() - started)
            return sum(len(segments) for segments in plans)

        agent, remote = puller.agent, puller.connect(peer)
        base, _, device_id, mem_type = peer["regions"]["kv"]
        local_mem = "VRAM" if kv.is_cuda else "DRAM"
        nbytes = sum(s.nbytes for s in plan_kv(record, local, record.block_ids, dst_blocks))
        raw_target = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        puller.register({"raw": raw_target})

        def raw() -> None:
            target = (raw_target.data_ptr(), nbytes, max(raw_target.get_device(), 0))
            local_descs = agent.get_xfer_descs([target], local_mem)
            remote_descs = agent.get_xfer_descs([(base, nbytes, device_id)], mem_type)
            xfer = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError("raw NIXL transfer failed")

        variants = (
            ("ours", ours),
            ("pipelined", pipelined),
            ("unprepared", lambda: ours(unprepared)),
            ("raw", raw),
        )
        times, runs = {name: [] for name, _ in variants}, {}
        expected = _source_content(args)[:, :, : args.blocks].to(args.device)
        index = torch.tensor(dst_blocks, device=args.device)
        for trial in range(args.trials + 1):  # the first round warms the connection up
            for name, fn in variants:
                if name != "raw":
                    kv.zero_()
                started = time.perf_counter()
                runs[name] = fn()
                if trial:
                    times[name].append(time.perf_counter() - started)
                if name != "raw" and not torch.equal(kv[:, :, index], expected):
                    raise RuntimeError(f"the blocks pulled by {name!r} differ from the source's")
        if puller.local_preparations != 1 or sum(puller.peer_preparations.values()) != 1:
            raise RuntimeError("the prepared descriptor lists were prepared more than once")
        num_runs = runs["ours"]
        first_group, all_posted = statistics.median(first_landed[1:]), statistics.median(posted[1:])
        puller.close()
        unprepared.close()
    finally:
        stop.put(None)
        worker.join(60)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "config": vars(args),
        "bytes": nbytes,
        "descriptors": num_runs,
        "seconds": times,
        "median_seconds": median,
        "ours_gb_per_s": nbytes / median["ours"] / 1e9,
        "raw_gb_per_s": nbytes / median["raw"] / 1e9,
        "ratio": _ratio(median, "ours"),
        "layer_groups": len(groups),
        "pipelined_descriptors": runs["pipelined"],
        "pipelined_gb_per_s": nbytes / median["pipelined"] / 1e9,
        "pipelined_ratio": _ratio(median, "pipelined"),
        "first_group_seconds": first_group,
        "posted_seconds": all_posted,
        "unprepared_gb_per_s": nbytes / median["unprepared"] / 1e9,
        "unprepared_ratio": _ratio(median, "unprepared"),
    }
    print(
        f"{nbytes / 1e6:.2f} MB in {num_runs} runs ({args.blocks} blocks"
        f"{', fragmented' if args.fragmented else ''}, {args.layers} layers, "
        f"{args.source_device or args.device} -> {args.device}, median of {args.trials} alternating trials): "
        f"handoff pull {result['ours_gb_per_s']:.3f} GB/s, raw NIXL {result['raw_gb_per_s']:.3f} GB/s, "
        f"ratio {result['ratio']:.3f}"
    )
    print(
        f"pipelined in {len(groups)} layer groups ({runs['pipelined']} runs): {result['pipelined_gb_per_s']:.3f} GB/s, "
        f"ratio {result['pipelined_ratio']:.3f}, all posted after {all_posted * 1e3:.3f} ms, first group landed "
        f"after {first_group * 1e3:.3f} ms of "
        f"{median['pipelined'] * 1e3:.3f} ms; unprepared descriptor lists: {result['unprepared_gb_per_s']:.3f} GB/s, "
        f"ratio {result['unprepared_ratio']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
