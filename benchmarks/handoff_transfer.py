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
release. The raw side times describing, posting, waiting for and releasing one READ of the
same bytes. Trials alternate (ours, raw, ours, ...) after one warm-up round; the medians are
compared. ``--fragmented`` takes the destination blocks in the plain free-list order instead
(one descriptor per block and layer plane), to show what coalescing buys. Every run checks that
the pulled blocks equal the source's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from megatron.core.benchmark_report import finish
from megatron.core.inference.contexts.block_allocator import BlockPool, PageReason
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout, dtype_from_name
from megatron.core.inference.handoff.plan import plan_kv
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


def _source_content(args) -> torch.Tensor:
    kv = _buffer(args, args.blocks, "cpu")
    return kv.copy_(torch.rand(kv.shape, generator=torch.Generator().manual_seed(0)).to(kv))


def source(args, exports, stop) -> None:
    kv = _source_content(args).to(args.source_device or args.device)
    transport = NixlTransport(f"bench-source-{os.getpid()}")
    transport.register({"kv": kv})
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
        puller.register({"kv": kv})
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

        def ours() -> int:
            segments = plan_kv(record, local, record.block_ids, dst_blocks)
            _wait(puller, puller.post_pull("bench", peer, segments))
            return len(segments)

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

        times = {"ours": [], "raw": []}
        for trial in range(args.trials + 1):  # the first round warms the connection up
            for name, fn in (("ours", ours), ("raw", raw)):
                started = time.perf_counter()
                result = fn()
                if trial:
                    times[name].append(time.perf_counter() - started)
                if name == "ours":
                    num_runs = result
        expected, pulled = _source_content(args), kv.cpu()
        index = torch.tensor(dst_blocks)
        if not torch.equal(pulled[:, :, index], expected[:, :, : args.blocks]):
            raise RuntimeError("the pulled blocks differ from the source's")
        puller.close()
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
        "ratio": median["raw"] / median["ours"],
    }
    print(
        f"{nbytes / 1e6:.2f} MB in {num_runs} runs ({args.blocks} blocks"
        f"{', fragmented' if args.fragmented else ''}, {args.layers} layers, "
        f"{args.source_device or args.device} -> {args.device}, median of {args.trials} alternating trials): "
        f"handoff pull {result['ours_gb_per_s']:.3f} GB/s, raw NIXL {result['raw_gb_per_s']:.3f} GB/s, "
        f"ratio {result['ratio']:.3f}"
    )
    return finish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
