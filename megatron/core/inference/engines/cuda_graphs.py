"""Steps replayed from CUDA graphs: decode steps per step bucket, and mixed (prefill) steps per
token bucket.

A decode-only step of ``R`` requests runs at the bucket ``b >= R`` of the engine's step buckets
(the size an eager step of ``R`` tokens is padded to). Its batch is built into the context's
step buffers with ``b`` request rows (the rows past ``R`` are padding requests: one token that
attends the dummy block and uses the scratch Mamba slot), so every step of bucket ``b`` reads the
same addresses. A mixed step (prefill chunks, with or without decode tokens) of ``n`` tokens runs
at the token bucket ``t >= n`` with ``min(t, max_requests)`` request rows, the rows past its
requests padding requests of no token, and projects one row per request row onto the vocabulary
(each request's last token, read on the device from the step's query offsets), so the graph of
``t`` serves every mixed step of up to ``t`` tokens whatever its requests. A stage with Mamba
layers captures mixed steps only where their prefill is the batch-invariant packed recurrence
on Triton (:func:`mixed_step_blocker`).

:meth:`StepGraphs.capture` records, for each key, the model's forward over those views, the
write-back of the Mamba states and the per-row log-softmax of the logits (the log-probs, by the
same row-invariant kernel an eager step samples with, so they are the same bits and the host
launches one graph instead of the log-softmax kernel too); :meth:`StepGraphs.run` replays it after
the step's inputs were copied in, and returns the graph's static logits, decoder output and
log-probs. Sampling runs after the graph, eagerly on the device (where per-request logits
processors fit). All graphs share one memory pool: the engine reads a graph's outputs (on the
stream) before it replays the next one.

On a CPU device nothing is captured: :meth:`StepGraphs.run` runs the same static-buffer step
eagerly, which is how the tests check that this path gives exactly the outputs of the dynamic one.

Capturing needs every kernel of a step to run without reading the device from the host: paged
attention through Triton (the grid is sized from shapes, the lengths are read on the device); the
Mamba mixer's packed decode step reads nothing back (:meth:`MambaMixer._packed_step`). An MoE
layer reads its per-expert token counts on the host, so a stage with one runs every step eagerly
(:func:`graph_blocker`).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch

from megatron.core.inference import kernels
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, StepBatch
from megatron.core.inference.contexts.paged_attention import resolve_backend
from megatron.core.inference.model_runner import ModelRunner
from megatron.core.transformer.moe.moe_layer import MoELayer


def add_cuda_graph_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--cuda-graphs`` / ``--no-cuda-graphs`` into ``args.enable_cuda_graphs`` (None when neither
    is given: the engine's default, graphs wherever the stage can be captured)."""
    parser.add_argument(
        "--cuda-graphs",
        dest="enable_cuda_graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode and prefill steps from CUDA graphs (default: on where the stage can be captured); "
        "--no-cuda-graphs runs every step eagerly",
    )


def graph_blocker(runner: ModelRunner, context: DynamicInferenceContext) -> str | None:
    """Why decode steps of this stage cannot be captured on its device, or None."""
    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {runner.device}"
    if runner.pp_size > 1:
        return "CUDA graphs are not captured under pipeline parallelism"
    if any(isinstance(module, MoELayer) for module in runner.model.modules()):
        return "MoE layers size each expert's batch from token counts read on the host, which a graph cannot replay"
    if context.spec.attention_layer_numbers and resolve_backend("auto", runner.device) != "triton":
        return "paged attention runs on the torch backend (Triton is off or missing), which reads back lengths"
    return None


def mixed_step_blocker(context: DynamicInferenceContext, batch_invariant: bool) -> str | None:
    """Why this stage's mixed (prefill) steps are not captured (decode steps may be), or None.
    A Mamba layer's prefill reads nothing on the host only as the batch-invariant packed
    recurrence on Triton (on a CPU the static-buffer steps run eagerly, the torch recurrence)."""
    if not context.spec.mamba_layer_numbers:
        return None
    if not batch_invariant:
        return "the Mamba layers' batch-variant prefill (the chunked scan) plans its chunks on the host"
    if context.device.type == "cuda" and kernels.kernel_backend(context.device) != "triton":
        return "the Mamba layers' prefill on the torch backend (Triton is off or missing) reads lengths on the host"
    return None


class GraphKey(NamedTuple):
    """The shape of one captured step: ``tokens`` packed rows, ``rows`` request rows; ``decode``:
    padding requests of one token and every row's logits, else padding requests of no token and
    one logit row per request row."""

    tokens: int
    rows: int
    decode: bool


class StepGraphs:
    """The static-buffer steps of one engine (see module doc).

    Args:
        runner / context: the engine's model runner and context.
        buckets: the step buckets (each <= the context's step rows).
        capture: record CUDA graphs (CUDA only); False runs the static-buffer steps eagerly.
        mixed_steps: also serve mixed (prefill) steps (see :func:`mixed_step_blocker`).
    """

    def __init__(
        self,
        runner: ModelRunner,
        context: DynamicInferenceContext,
        buckets: list[int],
        capture: bool,
        mixed_steps: bool = True,
    ):
        self.runner = runner
        self.context = context
        fitting = sorted(b for b in buckets if b <= context.step_buffers.max_requests)
        max_requests = context.capacity.max_requests
        # A decode step has at most max_requests requests: no bucket past the one that holds them.
        limit = next((b for b in fitting if b >= max_requests), None)
        self.buckets = [b for b in fitting if limit is None or b <= limit]
        self.mixed_buckets = fitting if mixed_steps else []
        self.capturing = capture
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def key_for(self, num_requests: int, num_tokens: int, one_logit_row_per_request: bool) -> GraphKey | None:
        """The graph of a step of ``num_requests`` requests and ``num_tokens`` tokens (None: eager):
        a decode-only step's bucket, else (when the step samples at most each request's last row)
        the mixed step's token bucket."""
        if num_tokens == num_requests:
            bucket = next((b for b in self.buckets if b >= num_requests), None)
            if bucket is not None:
                return GraphKey(bucket, bucket, True)
        if not one_logit_row_per_request:
            return None
        bucket = next((b for b in self.mixed_buckets if b >= num_tokens), None)
        return None if bucket is None else self._mixed_key(bucket)

    def keys(self) -> list[GraphKey]:
        """Every key served, largest first (the capture order)."""
        decode = [GraphKey(b, b, True) for b in self.buckets]
        return sorted(decode + [self._mixed_key(t) for t in self.mixed_buckets], reverse=True)

    def _mixed_key(self, tokens: int) -> GraphKey:
        # A step of ``tokens`` tokens has at most that many requests, and at most max_requests.
        return GraphKey(tokens, min(tokens, self.context.capacity.max_requests), False)

    @torch.no_grad()
    def capture(self) -> None:
        """Record one graph per key, largest first (all share one memory pool)."""
        if not self.capturing:
            return
        pool = None
        current = torch.cuda.current_stream()
        for key in self.keys():
            # Padding requests of one token each: every row attends, so no kernel is skipped.
            batch = self.context.build_step([], pad_to_tokens=key.tokens, pad_to_requests=key.rows)
            warmup = torch.cuda.Stream()
            warmup.wait_stream(current)
            with torch.cuda.stream(warmup):  # allocator, cuBLAS and Triton settle outside the capture
                self._forward(key, batch)
            current.wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(key, batch)
            pool = graph.pool()
            self.context.commit_step()
            self._graphs[key] = (graph, outputs)
        torch.cuda.synchronize()

    def run(self, key: GraphKey, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [n, V] fp32, hidden [t, h], log_probs [n, V] fp32)`` of a static batch of
        ``key`` (built with ``pad_to_tokens=key.tokens, pad_to_requests=key.rows``): ``n`` is
        every row of a decode step, one per request row of a mixed one. Replayed from its graph
        when captured. On the last stage only."""
        if not self.capturing:
            return self._forward(key, batch)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def _forward(self, key: GraphKey, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A mixed step's logit rows: each request row's last token (a padding request: the row before).
        logit_rows = None if key.decode else batch.cu_query_lengths[1:] - 1
        logits, hidden = self.runner.forward(self.context, batch, logit_rows=logit_rows)
        self.context.write_back_step_states()
        return logits, hidden, kernels.log_softmax(logits)
