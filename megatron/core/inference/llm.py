"""High-level offline inference: ``LLM(model, tokenizer).generate(prompts, sampling_params)``.

Example::

    llm = LLM(model, tokenizer, block_size=16, num_blocks=512, max_tokens_per_step=256,
              enable_chunked_prefill=True)
    outputs = llm.generate(["The capital of France is", [1, 2, 3]],
                           SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].text, outputs[1].token_ids)

    # Streaming, from asyncio: partial outputs (RequestOutput) as tokens are produced; their
    # text deltas concatenate to the text generate() returns.
    async for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=16)):
        print(delta.new_text, end="", flush=True)

``model`` is this rank's pipeline stage of a GPTModel / HybridModel built for
``pg_collection``'s layout; under torchrun every rank of the model-parallel group constructs
the LLM and makes the same calls (the engines stay in lockstep). Keyword arguments go to
:class:`~megatron.core.inference.engines.DynamicInferenceEngine` (pool size, per-step token
limit, chunked prefill, prefix caching, speculative tokens, ...). Prompts are strings (needs a
tokenizer) or lists of token ids; outputs come back in prompt order. The text (and stop
sequences) come from the engine's outputs (``RequestOutput.new_text``): this class decodes
nothing itself.

The constructor takes a built model. For a training checkpoint,
``model, tokenizer, _ = load_inference_model(DIR, pg)``
(:mod:`megatron.core.inference.checkpoint_loading`) builds it from the checkpoint's model
record and loads the weights, as ``examples/inference/offline_inference.py --load DIR`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from torch import nn

from megatron.core.inference.engines import DynamicInferenceEngine, RequestOutput
from megatron.core.inference.prompts import PromptTypeError, prompt_token_ids
from megatron.core.inference.sampling import SamplingParams
from megatron.core.process_groups import ProcessGroupCollection

Prompt = str | Sequence[int]
__all__ = ["LLM", "GenerationOutput", "Prompt", "PromptTypeError"]


@dataclass
class GenerationOutput:
    """The whole result of one prompt (``text``: None without a tokenizer)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    log_probs: list[float]
    prompt_log_probs: list[float] | None
    finish_reason: str | None


class LLM:
    """Offline generation over one :class:`DynamicInferenceEngine` (see module doc)."""

    def __init__(
        self, model: nn.Module, tokenizer=None, *, pg_collection: ProcessGroupCollection | None = None, **engine_kwargs
    ):
        self.tokenizer = tokenizer
        self.engine = DynamicInferenceEngine(model, tokenizer=tokenizer, pg_collection=pg_collection, **engine_kwargs)
        self._next_id = 0
        self._streams: dict[str, asyncio.Queue] = {}
        self._stepper: asyncio.Task | None = None

    def _add(self, prompt: Prompt, params: SamplingParams) -> tuple[str, list[int]]:
        request_id = f"llm-{self._next_id}"
        self._next_id += 1
        tokens = prompt_token_ids(prompt, self.tokenizer)
        self.engine.add_request(request_id, tokens, params)
        return request_id, tokens

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress=None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (one, or a list); returns outputs in prompt order.

        ``sampling_params``: one for all prompts or one per prompt (default
        ``SamplingParams()``). ``progress``: optional callable ``(num_finished) -> None`` called
        as requests finish (e.g. a tqdm bar's update).
        """
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        params = (
            sampling_params
            if isinstance(sampling_params, (list, tuple))
            else [sampling_params or SamplingParams()] * len(prompt_list)
        )
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} sampling params for {len(prompt_list)} prompts; give one or one each")
        order, partial, texts = [], {}, {}
        for prompt, p in zip(prompt_list, params, strict=True):
            request_id, tokens = self._add(prompt, p)
            order.append(request_id)
            partial[request_id] = GenerationOutput(tokens, [], None, [], None, None)
            texts[request_id] = []
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                output = partial.get(delta.request_id)
                if output is None:
                    continue
                output.token_ids += delta.new_token_ids
                output.log_probs += delta.new_log_probs
                if delta.new_text is not None:
                    texts[delta.request_id].append(delta.new_text)
                if delta.prompt_log_probs is not None:
                    output.prompt_log_probs = delta.prompt_log_probs
                if delta.finished:
                    output.finish_reason = delta.finish_reason
                    if progress is not None:
                        progress(1)
        if self.engine.tokenizer is not None:
            for request_id, output in partial.items():
                output.text = "".join(texts[request_id])
        return [partial[request_id] for request_id in order]

    async def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Async generator of one prompt's partial outputs, the last one with ``finished``; their
        ``new_text`` (with a tokenizer) concatenate to the text :meth:`generate` gives. Concurrent
        streams on the same event loop are batched into the same engine steps."""
        request_id, _ = self._add(prompt, sampling_params or SamplingParams())
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)  # the consumer stopped early

    async def _step_loop(self) -> None:
        while self._streams:
            for delta in self.engine.step():
                queue = self._streams.get(delta.request_id)
                if queue is not None:
                    if delta.finished:
                        del self._streams[delta.request_id]
                    queue.put_nowait(delta)
            await asyncio.sleep(0)  # let consumers and new streams run between steps
