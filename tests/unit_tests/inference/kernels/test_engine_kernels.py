"""The engine with every Triton kernel of the inference forward forced (batch-invariant GEMM,
paged attention, the Mamba conv and recurrence, the gated norm) gives the greedy tokens of the
torch path and its log-probs to rounding, on a hybrid model (attention, Mamba and MLP layers).

Without CUDA the kernels run under Triton's interpreter (slow: a tiny model, three steps)."""

import torch

from megatron.core.inference.contexts.paged_attention import BACKEND_ENV as ATTENTION_BACKEND_ENV
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.kernels import BACKEND_ENV
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import hybrid_model, prompts, run
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_engine_on_triton_kernels_gives_the_torch_path_outputs(pg, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, return_prompt_logprobs=True)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
        engine = DynamicInferenceEngine(
            hybrid_model(pg),
            block_size=4,
            num_blocks=16,
            max_requests=2,
            max_tokens_per_step=8,
            max_sequence_length=32,
            pg_collection=pg,
        )
        results[backend] = run(engine, prompts([5, 3]), params)
    for request_id, want in results["torch"].items():
        got = results["triton"][request_id]
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 3
        torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=0, atol=1e-4)
        torch.testing.assert_close(got["prompt_log_probs"], want["prompt_log_probs"], rtol=0, atol=1e-4)
