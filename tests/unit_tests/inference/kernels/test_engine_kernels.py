"""The engine with every Triton kernel of the inference forward forced (the fused ops of
:mod:`megatron.core.fusions`: norms with the residual add, RoPE in the QKV split, SwiGLU; the
batch-invariant GEMM, paged attention with GQA, the Mamba conv and recurrence, the gated norm)
gives the greedy tokens of the torch path and its log-probs to rounding, on a hybrid model
(attention, Mamba and MLP layers) and on a GPT (GQA 4/2, RoPE, SwiGLU, RMSNorm); and on those
kernels a request's log-probs are bitwise the same alone and batched with others.

Without CUDA the kernels run under Triton's interpreter (slow: tiny models, three steps)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import BACKEND_ENV as FUSION_BACKEND_ENV
from megatron.core.inference.contexts.paged_attention import BACKEND_ENV as ATTENTION_BACKEND_ENV
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.kernels import BACKEND_ENV
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import gpt_model, hybrid_model, prompts, run
from tests.unit_tests.transformer.single_rank import on_single_rank

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, return_prompt_logprobs=True)
MODELS = {
    "hybrid": hybrid_model,
    "gpt": lambda pg: gpt_model(pg, gated_linear_unit=True, activation_func=F.silu),
}


def use_kernels(monkeypatch, backend: str) -> None:
    for variable in (BACKEND_ENV, ATTENTION_BACKEND_ENV, FUSION_BACKEND_ENV):
        monkeypatch.setenv(variable, backend)


def engine_outputs(pg, model, requests):
    engine = DynamicInferenceEngine(
        model,
        block_size=4,
        num_blocks=16,
        max_requests=3,
        max_tokens_per_step=16,
        max_sequence_length=32,
        pg_collection=pg,
    )
    return run(engine, requests, PARAMS)


@on_single_rank
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_engine_on_triton_kernels_gives_the_torch_path_outputs(pg, monkeypatch, kind):
    model = MODELS[kind](pg)
    results = {}
    for backend in ("torch", "triton"):
        use_kernels(monkeypatch, backend)
        results[backend] = engine_outputs(pg, model, prompts([5, 3]))
    for request_id, want in results["torch"].items():
        got = results["triton"][request_id]
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 3
        torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=0, atol=1e-4)
        torch.testing.assert_close(got["prompt_log_probs"], want["prompt_log_probs"], rtol=0, atol=1e-4)


@on_single_rank
def test_request_on_triton_kernels_is_bitwise_the_same_alone_and_batched(pg, monkeypatch):
    use_kernels(monkeypatch, "triton")
    model = MODELS["gpt"](pg)
    requests = prompts([6, 4, 7], seed=1)
    batched = engine_outputs(pg, model, requests)
    alone = engine_outputs(pg, model, requests[:1])["0"]
    assert alone["tokens"] == batched["0"]["tokens"]
    assert alone["log_probs"] == batched["0"]["log_probs"]
    assert alone["prompt_log_probs"] == batched["0"]["prompt_log_probs"]
