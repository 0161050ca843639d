"""Tiny models (on the harness device), a reference greedy decoder and an engine driver shared
by the engine tests."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.config import TransformerConfig
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from tests.unit_tests.dist_harness import device

VOCAB, MAX_SEQ = 96, 128


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's values back to the host or size a result by them."""

    READS = (
        "_local_scalar_dense",  # .item(), int(t), bool(t)
        "equal",
        "is_nonzero",
        "nonzero",
        "masked_select",
        "unique",
        "_unique2",
        "repeat_interleave",
    )

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def tiny_config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        add_bias_linear=False,
        mamba_num_heads=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_state_dim=8,
        mamba_d_conv=4,
        mamba_chunk_size=4,
        init_method_std=0.2,
    )
    return TransformerConfig(**(base | overrides))


def gpt_model(
    pg,
    *,
    mtp_depths: int = 0,
    tp: int = 1,
    pp: int = 1,
    vocab_size: int = VOCAB,
    max_sequence_length: int = MAX_SEQ,
    position_embedding_type: str = "rope",
    **overrides,
) -> GPTModel:
    config = tiny_config(
        mtp_num_layers=mtp_depths or None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **overrides
    )
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    torch.manual_seed(0)
    return (
        GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size,
            max_sequence_length,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp_size - 1,
            position_embedding_type=position_embedding_type,
            mtp_block_spec=get_gpt_mtp_block_spec() if mtp_depths else None,
            pg_collection=pg,
        )
        .eval()
        .to(device())
    )


def mtp_model_with_tied_heads(pg, **overrides) -> GPTModel:
    """A GPT whose layers barely change the residual stream and whose MTP depths pass the
    (normalized) embedding of their input token straight to the shared output head: each depth
    proposes what the main model will most likely say next, so drafts are often, not always, right."""
    model = gpt_model(pg, mtp_depths=2, **overrides)
    h = model.config.hidden_size
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.linear_proj.weight.mul_(0.2)
            layer.mlp.linear_fc2.weight.mul_(0.2)
        for depth in model.mtp.layers:
            depth.eh_proj.weight.zero_()
            depth.eh_proj.weight[:, :h] = torch.eye(h)
            depth.transformer_layer.self_attention.linear_proj.weight.zero_()
            depth.transformer_layer.mlp.linear_fc2.weight.zero_()
    return model


def hybrid_model(pg, pattern: str = "M*-M", **overrides) -> HybridModel:
    config = tiny_config(num_layers=len(pattern.replace("|", "")), **overrides)
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    return (
        HybridModel(
            config,
            get_hybrid_stack_local_spec(),
            VOCAB,
            MAX_SEQ,
            hybrid_layer_pattern=pattern,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp_size - 1,
            pg_collection=pg,
        )
        .eval()
        .to(device())
    )


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids passed to its ``detokenize``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def detokenize(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tokenizer.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes without any cache (single process)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([tokens], device=device()))
        tokens.append(int(logits[0, -1, :VOCAB].argmax()))
    return tokens[len(prompt) :]


def assert_same_outputs(got: dict, want: dict) -> None:
    """Same tokens, terminal outputs and finish reasons. Log-probs are bitwise equal on the CPU
    reference kernels (batch invariant); CUDA kernels pick reductions by shape, so there they
    agree to rounding."""
    assert got.keys() == want.keys()
    exact = device().type == "cpu"
    for request_id, expected in want.items():
        result = got[request_id]
        for key in ("tokens", "terminal", "finish_reason"):
            assert result[key] == expected[key], (request_id, key)
        for key in ("log_probs", "prompt_log_probs", "top_log_probs"):
            if exact or expected[key] is None:
                assert result[key] == expected[key], (request_id, key)
            else:
                torch.testing.assert_close(result[key], expected[key], rtol=0, atol=1e-5)


def new_result() -> dict:
    """An empty per-request record for :func:`collect`."""
    return dict(
        tokens=[],
        log_probs=[],
        top_log_probs=None,
        text=None,
        prompt_log_probs=None,
        terminal=0,
        finish_reason=None,
        error=None,
    )


def collect(results: dict, outputs) -> None:
    """Fold engine outputs into per-request records: tokens, log-probs, top log-probs (None unless
    asked for), text (None without a tokenizer), prompt log-probs, number of terminal outputs,
    finish reason and error."""
    for output in outputs:
        result = results.setdefault(output.request_id, new_result())
        result["tokens"] += output.new_token_ids
        result["log_probs"] += output.new_log_probs
        if output.new_top_log_probs is not None:
            result["top_log_probs"] = (result["top_log_probs"] or []) + output.new_top_log_probs
        if output.new_text is not None:
            result["text"] = (result["text"] or "") + output.new_text
        if output.prompt_log_probs is not None:
            result["prompt_log_probs"] = output.prompt_log_probs
        if output.finished:
            result["terminal"] += 1
            result["finish_reason"] = output.finish_reason
            result["error"] = output.error


def run(
    engine: DynamicInferenceEngine,
    requests: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    on_step=None,
) -> dict:
    """Drive ``engine`` to completion; per request id the record of :func:`collect`."""
    params = params if isinstance(params, list) else [params] * len(requests)
    results = {}
    for index, (prompt, p) in enumerate(zip(requests, params, strict=True)):
        engine.add_request(str(index), prompt, p)
        results[str(index)] = new_result()
    while engine.has_unfinished_requests():
        collect(results, engine.step())
        if on_step is not None:
            on_step(engine)
    return results
