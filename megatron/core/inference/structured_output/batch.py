"""The engine's side of structured output: grammars checked at admission, one bitmask per step."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from megatron.core.inference.host_copies import to_device
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.structured_output.compiler import GrammarCache
from megatron.core.inference.structured_output.matcher import RequestMatcher
from megatron.core.tokenizers import MegatronTokenizer


class StructuredOutputs:
    """Constrains the sampled rows of requests whose ``SamplingParams.structured_output`` is set.

    :meth:`check` compiles a request's grammar when it is added (cached per grammar), so a bad
    schema is that request's :class:`~megatron.core.inference.structured_output.GrammarCompileError`
    and nothing else's. :meth:`mask_logits` runs once per step, after the previous step's tokens
    were applied and while the device runs this step's forward: each constrained request's
    matcher catches up with its accepted tokens, the step's bitmask is filled on the host, copied
    once and applied to the logits rows on the device (disallowed tokens get ``-inf``).
    Requests are keyed weakly: a finished request's matcher goes with it.
    """

    def __init__(self, tokenizer: MegatronTokenizer | None, vocab_size: int, eos_token_id: int | None):
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_token_id)
        self.vocab_size = vocab_size
        self._matchers: weakref.WeakKeyDictionary[object, RequestMatcher] = weakref.WeakKeyDictionary()

    def check(self, params: SamplingParams) -> None:
        """Compile the grammar of a request about to be added (raises GrammarCompileError)."""
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)

    def mask_logits(self, logits: torch.Tensor, requests: Sequence, drafts: Sequence[Sequence[int]]) -> None:
        """Mask ``logits [n, V]`` in place: row ``i`` samples for ``requests[i]`` (an
        ``EngineRequest``; consecutive rows of one request are its speculative depths 0, 1, ...,
        depth ``d`` following its generated tokens and the first ``d`` of its draft tokens
        ``drafts[i]``)."""
        import xgrammar

        constrained = [i for i, r in enumerate(requests) if r.sampling_params.structured_output is not None]
        if not constrained:
            return
        bitmask = xgrammar.allocate_token_bitmask(len(requests), self.vocab_size)
        rows = []
        start = 0
        while start < len(requests):
            request = requests[start]
            stop = start + 1
            while stop < len(requests) and requests[stop] is request:
                stop += 1
            matcher = self._matcher(request)
            if matcher is not None:
                matcher.fill(bitmask, start, stop - start, drafts[start])
                rows += range(start, stop)
            start = stop
        if rows:
            device_mask = to_device(bitmask, logits.device)
            xgrammar.apply_token_bitmask_inplace(logits, device_mask, vocab_size=self.vocab_size, indices=rows)

    def _matcher(self, request) -> RequestMatcher | None:
        """The request's matcher, caught up with its generated tokens; None when it does not constrain."""
        params = request.sampling_params.structured_output
        if params is None:
            return None
        matcher = self._matchers.get(request)
        if matcher is None:
            matcher = RequestMatcher(self.grammars.compile(params))
            self._matchers[request] = matcher
        matcher.sync(request.generated_tokens)
        return matcher if matcher.active else None
