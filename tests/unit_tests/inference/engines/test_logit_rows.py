"""An eager step projects onto the vocabulary only the rows sampling can read, not every prefill
row: each request's last row of the step, and where a step has prompt log-probs (or drafts to
verify) exactly the rows read."""

import pytest
import torch

from megatron.core.inference import kernels
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import VOCAB, gpt_model, prompts, reference_greedy, run
from tests.unit_tests.transformer.single_rank import on_single_rank

LENGTHS = [20, 7, 13]
NEW_TOKENS = 4


PLAIN = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
WITH_PROMPT = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, return_prompt_logprobs=True)


def _run_counting_rows(model, pg, params) -> tuple[dict, list[int], DynamicInferenceEngine]:
    """Run the three prompts in 16-token eager steps (a CUDA graph's replay runs no module hooks);
    the rows the output layer saw per forward."""
    engine = DynamicInferenceEngine(
        model,
        enable_cuda_graphs=False,
        block_size=4,
        num_blocks=128,
        max_requests=8,
        max_sequence_length=96,
        max_tokens_per_step=16,
        enable_chunked_prefill=True,
        pg_collection=pg,
    )
    rows_projected = []  # per forward of the run (the engine's construction ran its own)
    hook = model.output_layer.register_forward_hook(lambda module, args, out: rows_projected.append(args[0].shape[0]))
    try:
        results = run(engine, prompts(LENGTHS), params)
    finally:
        hook.remove()
    assert len(rows_projected) == engine.stats["steps"] == 6
    for index, prompt in enumerate(prompts(LENGTHS)):
        assert results[str(index)]["tokens"] == reference_greedy(model, prompt, NEW_TOKENS)
    return results, rows_projected, engine


@on_single_rank
def test_the_output_layer_sees_only_the_rows_sampling_reads(pg):
    model = gpt_model(pg)
    # Without prompt log-probs: each request's last row of every step, so one row per generated
    # token and one for each chunk that does not end its prompt (16 of request 0's 20 tokens in
    # the first step, 5 of request 2's 13 in the second).
    _, rows_projected, _ = _run_counting_rows(model, pg, PLAIN)
    assert rows_projected[:2] == [1, 3] and sum(rows_projected) == NEW_TOKENS * len(LENGTHS) + 2
    # With prompt log-probs for request 1: the steps that hold it project exactly the rows read,
    # one per sampled token and one per prompt position of request 1 but its last; the first
    # step (request 0 alone) still projects its one row.
    results, rows_projected, _ = _run_counting_rows(model, pg, [PLAIN, WITH_PROMPT, PLAIN])
    assert rows_projected[:2] == [1, 8] and sum(rows_projected) == NEW_TOKENS * len(LENGTHS) + LENGTHS[1] - 1 + 1
    prompt = prompts(LENGTHS)[1]
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=device()))[0, :, :VOCAB].float()
    want = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(prompt[1:], device=device())[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(results["1"]["prompt_log_probs"]), want.cpu(), rtol=0, atol=1e-5)


@on_single_rank
def test_logit_rows_are_those_rows_of_the_full_logits(pg):
    model = gpt_model(pg)
    tokens = torch.tensor([prompts([12])[0]], device=device())
    rows = torch.tensor([11, 3, 0, 7], device=device())
    with torch.no_grad(), kernels.batch_invariant(True):
        full = model(tokens)
        picked = model(tokens, logit_rows=rows)
    assert picked.shape == (1, 4, full.shape[-1])
    assert torch.equal(picked[0], full[0, rows])  # row-invariant kernels: the same bits
    with pytest.raises(ValueError, match=r"logit_rows selects sequence positions of one sequence's logits"):
        model(tokens, labels=tokens, logit_rows=rows)
