"""Decode steps replayed from CUDA graphs, one graph per step bucket.

A decode-only step of ``R`` requests runs at the bucket ``b >= R`` of the engine's step buckets
(the size an eager step of ``R`` tokens is padded to). Its batch is built into the context's
step buffers with ``b`` request rows (the rows past ``R`` are padding requests: one token that
attends the dummy block and uses the scratch Mamba slot), so every step of bucket ``b`` reads the
same addresses. :meth:`DecodeGraphs.capture` records, for each bucket, the model's forward over
those views, the write-back of the Mamba states and the per-row log-softmax of the logits (the
log-probs, by the same row-invariant kernel an eager step samples with, so they are the same bits
and the host launches one graph instead of the log-softmax kernel too); :meth:`DecodeGraphs.run`
replays it after the step's inputs were copied in, and returns the graph's static logits, decoder
output and log-probs. Sampling runs after the graph, eagerly on the device (where per-request
logits processors fit).

On a CPU device nothing is captured: :meth:`run` runs the same static-buffer step eagerly, which
is how the tests check that this path gives exactly the outputs of the dynamic one.

Capturing needs every kernel of a decode step to run without reading the device from the host:
paged attention through Triton (the step's per-token metadata is built on the host); the Mamba
mixer's packed decode step reads nothing back (:meth:`MambaMixer._packed_step`).
"""

from __future__ import annotations

import argparse

import torch

from megatron.core.inference import kernels
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, StepBatch
from megatron.core.inference.contexts.paged_attention import resolve_backend
from megatron.core.inference.model_runner import ModelRunner


def add_cuda_graph_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--cuda-graphs`` / ``--no-cuda-graphs`` into ``args.enable_cuda_graphs`` (None when neither
    is given: the engine's default, graphs wherever the stage can be captured)."""
    parser.add_argument(
        "--cuda-graphs",
        dest="enable_cuda_graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs (default: on where the stage can be captured); "
        "--no-cuda-graphs runs every step eagerly",
    )


def graph_blocker(runner: ModelRunner, context: DynamicInferenceContext) -> str | None:
    """Why decode steps of this stage cannot be captured on its device, or None."""
    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {runner.device}"
    if runner.pp_size > 1:
        return "CUDA graphs are not captured under pipeline parallelism"
    if context.spec.attention_layer_numbers and resolve_backend("auto", runner.device) != "triton":
        return "paged attention runs on the torch backend (Triton is off or missing), which reads back lengths"
    return None


class DecodeGraphs:
    """The static-buffer decode steps of one engine (see module doc).

    Args:
        runner / context: the engine's model runner and context.
        buckets: the step buckets decode steps may use (each <= the context's step rows).
        capture: record CUDA graphs (CUDA only); False runs the static-buffer steps eagerly.
    """

    def __init__(self, runner: ModelRunner, context: DynamicInferenceContext, buckets: list[int], capture: bool):
        self.runner = runner
        self.context = context
        fitting = sorted(b for b in buckets if b <= context.step_buffers.max_requests)
        # A decode step has at most max_requests requests: no bucket past the one that holds them.
        limit = next((b for b in fitting if b >= context.capacity.max_requests), None)
        self.buckets = [b for b in fitting if limit is None or b <= limit]
        self.capturing = capture
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def bucket_for(self, num_requests: int) -> int | None:
        """The bucket of a decode step of ``num_requests`` requests (None: above every bucket)."""
        for bucket in self.buckets:
            if bucket >= num_requests:
                return bucket
        return None

    @torch.no_grad()
    def capture(self) -> None:
        """Record one graph per bucket, largest first (all share one memory pool)."""
        if not self.capturing:
            return
        pool = None
        current = torch.cuda.current_stream()
        for bucket in sorted(self.buckets, reverse=True):
            batch = self.context.build_step([], pad_to_tokens=bucket, pad_to_requests=bucket)
            warmup = torch.cuda.Stream()
            warmup.wait_stream(current)
            with torch.cuda.stream(warmup):  # allocator, cuBLAS and Triton settle outside the capture
                self._forward(batch)
            current.wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(batch)
            pool = graph.pool()
            self.context.commit_step()
            self._graphs[bucket] = (graph, outputs)
        torch.cuda.synchronize()

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [b, V] fp32, hidden [b, h], log_probs [b, V] fp32)`` of a static decode batch
        (built with ``pad_to_requests=b``); replayed from its graph when captured. On the last
        stage only."""
        if not self.capturing:
            return self._forward(batch)
        graph, outputs = self._graphs[batch.num_rows]
        graph.replay()
        return outputs

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, hidden = self.runner.forward(self.context, batch)
        self.context.write_back_step_states()
        return logits, hidden, kernels.log_softmax(logits)
