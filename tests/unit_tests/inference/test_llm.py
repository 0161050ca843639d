"""The LLM API: batch generation in prompt order, text prompts and stop strings through a
tokenizer, and asyncio streaming whose deltas add up to the batch result."""

import asyncio
import contextlib

import pytest

from megatron.core.inference.llm import LLM, PromptTypeError
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from tests.unit_tests.inference.engines.common import gpt_model, prompts, reference_greedy
from tests.unit_tests.transformer.single_rank import on_single_rank

ENGINE = dict(block_size=4, num_blocks=64, max_tokens_per_step=32, max_sequence_length=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)


@on_single_rank
def test_generate_returns_outputs_in_prompt_order(pg):
    model = gpt_model(pg)
    llm = LLM(model, pg_collection=pg, **ENGINE)
    batch = prompts([9, 3, 6])
    outputs = llm.generate(batch, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == batch
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 8) for p in batch]
    assert all(len(o.log_probs) == 8 and o.finish_reason == "length" and o.text is None for o in outputs)
    single = llm.generate(batch[1], GREEDY)
    assert [o.token_ids for o in single] == [outputs[1].token_ids]
    with pytest.raises(PromptTypeError, match="a text prompt needs a tokenizer"):
        llm.generate("hello", GREEDY)


@on_single_rank
def test_text_prompts_and_stop_strings(pg):
    tokenizer = ByteLevelTokenizer()
    llm = LLM(gpt_model(pg, vocab_size=tokenizer.vocab_size), tokenizer, pg_collection=pg, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate(["abc"], params)
    assert full.prompt_token_ids == list(b"abc") and full.text == tokenizer.detokenize(full.token_ids)
    stop = full.text[4:6]
    (stopped,) = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < 12


@on_single_rank
def test_concurrent_streams_add_up_to_the_batch_result_and_early_exit_aborts(pg):
    llm = LLM(gpt_model(pg), pg_collection=pg, **ENGINE)
    batch = prompts([5, 10])
    expected = [o.token_ids for o in llm.generate(batch, GREEDY)]

    async def collect(prompt, limit=None):
        deltas = []
        async with contextlib.aclosing(llm.stream(prompt, GREEDY)) as stream:
            async for delta in stream:
                deltas.append(delta)
                if limit is not None and len(deltas) == limit:
                    break
        return deltas

    async def main():
        return await asyncio.gather(collect(batch[0]), collect(batch[1]), collect(batch[0], limit=2))

    first, second, cut = asyncio.run(main())
    for deltas, want in ((first, expected[0]), (second, expected[1])):
        assert [t for d in deltas for t in d.new_token_ids] == want
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
        assert len(deltas) > 1  # streamed, not delivered at once
    assert len(cut) == 2 and not cut[-1].finished
    # The abandoned stream was aborted: it stopped generating before its 8 tokens.
    assert not llm.engine.has_unfinished_requests() and llm.engine.context.num_requests == 0
    assert llm.engine.stats["tokens_generated"] < 5 * 8
