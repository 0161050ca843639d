"""An eager step projects onto the vocabulary only the rows sampling reads: each request's
sampled row and the prompt log-prob rows asked for, not every prefill row."""

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


@on_single_rank
def test_the_output_layer_sees_only_the_rows_sampling_reads(pg):
    model = gpt_model(pg)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with_prompt = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, return_prompt_logprobs=True)
    engine = DynamicInferenceEngine(
        model,
        block_size=4,
        num_blocks=128,
        max_requests=8,
        max_sequence_length=96,
        max_tokens_per_step=16,
        enable_chunked_prefill=True,
        pg_collection=pg,
    )
    rows_projected = []  # per forward of the run (the engine's construction ran its own)
    model.output_layer.register_forward_hook(lambda module, args, out: rows_projected.append(args[0].shape[0]))
    results = run(engine, prompts(LENGTHS), [plain, with_prompt, plain])
    # One row per generated token (a prefill chunk that does not end its prompt has none: the
    # first step, 16 of request 0's 20 tokens, projects no row), and one per prompt position of
    # request 1 but its last.
    assert rows_projected[0] == 0 and len(rows_projected) == engine.stats["steps"] == 6
    assert sum(rows_projected) == NEW_TOKENS * len(LENGTHS) + LENGTHS[1] - 1
    for index, prompt in enumerate(prompts(LENGTHS)):
        assert results[str(index)]["tokens"] == reference_greedy(model, prompt, NEW_TOKENS)
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
