#!/usr/bin/env python3
"""KV handoff transfer rate: our pull (transfer plan + NixlTransport) against a raw NIXL READ
of the same number of bytes, in the same run, between two processes.

    python benchmarks/handoff_transfer.py --layers 32 --blocks 256 --block-size 16 \\
        --kv-heads 8 --head-dim 128 --dtype bfloat16 --device cuda:0 --source-device cuda:1

The source process holds a KV buffer ``[2, layers, blocks + 1, block_size, kv_heads, head_dim]``
and serves reads; this process pulls ``--blocks`` blocks of a request into its own buffer
(scattered destination blocks, as the decode side does) and times it, then times one raw READ
of a contiguous region of the same size. Prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch

from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout, dtype_from_name
from megatron.core.inference.handoff.plan import plan_kv
from megatron.core.inference.handoff.transport import NixlTransport, TransferState


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64)
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
    parser.add_argument("--iters", type=int, default=5)
    return parser.parse_args(argv)


def _buffer(args, device) -> torch.Tensor:
    return torch.zeros(
        2,
        args.layers,
        args.blocks + 1,
        args.block_size,
        args.kv_heads,
        args.head_dim,
        dtype=dtype_from_name(args.dtype),
        device=device,
    )


def _layout(args, peer) -> SourceLayout:
    return SourceLayout(
        peer,
        tuple(range(1, args.layers + 1)),
        (),
        0,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.blocks + 1,
        args.dtype,
        0,
        1,
    )


def source(args, exports, stop) -> None:
    kv = _buffer(args, args.source_device or args.device)
    kv.copy_(torch.rand(kv.shape, generator=torch.Generator().manual_seed(0)).to(kv))
    transport = NixlTransport(f"bench-source-{os.getpid()}")
    transport.register({"kv": kv})
    exports.put(transport.export())
    stop.get()
    transport.close()


def _wait(transport, handle) -> float:
    started = time.perf_counter()
    while transport.poll(handle) is TransferState.PENDING:
        pass
    if handle.state is not TransferState.DONE:
        raise RuntimeError(f"transfer failed: {handle.error}")
    transport.release(handle)
    return time.perf_counter() - started


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
        kv = _buffer(args, args.device)
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
            [_layout(args, peer)],
            False,
        )
        destination = list(reversed(range(args.blocks)))  # scattered, as allocated blocks are
        segments = plan_kv(record, _layout(args, {}), record.block_ids, destination)
        nbytes = sum(s.nbytes for s in segments)
        ours, raw = [], []
        agent, remote = puller.agent, puller.connect(peer)
        base, _, device_id, mem_type = peer["regions"]["kv"]
        local_mem = "VRAM" if kv.is_cuda else "DRAM"
        for _ in range(args.iters + 1):  # the first round warms the connection up
            started = time.perf_counter()
            handle = puller.post_pull("bench", peer, segments)
            _wait(puller, handle)
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            local = agent.get_xfer_descs([(kv.data_ptr(), nbytes, max(kv.get_device(), 0))], local_mem)
            remote_descs = agent.get_xfer_descs([(base, nbytes, device_id)], mem_type)
            xfer = agent.initialize_xfer("READ", local, remote_descs, remote)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError("raw NIXL transfer failed")
            raw.append(time.perf_counter() - started)
        ours_gbps, raw_gbps = nbytes / min(ours[1:]) / 1e9, nbytes / min(raw[1:]) / 1e9
        print(
            f"{nbytes / 1e6:.2f} MB in {len(segments)} runs ({args.blocks} blocks, {args.layers} layers, "
            f"{args.source_device or args.device} -> {args.device}): handoff pull {ours_gbps:.3f} GB/s, "
            f"raw NIXL {raw_gbps:.3f} GB/s, "
            f"ratio {ours_gbps / raw_gbps:.3f}"
        )
        puller.close()
    finally:
        stop.put(None)
        worker.join(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
